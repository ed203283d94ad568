/* Per-chunk arithmetic: the loads of each dtype, the lane folds, the block sums
 * (float32 lanes added in double, re-read in double where a block may have overflowed),
 * max |x| by bits, and the in-place scales. Included once, by _native.c.
 */
#ifndef CLIPOPT_ARITH_H
#define CLIPOPT_ARITH_H

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

#endif /* CLIPOPT_ARITH_H */
