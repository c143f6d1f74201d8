/*
 * cpu_adam_module.c - CPython bindings of cpu_adam.h as the module zerooffload._cpu_adam. No
 * optimizer logic lives here: arguments are converted, the GIL is released around the pass, and
 * negative errnos become OSError. It is an extension of its own, apart from the async-I/O engine
 * (aio_module.c, zerooffload._aio), because it is the part that depends on the CPU's instruction
 * set: if it fails to build, the I/O engine is still there (and the optimizer falls back to torch).
 *
 * Python interface
 *   adam_steps([(param_addr, grad_addr, grad_dtype, exp_avg_addr, exp_avg_sq_addr, moment_dtype, exp_avg_scale_addr,
 *                exp_avg_sq_scale_addr, out_addr, out_dtype, master, residual_addr, residual_bits_addr, residual_bit0, noise_key, noise_base,
 *                n, lr, beta1, beta2, eps, weight_decay, grad_scale, step, adamw, want_sumsq), ...],
 *              threads) -> [float | None, ...]
 *       fused Adam/AdamW passes, each over its n elements, run as one split (cpu_adam.h's
 *       zo_adam_steps), returning each gradient's sum of squares where want_sumsq asks;
 *       OSError(EINVAL) on bad arguments, with no pass applied
 *   sum_squares(addr, dtype, n, threads) -> float: the sum of squares of n elements (cpu_adam.h)
 *   adam_simd() -> "avx512" | "avx2" | "scalar"; OSError(EINVAL) when ZO_ADAM_SIMD names no level.
 *       Off x86 (and when built with -DZO_ADAM_SCALAR_ONLY) it is always "scalar".
 *   DTYPE_NONE, DTYPE_FP32, DTYPE_BF16, DTYPE_FP16, DTYPE_INT8 (grad_dtype, out_dtype, moment_dtype)
 *   INT8_BLOCK: elements per scale of int8 moments
 *   MASTER_FP32, MASTER_SPLIT (master)
 */
#include "bindings.h"

#include "cpu_adam.h"

/* One update's tuple (the interface above) into a; its sum of squares goes to *sumsq when asked. */
static int parse_update(PyObject *update, struct zo_adam_args *a, double *sumsq)
{
    unsigned long long param, grad, exp_avg, exp_avg_sq, m_scale, v_scale, out, residual, residual_bits;
    long long step;
    Py_ssize_t n, bit0;
    int want_sumsq;
    if (!PyArg_ParseTuple(update, "KKiKKiKKKiiKKnIIndddddfLpp", &param, &grad, &a->grad_dtype, &exp_avg, &exp_avg_sq,
                          &a->moment_dtype, &m_scale, &v_scale, &out, &a->out_dtype, &a->master, &residual, &residual_bits, &bit0,
                          &a->noise_key, &a->noise_base, &n, &a->lr, &a->beta1, &a->beta2, &a->eps,
                          &a->weight_decay, &a->grad_scale, &step, &a->adamw, &want_sumsq))
        return -1;
    if (n < 0 || bit0 < 0) {
        PyErr_SetString(PyExc_ValueError, "n and residual_bit0 must be >= 0");
        return -1;
    }
    a->residual = (int16_t *)(uintptr_t)residual;
    a->residual_bits = (uint8_t *)(uintptr_t)residual_bits;
    a->residual_bit0 = (size_t)bit0;
    a->param = (float *)(uintptr_t)param;
    a->grad = (const void *)(uintptr_t)grad;
    a->exp_avg = (void *)(uintptr_t)exp_avg;
    a->exp_avg_sq = (void *)(uintptr_t)exp_avg_sq;
    a->out = (void *)(uintptr_t)out;
    a->exp_avg_scale = (float *)(uintptr_t)m_scale;
    a->exp_avg_sq_scale = (float *)(uintptr_t)v_scale;
    a->n = (size_t)n;
    a->step = step;
    a->grad_sumsq = want_sumsq ? sumsq : NULL;
    return 0;
}

static PyObject *adam_steps(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *updates;
    unsigned threads;
    if (!PyArg_ParseTuple(args, "O!I", &PyList_Type, &updates, &threads))
        return NULL;
    Py_ssize_t count = PyList_GET_SIZE(updates);
    struct zo_adam_args *a = PyMem_Calloc((size_t)count + 1, sizeof(*a));
    double *sums = PyMem_Calloc((size_t)count + 1, sizeof(*sums));
    PyObject *result = NULL;
    if (!a || !sums) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++)
        if (parse_update(PyList_GET_ITEM(updates, i), &a[i], &sums[i]) < 0)
            goto done;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = zo_adam_steps(a, (size_t)count, threads);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        raise_errno(rc);
        goto done;
    }
    result = PyList_New(count);
    for (Py_ssize_t i = 0; result && i < count; i++) {
        PyObject *item = a[i].grad_sumsq ? PyFloat_FromDouble(sums[i]) : Py_NewRef(Py_None);
        if (!item)
            Py_CLEAR(result);
        else
            PyList_SET_ITEM(result, i, item);
    }
done:
    PyMem_Free(sums);
    PyMem_Free(a);
    return result;
}

static PyObject *sum_squares(PyObject *Py_UNUSED(module), PyObject *args)
{
    unsigned long long addr;
    int dtype;
    Py_ssize_t n;
    unsigned threads;
    double sumsq = 0;
    if (!PyArg_ParseTuple(args, "KinI", &addr, &dtype, &n, &threads))
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "n must be >= 0");
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = zo_sum_squares((const void *)(uintptr_t)addr, dtype, (size_t)n, threads, &sumsq);
    Py_END_ALLOW_THREADS
    if (rc < 0)
        return raise_errno(rc);
    return PyFloat_FromDouble(sumsq);
}

static PyObject *adam_simd(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    int level = zo_adam_simd();
    if (level < 0)
        return raise_errno(level);
    return PyUnicode_FromString(zo_adam_simd_name(level));
}

static PyMethodDef module_methods[] = {
    {"adam_steps", adam_steps, METH_VARARGS, "Fused Adam/AdamW passes in one split (see native/cpu_adam.h)."},
    {"sum_squares", sum_squares, METH_VARARGS, "The sum of squares of a tensor (see native/cpu_adam.h)."},
    {"adam_simd", adam_simd, METH_NOARGS, "The instruction set adam_steps runs on."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, .m_name = "zerooffload._cpu_adam",
    .m_doc = "The fused CPU Adam/AdamW pass (native/cpu_adam.h).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__cpu_adam(void)
{
    PyObject *m = PyModule_Create(&module_def);
    if (!m)
        return NULL;
    if (PyModule_AddIntConstant(m, "DTYPE_NONE", ZO_DTYPE_NONE) < 0 ||
        PyModule_AddIntConstant(m, "DTYPE_FP32", ZO_DTYPE_FP32) < 0 ||
        PyModule_AddIntConstant(m, "DTYPE_BF16", ZO_DTYPE_BF16) < 0 ||
        PyModule_AddIntConstant(m, "DTYPE_FP16", ZO_DTYPE_FP16) < 0 ||
        PyModule_AddIntConstant(m, "DTYPE_INT8", ZO_DTYPE_INT8) < 0 ||
        PyModule_AddIntConstant(m, "INT8_BLOCK", (long)ZO_INT8_BLOCK) < 0 ||
        PyModule_AddIntConstant(m, "MASTER_FP32", ZO_MASTER_FP32) < 0 ||
        PyModule_AddIntConstant(m, "MASTER_SPLIT", ZO_MASTER_SPLIT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
