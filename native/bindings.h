/*
 * bindings.h - what the two CPython bindings files (aio_module.c, cpu_adam_module.c) share: the
 * Python.h include and the one conversion both need. It holds no state, so each extension
 * module stays self-contained: building or loading one never depends on the other.
 *
 * Include it first, before any system header: Python.h must see the feature macros it sets.
 */
#ifndef ZO_BINDINGS_H
#define ZO_BINDINGS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>

/* A negative errno (the native functions' failure return) as OSError; returns NULL to pass on. */
static inline PyObject *raise_errno(int negative_errno)
{
    errno = -negative_errno;
    return PyErr_SetFromErrno(PyExc_OSError);
}

#endif
