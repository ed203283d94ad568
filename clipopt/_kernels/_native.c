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

/* Lanes added pairwise, in a fixed order: lane k and lane k + 16, then k and k + 8 of
 * those sums, down to one. Each level is written out, so that the compiler keeps the
 * lanes in registers: as one loop over the levels it stored and reloaded them between
 * levels, and the fold cost as much as reading a block of 500 floats. */
#if LANES != 32
#error "the folds below are written out for 32 lanes"
#endif
#define DEFINE_FOLD(NAME, TYPE)                                                         \
    static INLINE TYPE NAME(const TYPE *acc) {                                          \
        TYPE a16[16], a8[8], a4[4], a2[2];                                              \
        for (int k = 0; k < 16; k++) a16[k] = acc[k] + acc[k + 16];                     \
        for (int k = 0; k < 8; k++) a8[k] = a16[k] + a16[k + 8];                        \
        for (int k = 0; k < 4; k++) a4[k] = a8[k] + a8[k + 4];                          \
        for (int k = 0; k < 2; k++) a2[k] = a4[k] + a4[k + 2];                          \
        return a2[0] + a2[1];                                                           \
    }
DEFINE_FOLD(fold_float, float)
DEFINE_FOLD(fold_double, double)

/* Sums of one block of at most BLOCK elements, x[i]**2 or |x[i]| by TERM, in LANES
 * lanes of ACC (float or double). */
