/* The launch floor: look a Triton kernel's specialization up, pack its arguments and call
 * cuLaunchKernel, all in C.
 *
 * Triton's own launcher (CompiledKernel.run) does the packing and launch plus per-call Python
 * (scratch buffers, hooks) and one driver query per pointer argument (cuPointerGetAttribute, to
 * validate it); launcher.py's key for the cache of compiled kernels cost as much again in Python
 * (DECISIONS.md). launcher.py comes here only when none of Triton's extras is needed: no scratch
 * buffers, launch hooks, clusters, cooperative grids or programmatic dependent launch, and CUDA
 * tensors on the current device.
 *
 *   init(tensor_type, current_device, current_stream, runtime_knobs)
 *       once: torch.Tensor (so tensors are recognised in C); torch's current-device and
 *       current-stream functions and Triton's runtime knobs (launch hooks), or None each
 *   launch(cache, kernel, grid, args, constexprs, num_warps, num_stages, options)
 *       -> True: launched. Else the specialization key (a tuple): launcher.py compiles (a miss)
 *          or launches through Triton (an entry without kinds, or no current CUDA context).
 *          None: a call launcher.py handles whole: a grid of other than 1 to 3 positive ints,
 *          a first argument that is not a CUDA tensor of the current device, launch hooks
 *          installed, or an argument the key does not cover.
 *   key(head, args, constexprs) -> the same key (head: kernel, device, num_warps, num_stages,
 *          then one (name, value) pair per option), or None
 *   pack(kinds, *args) -> bytes            (the parameter bytes, for tests without a GPU)
 *   hooks_installed() -> whether Triton's launch hooks are installed
 *   driver() -> (cuLaunchKernel, cuTensorMapEncodeTiled or None) as capsules named after them
 *          (native_plans.cpp launches with them); loads the driver, so it raises without one
 *   plain(args, tests, autograd_records, strided)
 *       -> False: an op's impl may be called directly with args (library.py's test, in C):
 *          every one of `tests` (zero-argument callables: modes, tracing, profiler) returns a
 *          false value, every argument is a strided CPU or CUDA tensor of the tensor type
 *          itself, an int, a float, a bool or None, and autograd records nothing (no tensor
 *          requires grad, or autograd_records() is false). True: a tensor requires grad and
 *          autograd records. None: anything else.
 *
 * The key is head + one entry per argument + the constexpr values. Triton specializes a pointer
 * on its dtype and 16-byte alignment, an int on being 1, on divisibility by 16 and on its width:
 * a tensor's entry is (dtype, aligned), an int's a code 16 + 4 * (== 1) + 2 * (% 16 == 0) +
 * (fits in 32 bits), a bool is itself, a float is the float type (floats are not specialized).
 * A cache entry is (compiled kernel, kinds or None, threads per program, shared bytes, function).
 *
 * `kinds` holds one character per kernel argument, in signature order:
 *   'p' a tensor (its data_ptr()) or an int address, 8 bytes    'i' int32   'l' int64
 *   'I' uint32   'L' uint64   'b' int8 (a bool)   'f' float32   'd' float64
 *   '-' not a kernel parameter (a constexpr, or an int Triton specialized to a constant)
 * Triton appends two pointer parameters to every kernel (global and profile scratch): both NULL.
 *
 * The driver is found with dlopen at the first launch, so the module builds and imports on a
 * machine without CUDA.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

#include "native_slot.h"

#define MAX_PARAMS 128

typedef int CUresult;
typedef CUresult (*launch_kernel_t)(void *function, unsigned grid_x, unsigned grid_y,
                                    unsigned grid_z, unsigned block_x, unsigned block_y,
                                    unsigned block_z, unsigned shared_bytes, void *stream,
                                    void **params, void **extra);
typedef CUresult (*error_string_t)(CUresult, const char **);

static launch_kernel_t cu_launch_kernel = NULL;
static error_string_t cu_get_error_string = NULL;
static void *cu_tensor_map_encode_tiled = NULL; /* for native_plans; NULL before CUDA 12 */

