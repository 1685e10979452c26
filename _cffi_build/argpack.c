/* flagcx_mc._argpack: the three lists of one transfer call packed into C arrays, at C speed.
 *
 * Mooncake's API takes Python lists of ints (addresses and lengths).  Converting them through
 * cffi costs ~70 ns an element on a small VM, which for 1024 blocks of 4 KiB is as long as the
 * copy itself.  This CPython extension walks the lists once, checks every element (integers in
 * [0, 2**64), no bools, no floats; numpy integers through __index__), sums the lengths, and
 * writes one bytes object laid out as local[n] | remote[n] | lengths[n], which cffi hands to the
 * core as a `const char *` (or views without copying, ffi.from_buffer).  It is not part of the C core: it never touches payload.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

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
            PyErr_Format(PyExc_TypeError, "%s must be integers (element %zd is %.100s)", WHAT[list], i,
                         Py_TYPE(v)->tp_name);
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

/* A plain int of up to two digits (below 2**60 with CPython's 30-bit digits: every address and
 * length in practice) read straight from its digits, on the CPython versions whose layout is
 * known here: ~4x faster than PyLong_AsLongLongAndOverflow, which for 3 x 1024 elements was
 * ~30 us of every call on a small VM. Returns 0 where it cannot tell (the caller converts). */
static inline int small_int_u64(PyObject *v, uint64_t *out)
{
#if PY_VERSION_HEX >= 0x030C0000 && PY_VERSION_HEX < 0x030F0000 && !defined(Py_LIMITED_API)
    const PyLongObject *l = (const PyLongObject *)v;
    uintptr_t tag = l->long_value.lv_tag; /* digit count << 3 | sign (0 +, 1 zero, 2 -) */
    size_t ndigits = (size_t)(tag >> 3);
    const digit *d = l->long_value.ob_digit;
    if ((tag & 3) == 2)
        return 0;
#elif PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000 && !defined(Py_LIMITED_API)
    Py_ssize_t size = Py_SIZE(v); /* digit count, negative for negative numbers */
    size_t ndigits = (size_t)size;
    const digit *d = ((const PyLongObject *)v)->ob_digit;
    if (size < 0)
        return 0;
#else
    (void)v;
    (void)out;
    return 0;
#endif
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030F0000 && !defined(Py_LIMITED_API)
    if (ndigits == 0) {
        *out = 0;
        return 1;
    }
    if (ndigits == 1) {
        *out = d[0];
        return 1;
    }
    if (ndigits == 2 && 2 * PyLong_SHIFT <= 63) {
        *out = (uint64_t)d[0] | (uint64_t)d[1] << PyLong_SHIFT;
        return 1;
    }
    return 0;
#endif
}

/* Lengths (list 2) are summed as they are packed. */
static inline void continue_total(int list, uint64_t x, uint64_t *total, int *overflow)
{
    if (list == 2) {
        *overflow |= *total + x < *total;
        *total += x;
    }
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
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq[0]);
    if (PySequence_Fast_GET_SIZE(seq[1]) != n || PySequence_Fast_GET_SIZE(seq[2]) != n) {
        PyErr_Format(PyExc_ValueError, "buffers, peer addresses and lengths differ in length (%zd, %zd, %zd)", n,
                     PySequence_Fast_GET_SIZE(seq[1]), PySequence_Fast_GET_SIZE(seq[2]));
        goto done;
    }
    /* At least one element per list, so an empty call still yields valid pointers. */
    Py_ssize_t slots = n > 0 ? n : 1;
    out = PyBytes_FromStringAndSize(NULL, 3 * slots * (Py_ssize_t)sizeof(uint64_t)); /* filled before anyone sees it */
    if (out == NULL)
        goto done;
    uint64_t *dst = (uint64_t *)(void *)PyBytes_AS_STRING(out);
    if (n == 0)
        memset(dst, 0, 3 * sizeof(uint64_t));
    uint64_t total = 0;
    int overflow = 0;
    for (int k = 0; k < 3; k++) {
        PyObject **items = PySequence_Fast_ITEMS(seq[k]);
        uint64_t *row = dst + k * slots;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *v = items[i];
            if (PyLong_CheckExact(v)) { /* the common case: a plain int below 2**63 */
                if (small_int_u64(v, &row[i])) {
                    continue_total(k, row[i], &total, &overflow);
                    continue;
                }
                int over = 0;
                long long x = PyLong_AsLongLongAndOverflow(v, &over);
                if (over == 0 && x >= 0) {
                    row[i] = (uint64_t)x;
                    continue_total(k, row[i], &total, &overflow);
                    continue;
                }
                if (x == -1 && PyErr_Occurred())
                    goto done;
            }
            if (element_u64(v, k, i, &row[i]) < 0) {
                goto done;
            }
            continue_total(k, row[i], &total, &overflow);
        }
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
                                    "Transfer-call argument packing (lists of ints to u64 arrays).", -1, METHODS};

PyMODINIT_FUNC PyInit__argpack(void)
{
    return PyModule_Create(&MODULE);
}
