/* Layouts: one dtype's dense tensors cut into chunks once, their addresses read in C,
 * shared by a clip's norm and its scale. Included once, by _native.c, after chunks.h.
 */
#ifndef CLIPOPT_LAYOUT_H
#define CLIPOPT_LAYOUT_H

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

#endif /* CLIPOPT_LAYOUT_H */
