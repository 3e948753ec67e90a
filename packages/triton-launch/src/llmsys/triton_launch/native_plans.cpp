/* Recorded plans: an op's call replayed below Python.
 *
 * An op's Python impl checks its arguments, allocates its outputs and launches its kernels. All
 * of that is decided by the arguments' metadata (dtype, sizes, strides, device, the low bits of
 * each data pointer) and the values of its ints, floats and bools: the call's signature. So a
 * call whose signature has been seen can skip the Python: allocate the same outputs with
 * at::empty_strided, launch the same kernels with the new pointers, and return what the impl
 * returned. plans.py records what the impl did (its allocations, its launches and its result) and
 * hands it here as data; this file keeps one table of signatures per op and replays.
 *
 * The table follows each signature through its calls:
 *   call 1: the impl runs as it is (it compiles, tunes and fills its caches);
 *   calls 2 and 3: the impl runs under plans.py's recorder; two equal recordings become the plan;
 *   a recording that fails (the impl did anything but allocate, copy, view and launch), or two
 *   that differ, leave the signature to the impl for good; a recording during a CUDA-graph
 *   capture is put off to a later call (a tuner does not tune there).
 * A full table (256 signatures) drops its signatures without a plan, then, if still full, all.
 *
 *   init(recorder, runtime_knobs)
 *       once: plans.py's recorder(impl, args) -> (result, plan or why not), and
 *       triton.knobs.runtime (whose launch_enter_hook is read before each replay); loads the
 *       driver (libcuda.so.1: cuLaunchKernel, cuTensorMapEncodeTiled), so it raises without one
 *   plain(args) -> library._plain_call(args) as the entries ask it, from torch's thread-locals
 *       (False: the impl directly; True: autograd records; None: the op)
 *   set_enabled(flag) -> the previous setting: False runs every call's impl (tests that poison
 *       fresh memory); signatures are kept
 *   register_autograd(name, key): a kernel for "AutogradCUDA" in front of the op's
 *       register_autograd kernel, for the calls autograd does not record (see there)
 *   Plans(impl, op, replays=False)
 *       replays: define_op's declaration that the op is expected to replay (plans.replays)
 *       plans(*args): the impl's result, replayed where a plan exists (the op's Python kernel:
 *           the dispatcher has done its work)
 *       plans.register_kernel(name, key): make this entry the op's kernel for a dispatch key
 *           ("CUDA"): a call with a plan replays from the dispatcher's arguments without
 *           Python; anything else is plans(*args) with those arguments as Python objects
 *       plans.below_autograd(args): library.call_below_autograd: the impl's result (replayed
 *           where it can be) when plain(args) says autograd records nothing and the
 *           dispatcher would only call the impl; else op(*args)
 *       plans.install(args, plan): install a plan for args' signature (tests)
 *       plans.report(): {'planned', 'pending', 'refused': signatures in each state, 'calls',
 *           'replayed': calls so far and how many replayed, 'why_not': why the last call that
 *           was not replayed was not}
 *       plans.clear()
 *
 * A plan (plans.py builds it) is (allocations, launches, result):
 *   allocations: ((sizes, strides, dtype), ...), allocated on the call's device
 *   launches: ((function, (grid_x, grid_y, grid_z), threads, shared_bytes, params), ...), in
 *       order, where a step (index,) is a contiguous copy of argument `index` (an impl's
 *       `.contiguous()` of a strided argument),
 *       params: ((kind, source, index, value), ...) one per kernel parameter, kinds 'p' pointer,
 *       'i' int32, 'l' int64, 'I' uint32, 'L' uint64, 'b' int8, 'f' float32, 'd' float64, 't' a
 *       host tensor descriptor's tensor map, passed by value;
 *       source 0: the constant value; 1: the data pointer of argument `index` plus `value`
 *       bytes; 2: the same of allocation `index`; 3: of copy `index`. A 't' parameter is
 *       (kind, source, index, offset, (dtype, swizzle, fill, dims, byte strides, box)): the
 *       tensor map is encoded at each replay for the new address, as Triton's launcher encodes
 *       it (innermost dimension first). Triton's two scratch pointers (NULL) are appended.
 *   result: (0, ()) None; (1, (output,)) one tensor; (2, (output, ...)) a tuple, where an output
 *       is (allocation,) or (allocation, sizes, strides, storage_offset) for a view of it.
 *
 * Replay needs CUDA tensors on the current device and no Triton launch hooks; anything else
 * goes to the impl. Kernels launch on the current stream, as the impl's would.
 */
#include <Python.h>
#include <structmember.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/profiler/orchestration/observer.h>
#include <torch/version.h>

#include <dlfcn.h>

#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

typedef int (*launch_kernel_t)(void *function, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                               unsigned block_x, unsigned block_y, unsigned block_z,
                               unsigned shared_bytes, void *stream, void **params, void **extra);

typedef int (*encode_tiled_t)(void *map, int dtype, unsigned rank, void *address,
                              const uint64_t *dims, const uint64_t *strides, const uint32_t *box,
                              const uint32_t *element_strides, int interleave, int swizzle,
                              int l2_promotion, int oob_fill);

launch_kernel_t cu_launch_kernel = nullptr;
encode_tiled_t cu_tensor_map_encode_tiled = nullptr;  // NULL before CUDA 12
PyObject *recorder, *runtime_knobs;  // NULL until init()
PyObject *enter_hook_name, *calls_name;

union Slot {  // one kernel parameter's bytes, as cuLaunchKernel reads them (a pointer to each)
    uint64_t u64;
    int64_t i64;
    uint32_t u32;
    int32_t i32;
    int8_t i8;
    float f32;
    double f64;
};
bool enabled = true;  // set_enabled(False): every call runs the impl (tests that poison memory)

constexpr int MAX_PARAMS = 128;
constexpr int MAX_MAPS = 8;  // tensor maps per launch
constexpr int L2_PROMOTION_128B = 2;  // CU_TENSOR_MAP_L2_PROMOTION_L2_128B, as Triton encodes

struct alignas(128) TensorMap {  // CUtensorMap: 128 opaque bytes
    uint64_t words[16];
};

// A host tensor descriptor's tensor map, less its address: cuTensorMapEncodeTiled's arguments
// as Triton's launcher passes them (innermost dimension first; strides in bytes).
struct MapSpec {
    int dtype, swizzle, fill;
    unsigned rank;
    uint64_t dims[5], strides[5];
    uint32_t box[5];
};
constexpr size_t MAX_SIGNATURES = 256;  // per op: past it, new signatures go to the impl

