/* flagcx_mc._argpack: the three lists of one transfer call packed into C arrays, at C speed.
 *
 * Mooncake's API takes Python lists of ints (addresses and lengths).  Converting them through
 * cffi costs ~30 ns an element (~95 us for 3 x 1024 on a 2-core VM), a large part of a 1024 x
 * 4 KiB copy.  This CPython extension walks the lists once, checks every element (integers in
 * [0, 2**64), no bools, no floats; numpy integers through __index__), sums the lengths, and
 * writes one bytes object laid out as local[n] | remote[n] | lengths[n], which cffi hands to the
 * core as a `const char *` (or views without copying, ffi.from_buffer): ~4.5 us for 3 x 1024
 * plain ints on that VM, against ~95 us through cffi and ~46 us with array('Q') and sum() (which
 * check nothing).  It is not part of the C core: it never touches payload.
 *
 * It is built against the limited API of CPython 3.10 (setup.py), so one abi3 module serves every
 * CPython from 3.10 on.  Through that API alone the same call takes ~15 us: a function call per
 * element to fetch it (PyList_GetItem) and one to read it (PyLong_AsLongLongAndOverflow).  So on
 * the CPython versions whose list, tuple and int layouts are known here (choose_layout), items
 * are read from the list's or tuple's item array and plain ints of up to two digits from their
 * digits, once an import-time check has found that these reads agree with the API on sample
 * objects; any other interpreter takes the API path, with the same results.
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

/* The layouts of the running interpreter's objects (64-bit CPython 3.10 to 3.14, 30-bit digits).
 * A list is its header, its size, then a pointer to its item array; a tuple its header, its size,
 * then the items themselves.  An int is its header, one word, then its digits: that word is
 * ob_size on 3.10 and 3.11 (the digit count, negative for a negative int: INTS_SIZE) and lv_tag
 * from 3.12 (digit count << 3 | flag bit | sign 0 positive, 1 zero, 2 negative: INTS_TAG). */
enum { INTS_API, INTS_SIZE, INTS_TAG };

typedef struct {
    PyObject ob_base;
    Py_ssize_t size;
    PyObject **items;
} list_view;

typedef struct {
    PyObject ob_base;
    Py_ssize_t size;
    PyObject *items[1];
} tuple_view;

typedef struct {
    PyObject ob_base;
    Py_ssize_t word; /* ob_size or lv_tag */
    uint32_t digit[2];
} int_view;

#define DIGIT_BITS 30

static int chosen_ints = INTS_API;  /* what choose_layout found */
static int chosen_seqs = 0;         /* 1: list and tuple item arrays are read directly */
static int ints = INTS_API, seqs = 0; /* in use: the chosen ones, or the API's (_read_layouts) */

/* A plain int of up to two digits (below 2**60: every address and length in practice) read
 * straight from its digits.  Returns 0 where it cannot tell (the caller converts). */
static inline int small_int_u64(PyObject *v, int layout, uint64_t *out)
{
    const int_view *l = (const int_view *)(void *)v;
    size_t ndigits;
    if (layout == INTS_TAG) {
        if ((l->word & 3) == 2)
            return 0;
        ndigits = (size_t)l->word >> 3;
    } else if (layout == INTS_SIZE) {
        if (l->word < 0)
            return 0;
        ndigits = (size_t)l->word;
    } else {
        return 0;
    }
    if (ndigits == 0) {
        *out = 0;
        return 1;
    }
    if (ndigits == 1) {
        *out = l->digit[0];
        return 1;
    }
    if (ndigits == 2) {
        *out = (uint64_t)l->digit[0] | (uint64_t)l->digit[1] << DIGIT_BITS;
        return 1;
    }
    return 0;
}

/* The item array of what PySequence_Fast returned (a list or a tuple), or NULL where items must be
 * fetched through the API. */
static inline PyObject *const *item_array(PyObject *seq, int direct)
{
    if (!direct)
        return NULL;
    return PyList_Check(seq) ? ((const list_view *)(void *)seq)->items : ((const tuple_view *)(void *)seq)->items;
}

/* Whether small_int_u64 reads `value` as the API does: as `value` itself, or not at all where the
 * value has more than two digits or is negative.  -1 with an exception set if no int was made. */
static int int_agrees(long long value, int layout)
{
    PyObject *v = PyLong_FromLongLong(value);
    if (v == NULL)
        return -1;
    uint64_t got = 0;
    int read = small_int_u64(v, layout, &got);
    Py_DECREF(v);
    int expected = value >= 0 && value < (1LL << (2 * DIGIT_BITS));
    return read == expected && (!read || got == (uint64_t)value);
}

/* Whether item_array finds the items, and the size field the length, of a list and a tuple of
 * `n` objects; -1 with an exception set if they could not be made. */
static int sequences_agree(PyObject *objects[], Py_ssize_t n)
{
    PyObject *list = PyList_New(0), *tuple = NULL;
    int agree = -1;
    if (list == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++)
        if (PyList_Append(list, objects[i]) < 0)
            goto done;
    tuple = PyList_AsTuple(list);
    if (tuple == NULL)
        goto done;
    agree = ((const list_view *)(void *)list)->size == n && ((const tuple_view *)(void *)tuple)->size == n;
    PyObject *const *in_list = item_array(list, 1), *const *in_tuple = item_array(tuple, 1);
    for (Py_ssize_t i = 0; agree && i < n; i++)
        agree = in_list[i] == objects[i] && in_tuple[i] == objects[i] && PyList_GetItem(list, i) == objects[i];
done:
    Py_XDECREF(tuple);
    Py_DECREF(list);
    return agree;
}