static int load_driver(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        PyErr_Format(PyExc_RuntimeError, "native_launch: cannot open libcuda.so.1: %s", dlerror());
        return 0;
    }
    cu_launch_kernel = (launch_kernel_t)dlsym(lib, "cuLaunchKernel");
    cu_get_error_string = (error_string_t)dlsym(lib, "cuGetErrorString");
    cu_tensor_map_encode_tiled = dlsym(lib, "cuTensorMapEncodeTiled");
    if (cu_launch_kernel == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "native_launch: libcuda has no cuLaunchKernel");
        return 0;
    }
    return 1;
}


static int address(PyObject *arg, uint64_t *out) {
    if (PyLong_Check(arg)) {
        *out = PyLong_AsUnsignedLongLong(arg);
        return !PyErr_Occurred();
    }
    PyObject *ptr = PyObject_CallMethod(arg, "data_ptr", NULL);
    if (ptr == NULL) return 0;
    *out = PyLong_AsUnsignedLongLong(ptr);
    Py_DECREF(ptr);
    return !PyErr_Occurred();
}

/* Fill slots[] and params[] from args by kinds (pointers from ptrs[] where given); returns the
 * number of parameters, or -1. */
static int pack_params(const char *kinds, Py_ssize_t n_kinds, PyObject *const *args,
                       const uint64_t *ptrs, Slot *slots, void **params) {
    int n = 0;
    for (Py_ssize_t i = 0; i < n_kinds; ++i) {
        PyObject *arg = args[i];
        Slot *slot = &slots[n];
        switch (kinds[i]) {
        case '-':
            continue;
        case 'p':
            if (ptrs != NULL) slot->u64 = ptrs[i];
            else if (!address(arg, &slot->u64)) return -1;
            break;
        case 'i':
            slot->i32 = (int32_t)PyLong_AsLong(arg);
            break;
        case 'l':
            slot->i64 = PyLong_AsLongLong(arg);
            break;
        case 'I':
            slot->u32 = (uint32_t)PyLong_AsUnsignedLong(arg);
            break;
        case 'L':
            slot->u64 = PyLong_AsUnsignedLongLong(arg);
            break;
        case 'b':
            slot->i8 = (int8_t)PyObject_IsTrue(arg);
            break;
        case 'f':
            slot->f32 = (float)PyFloat_AsDouble(arg);
            break;
        case 'd':
            slot->f64 = PyFloat_AsDouble(arg);
            break;
        default:
            PyErr_Format(PyExc_ValueError, "native_launch: unknown kind '%c'", kinds[i]);
            return -1;
        }
        if (PyErr_Occurred()) return -1;
        params[n++] = slot;
    }
    slots[n].u64 = 0; /* global scratch */
    params[n] = &slots[n];
    ++n;
    slots[n].u64 = 0; /* profile scratch */
    params[n] = &slots[n];
    return n + 1;
}

static int read_kinds(PyObject *obj, Py_ssize_t n_args, const char **kinds, Py_ssize_t *n) {
    if (PyBytes_AsStringAndSize(obj, (char **)kinds, n) < 0) return 0;
    if (*n != n_args || *n + 2 > MAX_PARAMS) {
        PyErr_Format(PyExc_ValueError,
                     "native_launch: %zd kinds for %zd arguments (at most %d parameters)", *n,
                     n_args, MAX_PARAMS - 2);
        return 0;
    }
    return 1;
}

static PyObject *tensor_type = NULL;
static PyObject *current_device = NULL; /* torch._C._cuda_getDevice, or None */
static PyObject *current_stream = NULL; /* torch._C._cuda_getCurrentRawStream, or None */
static PyObject *runtime_knobs = NULL;  /* triton.knobs.runtime, or None */
static PyObject *dtype_name = NULL, *data_ptr_name = NULL, *get_device_name = NULL;
static PyObject *enter_hook_name = NULL, *calls_name = NULL;
static PyObject *is_cuda_name = NULL, *is_cpu_name = NULL, *layout_name = NULL;
static PyObject *requires_grad_name = NULL;