#define DEFINE_BLOCK_SUM(NAME, TYPE, LOAD, ACC, FOLD, TERM)                             \
    static INLINE ACC NAME(const TYPE *x, int64_t n) {                                  \
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

/* Blocks of bfloat16 read as 32-bit words of two elements: the low half becomes a
 * float by a shift and the high half by a mask, so no instruction has to widen 16-bit
 * lanes: widening ran at 0.3-0.55x float32's elements per second, this at about 0.9x.
 * Lanes 0 to LANES/2 - 1 take the low halves and the others the high ones: still
 * BLOCK / LANES terms a lane. */
#define DEFINE_BF16_BLOCK_SUM(NAME, TERM)                                               \
    static INLINE float NAME(const uint16_t *x, int64_t n) {                            \
        float low[LANES / 2] = {0}, high[LANES / 2] = {0}, acc[LANES];                  \
        int64_t i = 0;                                                                  \
        for (; i + LANES <= n; i += LANES) {                                            \
            uint32_t words[LANES / 2]; /* x + i may be only 2-byte aligned */           \
            memcpy(words, x + i, sizeof words);                                         \
            for (int k = 0; k < LANES / 2; k++) {                                       \
                low[k] += TERM(f32_from_bits(words[k] << 16));                          \
                high[k] += TERM(f32_from_bits(words[k] & 0xffff0000u));                 \
            }                                                                           \
        }                                                                               \
        memcpy(acc, low, sizeof low);                                                   \
        memcpy(acc + LANES / 2, high, sizeof high);                                     \
        for (int k = 0; i < n; i++, k++) acc[k] += TERM(bf16_load(x, i));               \
        return fold_float(acc);                                                         \
    }

/* A chunk's sums for a 16- or 32-bit float type: float32 sums over blocks of BLOCK
 * elements (by NAME##_block_squares and NAME##_block_abs), added in double. A lane
 * adds BLOCK / LANES = 32 terms and the lanes fold in 5 levels, so a block's sum is
 * off by at most 36 float32 roundings (2.1e-6 relative; the errors of random data
 * mostly cancel: 8e-9 at 40M elements). A block whose float32 sum leaves [LOW,
 * FLT_MAX] may have lost terms to overflow or underflow and is read again, in double,
 * where a square of any of these types is exact. */
#define DEFINE_NARROW_SUMS(NAME, TYPE, LOAD, ATTRIBUTE)                                 \
    DEFINE_BLOCK_SUM(NAME##_block_squares_wide, TYPE, LOAD, double, fold_double, square_double) \
    DEFINE_BLOCK_SUM(NAME##_block_abs_wide, TYPE, LOAD, double, fold_double, fabs)    \
    ATTRIBUTE static double NAME##_sum_squares(const TYPE *x, int64_t n) {              \
        double total = 0.0;                                                             \
        for (int64_t i = 0; i < n; i += BLOCK) {                                        \
            int64_t m = n - i < BLOCK ? n - i : BLOCK;                                  \
            float s = NAME##_block_squares(x + i, m);                                   \
            total += (s >= LOW && s <= FLT_MAX) ? (double)s                             \
                                                : NAME##_block_squares_wide(x + i, m);  \
        }                                                                               \
        return total;                                                                   \
    }                                                                                   \
    ATTRIBUTE static double NAME##_sum_abs(const TYPE *x, int64_t n) {                  \
        double total = 0.0;                                                             \
        for (int64_t i = 0; i < n; i += BLOCK) {                                        \
            int64_t m = n - i < BLOCK ? n - i : BLOCK;                                  \
            float s = NAME##_block_abs(x + i, m);                                       \
            total += s <= FLT_MAX ? (double)s : NAME##_block_abs_wide(x + i, m);        \
        }                                                                               \
        return total;                                                                   \
    }

DEFINE_BLOCK_SUM(f32_block_squares, float, f32_load, float, fold_float, square_float)
DEFINE_BLOCK_SUM(f32_block_abs, float, f32_load, float, fold_float, fabsf)
DEFINE_NARROW_SUMS(f32, float, f32_load, CLONED)
DEFINE_BF16_BLOCK_SUM(bf16_block_squares, square_float)
DEFINE_BF16_BLOCK_SUM(bf16_block_abs, fabsf)
DEFINE_NARROW_SUMS(bf16, uint16_t, bf16_load, CLONED)
DEFINE_BLOCK_SUM(f16_block_squares, uint16_t, f16_load, float, fold_float, square_float)
DEFINE_BLOCK_SUM(f16_block_abs, uint16_t, f16_load, float, fold_float, fabsf)
DEFINE_NARROW_SUMS(f16, uint16_t, f16_load, CLONED)

/* float16 blocks converted by vcvtph2ps (F16C), which is exact for every half,
 * subnormals included, whatever MXCSR's flush modes say: the same lanes and the same
 * order of additions as f16_block_*, so the same bits, at several times the speed of
 * the integer conversion. Used when the CPU has AVX2 and F16C (use_f16c below). */
#if F16C_PATH
#define F16C_TARGET __attribute__((target("avx2,f16c")))
static INLINE F16C_TARGET __m256 f16c_square(__m256 v) { return _mm256_mul_ps(v, v); }
static INLINE F16C_TARGET __m256 f16c_abs(__m256 v) {
    return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
}

#define DEFINE_F16C_BLOCK_SUM(NAME, VECTOR_TERM, TERM)                                  \
    static INLINE F16C_TARGET float NAME(const uint16_t *x, int64_t n) {                \
        __m256 acc[LANES / 8];                                                          \
        for (int k = 0; k < LANES / 8; k++) acc[k] = _mm256_setzero_ps();               \
        int64_t i = 0;                                                                  \
        for (; i + LANES <= n; i += LANES)                                              \
            for (int k = 0; k < LANES / 8; k++) {                                       \
                __m128i halves = _mm_loadu_si128((const __m128i *)(x + i + 8 * k));     \
                acc[k] = _mm256_add_ps(acc[k], VECTOR_TERM(_mm256_cvtph_ps(halves)));   \
            }                                                                           \
        float lanes[LANES];                                                             \
        for (int k = 0; k < LANES / 8; k++) _mm256_storeu_ps(lanes + 8 * k, acc[k]);    \
        for (int k = 0; i < n; i++, k++) lanes[k] += TERM(f16_load(x, i));              \
        return fold_float(lanes);                                                       \
    }
DEFINE_F16C_BLOCK_SUM(f16c_block_squares, f16c_square, square_float)
DEFINE_F16C_BLOCK_SUM(f16c_block_abs, f16c_abs, fabsf)
DEFINE_NARROW_SUMS(f16c, uint16_t, f16_load, F16C_TARGET)
#endif

/* Whether float16 sums take the F16C path: set at import from the CPU's features. */
static int use_f16c = 0;

/* Double precision: double lanes over the whole chunk. */
static inline double f64_load(const double *x, int64_t i) { return x[i]; }
DEFINE_BLOCK_SUM(f64_lanes_squares, double, f64_load, double, fold_double, square_double)
DEFINE_BLOCK_SUM(f64_lanes_abs, double, f64_load, double, fold_double, fabs)
CLONED static double f64_sum_squares(const double *x, int64_t n) { return f64_lanes_squares(x, n); }
CLONED static double f64_sum_abs(const double *x, int64_t n) { return f64_lanes_abs(x, n); }

/* max of |x|'s bits as unsigned integers, for each width of float. */
#define DEFINE_MAX_BITS(NAME, UTYPE, MASK)                                              \
    CLONED static uint64_t NAME(const UTYPE *x, int64_t n) {                            \
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

/* In-place scaling by a coefficient, rounded as torch's mul_ rounds: float32 and
 * bfloat16 grads multiply in float32 (bfloat16 rounded to nearest even, NaN made quiet),
 * float64 grads in double. */
CLONED static void f32_scale(float *x, int64_t n, float c) {
    for (int64_t i = 0; i < n; i++) x[i] *= c;
}

CLONED static void f64_scale(double *x, int64_t n, double c) {
    for (int64_t i = 0; i < n; i++) x[i] *= c;
}

static inline uint16_t bf16_round(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    uint16_t rounded = (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    return value != value ? (uint16_t)0x7fc0u : rounded;
}

CLONED static void bf16_scale(uint16_t *x, int64_t n, float c) {
    for (int64_t i = 0; i < n; i++) x[i] = bf16_round(bf16_load(x, i) * c);
}

/* The buffers of one call, cut into chunks of at most CHUNK elements. */
typedef struct {
    char **starts;    /* first byte of each chunk */
    int64_t *lengths; /* elements in each chunk */
    int64_t count;    /* chunks */
    int64_t elements;
} Chunks;

/* One chunk's result: a sum, or for MAX_ABS the bits of its largest |x|. */
typedef union {
    double sum;
    uint64_t bits;
} ChunkResult;

typedef struct {
    int op, dtype;
    const Chunks *chunks;
    ChunkResult *results; /* thread t's k-th chunk at results[t * per_thread + k] */
    int64_t per_thread;
} ReduceWork;

typedef struct {
    int dtype;
    const Chunks *chunks;
    float coefficient;
    double coefficient64;
} ScaleWork;

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
#if F16C_PATH
        if (use_f16c) {
            r.sum = squares ? f16c_sum_squares((const uint16_t *)start, n)
                            : f16c_sum_abs((const uint16_t *)start, n);
            break;
        }
#endif
        r.sum = squares ? f16_sum_squares((const uint16_t *)start, n)
                        : f16_sum_abs((const uint16_t *)start, n);
    }
    return r;
}

/* The first cache lines of the chunk a thread takes next: with thousands of small grads,
 * each in an allocation of its own, waiting for each one's first lines cost more than
 * reading the rest (many_small: 80 ns a grad of 500 floats, against 30 ns to read it). */
#define PREFETCH_LINES 8
static inline void prefetch_start(const char *start) {
#if defined(__GNUC__)
    for (int k = 0; k < PREFETCH_LINES; k++) __builtin_prefetch(start + 64 * k, 0, 3);
#else
    (void)start;
#endif
}

/* Thread `t` of `threads` reduces chunks t, t + threads, ..., last first: the pass that
 * usually follows (the scale, a fused optimizer step) runs first to last, and then
 * starts on memory that every thread read last, still in cache. */
static void reduce_share(const void *opaque, int64_t t, int64_t threads) {
    const ReduceWork *work = opaque;
    const Chunks *chunks = work->chunks;
    if (t >= chunks->count) return;
    for (int64_t c = t + (chunks->count - 1 - t) / threads * threads; c >= 0; c -= threads) {
        if (c >= threads) prefetch_start(chunks->starts[c - threads]);
        work->results[t * work->per_thread + c / threads] =
            reduce_chunk(work->op, work->dtype, chunks->starts[c], chunks->lengths[c]);
    }
}

/* Thread `t` of `threads` scales chunks t, t + threads, ..., first to last. */
static void scale_share(const void *opaque, int64_t t, int64_t threads) {
    const ScaleWork *work = opaque;
    const Chunks *chunks = work->chunks;
    for (int64_t c = t; c < chunks->count; c += threads) {
        if (c + threads < chunks->count) prefetch_start(chunks->starts[c + threads]);
        char *start = chunks->starts[c];
        int64_t n = chunks->lengths[c];
        if (work->dtype == FLOAT64) f64_scale((double *)start, n, work->coefficient64);
        else if (work->dtype == FLOAT32) f32_scale((float *)start, n, work->coefficient);
        else bf16_scale((uint16_t *)start, n, work->coefficient);
    }
}

/* How many threads a pass over `chunks` is worth, at most `threads`. */
static int share_count(const Chunks *chunks, int threads) {
    int64_t useful = chunks->elements / PER_THREAD;
    if (useful < threads) threads = useful < 1 ? 1 : (int)useful;
    if (chunks->count < threads) threads = (int)chunks->count;
    return threads < 1 ? 1 : threads;
}

/* Runs share(work, t, threads) for t < threads on `threads` threads, the calling
 * one included. OpenMP here is the runtime torch already loaded (the same
 * libgomp.so.1), so these are torch's own intra-op threads: a second pool would compete
 * with torch's spinning workers for the cores. */
static void run_shares(void (*share)(const void *, int64_t, int64_t), const void *work,
                       int threads) {
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static, 1)
#endif
    for (int t = 0; t < threads; t++) share(work, t, threads);
}