/* chosen_ints and chosen_seqs for the running interpreter: from its version (Py_GetVersion, the
 * limited API's way that works on 3.10), kept only where reading sample objects agrees with the
 * API.  0, or -1 with an exception set. */
static int choose_layout(void)
{
    int major = 0, minor = 0, layout;
    if (sizeof(void *) != 8 || sscanf(Py_GetVersion(), "%d.%d", &major, &minor) != 2 || major != 3)
        return 0;
    if (minor == 10 || minor == 11)
        layout = INTS_SIZE;
    else if (minor >= 12 && minor <= 14)
        layout = INTS_TAG;
    else
        return 0;
    static const long long probes[] = {0, 1, 5, 255, 256, (1LL << 30) - 1, 1LL << 30, (1LL << 30) + 7,
                                       0x7f3a12345678LL, (1LL << 60) - 1, 1LL << 60, LLONG_MAX,
                                       -1, -5, -(1LL << 30), -(1LL << 40), LLONG_MIN};
    enum { NPROBES = sizeof(probes) / sizeof(probes[0]) };
    int agree = 1;
    for (size_t k = 0; agree == 1 && k < NPROBES; k++)
        agree = int_agrees(probes[k], layout);
    if (agree < 0)
        return -1;
    if (!agree)
        return 0;
    PyObject *objects[NPROBES] = {NULL};
    for (size_t k = 0; agree == 1 && k < NPROBES; k++)
        if ((objects[k] = PyLong_FromLongLong(probes[k])) == NULL)
            agree = -1;
    if (agree == 1)
        agree = sequences_agree(objects, NPROBES);
    for (size_t k = 0; k < NPROBES; k++)
        Py_XDECREF(objects[k]);
    if (agree < 0)
        return -1;
    chosen_ints = layout;
    chosen_seqs = agree;
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
 * *overflow set if it reached 2**64; -1 with an exception set on bad input.  Inlined once per
 * combination of layouts that pack3 dispatches to, so that the loop of the common case tests
 * neither; the sum is kept in locals, which stores through `row` cannot alias. */
static inline __attribute__((always_inline)) int pack_row(PyObject *seq, int list, Py_ssize_t n, int direct,
                                                          int layout, uint64_t *row, uint64_t *total_out,
                                                          int *overflow_out)
{
    PyObject *const *items = item_array(seq, direct);
    const int is_list = PyList_Check(seq);
    uint64_t sum = 0;
    int over_flag = 0;
    uint64_t *const total = &sum;
    int *const overflow = &over_flag;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = items ? items[i] : is_list ? PyList_GetItem(seq, i) : PyTuple_GetItem(seq, i);
        if (PyLong_CheckExact(v)) { /* the common case: a plain int below 2**63 */
            if (small_int_u64(v, layout, &row[i])) {
                continue_total(list, row[i], total, overflow);
                continue;
            }
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
    *total_out = sum;
    *overflow_out = over_flag;
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
        int rc;
        if (seqs && ints == INTS_SIZE)
            rc = pack_row(seq[k], k, n, 1, INTS_SIZE, row, sum, over);
        else if (seqs && ints == INTS_TAG)
            rc = pack_row(seq[k], k, n, 1, INTS_TAG, row, sum, over);
        else
            rc = pack_row(seq[k], k, n, seqs, ints, row, sum, over);
        if (rc < 0)
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

/* _read_layouts(flag) -> bool: whether items and ints are read through the known layouts; False
 * sends everything through the API, True restores what was chosen at import.  Returns the
 * previous setting.  For tests that compare both paths. */
static PyObject *read_layouts(PyObject *self, PyObject *flag)
{
    int on = PyObject_IsTrue(flag);
    if (on < 0)
        return NULL;
    int was = ints != INTS_API || seqs;
    ints = on ? chosen_ints : INTS_API;
    seqs = on ? chosen_seqs : 0;
    return PyBool_FromLong(was);
}

static PyMethodDef METHODS[] = {
    {"pack3", pack3, METH_VARARGS,
     "pack3(buffers, peer_addresses, lengths) -> (bytes local|remote|lengths as u64, n, total bytes)"},
    {"_read_layouts", read_layouts, METH_O,
     "_read_layouts(flag) -> previous flag: read items and ints through the known layouts (True) or the API"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "flagcx_mc._argpack",
                                    "Transfer-call argument packing (lists of ints to u64 arrays).", -1, METHODS,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__argpack(void)
{
    static const char *const INTS[] = {"api", "size", "tag"};
    if (choose_layout() < 0)
        return NULL;
    ints = chosen_ints;
    seqs = chosen_seqs;
    PyObject *module = PyModule_Create(&MODULE);
    if (module == NULL)
        return NULL;
    /* INT_LAYOUT: how plain ints are read ("api": through the C API only); DIRECT_ITEMS: whether
     * list and tuple items are read from their arrays. */
    if (PyModule_AddStringConstant(module, "INT_LAYOUT", INTS[chosen_ints]) < 0 ||
        PyModule_AddIntConstant(module, "DIRECT_ITEMS", chosen_seqs) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
