/* Copies that write around the caches, small frames joined in one call, and a small
 * frame put into (or taken from) a shared-memory ring: rlcomm.comm.transports._stream_copy.
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

/* A shared-memory ring (rlcomm/comm/transports/shm_memory.py): a control block of
 * 64-bit words (head and tail byte counters, each written by one side; the reader's
 * "sleeping" flag) followed by the data bytes. A record is a 16-byte head (kind as
 * uint32, a segment id as uint32, nbytes as uint64) and, for a frame, its bytes. The
 * layout is given once by ring_layout(); shm.py keeps a Python path for where this
 * module is not built. x86-64 keeps stores in order (shm.py only runs there): the
 * compiler barrier keeps the head's store after the data's. */
static Py_ssize_t lay_head, lay_tail, lay_sleeping, lay_ctrl, lay_frame = -1;

#define RECORD_BYTES 16
#define BARRIER() __asm__ __volatile__("" ::: "memory")

static PyObject *ring_layout(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "ring_layout(head, tail, sleeping, ctrl_bytes, frame_kind) takes 5 integers");
        return NULL;
    }
    Py_ssize_t v[5];
    for (int i = 0; i < 5; i++) {
        v[i] = PyLong_AsSsize_t(args[i]);
        if (v[i] == -1 && PyErr_Occurred())
            return NULL;
    }
    /* Checked once all are read: each word against the control block's size (v[3]). */
    for (int i = 0; i < 5; i++) {
        if (v[i] < 0 || (i < 3 && (v[i] % 8 != 0 || v[i] + 8 > v[3]))) {
            PyErr_SetString(PyExc_ValueError, "ring_layout: a word outside the control block");
            return NULL;
        }
    }
    lay_head = v[0];
    lay_tail = v[1];
    lay_sleeping = v[2];
    lay_ctrl = v[3];
    lay_frame = v[4];
    Py_RETURN_NONE;
}

/* The ring at address base (control block, then ring_bytes of data), checked. */
static char *ring_of(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want,
                     Py_ssize_t *ring_bytes, const char *usage)
{
    if (nargs != want || lay_frame < 0) {
        PyErr_SetString(PyExc_TypeError, lay_frame < 0 ? "ring_layout() was not called" : usage);
        return NULL;
    }
    char *base = (char *)PyLong_AsVoidPtr(args[0]);
    *ring_bytes = PyLong_AsSsize_t(args[1]);
    if (PyErr_Occurred())
        return NULL;
    if (base == NULL || *ring_bytes < RECORD_BYTES) {
        PyErr_SetString(PyExc_ValueError, "ring: a null ring or one too small for a record");
        return NULL;
    }
    return base;
}

#define WORD(base, off) (*(volatile int64_t *)((base) + (off)))

/* ring_put(base, ring_bytes, frame): write a frame record and publish it, when the ring
 * has room for it before its end; returns the reader's sleeping flag (nonzero: it needs
 * a wake-up token), or -1 having written nothing (the caller goes the general way). One
 * call instead of a dozen Python operations on the ring's words and bytes, on every
 * small message's path. */
static PyObject *ring_put(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    Py_ssize_t ring;
    char *base = ring_of(args, nargs, 3, &ring, "ring_put(base, ring_bytes, frame)");
    if (base == NULL)
        return NULL;
    if (!PyBytes_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "ring_put: the frame must be bytes");
        return NULL;
    }
    Py_ssize_t n = PyBytes_GET_SIZE(args[2]);
    int64_t head = WORD(base, lay_head);
    int64_t tail = WORD(base, lay_tail);
    /* Counters that no writer of this ring would leave (the peer maps it too): never an
     * address from them; the general way says what is wrong. */
    if (tail < 0 || head < tail || head - tail > ring)
        return PyLong_FromLong(-1);
    int64_t end = head % ring + RECORD_BYTES + n;
    if (n > ring || end > ring || head + RECORD_BYTES + n - tail > ring)
        return PyLong_FromLong(-1);
    char *at = base + lay_ctrl + end - n - RECORD_BYTES;
    uint32_t kind = (uint32_t)lay_frame, seg = 0;
    uint64_t size = (uint64_t)n;
    memcpy(at, &kind, 4);
    memcpy(at + 4, &seg, 4);
    memcpy(at + 8, &size, 8);
    memcpy(at + RECORD_BYTES, PyBytes_AS_STRING(args[2]), (size_t)n);
    BARRIER();
    WORD(base, lay_head) = head + RECORD_BYTES + n; /* published: the reader may take it */
    BARRIER();
    return PyLong_FromLong(WORD(base, lay_sleeping) != 0);
}

/* ring_take(base, ring_bytes): the next record's frame as bytes, taken (the tail moved
 * past it), when the ring holds the whole record before its end and it is a frame; else
 * None, having taken nothing (the caller reads it the general way). */
static PyObject *ring_take(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    Py_ssize_t ring;
    char *base = ring_of(args, nargs, 2, &ring, "ring_take(base, ring_bytes)");
    if (base == NULL)
        return NULL;
    int64_t tail = WORD(base, lay_tail);
    int64_t avail = WORD(base, lay_head) - tail;
    BARRIER();
    int64_t pos = tail % ring;
    if (tail < 0 || avail < RECORD_BYTES || avail > ring || pos + RECORD_BYTES > ring)
        Py_RETURN_NONE; /* (counters no writer would leave: the general way reads them) */
    const char *at = base + lay_ctrl + pos;
    uint32_t kind;
    uint64_t n;
    memcpy(&kind, at, 4);
    memcpy(&n, at + 8, 8);
    if (kind != (uint32_t)lay_frame || n > (uint64_t)(avail - RECORD_BYTES)
        || (uint64_t)(pos + RECORD_BYTES) + n > (uint64_t)ring)
        Py_RETURN_NONE;
    PyObject *frame = PyBytes_FromStringAndSize(at + RECORD_BYTES, (Py_ssize_t)n);
    if (frame == NULL)
        return NULL;
    BARRIER();
    WORD(base, lay_tail) = tail + RECORD_BYTES + (int64_t)n;
    return frame;
}

static PyMethodDef methods[] = {
    {"copy", (PyCFunction)(void (*)(void))copy, METH_FASTCALL,
     "copy(dst, src, n): copy n bytes from address src to address dst (non-temporal "
     "stores where the CPU has them), the GIL released."},
    {"joined", (PyCFunction)(void (*)(void))joined, METH_FASTCALL,
     "joined(head, src, n, ...): head (bytes) followed by the n bytes at address src "
     "(and at each further address its count of bytes), as "
     "one new bytes object."},
    {"ring_layout", (PyCFunction)(void (*)(void))ring_layout, METH_FASTCALL,
     "ring_layout(head, tail, sleeping, ctrl_bytes, frame_kind): where a shared-memory "
     "ring keeps its words and data, and a frame record's kind."},
    {"ring_put", (PyCFunction)(void (*)(void))ring_put, METH_FASTCALL,
     "ring_put(base, ring_bytes, frame): write and publish a frame record when it fits "
     "before the ring's end; the reader's sleeping flag, or -1 having written nothing."},
    {"ring_take", (PyCFunction)(void (*)(void))ring_take, METH_FASTCALL,
     "ring_take(base, ring_bytes): the next frame record's bytes, taken, when it is whole "
     "before the ring's end; else None."},
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