struct Param {
    char kind;
    int source;  // 0 constant, 1 argument, 2 allocation, 3 copy
    int index;
    int64_t offset;  // bytes past the pointer (sources 1 and 2)
    Slot constant;   // (source 0)
    int map;         // kind 't': the tensor map of a descriptor at that pointer (Launch::maps)
};

struct Launch {  // or, where copy_of >= 0, a contiguous copy of that argument
    int copy_of;
    void *function;
    unsigned grid[3];
    unsigned threads, shared;
    std::vector<Param> params;
    std::vector<MapSpec> maps;
};

struct Allocation {
    std::vector<int64_t> sizes, strides;
    c10::ScalarType dtype;
};

struct Output {
    int allocation;  // -1: None
    bool view;
    std::vector<int64_t> sizes, strides;
    int64_t offset;
};

struct Plan {
    std::vector<Allocation> allocations;
    std::vector<Launch> launches;
    int result;  // 0 None, 1 a tensor, 2 a tuple
    std::vector<Output> outputs;
};

// One signature's state: its plan, or how far its recording has got.
struct Entry {
    int calls = 0;           // calls seen before the plan
    bool refused = false;    // a failed or unstable recording: the impl from now on
    std::string why;         // (refused) why, in words
    PyObject *first = NULL;  // the first recording (a new reference)
    std::unique_ptr<Plan> plan;
};

typedef std::vector<int64_t> Signature;

struct SignatureHash {
    size_t operator()(const Signature &s) const {
        size_t h = s.size();
        for (int64_t v : s) h = h * 1000003u ^ std::hash<int64_t>()(v);
        return h;
    }
};

typedef std::unordered_map<Signature, Entry, SignatureHash> Table;

void clear_table(Table *table) {
    for (auto &item : *table) Py_CLEAR(item.second.first);
    table->clear();
}

/* library._plain_call's test, read from torch's thread-locals (the Python calls it stands for
 * cost about 2 us on an H100 host): no dispatch or function mode, functorch transform, tracer
 * or thread-local profiler on this thread. */
bool thread_plain() {
    return c10::impl::TorchDispatchModeTLS::stack_len() == 0 &&
           !at::impl::torch_function_mode_enabled() &&
           // a functorch transform: its front key is in the thread's included set while its
           // interpreter stack is not empty (ATen/functorch/DynamicLayer.h needs a JSON header
           // torch does not ship)
           !c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) &&
           !torch::jit::tracer::isTracing() && !torch::profiler::impl::profilerEnabled();
}

enum class Verdict { direct, records, op };

/* library._plain_call(args): direct (the impl may be called directly: the dispatcher past
 * autograd would do nothing else, and autograd records nothing), records (a tensor requires grad
 * and autograd records), or op (anything else: a mode, a subclass, a device other than CPU and
 * CUDA, an argument other than a tensor, int, float, bool or None). */
Verdict plain_call(PyObject *const *args, Py_ssize_t n) {
    if (!thread_plain()) return Verdict::op;
    bool requires_grad = false;
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject *arg = args[i];
        if (reinterpret_cast<PyObject *>(Py_TYPE(arg)) == THPVariableClass) {  // not a Parameter
            const at::Tensor &t = THPVariable_Unpack(arg);
            if (!(t.is_cuda() || t.is_cpu()) || t.layout() != c10::kStrided) return Verdict::op;
            requires_grad = requires_grad || t.requires_grad();
        } else if (!(arg == Py_None || PyBool_Check(arg) || PyLong_CheckExact(arg) ||
                     PyFloat_CheckExact(arg))) {
            return Verdict::op;
        }
    }
    bool records = requires_grad && c10::GradMode::is_enabled() &&
                   !c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::AutogradFunctionality);
    return records ? Verdict::records : Verdict::direct;
}

/* Append tensor t's part of a signature; false when it is not on CUDA, not strided, or on
 * another device than the call's other tensors. */
bool append_tensor(const at::Tensor &t, Signature &sig, int &device) {
    if (t.layout() != c10::kStrided || !t.is_cuda()) return false;
    int index = t.get_device();
    if (device >= 0 && index != device) return false;
    device = index;
    sig.push_back(1);
    sig.push_back(index);  // a plan's kernels belong to one device's context
    sig.push_back(static_cast<int64_t>(t.scalar_type()));
    sig.push_back(t.requires_grad());
    sig.push_back(t.dim());
    for (int64_t s : t.sizes()) sig.push_back(s);
    for (int64_t s : t.strides()) sig.push_back(s);
    // Triton specializes on 16-byte alignment, and a check may ask more: the low bits.
    sig.push_back(reinterpret_cast<uintptr_t>(t.data_ptr()) & 127);
    return true;
}

void append_float(double v, Signature &sig) {
    int64_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    sig.push_back(5);
    sig.push_back(bits);
}

/* The signature of args, and the CUDA device of its tensors; false (no error set) when the call
 * is not one to replay: a tensor not on CUDA or not strided, tensors on two devices, no tensor,
 * an int past 64 bits, an argument other than a tensor, int, float, bool or None. */
bool signature(PyObject *const *args, Py_ssize_t n, Signature &sig, int &device) {
    device = -1;
    sig.reserve(64);  // one allocation for a call of a few tensors
    for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject *arg = args[i];
        if (THPVariable_CheckExact(arg)) {
            if (!append_tensor(THPVariable_Unpack(arg), sig, device)) return false;
        } else if (arg == Py_None) {
            sig.push_back(2);
        } else if (PyBool_Check(arg)) {
            sig.push_back(3);
            sig.push_back(arg == Py_True);
        } else if (PyLong_CheckExact(arg)) {
            int overflow;
            long long v = PyLong_AsLongLongAndOverflow(arg, &overflow);
            if (overflow || (v == -1 && PyErr_Occurred())) {
                PyErr_Clear();
                return false;
            }
            sig.push_back(4);
            sig.push_back(v);
        } else if (PyFloat_CheckExact(arg)) {
            append_float(PyFloat_AS_DOUBLE(arg), sig);
        } else {
            return false;
        }
    }
    return device >= 0;
}

/* The same signature of the dispatcher's arguments (the registered CUDA kernel's): the same
 * numbers for the same Python call, so both ways in share a plan. */