static PyObject *init(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyType_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "native_launch.init(torch.Tensor, current_device, "
                        "current_stream, runtime_knobs)");
        return NULL;
    }
    Py_XSETREF(tensor_type, Py_NewRef(args[0]));
    Py_XSETREF(current_device, Py_NewRef(args[1]));
    Py_XSETREF(current_stream, Py_NewRef(args[2]));
    Py_XSETREF(runtime_knobs, Py_NewRef(args[3]));
    if (dtype_name == NULL) {
        dtype_name = PyUnicode_InternFromString("dtype");
        data_ptr_name = PyUnicode_InternFromString("data_ptr");
        get_device_name = PyUnicode_InternFromString("get_device");
        enter_hook_name = PyUnicode_InternFromString("launch_enter_hook");
        calls_name = PyUnicode_InternFromString("calls");
        is_cuda_name = PyUnicode_InternFromString("is_cuda");
        is_cpu_name = PyUnicode_InternFromString("is_cpu");
        layout_name = PyUnicode_InternFromString("layout");
        requires_grad_name = PyUnicode_InternFromString("requires_grad");
    }
    Py_RETURN_NONE;
}

/* The key (a new tuple) of head + args + constexprs; ptrs[i] gets tensor i's address. NULL with
 * no error set: an argument the key does not cover. */
static PyObject *make_key(PyObject *head, PyObject *args, PyObject *constexprs, uint64_t *ptrs) {
    if (tensor_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "native_launch: init() was not called");
        return NULL;
    }
    if (!PyTuple_Check(head) || !PyTuple_Check(args) || !PyDict_Check(constexprs)) {
        PyErr_SetString(PyExc_TypeError, "native_launch: head, args, constexprs: tuple, tuple, dict");
        return NULL;
    }
    Py_ssize_t n_head = PyTuple_GET_SIZE(head), n_args = PyTuple_GET_SIZE(args);
    if (n_args + PyDict_GET_SIZE(constexprs) + 2 > MAX_PARAMS) return NULL;
    PyObject *key = PyTuple_New(n_head + n_args + PyDict_GET_SIZE(constexprs));
    if (key == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n_head; ++i)
        PyTuple_SET_ITEM(key, i, Py_NewRef(PyTuple_GET_ITEM(head, i)));
    for (Py_ssize_t i = 0; i < n_args; ++i) {
        PyObject *arg = PyTuple_GET_ITEM(args, i), *entry;
        if (PyObject_TypeCheck(arg, (PyTypeObject *)tensor_type)) {
            PyObject *dtype = PyObject_GetAttr(arg, dtype_name);
            if (dtype == NULL) goto fail;
            PyObject *ptr = PyObject_CallMethodNoArgs(arg, data_ptr_name);
            if (ptr == NULL) { Py_DECREF(dtype); goto fail; }
            ptrs[i] = PyLong_AsUnsignedLongLong(ptr);
            Py_DECREF(ptr);
            if (PyErr_Occurred()) { Py_DECREF(dtype); goto fail; }
            entry = PyTuple_Pack(2, dtype, ptrs[i] % 16 == 0 ? Py_True : Py_False);
            Py_DECREF(dtype);
            if (entry == NULL) goto fail;
        } else if (PyBool_Check(arg)) {
            entry = Py_NewRef(arg);
        } else if (PyLong_CheckExact(arg)) {
            int overflow;
            long long v = PyLong_AsLongLongAndOverflow(arg, &overflow);
            if (overflow) goto fail; /* past int64 (Triton's u64 rules): keyed in Python */
            if (v == -1 && PyErr_Occurred()) goto fail;
            entry = PyLong_FromLong(16 + 4 * (v == 1) + 2 * (v % 16 == 0) +
                                    (v >= -2147483648LL && v < 2147483648LL));
        } else if (PyFloat_CheckExact(arg)) {
            entry = Py_NewRef((PyObject *)&PyFloat_Type);
        } else {
            goto fail; /* not covered: keyed in Python */
        }
        PyTuple_SET_ITEM(key, n_head + i, entry);
    }
    Py_ssize_t position = 0, i = n_head + n_args;
    PyObject *name, *value;
    while (PyDict_Next(constexprs, &position, &name, &value))
        PyTuple_SET_ITEM(key, i++, Py_NewRef(value));
    return key;
fail: /* an error is set, or (none set) an argument this key does not cover */
    Py_DECREF(key);
    return NULL;
}

static PyObject *key(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "native_launch.key(head, args, constexprs)");
        return NULL;
    }
    uint64_t ptrs[MAX_PARAMS];
    PyObject *result = make_key(args[0], args[1], args[2], ptrs);
    if (result == NULL && !PyErr_Occurred()) Py_RETURN_NONE;
    return result;
}

