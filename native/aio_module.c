/*
 * aio_module.c - CPython bindings of aio.h as the module zerooffload._aio. No I/O logic lives
 * here: arguments are converted, the GIL is released around every call that may block, and
 * negative errnos become OSError. It is built apart from the fused Adam pass (cpu_adam_module.c,
 * zerooffload._cpu_adam) and needs nothing but libc, pthreads and the kernel headers, so a
 * machine on which the Adam kernel cannot be built still gets io_uring and the pool.
 *
 * Python interface
 *   Engine(kind, block_size, queue_depth, threads)   kind: "uring" | "pool"
 *   Engine.submit([(op, fd, addr, len, offset), ...]) -> ticket (int)
 *   Engine.wait(ticket, timeout=None) -> total bytes, or None when timeout (seconds) expires;
 *       a failed batch raises OSError(errno, "request I failed at offset O: ...") with the
 *       attributes index and offset.
 *   Engine.poll(ticket) -> bool
 *   Engine.close()      queued requests end with ECANCELED, requests in flight are waited for
 *   uring_probe() -> 0 or the errno why io_uring is unusable; uring_supported() -> bool
 *       (the one io_uring probe: the auto backend and doctor both ask it, zerooffload/io/probe.py)
 *   crc32c(addr, nbytes, crc) -> int          the CRC32C of a host range, continuing crc (checksum.h)
 *   crc32c_combine(crc1, crc2, len2) -> int   the CRC32C of two ranges joined, from theirs
 *   crc32c_simd() -> str                      the level it runs on; ValueError when ZO_CRC32C_SIMD names none
 *   READ, WRITE (ops), EEOF (errno of a read that met end of file)
 */
#include "bindings.h"

#include <string.h>

#include "aio.h"
#include "checksum.h"

typedef struct {
    PyObject_HEAD
    zo_engine *engine;
} EngineObject;

static zo_engine *engine_of(EngineObject *self)
{
    if (!self->engine)
        PyErr_SetString(PyExc_ValueError, "engine is not initialized");
    return self->engine;
}

static int Engine_init(EngineObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"kind", "block_size", "queue_depth", "threads", NULL};
    const char *kind;
    Py_ssize_t block_size;
    unsigned int queue_depth, threads;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "snII", keywords, &kind, &block_size,
                                     &queue_depth, &threads))
        return -1;
    if (self->engine) {
        PyErr_SetString(PyExc_ValueError, "engine is already initialized");
        return -1;
    }
    struct zo_config config = {.block_size = block_size < 0 ? 0 : (size_t)block_size,
                               .queue_depth = queue_depth, .threads = threads};
    if (strcmp(kind, "uring") == 0) {
        config.kind = ZO_URING;
    } else if (strcmp(kind, "pool") == 0) {
        config.kind = ZO_POOL;
    } else {
        PyErr_Format(PyExc_ValueError, "kind = '%s': expected 'uring' or 'pool'", kind);
        return -1;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = zo_engine_create(&config, &self->engine);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        raise_errno(rc);
        return -1;
    }
    return 0;
}

static void Engine_dealloc(EngineObject *self)
{
    if (self->engine) {
        Py_BEGIN_ALLOW_THREADS
        zo_engine_destroy(self->engine);
        Py_END_ALLOW_THREADS
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int parse_request(PyObject *item, struct zo_request *r)
{
    unsigned long long addr;
    Py_ssize_t len;
    long long offset;
    if (!PyTuple_Check(item)) {
        PyErr_SetString(PyExc_TypeError, "a request is a tuple (op, fd, addr, len, offset)");
        return -1;
    }
    if (!PyArg_ParseTuple(item, "iiKnL", &r->op, &r->fd, &addr, &len, &offset))
        return -1;
    if (len < 0) {
        PyErr_SetString(PyExc_ValueError, "request length must be >= 0");
        return -1;
    }
    r->addr = (void *)(uintptr_t)addr;
    r->len = (size_t)len;
    r->offset = offset;
    return 0;
}

static PyObject *Engine_submit(EngineObject *self, PyObject *requests)
{
    zo_engine *engine = engine_of(self);
    if (!engine)
        return NULL;
    PyObject *seq = PySequence_Fast(requests, "submit() takes a sequence of requests");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    struct zo_request *reqs = PyMem_Calloc(n ? (size_t)n : 1, sizeof(*reqs));
    if (!reqs) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (parse_request(PySequence_Fast_GET_ITEM(seq, i), &reqs[i]) < 0) {
            PyMem_Free(reqs);
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    uint64_t ticket = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = zo_engine_submit(engine, reqs, (size_t)n, &ticket);
    Py_END_ALLOW_THREADS
    PyMem_Free(reqs);
    if (rc < 0)
        return raise_errno(rc);
    return PyLong_FromUnsignedLongLong(ticket);
}

static PyObject *batch_error(const struct zo_status *status)
{
    int err = (int)-status->result;
    char text[128];
    PyObject *exc = PyObject_CallFunction(
        PyExc_OSError, "iN", err,
        PyUnicode_FromFormat("request %zu failed at offset %lld: %s", status->failed_index,
                             (long long)status->failed_offset, strerror_r(err, text, sizeof(text))));
    if (!exc)
        return NULL;
    PyObject *index = PyLong_FromSize_t(status->failed_index);
    PyObject *offset = PyLong_FromLongLong((long long)status->failed_offset);
    if (index && offset && PyObject_SetAttrString(exc, "index", index) == 0 &&
        PyObject_SetAttrString(exc, "offset", offset) == 0)
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_XDECREF(index);
    Py_XDECREF(offset);
    Py_DECREF(exc);
    return NULL;
}

static PyObject *Engine_wait(EngineObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"ticket", "timeout", NULL};
    unsigned long long ticket;
    PyObject *timeout = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "K|O", keywords, &ticket, &timeout))
        return NULL;
    zo_engine *engine = engine_of(self);
    if (!engine)
        return NULL;
    int64_t timeout_ns = -1;
    if (timeout != Py_None) {
        double seconds = PyFloat_AsDouble(timeout);
        if (seconds == -1.0 && PyErr_Occurred())
            return NULL;
        timeout_ns = seconds <= 0 ? 0 : seconds >= 9e9 ? (int64_t)9e18 : (int64_t)(seconds * 1e9);
    }
    struct zo_status status;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = zo_engine_wait(engine, ticket, timeout_ns, &status);
    Py_END_ALLOW_THREADS
    if (rc == -ETIMEDOUT)
        Py_RETURN_NONE;
    if (rc == -ENOENT)
        return PyErr_Format(PyExc_ValueError, "unknown or already retired ticket %llu", ticket);
    if (rc < 0)
        return raise_errno(rc);
    if (status.result < 0)
        return batch_error(&status);
    return PyLong_FromLongLong((long long)status.result);
}