bool signature(c10::ArrayRef<c10::IValue> args, Signature &sig, int &device) {
    device = -1;
    sig.reserve(64);  // one allocation for a call of a few tensors
    for (const c10::IValue &arg : args) {
        if (arg.isTensor()) {
            if (!append_tensor(arg.toTensor(), sig, device)) return false;
        } else if (arg.isNone()) {
            sig.push_back(2);
        } else if (arg.isBool()) {
            sig.push_back(3);
            sig.push_back(arg.toBool());
        } else if (arg.isInt()) {
            sig.push_back(4);
            sig.push_back(arg.toInt());
        } else if (arg.isDouble()) {
            append_float(arg.toDouble(), sig);
        } else {
            return false;
        }
    }
    return device >= 0;
}

char *pointer_of(const at::Tensor &t) { return static_cast<char *>(t.data_ptr()); }

/* Replay plan on `device`, its outputs into `outputs` (an undefined tensor for None); false
 * when the call must go to the impl. tensor_at(i): argument i, a tensor. Throws on errors. */
template <typename TensorAt>
bool replay(const Plan &plan, TensorAt tensor_at, int device, std::vector<at::Tensor> &outputs) {
    const c10::impl::DeviceGuardImplInterface *cuda =
        c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    c10::Device where(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device));
    if (cuda->getDevice() != where) return false;  // the impl sets the device for the launch

    std::vector<at::Tensor> allocations;
    allocations.reserve(plan.allocations.size());
    for (const Allocation &a : plan.allocations)
        allocations.push_back(at::empty_strided(
            a.sizes, a.strides, at::TensorOptions().dtype(a.dtype).device(where)));

    void *stream = plan.launches.empty() ? nullptr : cuda->getStream(where).native_handle();
    Slot slots[MAX_PARAMS];
    void *params[MAX_PARAMS];
    TensorMap maps[MAX_MAPS];
    static const uint32_t unit_strides[5] = {1, 1, 1, 1, 1};
    std::vector<at::Tensor> copies;
    for (const Launch &launch : plan.launches) {
        if (launch.copy_of >= 0) {
            copies.push_back(tensor_at(launch.copy_of).contiguous());
            continue;
        }
        size_t n = launch.params.size();
        for (size_t i = 0; i < n; ++i) {
            const Param &p = launch.params[i];
            if (p.source == 0) {
                slots[i] = p.constant;
            } else {
                const at::Tensor &t = p.source == 1   ? tensor_at(p.index)
                                      : p.source == 2 ? allocations[p.index]
                                                      : copies[p.index];
                slots[i].u64 = reinterpret_cast<uint64_t>(pointer_of(t) + p.offset);
            }
            params[i] = &slots[i];
            if (p.kind == 't') {  // the tensor map is the parameter, passed by value
                const MapSpec &m = launch.maps[p.map];
                int status = cu_tensor_map_encode_tiled(
                    &maps[p.map], m.dtype, m.rank, reinterpret_cast<void *>(slots[i].u64), m.dims,
                    m.strides, m.box, unit_strides, 0, m.swizzle, L2_PROMOTION_128B, m.fill);
                TORCH_CHECK(status == 0, "native_plans: cuTensorMapEncodeTiled failed (", status,
                            ")");
                params[i] = &maps[p.map];
            }
        }
        slots[n].u64 = slots[n + 1].u64 = 0;  // Triton's global and profile scratch: NULL
        params[n] = &slots[n];
        params[n + 1] = &slots[n + 1];
        int status = cu_launch_kernel(launch.function, launch.grid[0], launch.grid[1],
                                      launch.grid[2], launch.threads, 1, 1, launch.shared, stream,
                                      params, NULL);
        TORCH_CHECK(status == 0, "native_plans: cuLaunchKernel failed (", status, ")");
    }

    outputs.reserve(plan.outputs.size());
    for (const Output &o : plan.outputs) {
        if (o.allocation < 0)
            outputs.emplace_back();
        else if (o.view)
            outputs.push_back(allocations[o.allocation].as_strided(o.sizes, o.strides, o.offset));
        else
            outputs.push_back(allocations[o.allocation]);
    }
    return true;
}

/* Replay plan with Python args: the result (a new reference), NULL with an error set, or NULL
 * with none set when the call must go to the impl. */
PyObject *replay_python(const Plan &plan, PyObject *const *args, int device) {
    HANDLE_TH_ERRORS
    std::vector<at::Tensor> outputs;
    auto tensor_at = [args](int i) -> const at::Tensor & { return THPVariable_Unpack(args[i]); };
    if (!replay(plan, tensor_at, device, outputs)) return NULL;
    if (plan.result == 0) Py_RETURN_NONE;
    PyObject *out = PyTuple_New(outputs.size());
    if (out == NULL) return NULL;
    for (size_t i = 0; i < outputs.size(); ++i) {
        PyObject *item = outputs[i].defined() ? THPVariable_Wrap(std::move(outputs[i]))
                                              : Py_NewRef(Py_None);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, item);
    }
    if (plan.result == 2) return out;
    PyObject *single = Py_NewRef(PyTuple_GET_ITEM(out, 0));
    Py_DECREF(out);
    return single;
    END_HANDLE_TH_ERRORS
}

// --- reading a plan from plans.py's data -------------------------------------------------------

bool fail_format(const char *what) {
    PyErr_Format(PyExc_ValueError, "native_plans: a plan's %s is malformed", what);
    return false;
}

bool read_ints(PyObject *obj, std::vector<int64_t> &out) {
    if (!PyTuple_Check(obj)) return fail_format("sizes or strides");
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(obj); ++i) {
        out.push_back(PyLong_AsLongLong(PyTuple_GET_ITEM(obj, i)));
        if (PyErr_Occurred()) return false;
    }
    return true;
}

bool read_map(PyObject *obj, MapSpec &m) {
    PyObject *dims, *strides, *box;
    if (!PyArg_ParseTuple(obj, "iiiO!O!O!", &m.dtype, &m.swizzle, &m.fill, &PyTuple_Type, &dims,
                          &PyTuple_Type, &strides, &PyTuple_Type, &box))
        return false;
    m.rank = static_cast<unsigned>(PyTuple_GET_SIZE(dims));
    if (m.rank < 1 || m.rank > 5 || PyTuple_GET_SIZE(box) != m.rank ||
        PyTuple_GET_SIZE(strides) != m.rank - 1)
        return fail_format("tensor map");
    for (unsigned i = 0; i < m.rank; ++i) {
        m.dims[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(dims, i));
        m.box[i] = static_cast<uint32_t>(PyLong_AsUnsignedLong(PyTuple_GET_ITEM(box, i)));
        if (i + 1 < m.rank) m.strides[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(strides, i));
    }
    return !PyErr_Occurred();
}