static const int ELEMENT_SIZE[] = {4, 8, 2, 2};

typedef struct {
    uintptr_t start, end;
} Span;

/* Sorts spans by start, least significant byte first (a stable counting sort a byte),
 * skipping the bytes every start shares (the high ones of a heap's addresses): about a
 * tenth of qsort's time on thousands of grads, which took as long as scaling them. */
static void sort_spans(Span *spans, Span *scratch, int64_t count) {
    uintptr_t differ = 0;
    for (int64_t c = 1; c < count; c++) differ |= spans[c].start ^ spans[0].start;
    for (unsigned shift = 0; shift < 8 * sizeof(uintptr_t); shift += 8) {
        if (((differ >> shift) & 0xffu) == 0) continue;
        int64_t offsets[256] = {0};
        for (int64_t c = 0; c < count; c++) offsets[(spans[c].start >> shift) & 0xffu]++;
        int64_t total = 0;
        for (int b = 0; b < 256; b++) {
            int64_t here = offsets[b];
            offsets[b] = total;
            total += here;
        }
        for (int64_t c = 0; c < count; c++) scratch[offsets[(spans[c].start >> shift) & 0xffu]++] = spans[c];
        memcpy(spans, scratch, sizeof(Span) * (size_t)count);
    }
}

/* Whether any two chunks share memory (a grad listed twice, or overlapping views). */
static int chunks_overlap(const Chunks *chunks, int element_size) {
    if (chunks->count < 2) return 0;
    Span *spans = malloc(2 * sizeof(Span) * (size_t)chunks->count);
    if (spans == NULL) return 1; /* cannot tell: treat as overlapping, the safe answer */
    int sorted = 1;
    for (int64_t c = 0; c < chunks->count; c++) {
        spans[c].start = (uintptr_t)chunks->starts[c];
        spans[c].end = spans[c].start + (uintptr_t)(chunks->lengths[c] * element_size);
        sorted = sorted && (c == 0 || spans[c - 1].start <= spans[c].start);
    }
    if (!sorted) sort_spans(spans, spans + chunks->count, chunks->count);
    int overlap = 0;
    for (int64_t c = 0; c + 1 < chunks->count && !overlap; c++)
        overlap = spans[c].end > spans[c + 1].start;
    free(spans);
    return overlap;
}

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
static int64_t *read_ints(PyObject *sequence, const char *name) {
    Py_ssize_t count = PySequence_Fast_GET_SIZE(sequence);
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

static void free_chunks(Chunks *chunks) {
    PyMem_Free(chunks->starts);
    PyMem_Free(chunks->lengths);
    chunks->starts = NULL;
    chunks->lengths = NULL;
}

/* Cuts `buffers` buffers, by their addresses and element counts, into chunks; 0 with an
 * exception set on bad input. */
static int fill_chunks(const int64_t *addresses, const int64_t *numels, Py_ssize_t buffers,
                       int dtype, Chunks *out) {
    memset(out, 0, sizeof *out);
    for (Py_ssize_t i = 0; i < buffers; i++) {
        if (numels[i] < 0) {
            PyErr_Format(PyExc_ValueError, "numels must be >= 0, got %lld", (long long)numels[i]);
            return 0;
        }
        out->count += (numels[i] + CHUNK - 1) / CHUNK;
        out->elements += numels[i];
    }
    size_t slots = (size_t)(out->count ? out->count : 1);
    out->starts = PyMem_Malloc(sizeof(char *) * slots);
    out->lengths = PyMem_Malloc(sizeof(int64_t) * slots);
    if (!out->starts || !out->lengths) {
        PyErr_NoMemory();
        free_chunks(out);
        return 0;
    }
    int64_t c = 0;
    for (Py_ssize_t i = 0; i < buffers; i++)
        for (int64_t offset = 0; offset < numels[i]; offset += CHUNK, c++) {
            out->starts[c] = (char *)(uintptr_t)addresses[i] + offset * ELEMENT_SIZE[dtype];
            out->lengths[c] = numels[i] - offset < CHUNK ? numels[i] - offset : CHUNK;
        }
    return 1;
}

static int check_dtype(int dtype) {
    if (dtype >= FLOAT32 && dtype <= FLOAT16) return 1;
    PyErr_Format(PyExc_ValueError, "dtype must be 0 to 3, got %d", dtype);
    return 0;
}

/* Cuts the buffers given as addresses and numels into chunks; 0 with an exception set
 * on bad input. */
static int read_chunks(PyObject *addresses_in, PyObject *numels_in, int dtype, Chunks *out) {
    memset(out, 0, sizeof *out);
    if (!check_dtype(dtype)) return 0;
    PyObject *addresses_seq = PySequence_Fast(addresses_in, "addresses must be a sequence");
    PyObject *numels_seq =
        addresses_seq ? PySequence_Fast(numels_in, "numels must be a sequence") : NULL;
    int64_t *addresses = NULL, *numels = NULL;
    int ok = 0;
    if (numels_seq == NULL) goto done;
    if (PySequence_Fast_GET_SIZE(numels_seq) != PySequence_Fast_GET_SIZE(addresses_seq)) {
        PyErr_SetString(PyExc_ValueError, "addresses and numels differ in length");
        goto done;
    }
    if (!(addresses = read_ints(addresses_seq, "addresses"))) goto done;
    if (!(numels = read_ints(numels_seq, "numels"))) goto done;
    ok = fill_chunks(addresses, numels, PySequence_Fast_GET_SIZE(addresses_seq), dtype, out);
done:
    PyMem_Free(addresses);
    PyMem_Free(numels);
    Py_XDECREF(addresses_seq);
    Py_XDECREF(numels_seq);
    return ok;
}

/* Reduces every chunk, then combines in chunk order the chunks of each of `ranges`
 * ranges into out[i]: range i ends before chunk ends[i], and starts where range i - 1
 * ended (range 0 at chunk 0). A range's value is the same whatever the other ranges
 * and the thread count: its chunks' results, added (or compared) first to last.
 * 0 with an exception set. */
static int reduce_ranges(int op, int dtype, const Chunks *chunks, int threads,
                         const int64_t *ends, int64_t ranges, double *out) {
    threads = share_count(chunks, threads);
    /* Each thread's results in cache lines of their own: interleaved, the threads' writes
     * to neighbouring results moved one line back and forth between their cores for
     * every small grad (many_small: reading on two threads took as long as on one). */
    int64_t per_thread = ((chunks->count + threads - 1) / threads + 7) / 8 * 8;
    ChunkResult *results = PyMem_Malloc(sizeof(ChunkResult) * (size_t)(threads * per_thread + 1));
    if (results == NULL) {
        PyErr_NoMemory();
        return 0;
    }
    ReduceWork work = {op, dtype, chunks, results, per_thread};
    Py_BEGIN_ALLOW_THREADS
    run_shares(reduce_share, &work, threads);
    Py_END_ALLOW_THREADS
    int64_t c = 0;
    for (int64_t i = 0; i < ranges; i++) {
        double total = 0.0;
        uint64_t top = 0;
        for (; c < ends[i]; c++) {
            ChunkResult r = results[c % threads * per_thread + c / threads];
            if (op == MAX_ABS) top = top > r.bits ? top : r.bits;
            else total += r.sum;
        }
        out[i] = op == MAX_ABS ? decode_max(top, dtype) : total;
    }
    PyMem_Free(results);
    return 1;
}

/* One reduction over chunks: the float the Python functions return. */
static PyObject *reduce_chunks(int op, int dtype, const Chunks *chunks, int threads) {
    double value;
    if (!reduce_ranges(op, dtype, chunks, threads, &chunks->count, 1, &value)) return NULL;
    return PyFloat_FromDouble(value);
}

/* Scales chunks in place by the coefficient at `coefficient_address`; `overlap` caches
 * whether chunks share memory (-1: not known yet). 0 with an exception set on bad input. */
static int scale_chunks(int dtype, const Chunks *chunks, unsigned long long coefficient_address,
                        int coefficient_dtype, int threads, int *overlap) {
    if (dtype < FLOAT32 || dtype > BFLOAT16) {
        PyErr_Format(PyExc_ValueError, "dtype must be 0 to 2, got %d", dtype);
        return 0;
    }
    if (coefficient_dtype != FLOAT32 && coefficient_dtype != FLOAT64) {
        PyErr_Format(PyExc_ValueError, "coefficient_dtype must be 0 or 1, got %d", coefficient_dtype);
        return 0;
    }
    const void *coefficient = (const void *)(uintptr_t)coefficient_address;
    double wide = coefficient_dtype == FLOAT64 ? *(const double *)coefficient
                                               : (double)*(const float *)coefficient;
    ScaleWork work = {dtype, chunks, (float)wide, wide};
    /* Scaling by exactly 1 changes no value: skip the write (the kernel reads its own
     * coefficient; the caller never does). */
    int identity = dtype == FLOAT64 ? wide == 1.0 : work.coefficient == 1.0f;
    if (identity) return 1;
    Py_BEGIN_ALLOW_THREADS
    if (*overlap < 0) *overlap = chunks_overlap(chunks, ELEMENT_SIZE[dtype]);
    /* Memory listed twice is scaled twice, in list order, as a loop of mul_ would. */
    if (*overlap) scale_share(&work, 0, 1);
    else run_shares(scale_share, &work, share_count(chunks, threads));
    Py_END_ALLOW_THREADS
    return 1;
}

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

/* ------------------------------------------------------------------ layouts
 * A layout is one dtype's dense tensors cut into chunks once, their addresses read here
 * by calling the `data_ptr` method given (Tensor.data_ptr) on each: one pass in C where
 * Python built two lists, shared by a clip's norm and its scale. */

#define LAYOUT_NAME "clipopt._kernels._native.layout"

typedef struct {
    Chunks chunks;
    int dtype;
    int overlap;     /* whether chunks share memory; -1 until a scale asks */
    int64_t buffers; /* tensors */
    int64_t *ends;   /* one past each tensor's last chunk */
} Layout;

static void free_layout(PyObject *capsule) {
    Layout *layout = PyCapsule_GetPointer(capsule, LAYOUT_NAME);
    if (layout == NULL) return;
    free_chunks(&layout->chunks);
    PyMem_Free(layout->ends);
    PyMem_Free(layout);
}

/* Each buffer's end in a layout's chunks, from the element counts fill_chunks took. */
static int64_t *chunk_ends(const int64_t *numels, Py_ssize_t buffers) {
    int64_t *ends = PyMem_Malloc(sizeof(int64_t) * (size_t)(buffers ? buffers : 1));
    if (ends == NULL) return (int64_t *)PyErr_NoMemory();
    int64_t end = 0;
    for (Py_ssize_t i = 0; i < buffers; i++) ends[i] = end += (numels[i] + CHUNK - 1) / CHUNK;
    return ends;
}

static Layout *get_layout(PyObject *capsule) {
    return PyCapsule_GetPointer(capsule, LAYOUT_NAME);
}

/* torch's own reader of a tensor's data pointer, for C code without torch's headers (the
 * one inductor's generated CPU wrappers call): void *(PyObject *). It is called only on
 * tensors whose type is exactly `exact` (torch.Tensor): it throws a C++ exception, which
 * nothing here could catch, on anything else, and the tensors whose data pointer torch
 * refuses (fake and functional tensors) are all of subclasses. */
typedef void *(*DataPtrFn)(PyObject *);

/* The address of every tensor of `tensors`, by `raw` where it may be called, else by the
 * `data_ptr` method; NULL with an exception set. */
static int64_t *read_addresses(PyObject *tensors, PyObject *data_ptr, PyObject *exact,
                               DataPtrFn raw) {
    Py_ssize_t count = PySequence_Fast_GET_SIZE(tensors);
    int64_t *addresses = PyMem_Malloc(sizeof(int64_t) * (size_t)(count ? count : 1));
    if (addresses == NULL) return (int64_t *)PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *tensor = PySequence_Fast_GET_ITEM(tensors, i);
        if (raw != NULL && (PyObject *)Py_TYPE(tensor) == exact) {
            addresses[i] = (int64_t)(uintptr_t)raw(tensor);
            continue;
        }
        PyObject *address = PyObject_Vectorcall(data_ptr, &tensor, 1, NULL);
        addresses[i] = address ? PyLong_AsLongLong(address) : -1;
        Py_XDECREF(address);
        if (addresses[i] == -1 && PyErr_Occurred()) {
            PyMem_Free(addresses);
            return NULL;
        }
    }
    return addresses;
}

