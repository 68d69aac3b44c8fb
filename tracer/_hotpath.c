/* The tracer's hot path in C: what `with tracer.start_as_current_span(name, attributes=...)`
 * runs in the common case (default flags, the current context as parent, a parent that is
 * a plain crosstrace span or none).
 *
 * Python (tracer/provider.py, tracer/span.py) keeps the whole implementation: each function
 * here hands any other case to it, unchanged, before touching anything, and Python alone
 * runs where this module is not built (no compiler) or CROSSTRACE_PURE_PYTHON is set. What
 * this saves is the interpreter's frames and attribute stores, not work: the steps are
 * those of ScopedSpan.__enter__/__exit__ and Tracer.start_as_current_span, in their order.
 *
 * Span ids come from a xoshiro256** generator seeded from os.urandom, and seeded again in
 * a forked child (compiled.py), as Python's `random` module is.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

/* ---- the span's fields (tracer/span.py names them) ---------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *trace_id, *span_id, *parent_id, *name, *kind, *start, *end_ns, *thread;
    PyObject *attributes, *extras, *sink, *token;
    PyObject *weakrefs;
} SpanFields;

static PyTypeObject SpanFieldsType, QueueFieldsType, TracerFieldsType;

/* The three types here are object fields and nothing else (their member tables list them):
 * what the garbage collector visits and clears, and what deallocation frees, read off the
 * table of the C type, whichever Python subclass the object is. */
#define FIELD_AT(self, m) (*(PyObject **)((char *)(self) + (m)->offset))

static PyMemberDef *fields_of(PyObject *self) {
    PyTypeObject *type = Py_TYPE(self);
    while (type->tp_base != NULL && type->tp_base != &PyBaseObject_Type)   /* the C type below the subclasses */
        type = type->tp_base;
    return type->tp_members;
}

static int fields_traverse(PyObject *self, visitproc visit, void *arg) {
    for (PyMemberDef *m = fields_of(self); m->name != NULL; m++)
        if (m->type == T_OBJECT_EX)
            Py_VISIT(FIELD_AT(self, m));
    return 0;
}

static int fields_clear(PyObject *self) {
    for (PyMemberDef *m = fields_of(self); m->name != NULL; m++)
        if (m->type == T_OBJECT_EX)
            Py_CLEAR(FIELD_AT(self, m));
    return 0;
}

static void fields_dealloc(PyObject *self) {
    PyObject_GC_UnTrack(self);
    Py_ssize_t weakrefs = Py_TYPE(self)->tp_weaklistoffset;
    if (weakrefs && *(PyObject **)((char *)self + weakrefs) != NULL)
        PyObject_ClearWeakRefs(self);
    fields_clear(self);
    Py_TYPE(self)->tp_free(self);
}

#define FIELD(name, member) {name, T_OBJECT_EX, offsetof(SpanFields, member), 0, NULL}
static PyMemberDef span_members[] = {
    FIELD("trace_id", trace_id), FIELD("span_id", span_id), FIELD("parent_id", parent_id),
    FIELD("name", name), FIELD("kind", kind), FIELD("start", start), FIELD("end_ns", end_ns),
    FIELD("thread", thread), FIELD("attributes", attributes), FIELD("extras", extras),
    FIELD("_sink", sink), FIELD("_token", token),
    {"__weakref__", T_OBJECT, offsetof(SpanFields, weakrefs), READONLY, NULL}, {NULL}};

/* ---- the export queue's fields that the hot path reads (tracer/exporter.py) ------------ */

typedef struct {
    PyObject_HEAD
    PyObject *now, *queue, *max_entries, *wake_at, *wake, *dropped;
} QueueFields;

#define QFIELD(name) {#name, T_OBJECT_EX, offsetof(QueueFields, name), 0, NULL}
static PyMemberDef queue_members[] = {
    QFIELD(now), QFIELD(queue), QFIELD(max_entries), QFIELD(wake_at), QFIELD(wake), QFIELD(dropped), {NULL}};

static PyTypeObject QueueFieldsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "crosstrace.tracer._hotpath.QueueFields",
    .tp_doc = "The export queue's fields that the hot path reads (tracer/exporter.py).",
    .tp_basicsize = sizeof(QueueFields),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_dealloc = fields_dealloc,
    .tp_traverse = fields_traverse,
    .tp_clear = fields_clear,
    .tp_members = queue_members,
};

static PyObject *s_now, *s_queue, *s_max_entries, *s_wake_at, *s_wake, *s_dropped, *s_extend;

