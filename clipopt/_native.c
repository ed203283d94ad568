/* Exact norm reductions over many dense CPU buffers, at the speed of reading them.
 *
 * clipopt._kernels hands over one (device, dtype) group of contiguous grads as lists of
 * data pointers and element counts. Each buffer is cut into chunks of CHUNK elements;
 * threads take runs of chunks, each chunk is reduced alone, and the chunk results are
 * combined in chunk order on the calling thread. The result therefore does not depend
 * on the number of threads or on which instruction set a clone below was built for.
 *
 * Sums (of squares, of absolute values) accumulate in double precision, in LANES
 * independent lanes so that compilers vectorise them without reassociating anything.
 * A float, bfloat16 or half value squared is exact in a double, so these sums cannot
 * overflow and lose at most a few units of 1e-16 per chunk.
 *
 * max |x| compares the bit patterns of |x| as unsigned integers: for IEEE floats with
 * the sign bit cleared that order is the order of the values, and every NaN sorts
 * above infinity, so a NaN anywhere gives a NaN result.
 *
 * The GIL is released while reducing; the buffers must stay alive and unchanged until
 * the call returns, which the synchronous CPU tensors of the caller guarantee.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && defined(__x86_64__) && defined(__ELF__) && !defined(__INTEL_COMPILER)
#define CLONED __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONED
#endif

enum Op { SUM_SQUARES = 0, SUM_ABS = 1, MAX_ABS = 2 };
enum Dtype { FLOAT32 = 0, FLOAT64 = 1, BFLOAT16 = 2, FLOAT16 = 3 };

#define CHUNK ((int64_t)1 << 16)    /* elements: the unit of work and of summation order */
#define LANES 32                    /* independent accumulators */
#define BLOCK 1024                  /* elements per float32 partial sum */
#define LOW 0x1p-100f               /* float32 block sums below this are read again in double */
#define PER_THREAD ((int64_t)1 << 18) /* fewer elements per extra thread cost more than a thread */