/* A positive C int from a Python int, or 0 (no error set) for anything else. */
static unsigned grid_size(PyObject *size) {
    if (!PyLong_CheckExact(size)) return 0;
    long value = PyLong_AsLong(size);
    if (value == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return value > 0 && value <= 0x7fffffff ? (unsigned)value : 0;
}

/* Whether Triton's launch hooks are installed (a profiler): launcher.py then takes Triton's
 * launch, which calls them. -1 on an error. */
static int hooks_installed(void) {
    if (runtime_knobs == Py_None) return 0;
    PyObject *hook = PyObject_GetAttr(runtime_knobs, enter_hook_name);
    if (hook == NULL) return -1;
    PyObject *calls = PyObject_GetAttr(hook, calls_name); /* a HookChain's list of hooks */
    if (calls == NULL) {
        PyErr_Clear();
        calls = Py_NewRef(hook); /* an older Triton: the hook itself, or None */
    }
    int installed = PyObject_IsTrue(calls);
    Py_DECREF(calls);
    Py_DECREF(hook);
    return installed;
}

/* The CUDA device of a tensor on the current device, or -1 (no error set) for anything else. */
static long launch_device(PyObject *first) {
    if (current_device == Py_None || current_stream == Py_None ||
        !PyObject_TypeCheck(first, (PyTypeObject *)tensor_type))
        return -1;
    PyObject *index = PyObject_CallMethodNoArgs(first, get_device_name);
    if (index == NULL) return -2;
    long device = PyLong_AsLong(index);
    Py_DECREF(index);
    if (device < 0) return PyErr_Occurred() ? -2 : -1;
    PyObject *current = PyObject_CallNoArgs(current_device);
    if (current == NULL) return -2;
    long current_index = PyLong_AsLong(current);
    Py_DECREF(current);
    if (current_index == -1 && PyErr_Occurred()) return -2;
    return device == current_index ? device : -1;
}

static PyObject *launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8 || !PyDict_Check(args[0]) || !PyDict_Check(args[7])) {
        PyErr_SetString(PyExc_TypeError, "native_launch.launch(cache, kernel, grid, args, "
                        "constexprs, num_warps, num_stages, options: dict)");
        return NULL;
    }
    PyObject *grid = args[2], *kernel_args = args[3], *constexprs = args[4], *options = args[7];
    unsigned sizes[3] = {1, 1, 1};
    if (PyTuple_Check(grid)) {
        Py_ssize_t n = PyTuple_GET_SIZE(grid);
        if (n < 1 || n > 3) Py_RETURN_NONE;
        for (Py_ssize_t i = 0; i < n; ++i)
            if ((sizes[i] = grid_size(PyTuple_GET_ITEM(grid, i))) == 0) Py_RETURN_NONE;
    } else if ((sizes[0] = grid_size(grid)) == 0) {
        Py_RETURN_NONE; /* 0, negative, not an int: launcher.py launches nothing or names it */
    }
    if (!PyTuple_Check(kernel_args) || PyTuple_GET_SIZE(kernel_args) == 0) Py_RETURN_NONE;
    long device = launch_device(PyTuple_GET_ITEM(kernel_args, 0));
    if (device == -2) return NULL;
    if (device < 0) Py_RETURN_NONE;
    int hooked = hooks_installed();
    if (hooked < 0) return NULL;
    if (hooked) Py_RETURN_NONE;

    PyObject *device_obj = PyLong_FromLong(device);
    if (device_obj == NULL) return NULL;
    PyObject *stream_obj = PyObject_CallOneArg(current_stream, device_obj);
    void *stream = stream_obj == NULL ? NULL : PyLong_AsVoidPtr(stream_obj);
    Py_XDECREF(stream_obj);
    if (PyErr_Occurred()) { Py_DECREF(device_obj); return NULL; }

    /* The head of the key: kernel, device, num_warps, num_stages, (name, value) per option. */
    Py_ssize_t n_options = PyDict_GET_SIZE(options);
    PyObject *head = PyTuple_New(4 + n_options);
    if (head == NULL) { Py_DECREF(device_obj); return NULL; }
    PyTuple_SET_ITEM(head, 0, Py_NewRef(args[1]));
    PyTuple_SET_ITEM(head, 1, device_obj); /* the tuple takes the reference */
    PyTuple_SET_ITEM(head, 2, Py_NewRef(args[5]));
    PyTuple_SET_ITEM(head, 3, Py_NewRef(args[6]));
    Py_ssize_t position = 0, i = 4;
    PyObject *name, *value;
    while (PyDict_Next(options, &position, &name, &value)) {
        PyObject *pair = PyTuple_Pack(2, name, value);
        if (pair == NULL) { Py_DECREF(head); return NULL; }
        PyTuple_SET_ITEM(head, i++, pair);
    }
    uint64_t ptrs[MAX_PARAMS];
    PyObject *key = make_key(head, kernel_args, constexprs, ptrs);
    Py_DECREF(head);
    if (key == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    PyObject *entry = PyDict_GetItemWithError(args[0], key); /* borrowed */
    if (entry == NULL) {
        if (PyErr_Occurred()) { Py_DECREF(key); return NULL; }
        return key; /* a miss: compile */
    }
    PyObject *kinds_obj = PyTuple_GET_ITEM(entry, 1);
    if (kinds_obj == Py_None) return key; /* Triton's launcher */
    const char *kinds = PyBytes_AS_STRING(kinds_obj);
    Py_ssize_t n_kinds = PyBytes_GET_SIZE(kinds_obj), n_args = PyTuple_GET_SIZE(kernel_args);
    if (n_kinds < n_args) return key;
    for (Py_ssize_t j = n_args; j < n_kinds; ++j)
        if (kinds[j] != '-') return key; /* a constexpr that is a parameter: Triton's launcher */
    Slot slots[MAX_PARAMS];
    void *params[MAX_PARAMS];
    if (pack_params(kinds, n_args, &PyTuple_GET_ITEM(kernel_args, 0), ptrs, slots, params) < 0) {
        Py_DECREF(key);
        return NULL;
    }
    void *function = PyLong_AsVoidPtr(PyTuple_GET_ITEM(entry, 4));
    unsigned threads = (unsigned)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(entry, 2));
    unsigned shared = (unsigned)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(entry, 3));
    if (PyErr_Occurred() || (cu_launch_kernel == NULL && !load_driver())) {
        Py_DECREF(key);
        return NULL;
    }
    CUresult status;
    Py_BEGIN_ALLOW_THREADS;
    status = cu_launch_kernel(function, sizes[0], sizes[1], sizes[2], threads, 1, 1, shared,
                              stream, params, NULL);
    Py_END_ALLOW_THREADS;
    if (status == 201) return key; /* no current context on this thread: Triton's launcher */
    Py_DECREF(key);
    if (status != 0) {
        const char *message = "unknown error";
        if (cu_get_error_string != NULL) cu_get_error_string(status, &message);
        PyErr_Format(PyExc_RuntimeError, "native_launch: cuLaunchKernel failed (%d): %s",
                     status, message);
        return NULL;
    }
    Py_RETURN_TRUE;
}