bool read_param(PyObject *obj, Param &p, Launch &launch) {
    const char *kind;
    PyObject *value, *map = NULL;
    if (!PyArg_ParseTuple(obj, "siiO|O", &kind, &p.source, &p.index, &value, &map)) return false;
    p.kind = kind[0];
    p.offset = 0;
    p.constant.u64 = 0;
    p.map = -1;
    if (p.kind == 't') {  // a descriptor: its tensor map's pointer, then its spec
        if (p.source == 0 || map == NULL || launch.maps.size() >= MAX_MAPS)
            return fail_format("tensor map");
        MapSpec m;
        if (!read_map(map, m)) return false;
        p.map = static_cast<int>(launch.maps.size());
        launch.maps.push_back(m);
    }
    if (p.source != 0) {
        if ((p.kind != 'p' && p.kind != 't') || p.source > 3 || p.index < 0)
            return fail_format("pointer");
        p.offset = PyLong_AsLongLong(value);
        return !PyErr_Occurred();
    }
    switch (p.kind) {
    case 'p': case 'L': p.constant.u64 = PyLong_AsUnsignedLongLong(value); break;
    case 'l': p.constant.i64 = PyLong_AsLongLong(value); break;
    case 'i': p.constant.i32 = static_cast<int32_t>(PyLong_AsLong(value)); break;
    case 'I': p.constant.u32 = static_cast<uint32_t>(PyLong_AsUnsignedLong(value)); break;
    case 'b': p.constant.i8 = static_cast<int8_t>(PyObject_IsTrue(value)); break;
    case 'f': p.constant.f32 = static_cast<float>(PyFloat_AsDouble(value)); break;
    case 'd': p.constant.f64 = PyFloat_AsDouble(value); break;
    default: return fail_format("parameter kind");
    }
    return !PyErr_Occurred();
}

bool read_output(PyObject *obj, Output &o, size_t n_allocations) {
    o.view = false;
    o.offset = 0;
    if (obj == Py_None) {
        o.allocation = -1;
        return true;
    }
    if (!PyTuple_Check(obj) || (PyTuple_GET_SIZE(obj) != 1 && PyTuple_GET_SIZE(obj) != 4))
        return fail_format("output");
    o.allocation = static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(obj, 0)));
    if (PyErr_Occurred()) return false;
    if (o.allocation < 0 || static_cast<size_t>(o.allocation) >= n_allocations)
        return fail_format("output");
    if (PyTuple_GET_SIZE(obj) == 4) {
        o.view = true;
        if (!read_ints(PyTuple_GET_ITEM(obj, 1), o.sizes)) return false;
        if (!read_ints(PyTuple_GET_ITEM(obj, 2), o.strides)) return false;
        o.offset = PyLong_AsLongLong(PyTuple_GET_ITEM(obj, 3));
    }
    return !PyErr_Occurred();
}

std::unique_ptr<Plan> read_plan(PyObject *obj, Py_ssize_t n_args) {
    auto plan = std::make_unique<Plan>();
    PyObject *allocations, *launches, *outputs;
    if (!PyArg_ParseTuple(obj, "O!O!(iO!)", &PyTuple_Type, &allocations, &PyTuple_Type,
                          &launches, &plan->result, &PyTuple_Type, &outputs))
        return nullptr;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(allocations); ++i) {
        Allocation a;
        PyObject *sizes, *strides, *dtype;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(allocations, i), "O!O!O", &PyTuple_Type, &sizes,
                              &PyTuple_Type, &strides, &dtype))
            return nullptr;
        if (!THPDtype_Check(dtype)) return fail_format("dtype"), nullptr;
        a.dtype = reinterpret_cast<THPDtype *>(dtype)->scalar_type;
        if (!read_ints(sizes, a.sizes) || !read_ints(strides, a.strides)) return nullptr;
        if (a.sizes.size() != a.strides.size()) return fail_format("allocation"), nullptr;
        plan->allocations.push_back(std::move(a));
    }
    size_t n_copies = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(launches); ++i) {
        Launch l;
        l.copy_of = -1;
        PyObject *step = PyTuple_GET_ITEM(launches, i), *function, *params;
        if (PyTuple_Check(step) && PyTuple_GET_SIZE(step) == 1) {  // a copy of an argument
            l.copy_of = static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(step, 0)));
            if (PyErr_Occurred()) return nullptr;
            if (l.copy_of < 0 || l.copy_of >= n_args) return fail_format("copy"), nullptr;
            ++n_copies;
            plan->launches.push_back(std::move(l));
            continue;
        }
        if (!PyArg_ParseTuple(step, "O(III)IIO!", &function, &l.grid[0],
                              &l.grid[1], &l.grid[2], &l.threads, &l.shared, &PyTuple_Type,
                              &params))
            return nullptr;
        l.function = PyLong_AsVoidPtr(function);
        if (PyErr_Occurred()) return nullptr;
        if (PyTuple_GET_SIZE(params) + 2 > MAX_PARAMS) return fail_format("parameters"), nullptr;
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(params); ++j) {
            Param p;
            if (!read_param(PyTuple_GET_ITEM(params, j), p, l)) return nullptr;
            if (p.kind == 't' && cu_tensor_map_encode_tiled == nullptr)
                return fail_format("tensor map (no cuTensorMapEncodeTiled)"), nullptr;
            size_t bound = p.source == 1   ? n_args
                           : p.source == 2 ? plan->allocations.size()
                                           : n_copies;
            if (p.source != 0 && static_cast<size_t>(p.index) >= bound)
                return fail_format("pointer"), nullptr;
            l.params.push_back(p);
        }
        plan->launches.push_back(std::move(l));
    }
    Py_ssize_t n_outputs = PyTuple_GET_SIZE(outputs);
    if (!(plan->result == 0 ? n_outputs == 0 : plan->result == 1 ? n_outputs == 1 : plan->result == 2))
        return fail_format("result"), nullptr;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(outputs); ++i) {
        Output o;
        if (!read_output(PyTuple_GET_ITEM(outputs, i), o, plan->allocations.size())) return nullptr;
        if (plan->result == 1 && o.allocation < 0) return fail_format("result"), nullptr;
        plan->outputs.push_back(std::move(o));
    }
    return plan;
}