PyDoc_STRVAR(layout_doc,
             "layout(dtype, tensors, numels, data_ptr, exact=None, raw=0) -> capsule\n\n"
             "The chunks of dense buffers of one dtype: data_ptr(t) of each tensor and\n"
             "its element count, for reduce_layout and scale_layout. raw: the address of\n"
             "torch's C function void *(PyObject *) giving the same pointer, called\n"
             "instead for tensors of exactly the type `exact` (0: never).");

static PyObject *native_layout(PyObject *self, PyObject *args) {
    (void)self;
    int dtype;
    PyObject *tensors_in, *numels_in, *data_ptr, *exact = Py_None;
    unsigned long long raw_address = 0;
    if (!PyArg_ParseTuple(args, "iOOO|OK", &dtype, &tensors_in, &numels_in, &data_ptr, &exact,
                          &raw_address))
        return NULL;
    DataPtrFn raw = exact == Py_None ? NULL : (DataPtrFn)(uintptr_t)raw_address;
    if (!check_dtype(dtype)) return NULL;
    PyObject *tensors = PySequence_Fast(tensors_in, "tensors must be a sequence");
    PyObject *numels_seq = tensors ? PySequence_Fast(numels_in, "numels must be a sequence") : NULL;
    int64_t *addresses = NULL, *numels = NULL;
    Layout *layout = NULL;
    PyObject *capsule = NULL;
    if (numels_seq == NULL) goto done;
    if (PySequence_Fast_GET_SIZE(numels_seq) != PySequence_Fast_GET_SIZE(tensors)) {
        PyErr_SetString(PyExc_ValueError, "tensors and numels differ in length");
        goto done;
    }
    if (!(numels = read_ints(numels_seq, "numels"))) goto done;
    if (!(addresses = read_addresses(tensors, data_ptr, exact, raw))) goto done;
    if (!(layout = PyMem_Malloc(sizeof(Layout)))) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t buffers = PySequence_Fast_GET_SIZE(tensors);
    if (!fill_chunks(addresses, numels, buffers, dtype, &layout->chunks)) {
        PyMem_Free(layout);
        goto done;
    }
    if (!(layout->ends = chunk_ends(numels, buffers))) {
        free_chunks(&layout->chunks);
        PyMem_Free(layout);
        goto done;
    }
    layout->dtype = dtype;
    layout->overlap = -1;
    layout->buffers = buffers;
    capsule = PyCapsule_New(layout, LAYOUT_NAME, free_layout);
    if (capsule == NULL) {
        free_chunks(&layout->chunks);
        PyMem_Free(layout->ends);
        PyMem_Free(layout);
    }
done:
    PyMem_Free(addresses);
    PyMem_Free(numels);
    Py_XDECREF(tensors);
    Py_XDECREF(numels_seq);
    return capsule;
}