static inline float f32_from_bits(uint32_t bits) {
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline float f32_load(const float *x, int64_t i) { return x[i]; }
static inline float bf16_load(const uint16_t *x, int64_t i) {
    return f32_from_bits((uint32_t)x[i] << 16);
}

/* |h| of an IEEE half as float32 bits, branch-free with integer operations (no F16C,
 * and unaffected by flush-to-zero modes): normals re-biased, zeros and subnormals
 * through an exact int-to-float conversion, inf and NaN moved to float's top exponent. */
static inline uint32_t f16_abs_to_f32_bits(uint16_t h) {
    uint32_t magnitude = h & 0x7fffu;
    uint32_t tiny = 0u - (uint32_t)(magnitude < 0x400u);
    uint32_t special = 0u - (uint32_t)(magnitude >= 0x7c00u);
    uint32_t normal_bits = (magnitude << 13) + ((127u - 15u) << 23);
    uint32_t special_bits = (magnitude << 13) | 0x7f800000u;
    float tiny_value = (float)(int32_t)magnitude * 0x1p-24f;
    uint32_t tiny_bits;
    memcpy(&tiny_bits, &tiny_value, sizeof tiny_bits);
    return (normal_bits & ~(tiny | special)) | (special_bits & special) | (tiny_bits & tiny);
}

static inline float f16_load(const uint16_t *x, int64_t i) {
    return f32_from_bits(f16_abs_to_f32_bits(x[i]));
}

/* Lanes added pairwise, in a fixed order. */
#define DEFINE_FOLD(NAME, TYPE)                                                         \
    static inline TYPE NAME(TYPE *acc) {                                                \
        for (int width = LANES / 2; width > 0; width /= 2)                              \
            for (int k = 0; k < width; k++) acc[k] += acc[k + width];                   \
        return acc[0];                                                                  \
    }
DEFINE_FOLD(fold_float, float)
DEFINE_FOLD(fold_double, double)

/* Sums of one block of at most BLOCK elements, x[i]**2 or |x[i]| by TERM, in LANES
 * lanes of ACC (float or double). */
#define DEFINE_BLOCK_SUM(NAME, TYPE, LOAD, ACC, FOLD, TERM)                             \
    static inline ACC NAME(const TYPE *x, int64_t n) {                                  \
        ACC acc[LANES] = {0};                                                           \
        int64_t i = 0;                                                                  \
        for (; i + LANES <= n; i += LANES)                                              \
            for (int k = 0; k < LANES; k++) {                                           \
                ACC v = (ACC)LOAD(x, i + k);                                            \
                acc[k] += TERM(v);                                                      \
            }                                                                           \
        for (int k = 0; i < n; i++, k++) {                                              \
            ACC v = (ACC)LOAD(x, i);                                                    \
            acc[k] += TERM(v);                                                          \
        }                                                                               \
        return FOLD(acc);                                                               \
    }
static inline float square_float(float v) { return v * v; }
static inline double square_double(double v) { return v * v; }

/* A chunk's sums for a 16- or 32-bit float type: float32 sums over blocks of BLOCK
 * elements (LANES lanes of BLOCK / LANES terms each: 2.5e-7 relative at worst),
 * added in double. A block whose float32 sum leaves [LOW, FLT_MAX] may have lost
 * terms to overflow or underflow and is read again, in double, where a square of
 * any of these types is exact. */
#define DEFINE_NARROW_SUMS(NAME, TYPE, LOAD)                                            \
    DEFINE_BLOCK_SUM(NAME##_block_squares, TYPE, LOAD, float, fold_float, square_float) \
    DEFINE_BLOCK_SUM(NAME##_block_squares_wide, TYPE, LOAD, double, fold_double, square_double) \
    DEFINE_BLOCK_SUM(NAME##_block_abs, TYPE, LOAD, float, fold_float, fabsf)          \
    DEFINE_BLOCK_SUM(NAME##_block_abs_wide, TYPE, LOAD, double, fold_double, fabs)    \
    CLONED static double NAME##_sum_squares(const TYPE *x, int64_t n) {                 \
        double total = 0.0;                                                             \
        for (int64_t i = 0; i < n; i += BLOCK) {                                        \
            int64_t m = n - i < BLOCK ? n - i : BLOCK;                                  \
            float s = NAME##_block_squares(x + i, m);                                   \
            total += (s >= LOW && s <= FLT_MAX) ? (double)s                             \
                                                : NAME##_block_squares_wide(x + i, m);  \
        }                                                                               \
        return total;                                                                   \
    }                                                                                   \
    CLONED static double NAME##_sum_abs(const TYPE *x, int64_t n) {                     \
        double total = 0.0;                                                             \
        for (int64_t i = 0; i < n; i += BLOCK) {                                        \
            int64_t m = n - i < BLOCK ? n - i : BLOCK;                                  \
            float s = NAME##_block_abs(x + i, m);                                       \
            total += s <= FLT_MAX ? (double)s : NAME##_block_abs_wide(x + i, m);        \
        }                                                                               \
        return total;                                                                   \
    }

DEFINE_NARROW_SUMS(f32, float, f32_load)
DEFINE_NARROW_SUMS(bf16, uint16_t, bf16_load)
DEFINE_NARROW_SUMS(f16, uint16_t, f16_load)

/* Double precision: double lanes over the whole chunk. */
static inline double f64_load(const double *x, int64_t i) { return x[i]; }
DEFINE_BLOCK_SUM(f64_lanes_squares, double, f64_load, double, fold_double, square_double)
DEFINE_BLOCK_SUM(f64_lanes_abs, double, f64_load, double, fold_double, fabs)
CLONED static double f64_sum_squares(const double *x, int64_t n) { return f64_lanes_squares(x, n); }
CLONED static double f64_sum_abs(const double *x, int64_t n) { return f64_lanes_abs(x, n); }

/* max of |x|'s bits as unsigned integers, for each width of float. */
#define DEFINE_MAX_BITS(NAME, UTYPE, MASK)                                              \
    CLONED static uint64_t NAME(const UTYPE *x, int64_t n) {                                   \
        UTYPE acc[LANES] = {0};                                                         \
        int64_t i = 0;                                                                  \
        for (; i + LANES <= n; i += LANES)                                              \
            for (int k = 0; k < LANES; k++) {                                           \
                UTYPE bits = x[i + k] & (MASK);                                         \
                acc[k] = acc[k] > bits ? acc[k] : bits;                                 \
            }                                                                           \
        for (int k = 0; i < n; i++, k++) {                                              \
            UTYPE bits = x[i] & (MASK);                                                 \
            acc[k] = acc[k] > bits ? acc[k] : bits;                                     \
        }                                                                               \
        UTYPE top = 0;                                                                  \
        for (int k = 0; k < LANES; k++) top = top > acc[k] ? top : acc[k];              \
        return top;                                                                     \
    }

DEFINE_MAX_BITS(max_bits_16, uint16_t, 0x7fffu)
DEFINE_MAX_BITS(max_bits_32, uint32_t, 0x7fffffffu)
DEFINE_MAX_BITS(max_bits_64, uint64_t, 0x7fffffffffffffffull)

/* One chunk's result: a sum, or for MAX_ABS the bits of its largest |x|. */
typedef union {
    double sum;
    uint64_t bits;
} ChunkResult;

typedef struct {
    int op, dtype;
    const char **starts; /* first byte of each chunk */
    int64_t *lengths;    /* elements in each chunk */
    ChunkResult *results;
    int64_t chunks;
} Work;

static inline ChunkResult reduce_chunk(int op, int dtype, const char *start, int64_t n) {
    ChunkResult r;
    if (op == MAX_ABS) {
        if (dtype == FLOAT64) r.bits = max_bits_64((const uint64_t *)start, n);
        else if (dtype == FLOAT32) r.bits = max_bits_32((const uint32_t *)start, n);
        else r.bits = max_bits_16((const uint16_t *)start, n);
        return r;
    }
    int squares = op == SUM_SQUARES;
    switch (dtype) {
    case FLOAT32:
        r.sum = squares ? f32_sum_squares((const float *)start, n)
                        : f32_sum_abs((const float *)start, n);
        break;
    case FLOAT64:
        r.sum = squares ? f64_sum_squares((const double *)start, n)
                        : f64_sum_abs((const double *)start, n);
        break;
    case BFLOAT16:
        r.sum = squares ? bf16_sum_squares((const uint16_t *)start, n)
                        : bf16_sum_abs((const uint16_t *)start, n);
        break;
    default:
        r.sum = squares ? f16_sum_squares((const uint16_t *)start, n)
                        : f16_sum_abs((const uint16_t *)start, n);
    }
    return r;
}

/* Thread `t` of `threads` reduces chunks t, t + threads, ..., last first: the pass that
 * usually follows (the scale, a fused optimizer step) runs first to last, and then
 * starts on memory that every thread read last, still in cache. */
static void reduce_chunks(const Work *work, int64_t t, int64_t threads) {
    if (t >= work->chunks) return;
    for (int64_t c = t + (work->chunks - 1 - t) / threads * threads; c >= 0; c -= threads)
        work->results[c] = reduce_chunk(work->op, work->dtype, work->starts[c], work->lengths[c]);
}

/* Reduce every chunk with up to `threads` threads, the calling one included. OpenMP
 * here is the runtime torch already loaded (the same libgomp.so.1), so these are
 * torch's own intra-op threads: a second pool would compete with torch's spinning
 * workers for the cores. */
static void run_chunks(const Work *base, int64_t elements, int threads) {
    int64_t chunks = base->chunks;
    int64_t useful = elements / PER_THREAD;
    if (useful < threads) threads = useful < 1 ? 1 : (int)useful;
    if (chunks < threads) threads = (int)chunks;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static, 1)
#endif
    for (int t = 0; t < threads; t++) reduce_chunks(base, t, threads);
}

static const int ELEMENT_SIZE[] = {4, 8, 2, 2};

static double decode_max(uint64_t bits, int dtype) {
    if (dtype == FLOAT64) {
        double value;
        memcpy(&value, &bits, sizeof value);
        return value;
    }
    if (dtype == FLOAT32) return f32_from_bits((uint32_t)bits);
    if (dtype == BFLOAT16) return f32_from_bits((uint32_t)bits << 16);
    return f32_from_bits(f16_abs_to_f32_bits((uint16_t)bits));
}

/* Reads a sequence of Python ints into a new array; NULL with an exception set on error. */
static int64_t *read_ints(PyObject *sequence, Py_ssize_t count, const char *name) {
    int64_t *values = PyMem_Malloc(sizeof(int64_t) * (size_t)(count ? count : 1));
    if (values == NULL) return (int64_t *)PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < count; i++) {
        values[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(sequence, i));
        if (values[i] == -1 && PyErr_Occurred()) {
            PyMem_Free(values);
            PyErr_Format(PyExc_TypeError, "%s must hold ints", name);
            return NULL;
        }
    }
    return values;
}

PyDoc_STRVAR(reduce_doc,
             "reduce(op, dtype, addresses, numels, threads) -> float\n\n"
             "op: 0 sum of squares, 1 sum of |x|, 2 max |x|. dtype: 0 float32, 1 float64,\n"
             "2 bfloat16, 3 float16. addresses and numels: one int per contiguous buffer.");

static PyObject *native_reduce(PyObject *self, PyObject *args) {
    (void)self;
    int op, dtype, threads;
    PyObject *addresses_in, *numels_in;
    if (!PyArg_ParseTuple(args, "iiOOi", &op, &dtype, &addresses_in, &numels_in, &threads))
        return NULL;
    if (op < SUM_SQUARES || op > MAX_ABS) return PyErr_Format(PyExc_ValueError, "op must be 0, 1 or 2, got %d", op);
    if (dtype < FLOAT32 || dtype > FLOAT16)
        return PyErr_Format(PyExc_ValueError, "dtype must be 0 to 3, got %d", dtype);
    PyObject *addresses_seq = PySequence_Fast(addresses_in, "addresses must be a sequence");
    if (addresses_seq == NULL) return NULL;
    PyObject *numels_seq = PySequence_Fast(numels_in, "numels must be a sequence");
    if (numels_seq == NULL) {
        Py_DECREF(addresses_seq);
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(addresses_seq);
    PyObject *result = NULL;
    int64_t *addresses = NULL, *numels = NULL;
    const char **starts = NULL;
    int64_t *lengths = NULL;
    ChunkResult *results = NULL;
    if (PySequence_Fast_GET_SIZE(numels_seq) != count) {
        PyErr_SetString(PyExc_ValueError, "addresses and numels differ in length");
        goto done;
    }
    if (!(addresses = read_ints(addresses_seq, count, "addresses"))) goto done;
    if (!(numels = read_ints(numels_seq, count, "numels"))) goto done;
    int64_t chunks = 0, elements = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (numels[i] < 0) {
            PyErr_Format(PyExc_ValueError, "numels must be >= 0, got %lld", (long long)numels[i]);
            goto done;
        }
        chunks += (numels[i] + CHUNK - 1) / CHUNK;
        elements += numels[i];
    }
    size_t slots = (size_t)(chunks ? chunks : 1);
    starts = PyMem_Malloc(sizeof(char *) * slots);
    lengths = PyMem_Malloc(sizeof(int64_t) * slots);
    results = PyMem_Malloc(sizeof(ChunkResult) * slots);
    if (!starts || !lengths || !results) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t c = 0;
    for (Py_ssize_t i = 0; i < count; i++)
        for (int64_t offset = 0; offset < numels[i]; offset += CHUNK, c++) {
            starts[c] = (const char *)(uintptr_t)addresses[i] + offset * ELEMENT_SIZE[dtype];
            lengths[c] = numels[i] - offset < CHUNK ? numels[i] - offset : CHUNK;
        }
    Work work = {op, dtype, starts, lengths, results, chunks};
    Py_BEGIN_ALLOW_THREADS
    run_chunks(&work, elements, threads);
    Py_END_ALLOW_THREADS
    double total = 0.0;
    uint64_t top = 0;
    for (int64_t k = 0; k < chunks; k++) {
        if (op == MAX_ABS) top = top > results[k].bits ? top : results[k].bits;
        else total += results[k].sum;
    }
    result = PyFloat_FromDouble(op == MAX_ABS ? decode_max(top, dtype) : total);
done:
    PyMem_Free(addresses);
    PyMem_Free(numels);
    PyMem_Free(starts);
    PyMem_Free(lengths);
    PyMem_Free(results);
    Py_DECREF(addresses_seq);
    Py_DECREF(numels_seq);
    return result;
}

static PyMethodDef methods[] = {
    {"reduce", native_reduce, METH_VARARGS, reduce_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "clipopt._native",
    "Exact norm reductions over dense CPU buffers (see _native.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
