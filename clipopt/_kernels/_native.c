/* Exact norm reductions and in-place scaling over many dense CPU buffers, at the speed
 * of reading (and writing) them.
 *
 * clipopt._kernels._norms hands over one (device, dtype) group of dense grads as lists of data
 * pointers and element counts. Each buffer is cut into chunks of CHUNK elements;
 * threads take every threads-th chunk, each chunk is reduced alone, and the chunk
 * results are combined in chunk order on the calling thread. The result therefore does
 * not depend on the number of threads or on which instruction set a clone below was
 * built for.
 *
 * Sums (of squares, of absolute values) run in LANES independent lanes, so that
 * compilers vectorise them without reassociating anything: float32 lanes over blocks
 * of BLOCK elements, whose sums are added in double (double lanes for float64 grads).
 * A block whose float32 sum may have overflowed or underflowed is read again in
 * double, where the square of a float, bfloat16 or half value is exact.
 *
 * max |x| compares the bit patterns of |x| as unsigned integers: for IEEE floats with
 * the sign bit cleared that order is the order of the values, and every NaN sorts
 * above infinity, so a NaN anywhere gives a NaN result.
 *
 * Scaling multiplies in place and rounds as torch's mul_ does; a coefficient of exactly
 * 1 (no clipping needed) writes nothing.
 *
 * The GIL is released while working; the buffers must stay alive and unchanged until
 * the call returns, which the synchronous CPU tensors of the caller guarantee.
 *
 * One translation unit, so that the instruction-set clones and the inlining see
 * everything: this file includes, in order, csrc/arith.h (per-chunk arithmetic),
 * csrc/chunks.h (chunks, threads and argument reading), csrc/layout.h (layouts kept
 * across a clip) and csrc/host.h (host helpers), and holds the entry points and the
 * module's table.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* One clone per instruction set, picked at load time (an ELF ifunc): GCC, or clang 14+. */
#if defined(__GNUC__) && defined(__x86_64__) && defined(__ELF__) && !defined(__INTEL_COMPILER) && \
    (!defined(__clang__) || __clang_major__ >= 14)
#define CLONED __attribute__((target_clones("avx512f", "avx2", "default")))
#define F16C_PATH 1 /* float16 by the conversion instruction, where the CPU has it */
#include <immintrin.h>
#else
#define CLONED
#define F16C_PATH 0
#endif

/* Block sums must be compiled inside each clone, not called at the baseline ISA. */
#if defined(__GNUC__)
#define INLINE inline __attribute__((always_inline))
#elif defined(_MSC_VER)
#define INLINE __forceinline
#else
#define INLINE inline
#endif

#include "csrc/arith.h"
#include "csrc/chunks.h"

PyDoc_STRVAR(reduce_doc,
             "reduce(op, dtype, addresses, numels, threads) -> float\n\n"
             "op: 0 sum of squares, 1 sum of |x|, 2 max |x|. dtype: 0 float32, 1 float64,\n"
             "2 bfloat16, 3 float16. addresses and numels: one int per dense buffer.");

static PyObject *native_reduce(PyObject *self, PyObject *args) {
    (void)self;
    int op, dtype, threads;
    PyObject *addresses, *numels;
    if (!PyArg_ParseTuple(args, "iiOOi", &op, &dtype, &addresses, &numels, &threads))
        return NULL;
    if (op < SUM_SQUARES || op > MAX_ABS)
        return PyErr_Format(PyExc_ValueError, "op must be 0, 1 or 2, got %d", op);
    Chunks chunks;
    if (!read_chunks(addresses, numels, dtype, &chunks)) return NULL;
    PyObject *result = reduce_chunks(op, dtype, &chunks, threads);
    free_chunks(&chunks);
    return result;
}

PyDoc_STRVAR(scale_doc,
             "scale(dtype, addresses, numels, coefficient_address, coefficient_dtype, threads)\n\n"
             "Multiplies every element in place by the coefficient read from memory (a\n"
             "float32 or float64 scalar, dtype 0 or 1); does nothing when it is exactly 1.\n"
             "dtype: 0 float32, 1 float64, 2 bfloat16.");

static PyObject *native_scale(PyObject *self, PyObject *args) {
    (void)self;
    int dtype, coefficient_dtype, threads;
    PyObject *addresses, *numels;
    unsigned long long coefficient_address;
    if (!PyArg_ParseTuple(args, "iOOKii", &dtype, &addresses, &numels, &coefficient_address,
                          &coefficient_dtype, &threads))
        return NULL;
    if (dtype < FLOAT32 || dtype > BFLOAT16)
        return PyErr_Format(PyExc_ValueError, "dtype must be 0 to 2, got %d", dtype);
    Chunks chunks;
    if (!read_chunks(addresses, numels, dtype, &chunks)) return NULL;
    int overlap = -1;
    int ok = scale_chunks(dtype, &chunks, coefficient_address, coefficient_dtype, threads, &overlap);
    free_chunks(&chunks);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

#include "csrc/layout.h"
#include "csrc/host.h"

static int cpu_has_f16c(void) {
#if F16C_PATH
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

PyDoc_STRVAR(float16_by_f16c_doc,
             "float16_by_f16c(enabled) -> bool\n\n"
             "Whether float16 sums use the F16C instruction from now on: enabled and the\n"
             "CPU has it. Both paths give the same bits; tests use this to check that.");

static PyObject *native_float16_by_f16c(PyObject *self, PyObject *arg) {
    (void)self;
    int enabled = PyObject_IsTrue(arg);
    if (enabled < 0) return NULL;
    use_f16c = enabled && cpu_has_f16c();
    return PyBool_FromLong(use_f16c);
}

static PyMethodDef methods[] = {
    {"reduce", native_reduce, METH_VARARGS, reduce_doc},
    {"scale", native_scale, METH_VARARGS, scale_doc},
    {"layout", native_layout, METH_VARARGS, layout_doc},
    {"reduce_layout", native_reduce_layout, METH_VARARGS, reduce_layout_doc},
    {"norms_layout", native_norms_layout, METH_VARARGS, norms_layout_doc},
    {"scale_layout", native_scale_layout, METH_VARARGS, scale_layout_doc},
    {"float16_by_f16c", native_float16_by_f16c, METH_O, float16_by_f16c_doc},
    {"grads", native_grads, METH_O, grads_doc},
    {"coefficient", native_coefficient, METH_VARARGS, coefficient_doc},
    {"any_instance", native_any_instance, METH_VARARGS, any_instance_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "clipopt._kernels._native",
    "Exact norm reductions and scaling over dense CPU buffers (see _native.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    use_f16c = cpu_has_f16c();
    return PyModule_Create(&module);
}
