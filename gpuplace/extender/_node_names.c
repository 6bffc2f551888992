/* gpuplace.extender._node_names: a set of node names matched against a JSON array of strings in C.

   filter receives ~10,000 node names as a JSON array and usually they are exactly the
   cluster's nodes, in some order. Parsing them into str objects and looking each up
   costs ~3 ms in the sidecar; this compares the array's bytes with the set directly:
   one pass, one hash and one probe per element, no Python object per name.

   NameSet(names, seed) keeps the UTF-8 of each distinct name back to back, with an
   open-addressing table of (hash tag, index); hashes are keyed by `seed` (random per
   process). `matches(data, start, end)` is True iff data[start:end] is a JSON array
   (JSON whitespace allowed) of strings without escapes or control bytes, naming each
   name of the set exactly once and nothing else. Anything else, including arrays it
   does not read (escapes), is False: the caller then parses the array as usual.
   O(bytes) per call; memory ~ 2 x the names' bytes + 28 bytes per name. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    PyObject_HEAD
    char *bytes;        /* every name's UTF-8, back to back */
    uint32_t *offsets;  /* name i is bytes[offsets[i]:offsets[i+1]] */
    uint32_t *seen;     /* per name: the last call of matches that met it */
    uint64_t *slots;    /* open addressing: (hash tag << 32) | (name + 1); 0 is empty */
    size_t mask;
    uint32_t count;
    uint32_t call;
    uint64_t seed;
} NameSet;

static inline uint64_t hash_bytes(const char *p, size_t n, uint64_t seed) {
    const uint64_t k = 0x9E3779B97F4A7C15ULL;
    uint64_t h = seed ^ (n * k);
    while (n >= 8) { uint64_t w; memcpy(&w, p, 8); h = (h ^ w) * k; h ^= h >> 31; p += 8; n -= 8; }
    if (n) { uint64_t w = 0; memcpy(&w, p, n); h = (h ^ w) * k; }
    h ^= h >> 33; h *= 0xff51afd7ed558ccdULL; h ^= h >> 33;
    return h;
}

/* The slot holding name bytes p[0:n], or the empty slot where it would go. */
static inline uint64_t *find(NameSet *self, const char *p, size_t n, uint64_t h) {
    uint64_t tag = h >> 32;
    size_t i = (size_t)h & self->mask;
    for (;;) {
        uint64_t *slot = &self->slots[i];
        uint64_t v = *slot;
        if (v == 0) return slot;
        if ((v >> 32) == tag) {
            uint32_t e = (uint32_t)v - 1, a = self->offsets[e];
            if (self->offsets[e + 1] - a == n && memcmp(self->bytes + a, p, n) == 0) return slot;
        }
        i = (i + 1) & self->mask;
    }
}

static void NameSet_dealloc(NameSet *self) {
    PyMem_Free(self->bytes); PyMem_Free(self->offsets); PyMem_Free(self->seen); PyMem_Free(self->slots);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int NameSet_init(NameSet *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"names", "seed", NULL};
    PyObject *names; unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|K", kwlist, &names, &seed)) return -1;
    PyObject *seq = PySequence_Fast(names, "names must be iterable");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), total = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t len;
        if (!PyUnicode_Check(items[i])) { PyErr_SetString(PyExc_TypeError, "names must be str"); goto fail; }
        if (!PyUnicode_AsUTF8AndSize(items[i], &len)) goto fail;
        total += len;
    }
    if (n >= UINT32_MAX / 2 || total >= UINT32_MAX) { PyErr_SetString(PyExc_OverflowError, "too many names"); goto fail; }
    size_t cap = 8; while (cap < (size_t)n + (size_t)n / 2 + 1) cap <<= 1;
    char *bytes = PyMem_Malloc(total ? (size_t)total : 1);
    uint32_t *offsets = PyMem_Malloc(((size_t)n + 1) * sizeof(uint32_t));
    uint32_t *seen = PyMem_Calloc((size_t)n + 1, sizeof(uint32_t));
    uint64_t *slots = PyMem_Calloc(cap, sizeof(uint64_t));
    if (!bytes || !offsets || !seen || !slots) {
        PyMem_Free(bytes); PyMem_Free(offsets); PyMem_Free(seen); PyMem_Free(slots);
        PyErr_NoMemory(); goto fail;
    }
    PyMem_Free(self->bytes); PyMem_Free(self->offsets); PyMem_Free(self->seen); PyMem_Free(self->slots);
    self->bytes = bytes; self->offsets = offsets; self->seen = seen; self->slots = slots;
    self->mask = cap - 1; self->count = 0; self->call = 0; self->seed = seed;
    uint32_t at = 0;
    offsets[0] = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t len; const char *utf8 = PyUnicode_AsUTF8AndSize(items[i], &len);
        uint64_t h = hash_bytes(utf8, (size_t)len, seed);
        memcpy(bytes + at, utf8, (size_t)len);
        offsets[self->count + 1] = at + (uint32_t)len;
        uint64_t *slot = find(self, bytes + at, (size_t)len, h);
        if (*slot) continue; /* a repeat */
        *slot = ((h >> 32) << 32) | (uint64_t)(self->count + 1);
        self->count++; at += (uint32_t)len;
    }
    Py_DECREF(seq);
    return 0;
