/* gpuplace.extender._priorities: prioritize's answer, ranked and encoded as JSON in one pass.

   prioritize answers ~10,000 nodes with kube-scheduler's 0-10 scores: the policy's best
   get 10, the others are spread linearly over 0-9 between the lowest score and the best
   (gpuplace.placement.choosing.ranked_found), and the nodes scoring 0 are left out
   (gpuplace.extender.wire.priorities_json). In Python that is a list of ints and a list of
   strings to join, ~1.6 ms at 10,000 nodes on a quiet core. It runs right after filter
   has sent its answer, while kube-scheduler reads that, and prioritize waits for it
   when kube-scheduler is quicker. This does both with no Python object per node.

   ranked_json(hosts, chosen, ten) -> bytes | None. `hosts` a list of str, `chosen` a
   list of the same length: each host's choice (an object with a float `score`) or None
   (no choice: 0); `ten` the best score (10). The bytes are exactly what the Python path
   writes. None when a score is not a finite float, or a host is not plain (only
   A-Z a-z 0-9 . _ : -, as node names are): the caller then takes the Python path.
   O(n); the scores are read once, into a buffer. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>

static PyObject *SCORE; /* "score", interned */

static int plain(const char *p, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)p[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == ':' || c == '-'))
            return 0;
    }
    return 1;
}

/* Each host's score into values[i] (NAN for no choice); the range of the others into
   *top and *low (*any false when none); an upper bound of the answer's size into
   *size. 1 on success, 0 when the Python path must answer, -1 with an exception. */
static int read_scores(PyObject *hosts, PyObject *chosen, double *values, double *top,
                       double *low, int *any, size_t *size) {
    Py_ssize_t n = PyList_GET_SIZE(hosts);
    *any = 0;
    *size = 2;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *host = PyList_GET_ITEM(hosts, i);
        PyObject *choice = PyList_GET_ITEM(chosen, i);
        if (choice == Py_None) {
            values[i] = NAN;
            continue;
        }
        if (!PyUnicode_CheckExact(host) || !PyUnicode_IS_ASCII(host))
            return 0;
        Py_ssize_t length = PyUnicode_GET_LENGTH(host);
        if (!plain((const char *)PyUnicode_DATA(host), length))
            return 0;
        PyObject *score = PyObject_GetAttr(choice, SCORE);
        if (score == NULL)
            return -1;
        int is_float = PyFloat_CheckExact(score);
        double v = is_float ? PyFloat_AS_DOUBLE(score) : 0.0;
        Py_DECREF(score);
        if (!is_float || !isfinite(v))
            return 0;
        values[i] = v;
        if (!*any) {
            *top = *low = v;
            *any = 1;
        } else if (v > *top) {
            *top = v;
        } else if (v < *low) {
            *low = v;
        }
        /* {"Host":"<host>","Score":NN}, */
        *size += (size_t)length + 24;
    }
    return 1;
}

static PyObject *ranked_json(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *hosts, *chosen;
    long ten;
    if (!PyArg_ParseTuple(args, "O!O!l", &PyList_Type, &hosts, &PyList_Type, &chosen, &ten))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(hosts);
    if (PyList_GET_SIZE(chosen) != n) {
        PyErr_Format(PyExc_ValueError, "%zd hosts but %zd choices", n, PyList_GET_SIZE(chosen));
        return NULL;
    }
    if (ten < 1 || ten > 99) {
        PyErr_SetString(PyExc_ValueError, "the best score must be 1-99");
        return NULL;
    }
    double *values = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(double));
    if (values == NULL)
        return PyErr_NoMemory();
    double top = 0.0, low = 0.0;
    int any;
    size_t size;
    int read = read_scores(hosts, chosen, values, &top, &low, &any, &size);
    if (read <= 0) {
        PyMem_Free(values);
        if (read < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    /* As Python computes it: (ten - 1) / (top - low); 0.0 when every score is the top
       or the span cannot be scaled, and then only the top scores. */
    double scale = top > low ? (double)(ten - 1) / (top - low) : 0.0;
    if (!isfinite(top - low) || !isfinite(scale))
        scale = 0.0;

    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)size);
    if (out == NULL) {
        PyMem_Free(values);
        return NULL;
    }
    char *start = PyBytes_AS_STRING(out);
    char *w = start;
    *w++ = '[';
    for (Py_ssize_t i = 0; any && i < n; i++) {
        double v = values[i];
        if (isnan(v))
            continue; /* no choice: 0 */
        long score = v == top ? ten : scale == 0.0 ? 0 : (long)(scale * (v - low));
        if (score == 0)
            continue;
        PyObject *host = PyList_GET_ITEM(hosts, i);
        Py_ssize_t length = PyUnicode_GET_LENGTH(host);
        if (w - start > 1)
            *w++ = ',';
        memcpy(w, "{\"Host\":\"", 9);
        w += 9;
        memcpy(w, PyUnicode_DATA(host), (size_t)length);
        w += length;
        memcpy(w, "\",\"Score\":", 10);
        w += 10;
        if (score >= 10)
            *w++ = (char)('0' + score / 10);
        *w++ = (char)('0' + score % 10);
        *w++ = '}';
    }
    *w++ = ']';
    PyMem_Free(values);
    if (_PyBytes_Resize(&out, w - start) < 0)
        return NULL;
    return out;
}

static PyMethodDef methods[] = {
    {"ranked_json", ranked_json, METH_VARARGS,
     "ranked_json(hosts, chosen, ten) -> bytes | None: prioritize's answer (see the module)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "gpuplace.extender._priorities",
    "prioritize's answer, ranked and encoded as JSON in one pass (see the C source).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__priorities(void) {
    SCORE = PyUnicode_InternFromString("score");
    if (SCORE == NULL)
        return NULL;
    return PyModule_Create(&module);
}