/* The export queue's field, a new reference: from the struct where the queue is of this
 * type and has it, else as Python reads it (another object; the AttributeError of one unset). */
static PyObject *sink_get(PyObject *sink, size_t offset, PyObject *name) {
    if (PyObject_TypeCheck(sink, &QueueFieldsType)) {
        PyObject *value = *(PyObject **)((char *)sink + offset);
        if (value != NULL)
            return Py_NewRef(value);
    }
    return PyObject_GetAttr(sink, name);
}
#define SINK(sink, field) sink_get(sink, offsetof(QueueFields, field), s_##field)

/* ---- what provider.py hands over (configure) ----------------------------------------- */

static PyObject *context_var;      /* OpenTelemetry's runtime ContextVar */
static PyObject *span_key;         /* the Context key of the current span */
static PyObject *context_type;     /* opentelemetry.context.Context */
static PyTypeObject *scoped_type;  /* provider.ScopedSpan */
static PyObject *enter_py, *exit_py, *start_py;   /* the Python implementations */
static PyObject *task_lane;        /* provider._task_lane */
static PyObject *could_not_leave;  /* logs a context left elsewhere, as detach_quietly does */
static PyObject *running_loop;     /* asyncio._get_running_loop */
static PyObject *internal_kind;    /* SpanKind.INTERNAL */
static PyObject *kinds;            /* ((kind given, the span's kind), ...): each SpanKind and crosstrace Kind */
static PyObject *kind_key;         /* the attribute that names a crosstrace kind */
static PyObject *kind_by_name;     /* its values ("compute", ...) and their kinds */

static PyObject *kw_names[9];      /* start_as_current_span's parameters, in order */

static PyObject *configure(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"context_var", "span_key", "context_type", "scoped_type", "enter", "exit",
                            "start", "task_lane", "could_not_leave", "running_loop", "internal_kind",
                            "kinds", "kind_key", "kind_by_name", NULL};
    PyObject *v[14];
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "$OUOO!OOOOOOOO!UO!:configure", names, &v[0], &v[1], &v[2],
                                     &PyType_Type, &v[3], &v[4], &v[5], &v[6], &v[7], &v[8], &v[9], &v[10],
                                     &PyTuple_Type, &v[11], &v[12], &PyDict_Type, &v[13]))
        return NULL;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(v[11]); i++) {
        PyObject *pair = PyTuple_GET_ITEM(v[11], i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "configure: kinds must be (kind given, span kind) pairs");
            return NULL;
        }
    }
    PyObject **slots[14] = {&context_var, &span_key, &context_type, (PyObject **)&scoped_type, &enter_py,
                            &exit_py, &start_py, &task_lane, &could_not_leave, &running_loop, &internal_kind,
                            &kinds, &kind_key, &kind_by_name};
    for (int i = 0; i < 14; i++) {
        Py_INCREF(v[i]);
        Py_XSETREF(*slots[i], v[i]);
    }
    Py_RETURN_NONE;
}

/* ---- span ids: xoshiro256** ---------------------------------------------------------- */

static uint64_t rng[4];

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t next64(void) {
    uint64_t result = rotl(rng[1] * 5, 7) * 9, t = rng[1] << 17;
    rng[2] ^= rng[0]; rng[3] ^= rng[1]; rng[1] ^= rng[2]; rng[0] ^= rng[3];
    rng[2] ^= t; rng[3] = rotl(rng[3], 45);
    return result;
}

static PyObject *seed(PyObject *module, PyObject *arg) {
    Py_buffer buf;
    if (PyObject_GetBuffer(arg, &buf, PyBUF_SIMPLE) < 0)
        return NULL;
    if (buf.len != sizeof rng) {
        PyBuffer_Release(&buf);
        return PyErr_Format(PyExc_ValueError, "seed: %zd bytes, not %zd", buf.len, (Py_ssize_t)sizeof rng);
    }
    memcpy(rng, buf.buf, sizeof rng);
    PyBuffer_Release(&buf);
    if (!(rng[0] | rng[1] | rng[2] | rng[3]))   /* the one state xoshiro cannot leave */
        rng[0] = 1;
    Py_RETURN_NONE;
}

static PyObject *new_span_id(void) {   /* 0 is the invalid id */
    uint64_t id;
    do id = next64(); while (!id);
    return PyLong_FromUnsignedLongLong(id);
}