fail:
    Py_DECREF(seq);
    return -1;
}

static Py_ssize_t NameSet_len(NameSet *self) { return self->count; }

/* Whether p[0:n] has no backslash and no byte below 0x20 (no JSON escape). */
static inline int plain(const char *p, size_t n) {
    const uint64_t ones = 0x0101010101010101ULL, highs = 0x8080808080808080ULL;
    uint64_t bad = 0;
    while (n >= 8) {
        uint64_t w, x; memcpy(&w, p, 8);
        x = w ^ (ones * '\\');
        bad |= ((w - ones * 0x20) & ~w) | ((x - ones) & ~x);
        p += 8; n -= 8;
    }
    bad &= highs;
    while (n--) { unsigned char c = (unsigned char)*p++; bad |= (c == '\\' || c < 0x20); }
    return bad == 0;
}

static inline const char *skip_ws(const char *p, const char *end) {
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) p++;
    return p;
}

static PyObject *NameSet_matches(NameSet *self, PyObject *args) {
    Py_buffer view; Py_ssize_t start, end;
    if (!PyArg_ParseTuple(args, "y*nn", &view, &start, &end)) return NULL;
    int ok = 0;
    if (start < 0 || end > view.len || start > end || self->slots == NULL) goto done;
    if (++self->call == 0) { memset(self->seen, 0, ((size_t)self->count + 1) * sizeof(uint32_t)); self->call = 1; }
    const uint32_t call = self->call;
    const char *p = (const char *)view.buf + start, *stop = (const char *)view.buf + end;
    uint32_t found = 0;
    p = skip_ws(p, stop);
    if (p >= stop || *p != '[') goto done;
    p = skip_ws(p + 1, stop);
    if (p < stop && *p == ']') p++;
    else for (;;) {
        if (p >= stop || *p != '"') goto done;
        const char *name = ++p;
        p = memchr(p, '"', (size_t)(stop - p));
        if (p == NULL) goto done;
        size_t n = (size_t)(p - name);
        if (!plain(name, n)) goto done;  /* an escape or a control byte */
        uint64_t v = *find(self, name, n, hash_bytes(name, n, self->seed));
        if (v == 0) goto done;                     /* not one of the names */
        uint32_t e = (uint32_t)v - 1;
        if (self->seen[e] == call) goto done;      /* listed twice */
        self->seen[e] = call; found++;
        p = skip_ws(p + 1, stop);
        if (p < stop && *p == ',') { p = skip_ws(p + 1, stop); continue; }
        if (p < stop && *p == ']') { p++; break; }
        goto done;
    }
    ok = skip_ws(p, stop) == stop && found == self->count;
done:
    PyBuffer_Release(&view);
    return PyBool_FromLong(ok);
}

static PyMethodDef NameSet_methods[] = {
    {"matches", (PyCFunction)NameSet_matches, METH_VARARGS, "matches(data, start, end) -> bool: whether data[start:end] is a JSON array naming each name once"},
    {NULL, NULL, 0, NULL}
};
static PySequenceMethods NameSet_as_sequence = { .sq_length = (lenfunc)NameSet_len };

static PyTypeObject NameSetType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpuplace.extender._node_names.NameSet",
    .tp_basicsize = sizeof(NameSet),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)NameSet_init,
    .tp_dealloc = (destructor)NameSet_dealloc,
    .tp_methods = NameSet_methods,
    .tp_as_sequence = &NameSet_as_sequence,
};

static struct PyModuleDef module = { PyModuleDef_HEAD_INIT, .m_name = "_node_names", .m_size = -1 };

PyMODINIT_FUNC PyInit__node_names(void) {
    if (PyType_Ready(&NameSetType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&NameSetType);
    if (PyModule_AddObject(m, "NameSet", (PyObject *)&NameSetType) < 0) { Py_DECREF(&NameSetType); Py_DECREF(m); return NULL; }
    return m;
}
