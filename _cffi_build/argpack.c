/* flagcx_mc._argpack: the three lists of one transfer call packed into C arrays, at C speed.
 *
 * Mooncake's API takes Python lists of ints (addresses and lengths).  Converting them through
 * cffi costs ~30 ns an element (~95 us for 3 x 1024 on a 2-core VM), a large part of a 1024 x
 * 4 KiB copy.  This CPython extension walks the lists once, checks every element (integers in
 * [0, 2**64), no bools, no floats; numpy integers through __index__), sums the lengths, and
 * writes one bytes object laid out as local[n] | remote[n] | lengths[n], which cffi hands to the
 * core as a `const char *` (or views without copying, ffi.from_buffer): ~15 us for 3 x 1024
 * plain ints on that VM, against ~95 us through cffi and ~46 us with array('Q') and sum() (which
 * check nothing), and well under a microsecond for the one to a few blocks of most calls.  It is
 * not part of the C core: it never touches payload.
 *
 * It is built against the limited API of CPython 3.10 (setup.py) and uses nothing else, so one
 * abi3 module serves every CPython from 3.10 on.  (Reading list items and int digits through the
 * interpreters' object layouts would take 3 x 1024 ints to ~4.5 us, but ties the module to
 * layouts the abi3 promise does not cover; the 10 us it saves are ~1 % of such a call.)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static const char *const WHAT[3] = {"buffers", "peer buffer addresses", "lengths"};

/* One element as u64; -1 with a ValueError/TypeError naming the list and index on bad input. */
static int element_u64(PyObject *v, int list, Py_ssize_t i, uint64_t *out)
{
    PyObject *index = NULL;
    if (PyBool_Check(v)) {
        PyErr_Format(PyExc_TypeError, "%s must be integers, not booleans (element %zd)", WHAT[list], i);
        return -1;
    }
    if (!PyLong_Check(v)) {
        index = PyNumber_Index(v); /* numpy integers and other __index__ types */
        if (index == NULL) {
            /* The type's name through its attribute: the limited API has no PyTypeObject fields. */
            PyObject *name = PyObject_GetAttrString((PyObject *)Py_TYPE(v), "__name__");
            PyErr_Clear();
            if (name != NULL && PyUnicode_Check(name))
                PyErr_Format(PyExc_TypeError, "%s must be integers (element %zd is %.100U)", WHAT[list], i, name);
            else
                PyErr_Format(PyExc_TypeError, "%s must be integers (element %zd)", WHAT[list], i);
            Py_XDECREF(name);
            return -1;
        }
        v = index;
    }
    unsigned long long x = PyLong_AsUnsignedLongLong(v);
    Py_XDECREF(index);
    if (x == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must lie in [0, 2**64) (element %zd)", WHAT[list], i);
        return -1;
    }
    *out = (uint64_t)x;
    return 0;
}

/* Lengths (list 2) are summed as they are packed. */
static inline void continue_total(int list, uint64_t x, uint64_t *total, int *overflow)
{
    if (list == 2) {
        *overflow |= *total + x < *total;
        *total += x;
    }
}

/* The length of what PySequence_Fast returned: a list or a tuple. */
static Py_ssize_t fast_size(PyObject *seq)
{
    return PyList_Check(seq) ? PyList_Size(seq) : PyTuple_Size(seq);
}

/* One list packed into `row`, and the sum of its elements (list 2, the lengths) in *total, with
 * *overflow set if it reached 2**64; -1 with an exception set on bad input. */
static int pack_row(PyObject *seq, int list, Py_ssize_t n, uint64_t *row, uint64_t *total, int *overflow)
{
    const int is_list = PyList_Check(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = is_list ? PyList_GetItem(seq, i) : PyTuple_GetItem(seq, i); /* borrowed */
        if (PyLong_CheckExact(v)) { /* the common case: a plain int below 2**63 */
            int over = 0;
            long long x = PyLong_AsLongLongAndOverflow(v, &over);
            if (over == 0 && x >= 0) {
                row[i] = (uint64_t)x;
                continue_total(list, row[i], total, overflow);
                continue;
            }
            if (x == -1 && PyErr_Occurred())
                return -1;
        }
        if (element_u64(v, list, i, &row[i]) < 0)
            return -1;
        continue_total(list, row[i], total, overflow);
    }
    return 0;
}

/* pack3(buffers, peer_addresses, lengths) -> (bytes, n, total_bytes) */
static PyObject *pack3(PyObject *self, PyObject *args)
{
    PyObject *in[3], *seq[3] = {NULL, NULL, NULL}, *out = NULL, *result = NULL;
    if (!PyArg_UnpackTuple(args, "pack3", 3, 3, &in[0], &in[1], &in[2]))
        return NULL;
    for (int k = 0; k < 3; k++) {
        seq[k] = PySequence_Fast(in[k], "");
        if (seq[k] == NULL) {
            PyErr_SetString(PyExc_TypeError, "buffers, peer addresses and lengths must be sequences");
            goto done;
        }
    }
    Py_ssize_t sizes[3];
    for (int k = 0; k < 3; k++)
        sizes[k] = fast_size(seq[k]);
    Py_ssize_t n = sizes[0];
    if (sizes[1] != n || sizes[2] != n) {
        PyErr_Format(PyExc_ValueError, "buffers, peer addresses and lengths differ in length (%zd, %zd, %zd)", n,
                     sizes[1], sizes[2]);
        goto done;
    }
    /* At least one element per list, so an empty call still yields valid pointers. */
    Py_ssize_t slots = n > 0 ? n : 1;
    out = PyBytes_FromStringAndSize(NULL, 3 * slots * (Py_ssize_t)sizeof(uint64_t)); /* filled before anyone sees it */
    if (out == NULL)
        goto done;
    uint64_t *dst = (uint64_t *)(void *)PyBytes_AsString(out);
    if (n == 0)
        memset(dst, 0, 3 * sizeof(uint64_t));
    uint64_t total = 0, unused_sum;
    int overflow = 0, unused_overflow;
    for (int k = 0; k < 3; k++) {
        uint64_t *row = dst + k * slots;
        uint64_t *sum = k == 2 ? &total : &unused_sum;
        int *over = k == 2 ? &overflow : &unused_overflow;
        if (pack_row(seq[k], k, n, row, sum, over) < 0)
            goto done;
    }
    if (overflow) {
        PyErr_SetString(PyExc_ValueError, "lengths add up to 2**64 bytes or more");
        goto done;
    }
    result = Py_BuildValue("(OnK)", out, n, (unsigned long long)total);
done:
    for (int k = 0; k < 3; k++)
        Py_XDECREF(seq[k]);
    Py_XDECREF(out);
    return result;
}

static PyMethodDef METHODS[] = {
    {"pack3", pack3, METH_VARARGS,
     "pack3(buffers, peer_addresses, lengths) -> (bytes local|remote|lengths as u64, n, total bytes)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "flagcx_mc._argpack",
                                    "Transfer-call argument packing (lists of ints to u64 arrays).", -1, METHODS,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__argpack(void)
{
    return PyModule_Create(&MODULE);
}