// --- the Plans type ----------------------------------------------------------------------------

struct PlansObject {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *impl;
    PyObject *op;
    char replays;  // define_op(replays=True): expected to replay (testing.assert_replays)
    Table *table;
    long calls, replayed;  // since creation, for report()
    std::string *why_not;  // why the last call that was not replayed was not
};

/* The impl's result for a call that is not replayed, and why not. */
PyObject *call_impl(PlansObject *self, PyObject *const *args, Py_ssize_t n, const char *why) {
    ++self->calls;
    *self->why_not = why;
    return PyObject_Vectorcall(self->impl, args, n, NULL);
}

/* Make room for a new signature in a full table: drop the signatures without a plan, and if every
 * one has a plan, all of them (a workload whose shapes keep changing keeps getting plans). */
void make_room(Table *table) {
    if (table->size() < MAX_SIGNATURES) return;
    for (auto it = table->begin(); it != table->end();) {
        if (it->second.plan) {
            ++it;
            continue;
        }
        Py_CLEAR(it->second.first);
        it = table->erase(it);
    }
    if (table->size() >= MAX_SIGNATURES) clear_table(table);
}

/* Whether a plan may replay now: replay on, and no Triton launch hooks installed (a profiler
 * must see every launch: the impl); -1 with an error set. The hooks are
 * triton.knobs.runtime.launch_enter_hook: a HookChain, whose list `calls` is empty by default
 * (an older Triton: the hook itself, or None). */
int replays_now() {
    if (!enabled) return 0;
    PyObject *hook = PyObject_GetAttr(runtime_knobs, enter_hook_name);
    if (hook == NULL) return -1;
    PyObject *calls = PyObject_GetAttr(hook, calls_name);
    if (calls == NULL) {
        PyErr_Clear();
        calls = Py_NewRef(hook);
    }
    int installed = PyObject_IsTrue(calls);
    Py_DECREF(calls);
    Py_DECREF(hook);
    return installed < 0 ? -1 : !installed;
}

/* The entry of sig (created where `create`), or NULL: none. */
Entry *find_entry(PlansObject *self, const Signature &sig, bool create) {
    auto found = self->table->find(sig);
    if (found != self->table->end()) return &found->second;
    if (!create) return NULL;
    make_room(self->table);
    return &self->table->emplace(sig, Entry()).first->second;  // (a copy: run() keeps sig)
}

/* The impl's result for args, replayed or recorded where the signature allows. */
PyObject *run(PlansObject *self, PyObject *const *args, Py_ssize_t n) {
    Signature sig;
    int device;
    if (!enabled) return call_impl(self, args, n, "replay is off (disabled())");
    if (!signature(args, n, sig, device))
        return call_impl(self, args, n, "its arguments: a tensor off CUDA or not strided, "
                                        "two devices, or an argument of another type");
    int now = replays_now();
    if (now <= 0)
        return now < 0 ? NULL : call_impl(self, args, n, "Triton's launch hooks are installed");
    Entry &entry = *find_entry(self, sig, true);
    if (entry.plan) {
        PyObject *result = replay_python(*entry.plan, args, device);
        if (result == NULL && !PyErr_Occurred())
            return call_impl(self, args, n, "its tensors are not on the current device");
        self->replayed += result != NULL;
        self->calls += result != NULL;
        return result;
    }
    if (entry.refused) return call_impl(self, args, n, entry.why.c_str());
    if (entry.calls++ == 0) return call_impl(self, args, n, "the first call of its signature");

    // Calls 2 and 3: record. (The table may change while the impl runs: look the entry up again.)
    ++self->calls;
    *self->why_not = "a call recorded";
    PyObject *tuple = PyTuple_New(n);
    if (tuple == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; ++i) PyTuple_SET_ITEM(tuple, i, Py_NewRef(args[i]));
    PyObject *recorded = PyObject_CallFunctionObjArgs(recorder, self->impl, tuple, NULL);
    Py_DECREF(tuple);
    if (recorded == NULL) return NULL;
    PyObject *result, *data;
    if (!PyArg_ParseTuple(recorded, "OO", &result, &data)) {
        Py_DECREF(recorded);
        return NULL;
    }
    Py_INCREF(result);
    Py_INCREF(data);
    Py_DECREF(recorded);
    auto again = self->table->find(sig);
    if (again == self->table->end()) {  // forgotten meanwhile
        Py_DECREF(data);
        return result;
    }
    Entry &e = again->second;
    if (data == Py_False) {  // not now (a CUDA-graph capture): record a later call instead
        --e.calls;
        Py_DECREF(data);
        return result;
    }
    if (PyUnicode_Check(data) || e.refused) {
        const char *why = e.refused ? NULL : PyUnicode_AsUTF8(data);
        if (why != NULL) e.why = std::string("refused: ") + why;
        PyErr_Clear();
        e.refused = true;
        Py_CLEAR(e.first);
        Py_DECREF(data);
        return result;
    }
    if (e.first == NULL) {
        e.first = data;
        return result;
    }
    int same = PyObject_RichCompareBool(e.first, data, Py_EQ);
    Py_CLEAR(e.first);
    if (same > 0) {
        e.plan = read_plan(data, n);
        if (!e.plan) {  // plans.py built a plan this file cannot read: a bug; the impl stands
            same = 0;
            PyObject *type, *value, *traceback;
            PyErr_Fetch(&type, &value, &traceback);
            PyObject *text = value != NULL ? PyObject_Str(value) : NULL;
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(traceback);
            int warned = PyErr_WarnFormat(PyExc_RuntimeWarning, 1,
                                          "native_plans: a recorded plan was refused (%S); "
                                          "this signature runs the Python impl",
                                          text != NULL ? text : Py_None);
            Py_XDECREF(text);
            if (warned < 0) {
                Py_DECREF(data);
                Py_DECREF(result);
                return NULL;
            }
        }
    }
    Py_DECREF(data);
    if (same < 0) {
        e.refused = true;
        Py_DECREF(result);
        return NULL;
    }
    e.refused = !same;
    if (!same) e.why = "refused: its two recordings differ";
    return result;
}