static PyObject *Engine_poll(EngineObject *self, PyObject *arg)
{
    zo_engine *engine = engine_of(self);
    if (!engine)
        return NULL;
    unsigned long long ticket = PyLong_AsUnsignedLongLong(arg);
    if (ticket == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    int rc = zo_engine_poll(engine, ticket);
    if (rc == -ENOENT)
        return PyErr_Format(PyExc_ValueError, "unknown or already retired ticket %llu", ticket);
    return PyBool_FromLong(rc);
}

static PyObject *Engine_close(EngineObject *self, PyObject *Py_UNUSED(ignored))
{
    zo_engine *engine = engine_of(self);
    if (!engine)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    zo_engine_shutdown(engine);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef Engine_methods[] = {
    {"submit", (PyCFunction)Engine_submit, METH_O, "Queue a batch of requests; returns a ticket."},
    {"wait", (PyCFunction)(void (*)(void))Engine_wait, METH_VARARGS | METH_KEYWORDS,
     "Total bytes of a batch, None on timeout; OSError (index, offset) on failure."},
    {"poll", (PyCFunction)Engine_poll, METH_O, "Whether a batch is done."},
    {"close", (PyCFunction)Engine_close, METH_NOARGS, "Cancel queued work, wait for the rest."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "zerooffload._aio.Engine",
    .tp_basicsize = sizeof(EngineObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "An async-I/O engine (see native/aio.h).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Engine_init,
    .tp_dealloc = (destructor)Engine_dealloc,
    .tp_methods = Engine_methods,
};

static PyObject *uring_probe(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = zo_uring_probe();
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(-rc);
}

static PyObject *uring_supported(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = zo_uring_probe();
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(rc == 0);
}

static PyObject *crc32c(PyObject *Py_UNUSED(module), PyObject *args)
{
    unsigned long long addr;
    Py_ssize_t nbytes;
    unsigned int crc;
    if (!PyArg_ParseTuple(args, "KnI", &addr, &nbytes, &crc))
        return NULL;
    if (nbytes < 0 || (addr == 0 && nbytes > 0)) {
        PyErr_SetString(PyExc_ValueError, "crc32c needs a non-negative length and, for bytes, an address");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    crc = zo_crc32c(crc, (const void *)(uintptr_t)addr, (size_t)nbytes);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLong(crc);
}

static PyObject *crc32c_combine(PyObject *Py_UNUSED(module), PyObject *args)
{
    unsigned int crc1, crc2;
    unsigned long long len2;
    if (!PyArg_ParseTuple(args, "IIK", &crc1, &crc2, &len2))
        return NULL;
    return PyLong_FromUnsignedLong(zo_crc32c_combine(crc1, crc2, len2));
}

static PyObject *crc32c_simd(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    const char *level = zo_crc32c_simd();
    if (!level)
        return PyErr_Format(PyExc_ValueError, "ZO_CRC32C_SIMD = '%s': expected 'avx512', 'sse42' or 'table' (or unset)",
                            getenv("ZO_CRC32C_SIMD"));
    return PyUnicode_FromString(level);
}

static PyMethodDef module_methods[] = {
    {"crc32c", crc32c, METH_VARARGS, "The CRC32C of nbytes at addr, continuing crc (see native/checksum.h)."},
    {"crc32c_combine", crc32c_combine, METH_VARARGS, "The CRC32C of two ranges joined: (crc1, crc2, len2)."},
    {"crc32c_simd", crc32c_simd, METH_NOARGS, "The instruction set crc32c runs on."},
    {"uring_probe", uring_probe, METH_NOARGS, "0, or the errno why io_uring is unusable here."},
    {"uring_supported", uring_supported, METH_NOARGS, "Whether io_uring works here."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, .m_name = "zerooffload._aio",
    .m_doc = "Native async I/O: io_uring and a pthread pool (native/aio.h).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__aio(void)
{
    if (PyType_Ready(&EngineType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (!m)
        return NULL;
    if (PyModule_AddIntConstant(m, "READ", ZO_READ) < 0 ||
        PyModule_AddIntConstant(m, "WRITE", ZO_WRITE) < 0 ||
        PyModule_AddIntConstant(m, "EEOF", ZO_EEOF) < 0 ||
        PyModule_AddObjectRef(m, "Engine", (PyObject *)&EngineType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