PyDoc_STRVAR(reduce_layout_doc,
             "reduce_layout(op, layout, threads) -> float\n\nreduce() over a layout.");

static PyObject *native_reduce_layout(PyObject *self, PyObject *args) {
    (void)self;
    int op, threads;
    PyObject *capsule;
    if (!PyArg_ParseTuple(args, "iOi", &op, &capsule, &threads)) return NULL;
    if (op < SUM_SQUARES || op > MAX_ABS)
        return PyErr_Format(PyExc_ValueError, "op must be 0, 1 or 2, got %d", op);
    Layout *layout = get_layout(capsule);
    if (layout == NULL) return NULL;
    return reduce_chunks(op, layout->dtype, &layout->chunks, threads);
}

PyDoc_STRVAR(norms_layout_doc,
             "norms_layout(op, layout, out_address, threads)\n\n"
             "The norm of each tensor of a layout on its own, into the float64 array at\n"
             "out_address (one per tensor): reduce() of that tensor alone, its square\n"
             "root for op 0 (correctly rounded, as math.sqrt), from one pass over all of\n"
             "them on `threads` threads.");

static PyObject *native_norms_layout(PyObject *self, PyObject *args) {
    (void)self;
    int op, threads;
    PyObject *capsule;
    unsigned long long out_address;
    if (!PyArg_ParseTuple(args, "iOKi", &op, &capsule, &out_address, &threads)) return NULL;
    if (op < SUM_SQUARES || op > MAX_ABS)
        return PyErr_Format(PyExc_ValueError, "op must be 0, 1 or 2, got %d", op);
    Layout *layout = get_layout(capsule);
    if (layout == NULL) return NULL;
    double *out = (double *)(uintptr_t)out_address;
    if (!reduce_ranges(op, layout->dtype, &layout->chunks, threads, layout->ends,
                       layout->buffers, out))
        return NULL;
    if (op == SUM_SQUARES)
        for (int64_t i = 0; i < layout->buffers; i++) out[i] = sqrt(out[i]);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(scale_layout_doc,
             "scale_layout(layout, coefficient_address, coefficient_dtype, threads)\n\n"
             "scale() over a layout.");

static PyObject *native_scale_layout(PyObject *self, PyObject *args) {
    (void)self;
    int coefficient_dtype, threads;
    PyObject *capsule;
    unsigned long long coefficient_address;
    if (!PyArg_ParseTuple(args, "OKii", &capsule, &coefficient_address, &coefficient_dtype, &threads))
        return NULL;
    Layout *layout = get_layout(capsule);
    if (layout == NULL) return NULL;
    if (!scale_chunks(layout->dtype, &layout->chunks, coefficient_address, coefficient_dtype,
                      threads, &layout->overlap))
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(grads_doc,
             "grads(params) -> list\n\n"
             "[p.grad for p in params if p.grad is not None], each p.grad read once.");

static PyObject *native_grads(PyObject *self, PyObject *params_in) {
    (void)self;
    static PyObject *name = NULL;
    if (name == NULL && !(name = PyUnicode_InternFromString("grad"))) return NULL;
    PyObject *params = PySequence_Fast(params_in, "params must be a sequence");
    if (params == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(params);
    PyObject *grads = PyList_New(0);
    for (Py_ssize_t i = 0; grads != NULL && i < count; i++) {
        PyObject *grad = PyObject_GetAttr(PySequence_Fast_GET_ITEM(params, i), name);
        if (grad == NULL || (grad != Py_None && PyList_Append(grads, grad) < 0)) Py_CLEAR(grads);
        Py_XDECREF(grad);
    }
    Py_DECREF(params);
    return grads;
}

PyDoc_STRVAR(any_instance_doc,
             "any_instance(objects, cls) -> bool\n\n"
             "any(issubclass(type(o), cls) for o in objects): each run of objects of\n"
             "one type is checked once.");

static PyObject *native_any_instance(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objects_in, *cls;
    if (!PyArg_ParseTuple(args, "OO", &objects_in, &cls)) return NULL;
    PyObject *objects = PySequence_Fast(objects_in, "objects must be a sequence");
    if (objects == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(objects);
    PyTypeObject *last = NULL;
    int found = 0;
    for (Py_ssize_t i = 0; i < count && !found; i++) {
        PyObject *object = PySequence_Fast_GET_ITEM(objects, i);
        if (Py_TYPE(object) == last) continue;
        last = Py_TYPE(object);
        found = PyObject_IsSubclass((PyObject *)last, cls);
    }
    Py_DECREF(objects);
    if (found < 0) return NULL;
    return PyBool_FromLong(found);
}

/* min(1, max_norm / (norm + eps)) as clipopt._kernels._norms.clip_coefficient's torch ops
 * round it, in the norm's precision: eps and max_norm rounded to it first, the quotient
 * as a reciprocal times max_norm (torch's scalar / tensor), a NaN norm kept, and a
 * coefficient in (0, smallest normal) made NaN. */
#define DEFINE_COEFFICIENT(NAME, TYPE, TINY)                                            \
    static TYPE NAME(TYPE norm, double max_norm, double eps) {                          \
        TYPE shifted = norm + (TYPE)eps;                                                \
        TYPE coefficient = ((TYPE)1 / shifted) * (TYPE)max_norm;                        \
        if (coefficient > (TYPE)1) coefficient = (TYPE)1;                               \
        return coefficient > 0 && coefficient < TINY ? (TYPE)NAN : coefficient;         \
    }
DEFINE_COEFFICIENT(coefficient_f32, float, FLT_MIN)
DEFINE_COEFFICIENT(coefficient_f64, double, DBL_MIN)

PyDoc_STRVAR(coefficient_doc,
             "coefficient(norm_address, dtype, max_norm, eps, out_address)\n\n"
             "Writes min(1, max_norm / (norm + eps)), rounded as torch's float ops round it\n"
             "(NaN for a NaN norm or a coefficient below the smallest normal), from the\n"
             "scalar at norm_address to the one at out_address; dtype 0 float32, 1 float64.");

static PyObject *native_coefficient(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long norm_address, out_address;
    int dtype;
    double max_norm, eps;
    if (!PyArg_ParseTuple(args, "KiddK", &norm_address, &dtype, &max_norm, &eps, &out_address))
        return NULL;
    if (dtype == FLOAT32) {
        float norm = *(const float *)(uintptr_t)norm_address;
        *(float *)(uintptr_t)out_address = coefficient_f32(norm, max_norm, eps);
    } else if (dtype == FLOAT64) {
        double norm = *(const double *)(uintptr_t)norm_address;
        *(double *)(uintptr_t)out_address = coefficient_f64(norm, max_norm, eps);
    } else {
        return PyErr_Format(PyExc_ValueError, "dtype must be 0 or 1, got %d", dtype);
    }
    Py_RETURN_NONE;
}

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