PyObject *plans_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                           PyObject *kwnames) {
    PlansObject *self = reinterpret_cast<PlansObject *>(callable);
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0) {
        ++self->calls;
        *self->why_not = "keyword arguments";
        return PyObject_Vectorcall(self->impl, args, nargsf, kwnames);
    }
    if (recorder == NULL) return call_impl(self, args, n, "native_plans.init() was not called");
    // Under the dispatcher the thread-state test still decides: a mode or a tracer the impl's own
    // allocations would meet sends the call to the impl.
    bool direct = plain_call(args, n) != Verdict::op;
    return direct ? run(self, args, n)
                  : call_impl(self, args, n, "a mode, tracer, transform or profiler is on");
}

// --- the op's registered CUDA kernel --------------------------------------------------------
// An op called by its name reaches its CUDA kernel through torch's autograd kernel. Registered
// here rather than as a Python function, a call with a plan replays without a trip into Python
// and back (the dispatcher's Python kernel: about 3 us on an H100 host, DECISIONS.md). At the
// CUDA key the dispatcher has done its work: modes, tracers and transforms have had their turn,
// and a replay's allocations go through the dispatcher as the impl's would.

struct GILHeld {  // the dispatcher may call a kernel with the GIL released
    PyGILState_STATE state = PyGILState_Ensure();
    ~GILHeld() { PyGILState_Release(state); }
};

[[noreturn]] void throw_python_error() {  // the Python error set, as a C++ exception
    python_error error;
    error.persist();
    throw error;
}

PyObject *to_python(const c10::IValue &v) {  // a new reference, or NULL with an error set
    if (v.isTensor()) return THPVariable_Wrap(v.toTensor());  // (the common case, directly)
    try {
        return torch::jit::toPyObject(v).release().ptr();
    } catch (pybind11::error_already_set &error) {
        error.restore();
    } catch (const std::exception &error) {
        PyErr_Format(PyExc_TypeError, "native_plans: cannot pass an argument of type %s to the "
                                      "impl (%s)", v.tagKind().c_str(), error.what());
    }
    return NULL;
}

bool optional_return(const c10::FunctionSchema &schema, size_t i) {  // a `Tensor?` return
    return schema.returns()[i].type()->kind() == c10::TypeKind::OptionalType;
}

/* Push the impl's result as the schema's returns: tensors, or None where a return is optional. */
void push_result(PyObject *result, const c10::FunctionSchema &schema, torch::jit::Stack *stack) {
    size_t n_returns = schema.returns().size();
    if (n_returns == 0) {
        TORCH_CHECK(result == Py_None, "native_plans: the impl returned a value where the op's "
                                       "schema returns nothing");
        return;
    }
    bool one = n_returns == 1;
    TORCH_CHECK(one || (PyTuple_Check(result) &&
                        static_cast<size_t>(PyTuple_GET_SIZE(result)) == n_returns),
                "native_plans: the impl returned ", Py_TYPE(result)->tp_name, " where the op's "
                "schema returns ", n_returns, " values");
    for (size_t i = 0; i < n_returns; ++i) {
        PyObject *item = one ? result : PyTuple_GET_ITEM(result, i);
        if (item == Py_None && optional_return(schema, i)) {
            stack->emplace_back();
            continue;
        }
        TORCH_CHECK(THPVariable_Check(item), "native_plans: the impl returned ",
                    Py_TYPE(item)->tp_name, " as output ", i, " where the op's schema says Tensor");
        stack->emplace_back(THPVariable_Unpack(item));
    }
}

class PlansKernel final : public c10::OperatorKernel {
  public:
    explicit PlansKernel(PlansObject *plans) : plans_(plans) {}

    void operator()(const c10::OperatorHandle &op, c10::DispatchKeySet, torch::jit::Stack *stack) {
        const c10::FunctionSchema &schema = op.schema();
        size_t n = schema.arguments().size();
        GILHeld gil;
        c10::ArrayRef<c10::IValue> args = torch::jit::last(*stack, n);
        std::vector<at::Tensor> outputs;
        if (replayed(args, schema, outputs)) {
            torch::jit::drop(*stack, n);
            for (at::Tensor &t : outputs) {
                if (t.defined())
                    stack->emplace_back(std::move(t));
                else
                    stack->emplace_back();
            }
            return;
        }
        // Anything else (no plan yet, a recording, a CPU tensor): the entry as Python calls it.
        std::vector<PyObject *> py_args;
        py_args.reserve(n);
        for (const c10::IValue &arg : args) {
            PyObject *item = to_python(arg);
            if (item == NULL) break;
            py_args.push_back(item);
        }
        PyObject *result = py_args.size() == n
                               ? plans_vectorcall(reinterpret_cast<PyObject *>(plans_),
                                                  py_args.data(), n, NULL)
                               : NULL;
        for (PyObject *item : py_args) Py_DECREF(item);
        if (result == NULL) throw_python_error();
        torch::jit::drop(*stack, n);
        try {
            push_result(result, schema, stack);
        } catch (...) {
            Py_DECREF(result);
            throw;
        }
        Py_DECREF(result);
    }

  private:
    /* Replay args' plan into outputs; false when there is none to replay now. */
    bool replayed(c10::ArrayRef<c10::IValue> args, const c10::FunctionSchema &schema,
                  std::vector<at::Tensor> &outputs) {
        Signature sig;
        int device;
        if (!signature(args, sig, device)) return false;
        int now = replays_now();
        if (now <= 0) {
            if (now < 0) throw_python_error();
            return false;
        }
        Entry *entry = find_entry(plans_, sig, false);
        if (entry == NULL || !entry->plan) return false;
        const Plan &plan = *entry->plan;
        size_t n_returns = schema.returns().size();
        bool fits = plan.result == 0 ? n_returns == 0
                    : plan.result == 1 ? n_returns == 1
                                       : plan.outputs.size() == n_returns;
        for (size_t i = 0; fits && i < plan.outputs.size(); ++i)
            fits = plan.outputs[i].allocation >= 0 || optional_return(schema, i);
        if (!fits) return false;  // the impl's result would fail the schema: let push_result say so
        auto tensor_at = [args](int i) -> const at::Tensor & { return args[i].toTensor(); };
        bool replayed = replay(plan, tensor_at, device, outputs);
        plans_->replayed += replayed;
        plans_->calls += replayed;
        return replayed;
    }

    PlansObject *plans_;  // a reference held for the process's life (the kernel is never removed)
};

