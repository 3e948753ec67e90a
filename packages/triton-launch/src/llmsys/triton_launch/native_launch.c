/* The launch floor: pack a Triton kernel's arguments and call cuLaunchKernel, in C.
 *
 * Triton's own launcher (CompiledKernel.run) does the same job, plus per-call Python (scratch
 * buffers, hooks) and one driver query per pointer argument (cuPointerGetAttribute, to validate
 * it): about 6.8 us per call on an H100 host, against 2-3 us here (DECISIONS.md). The callers in
 * native.py only come here when none of that is needed: no scratch buffers, no launch hooks, no
 * clusters, cooperative grids or programmatic dependent launch, and CUDA tensors on the current
 * device.
 *
 *   launch(function, grid_x, grid_y, grid_z, threads, shared_bytes, stream, kinds, *args)
 *       -> True, or False when the thread has no current CUDA context (nothing launched)
 *   pack(kinds, *args) -> bytes         (the parameter bytes, for tests without a GPU)
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

#define MAX_PARAMS 128

typedef int CUresult;
typedef CUresult (*launch_kernel_t)(void *function, unsigned grid_x, unsigned grid_y,
                                    unsigned grid_z, unsigned block_x, unsigned block_y,
                                    unsigned block_z, unsigned shared_bytes, void *stream,
                                    void **params, void **extra);
typedef CUresult (*error_string_t)(CUresult, const char **);

static launch_kernel_t cu_launch_kernel = NULL;
static error_string_t cu_get_error_string = NULL;

static int load_driver(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        PyErr_Format(PyExc_RuntimeError, "native_launch: cannot open libcuda.so.1: %s", dlerror());
        return 0;
    }
    cu_launch_kernel = (launch_kernel_t)dlsym(lib, "cuLaunchKernel");
    cu_get_error_string = (error_string_t)dlsym(lib, "cuGetErrorString");
    if (cu_launch_kernel == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "native_launch: libcuda has no cuLaunchKernel");
        return 0;
    }
    return 1;
}

typedef union {
    uint64_t u64;
    int64_t i64;
    uint32_t u32;
    int32_t i32;
    int8_t i8;
    float f32;
    double f64;
} Slot;

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

/* Fill slots[] and params[] from args by kinds; returns the number of parameters, or -1. */
static int pack_params(const char *kinds, Py_ssize_t n_kinds, PyObject *const *args, Slot *slots,
                       void **params) {
    int n = 0;
    for (Py_ssize_t i = 0; i < n_kinds; ++i) {
        PyObject *arg = args[i];
        Slot *slot = &slots[n];
        switch (kinds[i]) {
        case '-':
            continue;
        case 'p':
            if (!address(arg, &slot->u64)) return -1;
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

static PyObject *launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 8) {
        PyErr_SetString(PyExc_TypeError, "native_launch.launch: too few arguments");
        return NULL;
    }
    void *function = PyLong_AsVoidPtr(args[0]);
    unsigned grid_x = (unsigned)PyLong_AsUnsignedLong(args[1]);
    unsigned grid_y = (unsigned)PyLong_AsUnsignedLong(args[2]);
    unsigned grid_z = (unsigned)PyLong_AsUnsignedLong(args[3]);
    unsigned threads = (unsigned)PyLong_AsUnsignedLong(args[4]);
    unsigned shared = (unsigned)PyLong_AsUnsignedLong(args[5]);
    void *stream = PyLong_AsVoidPtr(args[6]);
    if (PyErr_Occurred()) return NULL;
    const char *kinds;
    Py_ssize_t n_kinds;
    if (!read_kinds(args[7], nargs - 8, &kinds, &n_kinds)) return NULL;
    Slot slots[MAX_PARAMS];
    void *params[MAX_PARAMS];
    if (pack_params(kinds, n_kinds, args + 8, slots, params) < 0) return NULL;
    if (cu_launch_kernel == NULL && !load_driver()) return NULL;
    CUresult status;
    Py_BEGIN_ALLOW_THREADS;
    status = cu_launch_kernel(function, grid_x, grid_y, grid_z, threads, 1, 1, shared, stream,
                              params, NULL);
    Py_END_ALLOW_THREADS;
    if (status == 201) Py_RETURN_FALSE; /* no current context on this thread: Triton's path */
    if (status != 0) {
        const char *message = "unknown error";
        if (cu_get_error_string != NULL) cu_get_error_string(status, &message);
        PyErr_Format(PyExc_RuntimeError, "native_launch: cuLaunchKernel failed (%d): %s",
                     status, message);
        return NULL;
    }
    Py_RETURN_TRUE;
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
    int n = pack_params(kinds, n_kinds, args + 1, slots, params);
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
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL, "Launch a compiled kernel."},
    {"pack", (PyCFunction)(void (*)(void))pack, METH_FASTCALL, "The packed parameter bytes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "native_launch", NULL, -1, methods};

PyMODINIT_FUNC PyInit_native_launch(void) { return PyModule_Create(&module); }
