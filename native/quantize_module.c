/*
 * quantize_module.c - CPython bindings of quantize.h as the module zerooffload._quantize. No logic lives
 * here: arguments are converted, the GIL is released around the pass, and negative errnos become OSError.
 * An extension of its own, like _cpu_adam: it depends on the CPU's instruction set, and without it
 * zerooffload/comm/quantize.py computes the same code with torch.
 *
 * Python interface
 *   quantize(src_addr, src_dtype, n, block, bits, codes_addr, scales_addr, level) -> None
 *   dequantize(codes_addr, scales_addr, n, block, bits, dst_addr, dst_dtype, accumulate, level) -> None
 *       level: -1 for the CPU's best, else LEVEL_* (lowered to the best the CPU has)
 *   best_level() -> int; level_name(level) -> "avx512" | "avx2" | "scalar"
 *   DTYPE_FP32, DTYPE_BF16, LEVEL_SCALAR, LEVEL_AVX2, LEVEL_AVX512
 */
#include "bindings.h"

#include "quantize.h"

static PyObject *quantize(PyObject *Py_UNUSED(module), PyObject *args)
{
    unsigned long long src, codes, scales;
    int dtype, bits, level;
    Py_ssize_t n, block;
    if (!PyArg_ParseTuple(args, "KinniKKi", &src, &dtype, &n, &block, &bits, &codes, &scales, &level))
        return NULL;
    if (n < 0 || block <= 0)
        return raise_errno(-EINVAL);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = zo_quantize((const void *)(uintptr_t)src, dtype, (size_t)n, (size_t)block, bits, (uint8_t *)(uintptr_t)codes,
                     (float *)(uintptr_t)scales, level);
    Py_END_ALLOW_THREADS
    if (rc < 0)
        return raise_errno(rc);
    Py_RETURN_NONE;
}

static PyObject *dequantize(PyObject *Py_UNUSED(module), PyObject *args)
{
    unsigned long long codes, scales, dst;
    int dtype, bits, accumulate, level;
    Py_ssize_t n, block;
    if (!PyArg_ParseTuple(args, "KKnniKipi", &codes, &scales, &n, &block, &bits, &dst, &dtype, &accumulate, &level))
        return NULL;
    if (n < 0 || block <= 0)
        return raise_errno(-EINVAL);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = zo_dequantize((const uint8_t *)(uintptr_t)codes, (const float *)(uintptr_t)scales, (size_t)n, (size_t)block,
                       bits, (void *)(uintptr_t)dst, dtype, accumulate, level);
    Py_END_ALLOW_THREADS
    if (rc < 0)
        return raise_errno(rc);
    Py_RETURN_NONE;
}

static PyObject *best_level(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromLong(zo_quantize_best_level());
}

static PyObject *level_name(PyObject *Py_UNUSED(module), PyObject *args)
{
    int level;
    if (!PyArg_ParseTuple(args, "i", &level))
        return NULL;
    return PyUnicode_FromString(zo_quantize_level_name(level));
}

static PyMethodDef module_methods[] = {
    {"quantize", quantize, METH_VARARGS, "Block-quantize n fp32/bf16 elements to int8/int4 codes (native/quantize.h)."},
    {"dequantize", dequantize, METH_VARARGS, "Decode codes into fp32/bf16, or add them to fp32 (native/quantize.h)."},
    {"best_level", best_level, METH_NOARGS, "The best instruction set this CPU runs the code on."},
    {"level_name", level_name, METH_VARARGS, "A level's name."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, .m_name = "zerooffload._quantize",
    .m_doc = "ZeRO++'s block code for data on the wire (native/quantize.h).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__quantize(void)
{
    PyObject *m = PyModule_Create(&module_def);
    if (!m)
        return NULL;
    if (PyModule_AddIntConstant(m, "DTYPE_FP32", ZO_Q_FP32) < 0 || PyModule_AddIntConstant(m, "DTYPE_BF16", ZO_Q_BF16) < 0 ||
        PyModule_AddIntConstant(m, "LEVEL_SCALAR", ZO_Q_SCALAR) < 0 ||
        PyModule_AddIntConstant(m, "LEVEL_AVX2", ZO_Q_AVX2) < 0 ||
        PyModule_AddIntConstant(m, "LEVEL_AVX512", ZO_Q_AVX512) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
