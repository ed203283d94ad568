/* Chunks and threads: grads cut into chunks of CHUNK elements, spread over OpenMP
 * threads in a fixed order, the spans' overlap check, and reading the address and
 * length lists Python hands over. Included once, by _native.c, after arith.h.
 */
#ifndef CLIPOPT_CHUNKS_H
#define CLIPOPT_CHUNKS_H

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

#endif /* CLIPOPT_CHUNKS_H */