static PyObject *new_trace_id(void) {
    uint64_t id[2];
    do { id[0] = next64(); id[1] = next64(); } while (!(id[0] | id[1]));
#if PY_VERSION_HEX >= 0x030D0000
    return PyLong_FromUnsignedNativeBytes(id, 16, Py_ASNATIVEBYTES_LITTLE_ENDIAN);
#else
    unsigned char bytes[16];   /* little endian, whatever the machine's order */
    for (int i = 0; i < 16; i++)
        bytes[i] = (unsigned char)(id[i / 8] >> (8 * (i % 8)));
    return _PyLong_FromByteArray(bytes, 16, 1, 0);
#endif
}

/* ---- Tracer.start_as_current_span ------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    PyObject *queue, *now;
} TracerFields;

static PyMemberDef tracer_members[] = {
    {"_queue", T_OBJECT_EX, offsetof(TracerFields, queue), 0, NULL},
    {"_now", T_OBJECT_EX, offsetof(TracerFields, now), 0, NULL}, {NULL}};

/* `func(self, *args)` with the keywords as they came: the Python implementation's turn. */
static PyObject *hand_over(PyObject *func, PyObject *self, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames) {
    Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
    PyObject *small[16], **all = total < 16 ? small : PyMem_New(PyObject *, total + 1);
    if (all == NULL)
        return PyErr_NoMemory();
    all[0] = self;
    memcpy(all + 1, args, total * sizeof(PyObject *));
    PyObject *result = PyObject_Vectorcall(func, all, nargs + 1, kwnames);
    if (all != small)
        PyMem_Free(all);
    return result;
}

static int is_default(PyObject *value, PyObject *default_value) {
    return value == NULL || value == default_value;
}

static PyObject *start_scoped(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *given[9] = {NULL};   /* name, context, kind, attributes, links, start_time, and 3 flags */
    if (nargs < 1 || nargs > 9 || scoped_type == NULL || ((TracerFields *)self)->queue == NULL)
        return hand_over(start_py, self, args, nargs, kwnames);
    for (Py_ssize_t i = 0; i < nargs; i++)
        given[i] = args[i];
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        int found = -1;
        for (int i = 0; i < 9 && found < 0; i++)   /* keywords in code are interned: one pass by identity */
            if (key == kw_names[i])
                found = i;
        for (int i = 0; i < 9 && found < 0; i++)
            if (PyUnicode_Compare(key, kw_names[i]) == 0)
                found = i;
        if (found < 0 || given[found] != NULL)   /* Python says what is wrong with the call */
            return hand_over(start_py, self, args, nargs, kwnames);
        given[found] = args[nargs + k];
    }
    if (given[0] == NULL || !is_default(given[1], Py_None)
            || !is_default(given[4], Py_None) || !is_default(given[5], Py_None) || !is_default(given[6], Py_True)
            || !is_default(given[7], Py_True) || !is_default(given[8], Py_True))
        return hand_over(start_py, self, args, nargs, kwnames);
    PyObject *kind = NULL;   /* the span's (held): the pair's object, or the name's, as Python takes it */
    if (!(is_default(given[2], internal_kind) || given[2] == Py_None)) {   /* (None: INTERNAL, as in Python) */
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kinds) && kind == NULL; i++)   /* enum members: by identity */
            if (PyTuple_GET_ITEM(PyTuple_GET_ITEM(kinds, i), 0) == given[2])
                kind = Py_NewRef(PyTuple_GET_ITEM(PyTuple_GET_ITEM(kinds, i), 1));
        if (kind == NULL)
            return hand_over(start_py, self, args, nargs, kwnames);
    }
    PyObject *attributes = given[3];
    if (attributes == NULL || attributes == Py_None || (PyDict_CheckExact(attributes) && !PyDict_GET_SIZE(attributes))) {
        attributes = Py_NewRef(Py_None);
    } else if (PyDict_CheckExact(attributes)) {
        PyObject *named = PyDict_GetItemWithError(attributes, kind_key);   /* borrowed */
        if (named != NULL) {   /* a kind by name, in the exact spelling: the span's kind, not an attribute */
            PyObject *by_name = PyUnicode_CheckExact(named) ? PyDict_GetItemWithError(kind_by_name, named) : NULL;
            Py_XSETREF(kind, Py_XNewRef(by_name));
        }
        if (PyErr_Occurred() || (named != NULL && kind == NULL)) {   /* (another spelling or value: Python's) */
            Py_XDECREF(kind);
            return PyErr_Occurred() ? NULL : hand_over(start_py, self, args, nargs, kwnames);
        }
        attributes = PyDict_Copy(attributes);
        if (attributes != NULL && named != NULL && PyDict_DelItem(attributes, kind_key) < 0)
            Py_CLEAR(attributes);
        if (attributes == NULL) {
            Py_XDECREF(kind);
            return NULL;
        }
    } else {
        Py_XDECREF(kind);
        return hand_over(start_py, self, args, nargs, kwnames);
    }
    PyObject *queue = Py_XNewRef(((TracerFields *)self)->queue);   /* (the copy above could run a finalizer) */
    if (queue == NULL) {
        Py_DECREF(attributes);
        Py_XDECREF(kind);
        return hand_over(start_py, self, args, nargs, kwnames);
    }
    SpanFields *span = (SpanFields *)scoped_type->tp_alloc(scoped_type, 0);
    PyObject *span_id = new_span_id();
    if (span == NULL || span_id == NULL) {
        Py_XDECREF(span); Py_XDECREF(span_id); Py_DECREF(attributes); Py_DECREF(queue); Py_XDECREF(kind);
        return NULL;
    }
    PyObject *zero = PyLong_FromLong(0);   /* a cached small int: no allocation */
    span->sink = queue;
    span->trace_id = Py_NewRef(zero);
    span->parent_id = Py_NewRef(zero);
    span->end_ns = Py_NewRef(zero);
    span->kind = kind ? kind : Py_NewRef(zero);
    Py_DECREF(zero);
    span->span_id = span_id;
    span->name = Py_NewRef(given[0]);
    span->extras = Py_NewRef(Py_None);
    span->attributes = attributes;
    return (PyObject *)span;
}

