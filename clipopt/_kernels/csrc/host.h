/* Host helpers that spare Python a loop per tensor: reading every grad, testing
 * types, and the clip coefficient of a norm already on the host. Included once, by
 * _native.c.
 */
#ifndef CLIPOPT_HOST_H
#define CLIPOPT_HOST_H

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

/* min(1, max_norm / (norm + eps)) as clipopt._kernels._scale.clip_coefficient's torch ops
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

#endif /* CLIPOPT_HOST_H */