/* plans.register_kernel(qualified_name, dispatch_key): make this entry the op's kernel for that
 * key ("CUDA"; "CPU" in tests), in place of a Python kernel the caller has removed. */
PyObject *plans_register_kernel(PlansObject *self, PyObject *const *args, Py_ssize_t n) {
    const char *name, *key;
    if (n != 2 || !(name = PyUnicode_AsUTF8(args[0])) || !(key = PyUnicode_AsUTF8(args[1]))) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "Plans.register_kernel(name: str, key: str)");
        return NULL;
    }
    HANDLE_TH_ERRORS
    c10::DispatchKey dispatch_key = c10::parseDispatchKey(key);
    Py_INCREF(self);  // the kernel's reference
    auto functor = std::make_unique<PlansKernel>(self);
    // The handle is kept, never destroyed: unregistering at interpreter exit would run after
    // Python is gone.
    new c10::RegistrationHandleRAII(c10::Dispatcher::singleton().registerImpl(
        c10::OperatorName(name, ""), dispatch_key,
        c10::KernelFunction::makeFromBoxedKernel(c10::BoxedKernel::makeFromFunctor(std::move(functor))),
        std::nullopt, nullptr, "llmsys native_plans.Plans"));
    Py_RETURN_NONE;
    END_HANDLE_TH_ERRORS
}

// --- the op's autograd kernel for CUDA --------------------------------------------------------
// An op with a torch.library.register_autograd formula is called by name through torch's Python
// autograd kernel, even where autograd records nothing: about 10 us of host time on an H100
// host. Registered for AutogradCUDA, this kernel sends such a call below autograd as that
// kernel's no-grad branch does (without Python), and hands every other call to that kernel,
// kept from before: the formula stays the one torch.library.register_autograd wired.

#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 9  // (getComputedKernelForDispatchKey)
bool any_requires_grad(c10::ArrayRef<c10::IValue> args) {  // torch._C._any_requires_grad
    auto wants = [](const c10::IValue &v) {
        return v.isTensor() && v.toTensor().defined() && v.toTensor().requires_grad();
    };
    for (const c10::IValue &arg : args) {
        if (wants(arg)) return true;
        if (arg.isList())
            for (const c10::IValue &item : arg.toListRef())
                if (wants(item)) return true;
    }
    return false;
}

class AutogradKernel final : public c10::OperatorKernel {
  public:
    explicit AutogradKernel(c10::SafeKernelFunction formula) : formula_(std::move(formula)) {}

    void operator()(const c10::OperatorHandle &op, c10::DispatchKeySet keys,
                    torch::jit::Stack *stack) {
        size_t n = op.schema().arguments().size();
        if (c10::GradMode::is_enabled() && any_requires_grad(torch::jit::last(*stack, n))) {
            formula_.callBoxed(op, keys, stack);
            return;
        }
        c10::impl::ExcludeDispatchKeyGuard below(c10::autograd_dispatch_keyset);
        op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
    }

  private:
    c10::SafeKernelFunction formula_;  // torch's autograd kernel of the op, before this one
};
#endif

/* register_autograd(qualified_name, dispatch_key): put an AutogradKernel in front of the op's
 * autograd kernel for that key ("AutogradCUDA"; "AutogradCPU" in tests). */
PyObject *register_autograd(PyObject *, PyObject *const *args, Py_ssize_t n) {
    const char *name, *key;
    if (n != 2 || !(name = PyUnicode_AsUTF8(args[0])) || !(key = PyUnicode_AsUTF8(args[1]))) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "native_plans.register_autograd(name: str, key: str)");
        return NULL;
    }
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 9
    HANDLE_TH_ERRORS
    c10::DispatchKey dispatch_key = c10::parseDispatchKey(key);
    c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
    auto kernel = std::make_unique<AutogradKernel>(op.getComputedKernelForDispatchKey(dispatch_key));
    new c10::RegistrationHandleRAII(c10::Dispatcher::singleton().registerImpl(  // (kept: as above)
        op.operator_name(), dispatch_key,
        c10::KernelFunction::makeFromBoxedKernel(c10::BoxedKernel::makeFromFunctor(std::move(kernel))),
        std::nullopt, nullptr, "llmsys native_plans autograd"));
    Py_RETURN_NONE;
    END_HANDLE_TH_ERRORS
#else
    Py_RETURN_NONE;  // an older torch: its autograd kernel takes every call
#endif
}

PyObject *plans_below_autograd(PlansObject *self, PyObject *args) {
    if (!PyTuple_Check(args)) {
        PyErr_SetString(PyExc_TypeError, "Plans.below_autograd(args: tuple)");
        return NULL;
    }
    if (recorder == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "native_plans: init() was not called");
        return NULL;
    }
    PyObject *const *items = &PyTuple_GET_ITEM(args, 0);
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    bool direct = plain_call(items, n) == Verdict::direct;
    if (direct) return run(self, items, n);
    return PyObject_Vectorcall(self->op, items, n, NULL);
}

PyObject *plans_install(PlansObject *self, PyObject *const *args, Py_ssize_t n) {
    if (n != 2 || !PyTuple_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "Plans.install(args: tuple, plan)");
        return NULL;
    }
    Signature sig;
    int device;
    Py_ssize_t n_args = PyTuple_GET_SIZE(args[0]);
    if (!signature(&PyTuple_GET_ITEM(args[0], 0), n_args, sig, device)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "Plans.install: args have no replayable signature");
        return NULL;
    }
    std::unique_ptr<Plan> plan = read_plan(args[1], n_args);
    if (!plan) return NULL;
    PyObject *const *items = &PyTuple_GET_ITEM(args[0], 0);
    for (const Launch &l : plan->launches) {  // every argument a plan reads must be a tensor
        bool tensors = l.copy_of < 0 || THPVariable_Check(items[l.copy_of]);
        for (const Param &p : l.params)
            tensors = tensors && (p.source != 1 || THPVariable_Check(items[p.index]));
        if (!tensors) return fail_format("pointer (not a tensor argument)"), nullptr;
    }
    Entry &entry = *find_entry(self, sig, true);
    Py_CLEAR(entry.first);
    entry.refused = false;
    entry.plan = std::move(plan);
    Py_RETURN_NONE;
}