/* ---- ScopedSpan.__enter__ / __exit__ --------------------------------------------------- */

/* A span's field, a new reference, or the AttributeError Python raises where it is unset
 * (Python code run meanwhile, a finalizer say, can delete it). */
static PyObject *span_get(PyObject *op, PyObject *field, const char *name) {
    return field != NULL ? Py_NewRef(field) : PyObject_GetAttrString(op, name);
}

/* sink.now(), as Python calls it. */
static PyObject *sink_now(PyObject *op) {
    PyObject *sink = span_get(op, ((SpanFields *)op)->sink, "_sink");
    PyObject *now = sink ? SINK(sink, now) : NULL;
    PyObject *t = now ? PyObject_CallNoArgs(now) : NULL;
    Py_XDECREF(now);
    Py_XDECREF(sink);
    return t;
}

static PyObject *scoped_enter(PyObject *op, PyObject *unused) {
    SpanFields *self = (SpanFields *)op;
    if (self->trace_id == NULL || context_var == NULL)
        return PyObject_CallOneArg(enter_py, op);
    int entered = PyObject_IsTrue(self->trace_id);
    if (entered < 0)
        return NULL;
    if (entered)   /* Python raises what that is */
        return PyObject_CallOneArg(enter_py, op);
    PyObject *parent;
    if (PyContextVar_Get(context_var, NULL, &parent) < 0)
        return NULL;
    if (parent == NULL || !PyDict_Check(parent)) {
        Py_XDECREF(parent);
        return PyObject_CallOneArg(enter_py, op);
    }
    PyObject *current = PyDict_GetItemWithError(parent, span_key);   /* borrowed */
    Py_ssize_t size = PyDict_GET_SIZE(parent);
    PyObject *trace_id, *parent_id = NULL;
    if (current == NULL) {
        if (PyErr_Occurred() || size) {   /* a context with other values (baggage): Python copies them */
            Py_DECREF(parent);
            return PyErr_Occurred() ? NULL : PyObject_CallOneArg(enter_py, op);
        }
        if ((trace_id = new_trace_id()) == NULL) {
            Py_DECREF(parent);
            return NULL;
        }
    } else {   /* under a plain crosstrace span; any other parent is Python's to judge */
        SpanFields *under = (SpanFields *)current;
        if (size != 1 || !PyObject_TypeCheck(current, &SpanFieldsType) || under->extras != Py_None
                || under->trace_id == NULL || under->span_id == NULL) {
            Py_DECREF(parent);
            return PyObject_CallOneArg(enter_py, op);
        }
        trace_id = Py_NewRef(under->trace_id);
        parent_id = Py_NewRef(under->span_id);
    }
    Py_DECREF(parent);
    Py_XSETREF(self->trace_id, trace_id);
    if (parent_id != NULL)
        Py_XSETREF(self->parent_id, parent_id);
    PyObject *context = PyObject_CallNoArgs(context_type);
    if (context == NULL)
        return NULL;
    if (PyDict_SetItem(context, span_key, op) < 0) {   /* dict's own: Context refuses item assignment */
        Py_DECREF(context);
        return NULL;
    }
    PyObject *token = PyContextVar_Set(context_var, context);
    Py_DECREF(context);
    if (token == NULL)
        return NULL;
    Py_XSETREF(self->token, token);
    PyObject *thread = PyLong_FromUnsignedLong(PyThread_get_thread_ident());
    if (thread == NULL)
        return NULL;
    PyObject *loop = PyObject_CallNoArgs(running_loop);
    if (loop == NULL) {
        Py_DECREF(thread);
        return NULL;
    }
    if (loop != Py_None) {   /* asyncio: the task is the lane */
        Py_SETREF(thread, PyObject_CallOneArg(task_lane, thread));
        if (thread == NULL) {
            Py_DECREF(loop);
            return NULL;
        }
    }
    Py_DECREF(loop);
    Py_XSETREF(self->thread, thread);
    PyObject *start = sink_now(op);
    if (start == NULL)
        return NULL;
    Py_XSETREF(self->start, start);
    return Py_NewRef(op);
}

