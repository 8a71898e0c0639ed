/* Copies that write around the caches, and small frames joined in one call:
 * rlcomm.comm.transports._stream_copy.
 *
 * copy(dst, src, n) copies n bytes between two non-overlapping buffers given by address,
 * with the GIL released. On x86-64 the destination is written with non-temporal stores
 * (SSE2 movntdq: the data goes to memory without reading the destination's cache lines
 * first, and without evicting what the caches hold). bulk_copy.py uses it for large
 * copies into shared memory, where reading each destination line before writing it
 * would double the memory traffic; memcpy only switches to such stores for copies of a
 * few hundred MiB (docs/performance.md has the figures). Elsewhere (or for overlapping
 * ranges) it is memmove.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
#define RLCOMM_STREAM 1
#endif

static void stream_copy(char *dst, const char *src, size_t n)
{
#ifdef RLCOMM_STREAM
    /* Align the destination to a cache line; the head goes by memcpy. */
    size_t head = (64 - ((uintptr_t)dst & 63)) & 63;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t lines = n / 64;
    for (size_t i = 0; i < lines; i++) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)(dst), a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
        dst += 64;
        src += 64;
    }
    _mm_sfence(); /* the stores are visible before anyone is told of them */
    memcpy(dst, src, n - lines * 64);
#else
    memcpy(dst, src, n);
#endif
}

static PyObject *copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "copy(dst, src, n) takes 3 integers");
        return NULL;
    }
    void *dst = PyLong_AsVoidPtr(args[0]);
    void *src = PyLong_AsVoidPtr(args[1]);
    size_t n = PyLong_AsSize_t(args[2]);
    if (PyErr_Occurred())
        return NULL;
    uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;
    int overlap = d < s + n && s < d + n;
    Py_BEGIN_ALLOW_THREADS
    if (overlap)
        memmove(dst, src, n);
    else
        stream_copy((char *)dst, (const char *)src, n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* joined(head, src, n, [src2, n2, ...]): a new bytes object of head followed by the n
 * bytes at address src (then the n2 at src2, ...). A small message's frame is its cached
 * opening and its tensors' bytes: one call here instead of ctypes.string_at and a
 * concatenation for each (ctypes' call alone costs about 0.3 us, a tenth of such a
 * send). */
static PyObject *joined(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs < 3 || nargs % 2 == 0 || !PyBytes_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError,
                        "joined(head, src, n, ...) takes bytes and pairs of integers");
        return NULL;
    }
    Py_ssize_t h = PyBytes_GET_SIZE(args[0]);
    Py_ssize_t total = h;
    for (Py_ssize_t i = 2; i < nargs; i += 2) {
        Py_ssize_t n = PyLong_AsSsize_t(args[i]);
        if (n == -1 && PyErr_Occurred())
            return NULL;
        if (n < 0) {
            PyErr_SetString(PyExc_ValueError, "joined: n must be >= 0");
            return NULL;
        }
        if (n > PY_SSIZE_T_MAX - total) {
            PyErr_SetString(PyExc_OverflowError, "joined: the result is too large");
            return NULL;
        }
        total += n;
    }
    /* Every address is read before anything is allocated: a bad one raises here. */
    for (Py_ssize_t i = 1; i < nargs; i += 2) {
        if (PyLong_AsVoidPtr(args[i]) == NULL && PyErr_Occurred())
            return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL)
        return NULL;
    char *dst = PyBytes_AS_STRING(out);
    memcpy(dst, PyBytes_AS_STRING(args[0]), (size_t)h);
    dst += h;
    for (Py_ssize_t i = 1; i < nargs; i += 2) {
        Py_ssize_t n = PyLong_AsSsize_t(args[i + 1]);
        memcpy(dst, PyLong_AsVoidPtr(args[i]), (size_t)n);
        dst += n;
    }
    return out;
}

static PyMethodDef methods[] = {
    {"copy", (PyCFunction)(void (*)(void))copy, METH_FASTCALL,
     "copy(dst, src, n): copy n bytes from address src to address dst (non-temporal "
     "stores where the CPU has them), the GIL released."},
    {"joined", (PyCFunction)(void (*)(void))joined, METH_FASTCALL,
     "joined(head, src, n, ...): head (bytes) followed by the n bytes at address src "
     "(and at each further address its count of bytes), as "
     "one new bytes object."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_stream_copy",
    "Copies that write around the caches (see the C source).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__stream_copy(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "STREAMS",
#ifdef RLCOMM_STREAM
                                             1
#else
                                             0
#endif
                                             ) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