PyObject *plans_report(PlansObject *self, PyObject *) {
    long planned = 0, refused = 0, pending = 0;
    for (const auto &item : *self->table) {
        if (item.second.plan) ++planned;
        else if (item.second.refused) ++refused;
        else ++pending;
    }
    return Py_BuildValue("{s:l,s:l,s:l,s:l,s:l,s:s}", "planned", planned, "pending", pending,
                         "refused", refused, "calls", self->calls, "replayed", self->replayed,
                         "why_not", self->why_not->c_str());
}

PyObject *plans_clear(PlansObject *self, PyObject *) {
    clear_table(self->table);
    Py_RETURN_NONE;
}

PyObject *plans_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *impl, *op;
    int replays = 0;
    if (!PyArg_ParseTuple(args, "OO|p:Plans", &impl, &op, &replays)) return NULL;
    PlansObject *self = reinterpret_cast<PlansObject *>(type->tp_alloc(type, 0));
    if (self == NULL) return NULL;
    self->vectorcall = plans_vectorcall;
    self->impl = Py_NewRef(impl);
    self->op = Py_NewRef(op);
    self->replays = static_cast<char>(replays);
    self->table = new Table();
    self->why_not = new std::string("no call yet");
    return reinterpret_cast<PyObject *>(self);
}

void plans_dealloc(PlansObject *self) {
    clear_table(self->table);
    delete self->table;
    delete self->why_not;
    Py_CLEAR(self->impl);
    Py_CLEAR(self->op);
    Py_TYPE(self)->tp_free(reinterpret_cast<PyObject *>(self));
}

PyObject *plans_call(PyObject *self, PyObject *args, PyObject *kwargs) {
    return PyVectorcall_Call(self, args, kwargs);
}

PyMethodDef plans_methods[] = {
    {"below_autograd", (PyCFunction)plans_below_autograd, METH_O,
     "The impl's result where autograd records nothing and the dispatcher would only call the "
     "impl, else op(*args)."},
    {"register_kernel", (PyCFunction)(void (*)(void))plans_register_kernel, METH_FASTCALL,
     "Register this entry as the op's kernel for a dispatch key (C++, no Python per call)."},
    {"install", (PyCFunction)(void (*)(void))plans_install, METH_FASTCALL,
     "Install a plan for the signature of args."},
    {"report", (PyCFunction)plans_report, METH_NOARGS,
     "Signatures per state, calls and replays so far, and why the last call was not replayed."},
    {"clear", (PyCFunction)plans_clear, METH_NOARGS, "Forget every signature."},
    {NULL, NULL, 0, NULL},
};

PyMemberDef plans_members[] = {
    {"replays", T_BOOL, offsetof(PlansObject, replays), READONLY,
     "define_op(replays=True): expected to replay."},
    {NULL, 0, 0, 0, NULL},
};

PyTypeObject PlansType = {PyVarObject_HEAD_INIT(NULL, 0)};

PyObject *init(PyObject *, PyObject *const *args, Py_ssize_t n) {
    if (n != 2) {
        PyErr_SetString(PyExc_TypeError, "native_plans.init(recorder, runtime_knobs)");
        return NULL;
    }
    void *driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);  // (kept open for good)
    if (driver == NULL) {
        PyErr_Format(PyExc_RuntimeError, "native_plans: cannot open libcuda.so.1: %s", dlerror());
        return NULL;
    }
    cu_launch_kernel = reinterpret_cast<launch_kernel_t>(dlsym(driver, "cuLaunchKernel"));
    cu_tensor_map_encode_tiled =
        reinterpret_cast<encode_tiled_t>(dlsym(driver, "cuTensorMapEncodeTiled"));
    if (cu_launch_kernel == nullptr) {
        PyErr_SetString(PyExc_RuntimeError, "native_plans: libcuda has no cuLaunchKernel");
        return NULL;
    }
    enter_hook_name = PyUnicode_InternFromString("launch_enter_hook");
    calls_name = PyUnicode_InternFromString("calls");
    if (enter_hook_name == NULL || calls_name == NULL) return NULL;
    Py_XSETREF(recorder, Py_NewRef(args[0]));
    Py_XSETREF(runtime_knobs, Py_NewRef(args[1]));
    Py_RETURN_NONE;
}

PyObject *plain(PyObject *, PyObject *args) {  // plain_call for tests: False, True or None
    if (!PyTuple_Check(args)) {
        PyErr_SetString(PyExc_TypeError, "native_plans.plain(args: tuple)");
        return NULL;
    }
    Verdict verdict = plain_call(&PyTuple_GET_ITEM(args, 0), PyTuple_GET_SIZE(args));
    if (verdict == Verdict::op) Py_RETURN_NONE;
    return PyBool_FromLong(verdict == Verdict::records);
}

PyObject *set_enabled(PyObject *, PyObject *flag) {
    int on = PyObject_IsTrue(flag);
    if (on < 0) return NULL;
    PyObject *before = PyBool_FromLong(enabled);
    enabled = on;
    return before;
}

PyMethodDef module_methods[] = {
    {"init", (PyCFunction)(void (*)(void))init, METH_FASTCALL, "Set the Python callables."},
    {"register_autograd", (PyCFunction)(void (*)(void))register_autograd, METH_FASTCALL,
     "Short-cut the op's autograd kernel for a dispatch key where autograd records nothing."},
    {"plain", plain, METH_O,
     "library._plain_call(args) as the entries ask it: False (direct), True (autograd records) "
     "or None (the op)."},
    {"set_enabled", set_enabled, METH_O,
     "Replay and record (True) or run every impl (False); returns the previous setting."},
    {NULL, NULL, 0, NULL},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "native_plans", NULL, -1, module_methods};

}  // namespace

PyMODINIT_FUNC PyInit_native_plans(void) {
    PlansType.tp_name = "native_plans.Plans";
    PlansType.tp_basicsize = sizeof(PlansObject);
    PlansType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL;
    PlansType.tp_new = plans_new;
    PlansType.tp_dealloc = reinterpret_cast<destructor>(plans_dealloc);
    PlansType.tp_call = plans_call;
    PlansType.tp_vectorcall_offset = offsetof(PlansObject, vectorcall);
    PlansType.tp_methods = plans_methods;
    PlansType.tp_members = plans_members;
    PlansType.tp_doc = "An op's impl with its recorded plans (see native_plans.cpp).";
    if (PyType_Ready(&PlansType) < 0) return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) return NULL;
    if (PyModule_AddObjectRef(module, "Plans", reinterpret_cast<PyObject *>(&PlansType)) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