/* n < limit (op Py_LT) or n == limit (Py_EQ), as Python compares them: a limit need not
 * be an int that fits a Py_ssize_t (max_queue=1e6 is a float). */
static int compare_size(Py_ssize_t n, PyObject *limit, int op) {
    if (PyLong_CheckExact(limit)) {
        int overflow;
        long long bound = PyLong_AsLongLongAndOverflow(limit, &overflow);
        if (bound == -1 && PyErr_Occurred())
            return -1;
        if (overflow)
            return op == Py_LT ? overflow > 0 : 0;
        return op == Py_LT ? n < bound : n == bound;
    }
    PyObject *size = PyLong_FromSsize_t(n);
    int result = size ? PyObject_RichCompareBool(size, limit, op) : -1;
    Py_XDECREF(size);
    return result;
}

/* queue.extend(fields): a list's in one go, holding the GIL (no other thread's fields come
 * between), and nothing of the span left in it where that fails part way. */
static int extend(PyObject *queue, PyObject **fields) {
    if (!PyList_CheckExact(queue)) {
        PyObject *row = PyTuple_New(10);
        if (row == NULL)
            return -1;
        for (int i = 0; i < 10; i++)
            PyTuple_SET_ITEM(row, i, Py_NewRef(fields[i]));
        PyObject *result = PyObject_CallMethodOneArg(queue, s_extend, row);
        Py_DECREF(row);
        Py_XDECREF(result);
        return result ? 0 : -1;
    }
    Py_ssize_t start = PyList_GET_SIZE(queue);
    for (int i = 0; i < 10; i++) {
        if (PyList_Append(queue, fields[i]) < 0) {
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyList_SetSlice(queue, start, PyList_GET_SIZE(queue), NULL);
            PyErr_Restore(type, value, tb);
            return -1;
        }
    }
    return 0;
}

/* Span.end() without an end time, as ScopedSpan._exit has it inline: the span's fields
 * onto the export queue. Every object is held while Python code (the clock, a finalizer)
 * could change what the span or the queue refer to. */