/* The truth of obj.name, or -1 on an error. */
static int attribute_true(PyObject *obj, PyObject *name) {
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL) return -1;
    int truth = PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

static PyObject *plain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyTuple_Check(args[0]) || !PyTuple_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError,
                        "native_launch.plain(args: tuple, tests: tuple, autograd_records, strided)");
        return NULL;
    }
    if (tensor_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "native_launch: init() was not called");
        return NULL;
    }
    PyObject *tests = args[1];
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tests); ++i) {
        PyObject *result = PyObject_CallNoArgs(PyTuple_GET_ITEM(tests, i));
        if (result == NULL) return NULL;
        int active = PyObject_IsTrue(result);
        Py_DECREF(result);
        if (active < 0) return NULL;
        if (active) Py_RETURN_NONE;
    }
    PyObject *call_args = args[0];
    int requires_grad = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(call_args); ++i) {
        PyObject *arg = PyTuple_GET_ITEM(call_args, i);
        if (Py_TYPE(arg) == (PyTypeObject *)tensor_type) {
            int on_device = attribute_true(arg, is_cuda_name);
            if (on_device == 0) on_device = attribute_true(arg, is_cpu_name);
            if (on_device < 0) return NULL;
            if (!on_device) Py_RETURN_NONE;
            PyObject *layout = PyObject_GetAttr(arg, layout_name);
            if (layout == NULL) return NULL;
            Py_DECREF(layout); /* compared by identity, as torch.strided is one object */
            if (layout != args[3]) Py_RETURN_NONE;
            if (!requires_grad) {
                requires_grad = attribute_true(arg, requires_grad_name);
                if (requires_grad < 0) return NULL;
            }
        } else if (!(arg == Py_None || PyBool_Check(arg) || PyLong_CheckExact(arg) ||
                     PyFloat_CheckExact(arg))) {
            Py_RETURN_NONE; /* a subclass, a proxy, anything else: the op */
        }
    }
    if (!requires_grad) Py_RETURN_FALSE;
    PyObject *records = PyObject_CallNoArgs(args[2]);
    if (records == NULL) return NULL;
    int recorded = PyObject_IsTrue(records);
    Py_DECREF(records);
    if (recorded < 0) return NULL;
    return PyBool_FromLong(recorded);
}