static int queue_span(PyObject *op) {
    SpanFields *self = (SpanFields *)op;
    PyObject *sink = span_get(op, self->sink, "_sink");
    if (sink == NULL)
        return -1;
    PyObject *end = NULL, *queue = NULL, *limit = NULL, *fields[10] = {NULL};
    int rc = -1;
    PyObject *now = SINK(sink, now);
    if (now == NULL || (end = PyObject_CallNoArgs(now)) == NULL)
        goto done;
    Py_XSETREF(self->end_ns, Py_NewRef(end));
    if ((queue = SINK(sink, queue)) == NULL)
        goto done;
    Py_ssize_t size = PyList_CheckExact(queue) ? PyList_GET_SIZE(queue) : PyObject_Size(queue);
    if (size < 0 || (limit = SINK(sink, max_entries)) == NULL)
        goto done;
    int room = compare_size(size, limit, Py_LT);
    if (room < 0)
        goto done;
    if (!room) {
        PyObject *dropped = SINK(sink, dropped), *one = PyLong_FromLong(1);
        PyObject *more = dropped ? PyNumber_Add(dropped, one) : NULL;
        Py_XDECREF(dropped);
        Py_DECREF(one);
        rc = more ? PyObject_SetAttr(sink, s_dropped, more) : -1;
        Py_XDECREF(more);
        goto done;
    }
    static const char *names[10] = {"trace_id", "span_id", "parent_id", "name", "kind", "start", NULL, "thread",
                                    "extras", "attributes"};
    static const size_t offsets[10] = {offsetof(SpanFields, trace_id), offsetof(SpanFields, span_id),
        offsetof(SpanFields, parent_id), offsetof(SpanFields, name), offsetof(SpanFields, kind),
        offsetof(SpanFields, start), 0, offsetof(SpanFields, thread), offsetof(SpanFields, extras),
        offsetof(SpanFields, attributes)};
    for (int i = 0; i < 10; i++) {   /* each read when its turn comes: one unset runs Python code (getattr) */
        fields[i] = i == 6 ? Py_NewRef(end) : span_get(op, *(PyObject **)((char *)op + offsets[i]), names[i]);
        if (fields[i] == NULL)
            goto done;
    }
    if (extend(queue, fields) < 0)
        goto done;
    size = PyList_CheckExact(queue) ? PyList_GET_SIZE(queue) : PyObject_Size(queue);
    Py_CLEAR(limit);
    if (size < 0 || (limit = SINK(sink, wake_at)) == NULL)
        goto done;
    int wake = compare_size(size, limit, Py_EQ);
    if (wake < 0)
        goto done;
    if (wake) {
        PyObject *call = SINK(sink, wake);
        PyObject *result = call ? PyObject_CallNoArgs(call) : NULL;
        Py_XDECREF(call);
        if (result == NULL)
            goto done;
        Py_DECREF(result);
    }
    rc = 0;
done:
    for (int i = 0; i < 10; i++)
        Py_XDECREF(fields[i]);
    Py_XDECREF(limit);
    Py_XDECREF(queue);
    Py_XDECREF(end);
    Py_XDECREF(now);
    Py_DECREF(sink);
    return rc;
}

static PyObject *scoped_exit(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    SpanFields *self = (SpanFields *)op;
    if (nargs != 3 || kwnames != NULL || args[1] != Py_None || self->token == NULL || self->token == Py_None)
        return hand_over(exit_py, op, args, nargs, kwnames);
    PyObject *token = Py_NewRef(self->token);
    int reset = PyContextVar_Reset(context_var, token);
    Py_DECREF(token);
    if (reset < 0) {
        if (!PyErr_ExceptionMatches(PyExc_ValueError) && !PyErr_ExceptionMatches(PyExc_RuntimeError)
                && !PyErr_ExceptionMatches(PyExc_TypeError))
            return NULL;
        PyObject *type, *value, *tb;   /* left in another context: logged, and the span ends */
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        PyObject *logged = PyObject_CallOneArg(could_not_leave, value ? value : Py_None);
        Py_XDECREF(type); Py_XDECREF(value); Py_XDECREF(tb);
        if (logged == NULL)
            return NULL;
        Py_DECREF(logged);
    }
    Py_XSETREF(self->token, Py_NewRef(Py_None));
    PyObject *end_ns = span_get(op, self->end_ns, "end_ns");
    int ended = end_ns ? PyObject_IsTrue(end_ns) : -1;
    Py_XDECREF(end_ns);
    if (ended < 0 || (!ended && queue_span(op) < 0))
        return NULL;
    Py_RETURN_NONE;
}

/* ---- the exporter's columns (tracer/encode.py) ----------------------------------------- */

static void put_le64(unsigned char *out, uint64_t v) {
    for (int i = 0; i < 8; i++)
        out[i] = (unsigned char)(v >> (8 * i));
}

/* A column's i-th value as an int, a new reference (an int-like one through __index__, as
 * numpy takes a numpy integer); NULL with an error where the column is no longer that long
 * (__index__ is Python code, which can change it). */
static PyObject *column_int(PyObject *seq, Py_ssize_t i, Py_ssize_t n) {
    if (PySequence_Fast_GET_SIZE(seq) != n) {
        PyErr_SetString(PyExc_RuntimeError, "crosstrace: a column changed while it was packed");
        return NULL;
    }
    PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
    if (PyLong_CheckExact(item))
        return Py_NewRef(item);
    Py_INCREF(item);
    PyObject *value = PyNumber_Index(item);
    Py_DECREF(item);
    return value;
}

/* A list of ints as one little-endian u64 (signed: i64) column; OverflowError or TypeError
 * for a value that is not one, as numpy's fromiter raises (the exporter then finds its span). */
static PyObject *pack64(PyObject *values, int is_signed) {
    PyObject *seq = PySequence_Fast(values, "crosstrace: a column must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 8);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *value = column_int(seq, i, n);
        uint64_t v = value == NULL ? (uint64_t)-1
                   : is_signed ? (uint64_t)PyLong_AsLongLong(value) : PyLong_AsUnsignedLongLong(value);
        Py_XDECREF(value);
        if (v == (uint64_t)-1 && PyErr_Occurred())
            Py_CLEAR(out);
        else
            put_le64((unsigned char *)PyBytes_AS_STRING(out) + 8 * i, v);
    }
    Py_DECREF(seq);
    return out;
}

static PyObject *pack_u64(PyObject *module, PyObject *values) { return pack64(values, 0); }
static PyObject *pack_i64(PyObject *module, PyObject *values) { return pack64(values, 1); }

/* An int as 16 little-endian bytes; OverflowError where it is negative or over 128 bits,
 * as int.to_bytes(16, "little") raises. */
static int as_u128(PyObject *value, unsigned char *id) {
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *zero = PyLong_FromLong(0);
    int negative = PyObject_RichCompareBool(value, zero, Py_LT);
    Py_DECREF(zero);
    if (negative < 0)
        return -1;
    Py_ssize_t needed = negative ? 0 : PyLong_AsNativeBytes(value, id, 16, Py_ASNATIVEBYTES_LITTLE_ENDIAN
                                                            | Py_ASNATIVEBYTES_UNSIGNED_BUFFER);
    if (needed < 0)
        return -1;
    if (negative || needed > 16) {
        PyErr_SetString(PyExc_OverflowError, "crosstrace: a trace id must fit 128 unsigned bits");
        return -1;
    }
    return 0;
#else
    return _PyLong_AsByteArray((PyLongObject *)value, id, 16, 1, 0);
#endif
}

/* A list of 128-bit ints as two little-endian u64 columns: (high halves, low halves). */
static PyObject *pack_u128(PyObject *module, PyObject *values) {
    PyObject *seq = PySequence_Fast(values, "crosstrace: a column must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *hi = PyBytes_FromStringAndSize(NULL, n * 8), *lo = PyBytes_FromStringAndSize(NULL, n * 8);
    PyObject *result = NULL;
    Py_ssize_t i = 0;
    for (; hi != NULL && lo != NULL && i < n; i++) {
        unsigned char id[16];
        PyObject *value = column_int(seq, i, n);
        int rc = value == NULL ? -1 : as_u128(value, id);
        Py_XDECREF(value);
        if (rc < 0)
            break;
        memcpy(PyBytes_AS_STRING(lo) + 8 * i, id, 8);
        memcpy(PyBytes_AS_STRING(hi) + 8 * i, id + 8, 8);
    }
    if (hi != NULL && lo != NULL && i == n)
        result = PyTuple_Pack(2, hi, lo);
    Py_XDECREF(hi);
    Py_XDECREF(lo);
    Py_DECREF(seq);
    return result;
}

/* ---- the types and the module ------------------------------------------------------- */

static PyMethodDef span_methods[] = {
    {"_scoped_enter", scoped_enter, METH_NOARGS,
     "_scoped_enter($self, /)\n--\n\nScopedSpan.__enter__, its common case (provider.py)."},
    {"_scoped_exit", (PyCFunction)(void (*)(void))scoped_exit, METH_FASTCALL | METH_KEYWORDS,
     "_scoped_exit($self, exc_type, exc, tb, /)\n--\n\nScopedSpan.__exit__, its common case (provider.py)."},
    {NULL}};

static PyTypeObject SpanFieldsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "crosstrace.tracer._hotpath.SpanFields",
    .tp_doc = "A span's fields, as slots (tracer/span.py).",
    .tp_basicsize = sizeof(SpanFields),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_dealloc = fields_dealloc,
    .tp_traverse = fields_traverse,
    .tp_clear = fields_clear,
    .tp_weaklistoffset = offsetof(SpanFields, weakrefs),
    .tp_members = span_members,
    .tp_methods = span_methods,
};