static PyObject *hooks(PyObject *self, PyObject *unused) {
    int installed = hooks_installed();
    if (installed < 0) return NULL;
    return PyBool_FromLong(installed);
}

static PyObject *driver(PyObject *self, PyObject *unused) {
    if (cu_launch_kernel == NULL && !load_driver()) return NULL;
    PyObject *launch = PyCapsule_New((void *)cu_launch_kernel, "cuLaunchKernel", NULL);
    if (launch == NULL) return NULL;
    PyObject *encode = cu_tensor_map_encode_tiled == NULL
                           ? Py_NewRef(Py_None)
                           : PyCapsule_New(cu_tensor_map_encode_tiled, "cuTensorMapEncodeTiled", NULL);
    if (encode == NULL) { Py_DECREF(launch); return NULL; }
    PyObject *pair = PyTuple_Pack(2, launch, encode);
    Py_DECREF(launch);
    Py_DECREF(encode);
    return pair;
}

static PyObject *pack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1) {
        PyErr_SetString(PyExc_TypeError, "native_launch.pack: too few arguments");
        return NULL;
    }
    const char *kinds;
    Py_ssize_t n_kinds;
    if (!read_kinds(args[0], nargs - 1, &kinds, &n_kinds)) return NULL;
    Slot slots[MAX_PARAMS];
    void *params[MAX_PARAMS];
    int n = pack_params(kinds, n_kinds, args + 1, NULL, slots, params);
    if (n < 0) return NULL;
    /* Each parameter as the driver reads it: its own width, in order. */
    char buffer[MAX_PARAMS * 8];
    Py_ssize_t size = 0;
    int p = 0;
    for (Py_ssize_t i = 0; i < n_kinds; ++i) {
        size_t width;
        switch (kinds[i]) {
        case '-': continue;
        case 'b': width = 1; break;
        case 'i': case 'I': case 'f': width = 4; break;
        default: width = 8;
        }
        memcpy(buffer + size, params[p++], width);
        size += width;
    }
    memcpy(buffer + size, params[p++], 8);
    memcpy(buffer + size + 8, params[p], 8);
    return PyBytes_FromStringAndSize(buffer, size + 16);
}

static PyMethodDef methods[] = {
    {"init", (PyCFunction)(void (*)(void))init, METH_FASTCALL, "Set the tensor type."},
    {"key", (PyCFunction)(void (*)(void))key, METH_FASTCALL, "The specialization key."},
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL,
     "Look the specialization up and launch it."},
    {"pack", (PyCFunction)(void (*)(void))pack, METH_FASTCALL, "The packed parameter bytes."},
    {"plain", (PyCFunction)(void (*)(void))plain, METH_FASTCALL,
     "Whether an op's impl may be called directly."},
    {"hooks_installed", hooks, METH_NOARGS, "Whether Triton's launch hooks are installed."},
    {"driver", driver, METH_NOARGS, "cuLaunchKernel and cuTensorMapEncodeTiled as capsules."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "native_launch", NULL, -1, methods};

PyMODINIT_FUNC PyInit_native_launch(void) { return PyModule_Create(&module); }