static PyMethodDef tracer_methods[] = {
    {"_start_scoped", (PyCFunction)(void (*)(void))start_scoped, METH_FASTCALL | METH_KEYWORDS,
     "_start_scoped($self, /, name, context=None, kind=None, attributes=None, links=None, start_time=None, "
     "record_exception=True, set_status_on_exception=True, end_on_exit=True)\n--\n\n"
     "OpenTelemetry's Tracer.start_as_current_span: a span that starts, and becomes the current\n"
     "one, when its `with` is entered, and ends when it is left. kind=None is INTERNAL. Its\n"
     "common case runs in C; Tracer._start_as_current_span (provider.py) takes every other."},
    {NULL}};

static PyTypeObject TracerFieldsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "crosstrace.tracer._hotpath.TracerFields",
    .tp_doc = "A tracer's fields (tracer/provider.py).",
    .tp_basicsize = sizeof(TracerFields),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_dealloc = fields_dealloc,
    .tp_traverse = fields_traverse,
    .tp_clear = fields_clear,
    .tp_members = tracer_members,
    .tp_methods = tracer_methods,
};

static PyMethodDef module_methods[] = {
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS,
     "Hand over the Python objects the hot path uses (provider.py, once)."},
    {"seed", seed, METH_O, "Seed the span id generator with 32 bytes (os.urandom)."},
    {"pack_u64", pack_u64, METH_O, "A list of ints as one little-endian u64 column (bytes)."},
    {"pack_i64", pack_i64, METH_O, "A list of ints as one little-endian i64 column (bytes)."},
    {"pack_u128", pack_u128, METH_O, "A list of 128-bit ints as (high, low) little-endian u64 columns."},
    {NULL}};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "crosstrace.tracer._hotpath",
    "The tracer's hot path in C; tracer/provider.py has the whole of it in Python.", -1, module_methods};

PyMODINIT_FUNC PyInit__hotpath(void) {
    /* object's own __new__, so that object.__new__(ScopedSpan) stays valid, as with slots */
    SpanFieldsType.tp_new = PyBaseObject_Type.tp_new;
    TracerFieldsType.tp_new = PyBaseObject_Type.tp_new;
    QueueFieldsType.tp_new = PyBaseObject_Type.tp_new;
    if (PyType_Ready(&SpanFieldsType) < 0 || PyType_Ready(&TracerFieldsType) < 0
            || PyType_Ready(&QueueFieldsType) < 0)
        return NULL;
    static const char *params[9] = {"name", "context", "kind", "attributes", "links", "start_time",
                                    "record_exception", "set_status_on_exception", "end_on_exit"};
    for (int i = 0; i < 9; i++)
        if ((kw_names[i] = PyUnicode_InternFromString(params[i])) == NULL)
            return NULL;
    const char *fields[7] = {"now", "queue", "max_entries", "wake_at", "wake", "dropped", "extend"};
    PyObject **strings[7] = {&s_now, &s_queue, &s_max_entries, &s_wake_at, &s_wake, &s_dropped, &s_extend};
    for (int i = 0; i < 7; i++)
        if ((*strings[i] = PyUnicode_InternFromString(fields[i])) == NULL)
            return NULL;
    /* __slots__ as the Python twins have them (compiled.py): copy and pickle read it */
    PyTypeObject *types[3] = {&SpanFieldsType, &TracerFieldsType, &QueueFieldsType};
    PyMemberDef *members[3] = {span_members, tracer_members, queue_members};
    for (int t = 0; t < 3; t++) {
        PyObject *slots = PyList_New(0);
        for (PyMemberDef *m = members[t]; slots != NULL && m->name != NULL; m++) {
            PyObject *name = PyUnicode_InternFromString(m->name);
            if (name == NULL || PyList_Append(slots, name) < 0)
                Py_CLEAR(slots);
            Py_XDECREF(name);
        }
        PyObject *tuple = slots ? PyList_AsTuple(slots) : NULL;
        Py_XDECREF(slots);
        int rc = tuple ? PyDict_SetItemString(types[t]->tp_dict, "__slots__", tuple) : -1;
        Py_XDECREF(tuple);
        if (rc < 0)
            return NULL;
        PyType_Modified(types[t]);
    }
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "SpanFields", (PyObject *)&SpanFieldsType) < 0
            || PyModule_AddObjectRef(module, "TracerFields", (PyObject *)&TracerFieldsType) < 0
            || PyModule_AddObjectRef(module, "QueueFields", (PyObject *)&QueueFieldsType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
