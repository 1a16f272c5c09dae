/*
 * batchcraft C recording core (optional; the pure-Python core in recorder.py is the reference).
 *
 * What lives here is the per-operation hot path of auto-batching and nothing else:
 *   - LazyBase: the lazy value type (rec, node, slot, did, base), its Tensor operators, common
 *     Tensor methods (a vectorcall method descriptor, no allocation per call) and
 *     __torch_function__ as a C classmethod;
 *   - Recorder: the graph of one call in flat C arrays (signature id, depth, phase, instance,
 *     requires-grad bits, inputs, ragged list lengths, location once executed), the
 *     (phase, depth, signature) buckets filled while recording, the fast signature table
 *     (an argument spelling -> interned signature id), scalar leaves for torch.tensor(int),
 *     static-block calls recorded in one C call, and the gather planner that emits index
 *     buffers for the executor;
 *   - Mode: the torch-function mode object whose __torch_function__ is a C method;
 *   - BlockCall: the __call__ of static blocks and static-block modules.
 *   - FastCall: the __call__ of nn.Linear / nn.Embedding / the cell modules while a call records
 *     (modcalls.py's rules; the cells' common forward recorded here too);
 *   - FastFn: torch.<function> as the recording thread reads it (ccore.FAST_TORCH_FUNCTIONS):
 *     calls on lazy values recorded without torch's dispatch to the mode.
 * Anything unusual (a signature seen for the first time, keyword arguments the spelling does
 * not cover, autocast, errors) calls back into the Python methods of the CRecorder subclass
 * (ccore.py), which share recorder.RecorderBase with the Python core.
 *
 * Plain CPython C API only: no torch headers, so no ABI tie to a torch version.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

/* Python 3.11: every dict carries a version tag that each change to it, and each new dict, renews
   (PEP 509). The caches of module attributes, of torch's dict entries, of static blocks and the
   module tree's token key on it; on other versions they are off. */
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
#define DICT_TAGS 1
static inline uint64_t dict_tag(PyObject *d) { return ((PyDictObject *)d)->ma_version_tag; }
#else
#define DICT_TAGS 0
#endif

/* ------------------------------------------------------------------------------------------ */
/* globals set by setup()                                                                       */
/* ------------------------------------------------------------------------------------------ */
static PyObject *g_TensorType = NULL;      /* torch._C.TensorBase */
/* torch.Tensor, nn.Parameter (no __torch_function__ of their own in eager) and the type of a
   property getter handed to a mode (Tensor.device.__get__) */
static PyObject *g_plain_tensor = NULL, *g_parameter = NULL, *g_method_wrapper = NULL;
static PyObject *g_DtypeType = NULL;       /* torch.dtype */
static PyObject *g_torch_tensor = NULL;    /* torch.tensor */
static PyObject *g_torch_as_tensor = NULL; /* torch.as_tensor: of Python scalars, what torch.tensor makes */
static PyObject *g_set_grad_enabled = NULL; /* torch._C._set_grad_enabled: `with torch.no_grad():` reaches modes as it */
static PyObject *g_const_factories = NULL; /* consts.CONST_FACTORIES: const_leaf_c, else rec.mode_call */
static PyObject *g_const_cache = NULL;     /* bytes of a constant call's key -> (did, ConstLeaf) */
#define MAX_CONST_KEYS 1024
static PyObject *g_tf_push = NULL;         /* torch._C._push_on_torch_function_stack */
static PyObject *g_tf_pop = NULL;          /* torch._C._pop_torch_function_stack */
static PyObject *g_get_default_dtype = NULL;
static PyObject *g_rebuild = NULL;         /* signature.rebuild */
static PyObject *g_escape = NULL;          /* callable(func) -> raises the "escaped lazy" error */
static PyObject *g_StaticBlock = NULL;     /* blocks.StaticBlock */
static PyTypeObject *g_LazyType = NULL;    /* lazy.LazyTensor (the Python subclass) */
static int g_int_did = 0, g_bool_did = 0;
static PyObject *g_float_dids = NULL;      /* dict dtype -> did for torch.tensor(float) */
static PyObject *g_scalar_dids = NULL;     /* dict dtype -> did of a 0-d CPU tensor of that dtype */
static PyObject *g_list_did = NULL;        /* Python: (element did, n) -> did of shape (n,) like it */
static PyObject *g_list_dids = NULL;       /* dict element did * 128 + n -> that did (a cache) */
static PyObject *g_cpu_device = NULL;      /* torch.device("cpu") */
static PyObject *g_int64_dtype = NULL, *g_bool_dtype = NULL;  /* torch.int64, torch.bool */

/* torch's state queries (grad mode, autocast, the function-mode stack) are no-argument
   builtins: their C functions are called directly where they are plain METH_NOARGS builtins
   (10-40 ns less a call than through the object, and each block call and scalar leaf asks
   several), else through the object. NOARG(x) declares x and its direct function. */
#define NOARG(name) static PyObject *name = NULL; static PyCFunction name##_fn = NULL;
NOARG(g_is_grad_q) NOARG(g_any_autocast_q) NOARG(g_is_inference_q) NOARG(g_tf_mode_enabled_q)
NOARG(g_tf_len_q) NOARG(g_tf_enabled_q)
#undef NOARG
static inline PyObject *call_noarg(PyObject *obj, PyCFunction fn) {
    if (fn) return fn(PyCFunction_GET_SELF(obj), NULL);
    return PyObject_CallNoArgs(obj);
}
static PyCFunction noarg_fn(PyObject *obj) {
    return (PyCFunction_Check(obj) && (PyCFunction_GET_FLAGS(obj) & (METH_VARARGS | METH_FASTCALL | METH_NOARGS | METH_O
            | METH_KEYWORDS | METH_METHOD)) == METH_NOARGS) ? PyCFunction_GET_FUNCTION(obj) : NULL;
}
#define Q_IS_GRAD() call_noarg(g_is_grad_q, g_is_grad_q_fn)
#define Q_ANY_AUTOCAST() call_noarg(g_any_autocast_q, g_any_autocast_q_fn)
#define Q_IS_INFERENCE() call_noarg(g_is_inference_q, g_is_inference_q_fn)
#define Q_TF_MODE_ENABLED() call_noarg(g_tf_mode_enabled_q, g_tf_mode_enabled_q_fn)
#define Q_TF_ENABLED() call_noarg(g_tf_enabled_q, g_tf_enabled_q_fn)
static inline PyObject *tf_stack_len(void) { return call_noarg(g_tf_len_q, g_tf_len_q_fn); }

/* The same state read through torch's own C++ accessors, where statereaders.py found them by
   symbol and checked them against the builtins above in every state it could set (else NULL and
   the builtins are asked). The builtins wrap each answer in torch's error and warning handlers,
   about 35 ns a question here; a block call asks four, a scalar leaf four. No torch header: plain
   function pointers (no arguments; bool, int or int64 results), so nothing ties the build to a
   torch version. Autocast is read from its dispatch-key bits (below): its C++ accessor takes a
   device type and throws for one it does not know. */
static _Bool (*sr_grad)(void) = NULL, (*sr_inference)(void) = NULL, (*sr_tf_mode)(void) = NULL;
static int (*sr_tf_state)(void) = NULL;    /* 0: torch functions enabled */
static int64_t (*sr_tf_len)(void) = NULL;

static inline int q_bool(PyObject *o) {    /* a builtin's answer: 0/1, -1 on error */
    if (!o) return -1;
    int r = o == Py_True;
    Py_DECREF(o);
    return r;
}

/* Autocast: torch keeps each device's switch as one bit of the thread's local dispatch-key set
   (c10::impl::raw_local_dispatch_key_set, a thread-local {included, excluded} pair that torch's
   library exports). statereaders.py learns which bits of the excluded word the devices' switches
   are (ac_mask) and their values with autocast off (ac_off) by switching each device on and off,
   and checks the answers against torch._C._is_any_autocast_enabled. The pair's address differs per
   thread: dlsym gives this thread's, kept in a thread-local of ours. */
#if defined(__unix__) || defined(__APPLE__)
#include <dlfcn.h>
#define HAVE_DLSYM 1
static void *g_dks_lib = NULL;             /* the library's dlopen handle (ctypes'; not closed) */
static char g_dks_symbol[128];
static uint64_t g_ac_mask = 0, g_ac_off = 0;
static int g_ac_fast = 0;
static __thread const uint64_t *tl_dks = NULL;
static inline const uint64_t *dks_words(void) {
    const uint64_t *p = tl_dks;
    if (!p) p = tl_dks = (const uint64_t *)dlsym(g_dks_lib, g_dks_symbol);
    return p;
}
#endif
static PyObject *g_autocast_key = NULL;   /* statereaders.AutocastKeys: word -> id | None */

/* While autocast is on: a small id of the devices on, their dtypes and the cache switch (see
   AutocastKeys), in *id; 1: no id (the slow path), -1: an error. */
static int autocast_id(uint64_t *id) {
#ifdef HAVE_DLSYM
    const uint64_t *p = g_ac_fast && g_autocast_key ? dks_words() : NULL;
    if (!p) return 1;
    PyObject *w = PyLong_FromUnsignedLongLong((unsigned long long)((p[1] ^ g_ac_off) & g_ac_mask));
    if (!w) return -1;
    PyObject *r = PyObject_CallOneArg(g_autocast_key, w);
    Py_DECREF(w);
    if (!r) return -1;
    int out = 1;
    if (PyLong_CheckExact(r)) {
        unsigned long long v = PyLong_AsUnsignedLongLong(r);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) { Py_DECREF(r); return -1; }
        if (v > 0 && v < (1ull << 40)) { *id = v; out = 0; }
    }
    Py_DECREF(r);
    return out;
#else
    (void)id;
    return 1;
#endif
}

static inline int q_any_autocast(void) {
#ifdef HAVE_DLSYM
    if (g_ac_fast) {
        const uint64_t *p = dks_words();
        if (p) return ((p[1] ^ g_ac_off) & g_ac_mask) != 0;
    }
#endif
    return q_bool(Q_ANY_AUTOCAST());
}
static inline int q_grad(void) { return sr_grad ? (int)sr_grad() : q_bool(Q_IS_GRAD()); }
static inline int q_inference(void) { return sr_inference ? (int)sr_inference() : q_bool(Q_IS_INFERENCE()); }
static inline int q_tf_mode_enabled(void) { return sr_tf_mode ? (int)sr_tf_mode() : q_bool(Q_TF_MODE_ENABLED()); }
static inline int q_tf_enabled(void) { return sr_tf_state ? sr_tf_state() == 0 : q_bool(Q_TF_ENABLED()); }
static inline Py_ssize_t q_tf_len(void) {  /* -1 with an error set */
    if (sr_tf_len) return (Py_ssize_t)sr_tf_len();
    PyObject *n = tf_stack_len();
    if (!n) return -1;
    Py_ssize_t len = PyLong_AsSsize_t(n);
    Py_DECREF(n);
    return len;
}
static PyObject *g_tf_at = NULL;           /* torch._C._get_function_stack_at */
static PyObject *g_torch_dir = NULL;       /* torch's package directory, ending in the separator */
static PyObject *g_own_dir = NULL;         /* batchcraft's package directory, ending in the separator */
static int g_ready = 0;                    /* setup() ran */

static PyObject *s_leaf = NULL;
static PyObject *s_record, *s_general, *s_requires_grad, *s_sig_entry, *s_materialize_leaves,
    *s_pending_limit, *s_step_limit, *s_inplace, *s_const_entry, *s_mode_call, *s_mode, *s_under_user_mode, *s_block_slow, *s_check_fp,
    *s_batchcraft_block, *s_fn, *s_register_view, *s_dunder_tf, *s_for_handler;

static PyTypeObject LazyBaseType, RecorderType, ModeType, LazyMethodType, BlockCallType;

/* ------------------------------------------------------------------------------------------ */
/* the active recorder stack, one per thread                                                  */
/* ------------------------------------------------------------------------------------------ */
typedef struct { PyObject **items; Py_ssize_t n, cap; } RecStack;
static Py_tss_t g_tss = Py_tss_NEEDS_INIT;

static RecStack *rec_stack(void) {
    RecStack *s = (RecStack *)PyThread_tss_get(&g_tss);
    if (!s) {
        s = (RecStack *)PyMem_RawCalloc(1, sizeof(RecStack));
        if (!s) return NULL;
        PyThread_tss_set(&g_tss, s);
    }
    return s;
}

static inline PyObject *current_rec(void) {  /* borrowed; NULL when none (or None pushed) */
    RecStack *s = (RecStack *)PyThread_tss_get(&g_tss);
    if (!s || s->n == 0) return NULL;
    PyObject *r = s->items[s->n - 1];
    return r == Py_None ? NULL : r;
}

static PyObject *py_current(PyObject *m, PyObject *noargs) {
    PyObject *r = current_rec();
    if (!r) Py_RETURN_NONE;
    Py_INCREF(r);
    return r;
}

static PyObject *py_push(PyObject *m, PyObject *rec) {
    RecStack *s = rec_stack();
    if (!s) return PyErr_NoMemory();
    if (s->n == s->cap) {
        Py_ssize_t nc = s->cap ? s->cap * 2 : 8;
        PyObject **ni = (PyObject **)PyMem_RawRealloc(s->items, nc * sizeof(PyObject *));
        if (!ni) return PyErr_NoMemory();
        s->items = ni; s->cap = nc;
    }
    Py_INCREF(rec);
    s->items[s->n++] = rec;
    Py_RETURN_NONE;
}

static PyObject *py_pop(PyObject *m, PyObject *noargs) {
    RecStack *s = rec_stack();
    if (!s || s->n == 0) { PyErr_SetString(PyExc_RuntimeError, "batchcraft: recorder stack is empty"); return NULL; }
    PyObject *r = s->items[--s->n];
    Py_DECREF(r);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------ */
/* LazyBase                                                                                   */
/* ------------------------------------------------------------------------------------------ */
/* live lazy objects per (node, slot < 4) of a C recorder (chains.py asks whether a cell state is
   still reachable from Python); defined after RecObject */
static void live_add(PyObject *rec, Py_ssize_t node, int slot, int d);

typedef struct {
    PyObject_HEAD
    PyObject *rec;
    Py_ssize_t node;
    int slot;
    int did;
    PyObject *base;
    PyObject *weakreflist;
} LazyObject;

static int lazy_traverse(LazyObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->rec);
    Py_VISIT(self->base);
    return 0;
}

static int lazy_clear(LazyObject *self) {
    if (self->rec) live_add(self->rec, self->node, self->slot, -1);
    Py_CLEAR(self->rec);
    Py_CLEAR(self->base);
    return 0;
}

/* Freed lazy values of the LazyTensor type are kept for reuse (a recorded TreeLSTM node makes six
   and drops most of them at once): new_lazy takes one back instead of allocating, initialising
   and linking a fresh GC object. Under the GIL; the memory is the type's own allocation. */
#define LAZY_FREE_MAX 2048
static LazyObject *g_lazy_free[LAZY_FREE_MAX];
static int g_lazy_nfree = 0;

static void lazy_dealloc(LazyObject *self) {
    PyObject_GC_UnTrack(self);
    if (self->weakreflist) PyObject_ClearWeakRefs((PyObject *)self);
    lazy_clear(self);
    if (Py_TYPE(self) == g_LazyType && g_lazy_nfree < LAZY_FREE_MAX) {
        self->weakreflist = NULL;
        g_lazy_free[g_lazy_nfree++] = self;  /* (subtype_dealloc drops the instance's type reference) */
        return;
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* tp_dealloc of the LazyTensor subclass itself (py_setup_lazy sets it where the subclass adds no
   slots, dict or finaliser): what CPython's subtype_dealloc does for such a class (untrack, the base
   dealloc, the type reference dropped), without its generic checks; a recorded TreeLSTM node frees
   about six lazy values. Reached as a further subclass's base dealloc, it drops that subclass's
   reference too: subtype_dealloc leaves it to a base that is a heap type. */
static void lazy_subtype_dealloc(LazyObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    Py_TRASHCAN_BEGIN(self, lazy_subtype_dealloc)  /* (a long chain of views, each holding its base) */
    lazy_dealloc(self);
    Py_DECREF(tp);
    Py_TRASHCAN_END
}

static int lazy_init(LazyObject *self, PyObject *args, PyObject *kw) {
    PyObject *rec; Py_ssize_t node; int slot, did;
    if (!PyArg_ParseTuple(args, "Onii", &rec, &node, &slot, &did)) return -1;
    if (self->rec) live_add(self->rec, self->node, self->slot, -1);
    Py_INCREF(rec);
    Py_XSETREF(self->rec, rec);
    self->node = node; self->slot = slot; self->did = did;
    live_add(rec, node, slot, 1);
    return 0;
}

static inline LazyObject *new_lazy(PyObject *rec, Py_ssize_t node, int slot, int did) {
    LazyObject *x;
    if (g_lazy_nfree > 0) {
        x = g_lazy_free[--g_lazy_nfree];
        PyObject_Init((PyObject *)x, g_LazyType);  /* a new reference, and one to the (heap) type */
        x->weakreflist = NULL;
        PyObject_GC_Track(x);
    } else {
        x = (LazyObject *)g_LazyType->tp_alloc(g_LazyType, 0);
        if (!x) return NULL;
    }
    Py_INCREF(rec);
    x->rec = rec; x->node = node; x->slot = slot; x->did = did; x->base = NULL;
    live_add(rec, node, slot, 1);
    return x;
}

static PyMemberDef lazy_members[] = {
    {"rec", T_OBJECT, offsetof(LazyObject, rec), READONLY, "owning recorder"},
    {"did", T_INT, offsetof(LazyObject, did), 0, "descriptor id"},
    {"base", T_OBJECT, offsetof(LazyObject, base), 0, "the value this one is a view of"},
    {NULL}
};

static PyObject *lazy_get_node(LazyObject *self, void *c) { return PyLong_FromSsize_t(self->node); }
static PyObject *lazy_get_slot(LazyObject *self, void *c) { return PyLong_FromLong(self->slot); }

/* re-pointing a handle (functional.repoint) moves its count to the new (node, slot) */
static int lazy_set_node(LazyObject *self, PyObject *v, void *c) {
    if (!v) { PyErr_SetString(PyExc_AttributeError, "cannot delete node"); return -1; }
    Py_ssize_t n = PyLong_AsSsize_t(v);
    if (n == -1 && PyErr_Occurred()) return -1;
    if (self->rec) live_add(self->rec, self->node, self->slot, -1);
    self->node = n;
    if (self->rec) live_add(self->rec, self->node, self->slot, 1);
    return 0;
}

static int lazy_set_slot(LazyObject *self, PyObject *v, void *c) {
    if (!v) { PyErr_SetString(PyExc_AttributeError, "cannot delete slot"); return -1; }
    long n = PyLong_AsLong(v);
    if (n == -1 && PyErr_Occurred()) return -1;
    if (self->rec) live_add(self->rec, self->node, self->slot, -1);
    self->slot = (int)n;
    if (self->rec) live_add(self->rec, self->node, self->slot, 1);
    return 0;
}

static PyGetSetDef lazy_getset[] = {
    {"node", (getter)lazy_get_node, (setter)lazy_set_node, "node index", NULL},
    {"slot", (getter)lazy_get_slot, (setter)lazy_set_slot, "output slot", NULL},
    {NULL},
};

#define IS_LAZY(o) (Py_TYPE(o) == g_LazyType)

/* forward */
static PyObject *rec_record_impl(PyObject *rec, PyObject *func, PyObject *const *args, Py_ssize_t nargs,
                                 PyObject *kwargs);

/* Send func(*args, **kwargs) to the active recorder. */
static int require_setup(void);

/* rec.<name>(func, args as a tuple, kwargs or {}) */
static PyObject *call_rec(PyObject *rec, PyObject *name, PyObject *func, PyObject *const *args, Py_ssize_t nargs,
                          PyObject *kwargs) {
    PyObject *t = PyTuple_New(nargs);
    if (!t) return NULL;
    for (Py_ssize_t i = 0; i < nargs; i++) { Py_INCREF(args[i]); PyTuple_SET_ITEM(t, i, args[i]); }
    PyObject *kw = kwargs ? kwargs : PyDict_New();
    PyObject *r = kw ? PyObject_CallMethodObjArgs(rec, name, func, t, kw, NULL) : NULL;
    if (!kwargs) Py_XDECREF(kw);
    Py_DECREF(t);
    return r;
}

static PyObject *dispatch(PyObject *func, PyObject *const *args, Py_ssize_t nargs, PyObject *kwargs) {
    PyObject *rec = current_rec();
    if (!rec) {
        if (require_setup() < 0) return NULL;
        return PyObject_CallOneArg(g_escape, func);
    }
    if (PyObject_TypeCheck(rec, &RecorderType)) return rec_record_impl(rec, func, args, nargs, kwargs);
    return call_rec(rec, s_record, func, args, nargs, kwargs);
}

/* 1 when a torch-function mode that instance code entered is innermost (above the recorder's
   own mode, torch functions enabled), 0 if not, -1 on error. One call of torch's stack length
   in the common case (only the recorder's mode on the stack). */
static PyObject *rec_mode_ref(PyObject *rec);  /* the recorder's mode: a new reference */

static int user_mode_on_top(PyObject *rec) {
    if (!g_ready) return 0;
    Py_ssize_t len = q_tf_len();
    if (len < 0 && PyErr_Occurred()) return -1;
    if (len <= 1) return 0;
    PyObject *mode = rec_mode_ref(rec);
    if (!mode) { PyErr_Clear(); return 0; }  /* a block's tracer: no mode of its own */
    if (mode == Py_None) { Py_DECREF(mode); return 0; }
    PyObject *top = PyObject_CallFunction(g_tf_at, "n", len - 1);
    if (!top) { Py_DECREF(mode); return -1; }
    int user = top != mode;
    Py_DECREF(top);
    Py_DECREF(mode);
    if (!user) return 0;
    return q_tf_mode_enabled();
}

/* A Tensor method or operator called on a lazy value (not through torch's dispatch): recorded,
   unless a mode of the user's is innermost, which then sees the call as in eager (bug #49; the
   recorder's under_user_mode runs it on concrete values). */
static PyObject *dispatch_direct(PyObject *func, PyObject *const *args, Py_ssize_t nargs, PyObject *kwargs) {
    PyObject *rec = current_rec();
    if (rec) {
        int user = user_mode_on_top(rec);
        if (user < 0) return NULL;
        if (user) return call_rec(rec, s_under_user_mode, func, args, nargs, kwargs);
    }
    return dispatch(func, args, nargs, kwargs);
}

static PyObject *dispatch_inplace(PyObject *func, PyObject *self, PyObject *other) {
    PyObject *rec = current_rec();
    if (!rec) return PyObject_CallOneArg(g_escape, func);
    PyObject *t = PyTuple_Pack(2, self, other);
    PyObject *kw = PyDict_New();
    PyObject *r = (t && kw) ? PyObject_CallMethodObjArgs(rec, s_inplace, self, func, t, kw, NULL) : NULL;
    Py_XDECREF(t); Py_XDECREF(kw);
    return r;
}

/* operator slots: the torch.Tensor function each one records */
enum { OP_ADD, OP_RADD, OP_SUB, OP_RSUB, OP_MUL, OP_RMUL, OP_TRUEDIV, OP_RTRUEDIV, OP_FLOORDIV, OP_RFLOORDIV,
       OP_MOD, OP_POW, OP_RPOW, OP_MATMUL, OP_RMATMUL, OP_AND, OP_OR, OP_XOR, OP_LT, OP_LE, OP_GT, OP_GE,
       OP_EQ, OP_NE, OP_GETITEM, OP_LSHIFT, OP_RSHIFT, OP_NEG, OP_ABS, OP_INVERT, OP_POS,
       OP_IADD, OP_ISUB, OP_IMUL, OP_ITRUEDIV, OP_IFLOORDIV, OP_IMOD, OP_IPOW, OP_IAND, OP_IOR, OP_IXOR,
       OP_ILSHIFT, OP_IRSHIFT, OP_COUNT };
static const char *op_names[OP_COUNT] = {
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
    "__floordiv__", "__rfloordiv__", "__mod__", "__pow__", "__rpow__", "__matmul__", "__rmatmul__",
    "__and__", "__or__", "__xor__", "__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__",
    "__getitem__", "__lshift__", "__rshift__", "__neg__", "__abs__", "__invert__", "__pos__",
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"};
static PyObject *op_funcs[OP_COUNT];

static PyObject *binop(int op, int rop, PyObject *a, PyObject *b) {
    PyObject *args[2];
    if (IS_LAZY(a)) { args[0] = a; args[1] = b; return dispatch_direct(op_funcs[op], args, 2, NULL); }
    if (rop < 0) Py_RETURN_NOTIMPLEMENTED;
    args[0] = b; args[1] = a;
    return dispatch_direct(op_funcs[rop], args, 2, NULL);
}

#define BINOP(name, op, rop) static PyObject *lazy_##name(PyObject *a, PyObject *b) { return binop(op, rop, a, b); }
BINOP(add, OP_ADD, OP_RADD)
BINOP(sub, OP_SUB, OP_RSUB)
BINOP(mul, OP_MUL, OP_RMUL)
BINOP(truediv, OP_TRUEDIV, OP_RTRUEDIV)
BINOP(floordiv, OP_FLOORDIV, OP_RFLOORDIV)
BINOP(mod, OP_MOD, -1)
BINOP(matmul, OP_MATMUL, OP_RMATMUL)
BINOP(and, OP_AND, OP_AND)
BINOP(or, OP_OR, OP_OR)
BINOP(xor, OP_XOR, OP_XOR)
BINOP(lshift, OP_LSHIFT, -1)
BINOP(rshift, OP_RSHIFT, -1)

static PyObject *lazy_pow(PyObject *a, PyObject *b, PyObject *mod) {
    if (mod != Py_None) Py_RETURN_NOTIMPLEMENTED;
    return binop(OP_POW, OP_RPOW, a, b);
}

#define UNOP(name, op) static PyObject *lazy_##name(PyObject *a) { PyObject *args[1] = {a}; \
    return dispatch_direct(op_funcs[op], args, 1, NULL); }
UNOP(neg, OP_NEG)
UNOP(abs, OP_ABS)
UNOP(invert, OP_INVERT)
UNOP(pos, OP_POS)

#define IOP(name, op) static PyObject *lazy_##name(PyObject *a, PyObject *b) { \
    return dispatch_inplace(op_funcs[op], a, b); }
IOP(iadd, OP_IADD)
IOP(isub, OP_ISUB)
IOP(imul, OP_IMUL)
IOP(itruediv, OP_ITRUEDIV)
IOP(ifloordiv, OP_IFLOORDIV)
IOP(imod, OP_IMOD)
IOP(iand, OP_IAND)
IOP(ior, OP_IOR)
IOP(ixor, OP_IXOR)
IOP(ilshift, OP_ILSHIFT)
IOP(irshift, OP_IRSHIFT)
static PyObject *lazy_ipow(PyObject *a, PyObject *b, PyObject *mod) { return dispatch_inplace(op_funcs[OP_IPOW], a, b); }

static PyObject *lazy_richcompare(PyObject *a, PyObject *b, int op) {
    int which;
    switch (op) {
        case Py_LT: which = OP_LT; break;
        case Py_LE: which = OP_LE; break;
        case Py_GT: which = OP_GT; break;
        case Py_GE: which = OP_GE; break;
        case Py_EQ: which = OP_EQ; break;
        default: which = OP_NE; break;
    }
    PyObject *args[2] = {a, b};
    return dispatch_direct(op_funcs[which], args, 2, NULL);
}

static PyObject *lazy_subscript(PyObject *a, PyObject *key) {
    PyObject *args[2] = {a, key};
    return dispatch_direct(op_funcs[OP_GETITEM], args, 2, NULL);
}

static PyNumberMethods lazy_as_number = {
    .nb_add = lazy_add, .nb_subtract = lazy_sub, .nb_multiply = lazy_mul, .nb_remainder = lazy_mod,
    .nb_power = lazy_pow, .nb_negative = lazy_neg, .nb_positive = lazy_pos, .nb_absolute = lazy_abs,
    .nb_invert = lazy_invert, .nb_lshift = lazy_lshift, .nb_rshift = lazy_rshift, .nb_and = lazy_and,
    .nb_xor = lazy_xor, .nb_or = lazy_or, .nb_inplace_add = lazy_iadd, .nb_inplace_subtract = lazy_isub,
    .nb_inplace_multiply = lazy_imul, .nb_inplace_remainder = lazy_imod, .nb_inplace_power = lazy_ipow,
    .nb_inplace_lshift = lazy_ilshift, .nb_inplace_rshift = lazy_irshift, .nb_inplace_and = lazy_iand,
    .nb_inplace_xor = lazy_ixor, .nb_inplace_or = lazy_ior, .nb_floor_divide = lazy_floordiv,
    .nb_true_divide = lazy_truediv, .nb_inplace_floor_divide = lazy_ifloordiv,
    .nb_inplace_true_divide = lazy_itruediv, .nb_matrix_multiply = lazy_matmul,
};

static PyMappingMethods lazy_as_mapping = {.mp_subscript = lazy_subscript};

/* __torch_function__(cls, func, types, args=(), kwargs=None) as a C classmethod */
static PyObject *lazy_torch_function(PyObject *cls, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *func = NULL, *fargs = NULL, *fkwargs = NULL;
    if (nargs >= 1) func = args[0];
    if (nargs >= 3) fargs = args[2];
    if (nargs >= 4) fkwargs = args[3];
    if (kwnames) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kwnames); i++) {
            PyObject *k = PyTuple_GET_ITEM(kwnames, i);
            if (PyUnicode_CompareWithASCIIString(k, "args") == 0) fargs = args[nargs + i];
            else if (PyUnicode_CompareWithASCIIString(k, "kwargs") == 0) fkwargs = args[nargs + i];
            else if (PyUnicode_CompareWithASCIIString(k, "func") == 0) func = args[nargs + i];
        }
    }
    if (!func) { PyErr_SetString(PyExc_TypeError, "__torch_function__: missing func"); return NULL; }
    /* torch reaches here with a mode of the user's innermost only after that mode returned
       NotImplemented: raise as eager does rather than answer (bug #57) */
    PyObject *rec = current_rec();
    if (rec) {
        int user = user_mode_on_top(rec);
        if (user < 0) return NULL;
        if (user) {
            PyErr_Format(PyExc_TypeError, "Multiple dispatch failed for %R; all __torch_function__ handlers "
                         "returned NotImplemented (a torch-function mode entered in instance code declined it)",
                         func);
            return NULL;
        }
    }
    if (fkwargs == Py_None || (fkwargs && PyDict_GET_SIZE(fkwargs) == 0)) fkwargs = NULL;
    if (!fargs || fargs == Py_None) return dispatch(func, NULL, 0, fkwargs);
    if (!PyTuple_Check(fargs)) {
        PyObject *t = PySequence_Tuple(fargs);
        if (!t) return NULL;
        PyObject *r = dispatch(func, &PyTuple_GET_ITEM(t, 0), PyTuple_GET_SIZE(t), fkwargs);
        Py_DECREF(t);
        return r;
    }
    return dispatch(func, &PyTuple_GET_ITEM(fargs, 0), PyTuple_GET_SIZE(fargs), fkwargs);
}

static PyMethodDef lazy_methods[] = {
    {"__torch_function__", (PyCFunction)(void (*)(void))lazy_torch_function, METH_FASTCALL | METH_KEYWORDS | METH_CLASS,
     "Route a torch call on lazy values to the active recorder."},
    {NULL}
};

static PyTypeObject LazyBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "batchcraft.autobatching._core.LazyBase",
    .tp_basicsize = sizeof(LazyObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Base of lazy values: operators and common Tensor methods in C.",
    .tp_traverse = (traverseproc)lazy_traverse,
    .tp_clear = (inquiry)lazy_clear,
    .tp_dealloc = (destructor)lazy_dealloc,
    .tp_init = (initproc)lazy_init,
    .tp_new = PyType_GenericNew,
    .tp_members = lazy_members,
    .tp_getset = lazy_getset,
    .tp_methods = lazy_methods,
    .tp_as_number = &lazy_as_number,
    .tp_as_mapping = &lazy_as_mapping,
    .tp_richcompare = lazy_richcompare,
    .tp_weaklistoffset = offsetof(LazyObject, weakreflist),
};

/* A Tensor method of lazy values (x.sigmoid(), x.sum(-1)): a method descriptor with vectorcall,
   so `x.sigmoid()` records without allocating a bound method. */
typedef struct {
    PyObject_HEAD
    PyObject *func;
    int inplace;
    vectorcallfunc vectorcall;
} LazyMethodObject;

static PyObject *kwnames_to_dict(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kwnames); i++)
        if (PyDict_SetItem(d, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0) { Py_DECREF(d); return NULL; }
    return d;
}

static PyObject *lazymethod_vectorcall(LazyMethodObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 1) { PyErr_SetString(PyExc_TypeError, "lazy method needs self"); return NULL; }
    PyObject *kw = NULL;
    if (kwnames && PyTuple_GET_SIZE(kwnames)) { kw = kwnames_to_dict(args, nargs, kwnames); if (!kw) return NULL; }
    PyObject *r;
    if (self->inplace) {
        PyObject *rec = current_rec();
        if (!rec) r = PyObject_CallOneArg(g_escape, self->func);
        else {
            PyObject *t = PyTuple_New(nargs);
            for (Py_ssize_t i = 0; t && i < nargs; i++) { Py_INCREF(args[i]); PyTuple_SET_ITEM(t, i, args[i]); }
            PyObject *k2 = kw ? kw : PyDict_New();
            r = (t && k2) ? PyObject_CallMethodObjArgs(rec, s_inplace, args[0], self->func, t, k2, NULL) : NULL;
            if (!kw) Py_XDECREF(k2);
            Py_XDECREF(t);
        }
    } else {
        r = dispatch_direct(self->func, args, nargs, kw);
    }
    Py_XDECREF(kw);
    return r;
}

static PyObject *lazymethod_get(PyObject *self, PyObject *obj, PyObject *type) {
    if (obj == NULL || obj == Py_None) { Py_INCREF(self); return self; }
    return PyMethod_New(self, obj);
}

static void lazymethod_dealloc(LazyMethodObject *self) {
    Py_XDECREF(self->func);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *lazymethod_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    PyObject *func; int inplace = 0;
    if (!PyArg_ParseTuple(args, "O|p", &func, &inplace)) return NULL;
    LazyMethodObject *self = (LazyMethodObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    Py_INCREF(func);
    self->func = func;
    self->inplace = inplace;
    self->vectorcall = (vectorcallfunc)lazymethod_vectorcall;
    return (PyObject *)self;
}

static PyObject *lazymethod_repr(LazyMethodObject *self) {
    return PyUnicode_FromFormat("<lazy method %R>", self->func);
}

static PyTypeObject LazyMethodType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "batchcraft.autobatching._core.LazyMethod",
    .tp_basicsize = sizeof(LazyMethodObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_METHOD_DESCRIPTOR | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(LazyMethodObject, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_descr_get = lazymethod_get,
    .tp_dealloc = (destructor)lazymethod_dealloc,
    .tp_new = lazymethod_new,
    .tp_repr = (reprfunc)lazymethod_repr,
};

/* ------------------------------------------------------------------------------------------ */
/* the fast signature table: argument spelling (key words) -> entry                           */
/* ------------------------------------------------------------------------------------------ */
#define MAXW 64
#define MAXLEAVES 128
enum { K_LAZY = 1, K_LAZYRG, K_INT, K_FLOAT, K_BOOL, K_NONE, K_ELL, K_TENSOR, K_OBJ, K_STR, K_LIST, K_TUPLE,
       K_SLICE, K_KW, K_STATE, K_RLIST, K_CLASS, K_BLOCK };
#define TAG(t, v) (((uint64_t)(t) << 56) | ((uint64_t)(v) & 0x00FFFFFFFFFFFFFFull))

typedef struct {
    uint64_t hash;
    int nwords;
    uint64_t *words;
    int kind;            /* 0 single, 1 flat tuple, 2 structure, 3 "not ragged: use the per-length key" */
    int sid;
    int n_out;
    int *out_dids;
    uint64_t rg_mask;
    int n_dep;
    uint64_t *rg_dep;
    int view;
    int ragged;          /* block entries: the node's inputs are singles then ragged members */
    PyObject *out_struct;
} SigEntry;

static SigEntry *g_tab = NULL;
static Py_ssize_t g_tab_cap = 0, g_tab_n = 0;

static uint64_t hash_words(const uint64_t *w, int n) {
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < n; i++) { h ^= w[i]; h *= 1099511628211ull; h ^= h >> 29; }
    return h ? h : 1;
}

static void free_entry(SigEntry *e) {
    PyMem_Free(e->words); PyMem_Free(e->out_dids); PyMem_Free(e->rg_dep);
    Py_XDECREF(e->out_struct);
    memset(e, 0, sizeof(*e));
}

static void tab_clear(void) {
    for (Py_ssize_t i = 0; i < g_tab_cap; i++) if (g_tab[i].hash) free_entry(&g_tab[i]);
    g_tab_n = 0;
}

static SigEntry *tab_find(const uint64_t *w, int n, uint64_t h) {
    if (!g_tab_cap) return NULL;
    Py_ssize_t mask = g_tab_cap - 1, i = (Py_ssize_t)(h & mask);
    for (;;) {
        SigEntry *e = &g_tab[i];
        if (!e->hash) return NULL;
        if (e->hash == h && e->nwords == n && memcmp(e->words, w, n * sizeof(uint64_t)) == 0) return e;
        i = (i + 1) & mask;
    }
}

static int tab_grow(void) {
    Py_ssize_t nc = g_tab_cap ? g_tab_cap * 2 : 4096;
    SigEntry *nt = (SigEntry *)PyMem_Calloc(nc, sizeof(SigEntry));
    if (!nt) { PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < g_tab_cap; i++) {
        SigEntry *e = &g_tab[i];
        if (!e->hash) continue;
        Py_ssize_t j = (Py_ssize_t)(e->hash & (nc - 1));
        while (nt[j].hash) j = (j + 1) & (nc - 1);
        nt[j] = *e;
    }
    PyMem_Free(g_tab);
    g_tab = nt; g_tab_cap = nc;
    return 0;
}

/* Register key -> entry from the Python tuple made by CRecorder._sig_entry(info):
   (kind, sid, out_dids, rg_mask, rg_dep, view, ragged, out_struct) */
static SigEntry *tab_insert(const uint64_t *w, int n, uint64_t h, PyObject *desc) {
    if ((g_tab_n + 1) * 2 > g_tab_cap && tab_grow() < 0) return NULL;
    SigEntry *old = tab_find(w, n, h);
    if (old) free_entry(old);
    Py_ssize_t mask = g_tab_cap - 1, i = (Py_ssize_t)(h & mask);
    if (!old) { while (g_tab[i].hash) i = (i + 1) & mask; }
    SigEntry *e = old ? old : &g_tab[i];
    PyObject *dids, *deps, *ostruct;
    int kind, sid, view, ragged; unsigned long long rgm;
    if (!PyArg_ParseTuple(desc, "iiOKOiiO", &kind, &sid, &dids, &rgm, &deps, &view, &ragged, &ostruct)) return NULL;
    e->words = (uint64_t *)PyMem_Malloc(n * sizeof(uint64_t));
    if (!e->words) { PyErr_NoMemory(); return NULL; }
    memcpy(e->words, w, n * sizeof(uint64_t));
    e->nwords = n; e->kind = kind; e->sid = sid; e->rg_mask = rgm; e->view = view; e->ragged = ragged;
    e->n_out = (int)PyTuple_GET_SIZE(dids);
    e->out_dids = (int *)PyMem_Malloc((e->n_out + 1) * sizeof(int));
    for (int k = 0; k < e->n_out; k++) e->out_dids[k] = (int)PyLong_AsLong(PyTuple_GET_ITEM(dids, k));
    e->n_dep = (int)PyTuple_GET_SIZE(deps);
    e->rg_dep = (uint64_t *)PyMem_Malloc((e->n_dep + 1) * sizeof(uint64_t));
    for (int k = 0; k < e->n_dep; k++) e->rg_dep[k] = PyLong_AsUnsignedLongLongMask(PyTuple_GET_ITEM(deps, k));
    Py_INCREF(ostruct);
    e->out_struct = ostruct;
    e->hash = h;
    if (!old) g_tab_n++;
    return e;
}

/* ------------------------------------------------------------------------------------------ */
/* Recorder                                                                                    */
/* ------------------------------------------------------------------------------------------ */
typedef struct { int32_t *v; Py_ssize_t n, cap; } IVec;

static int ivec_push(IVec *a, int32_t x) {
    if (a->n == a->cap) {
        Py_ssize_t nc = a->cap ? a->cap * 2 : 16;
        int32_t *nv = (int32_t *)PyMem_Realloc(a->v, nc * sizeof(int32_t));
        if (!nv) { PyErr_NoMemory(); return -1; }
        a->v = nv; a->cap = nc;
    }
    a->v[a->n++] = x;
    return 0;
}

typedef struct { int32_t phase, depth, sid; IVec nodes; } Bucket;

typedef struct {
    PyObject_HEAD
    /* per node */
    Py_ssize_t n, cap;
    int32_t *sid, *depth, *phase, *inst, *in_count, *lens_start, *loc_buf, *loc_row, *leaf_idx;
    int64_t *in_start;
    uint64_t *rgbits;
    uint64_t *live;        /* per node: 16-bit counts of live lazy objects of slots 0-3 (0xFFFF: sticky) */
    Py_ssize_t n_lazies;   /* lazy objects of this recorder alive now (all nodes; exact, never saturates) */
    /* inputs */
    IVec in_node, in_slot, lens;
    /* leaves */
    PyObject *leaf_obj;    /* list: tensor or None */
    PyObject *leaf_py;     /* list: python scalar or None */
    IVec leaf_did;         /* per leaf */
    PyObject *pending_leaves; /* dict did -> list of nodes */
    int last_leaf_did;     /* the did add_leaf_c appended to last, and its list there (borrowed; */
    PyObject *last_leaf_list; /* NULL whenever pending_leaves loses an entry) */
    /* buckets */
    Bucket *bk; Py_ssize_t bk_n, bk_cap;
    Py_ssize_t *bk_tab; Py_ssize_t bk_tab_cap;  /* open addressing: index+1 into bk */
    /* state read by the fast path */
    int instance, rphase, inst_steps;
    Py_ssize_t max_steps, max_pending;  /* -1: none */
    Py_ssize_t ops_recorded, n_pending;
    int ragged_on;
    int sig_table;         /* 0: this call records without the signature table (under a torch.func transform) */
    int fast_factories;    /* RecordingAttr hands this thread fast_tensor while this recorder's mode is on top */
    int caller_inference;  /* the caller's inference mode: leaves without a tensor only in it (leaf_mode_ok) */
    PyObject *runtime;
    PyObject *views;       /* dict id(base) -> list of weakrefs */
    PyObject *checked;     /* set of blocks whose fingerprint was checked this call */
    PyObject *chk_last[4]; /* the last blocks added to `checked` (borrowed: the set holds them; emptied
                              with it by clear_checked): found without a set lookup */
    int chk_n;
    PyObject *factory_funcs; /* None, or the functions the Python mode_call gives a default device= */
    PyObject *factory_device; /* None, or the device of the innermost DeviceContext on the mode stack */
    PyObject *dev_dids;    /* dict device -> dict dtype -> did of torch.tensor(scalar) leaves (filled by Python) */
    PyObject *mode;        /* the recording mode (a slot: the C paths read it on every factory call) */
    PyObject *dict;
} RecObject;

static void live_add(PyObject *rec, Py_ssize_t node, int slot, int d) {
    if (!rec || !PyObject_TypeCheck(rec, &RecorderType)) return;
    RecObject *r = (RecObject *)rec;
    r->n_lazies += d;
    if (node < 0 || node >= r->n || slot < 0 || slot > 3 || !r->live) return;
    int sh = slot * 16;
    uint64_t c = (r->live[node] >> sh) & 0xFFFFull;
    if (c == 0xFFFFull) return;  /* saturated: counted as live for good */
    if (d > 0) c++;
    else if (c > 0) c--;
    r->live[node] = (r->live[node] & ~(0xFFFFull << sh)) | (c << sh);
}

static PyObject *rec_mode_ref(PyObject *rec) {
    if (!PyObject_TypeCheck(rec, &RecorderType)) return PyObject_GetAttr(rec, s_mode);
    PyObject *m = ((RecObject *)rec)->mode ? ((RecObject *)rec)->mode : Py_None;
    Py_INCREF(m);
    return m;
}

static int rec_traverse(RecObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->leaf_obj); Py_VISIT(self->leaf_py); Py_VISIT(self->pending_leaves);
    Py_VISIT(self->runtime); Py_VISIT(self->views); Py_VISIT(self->checked); Py_VISIT(self->dict);
    Py_VISIT(self->factory_funcs); Py_VISIT(self->factory_device); Py_VISIT(self->dev_dids); Py_VISIT(self->mode);
    return 0;
}

static int rec_clear_refs(RecObject *self) {
    self->last_leaf_list = NULL;
    Py_CLEAR(self->leaf_obj); Py_CLEAR(self->leaf_py); Py_CLEAR(self->pending_leaves);
    Py_CLEAR(self->runtime); Py_CLEAR(self->views); Py_CLEAR(self->checked); self->chk_n = 0; Py_CLEAR(self->dict);
    Py_CLEAR(self->factory_funcs); Py_CLEAR(self->factory_device); Py_CLEAR(self->dev_dids); Py_CLEAR(self->mode);
    return 0;
}

static void rec_dealloc(RecObject *self) {
    PyObject_GC_UnTrack(self);
    rec_clear_refs(self);
    PyMem_Free(self->sid); PyMem_Free(self->depth); PyMem_Free(self->phase); PyMem_Free(self->inst);
    PyMem_Free(self->in_count); PyMem_Free(self->lens_start); PyMem_Free(self->loc_buf);
    PyMem_Free(self->loc_row); PyMem_Free(self->leaf_idx); PyMem_Free(self->in_start); PyMem_Free(self->rgbits); PyMem_Free(self->live);
    PyMem_Free(self->in_node.v); PyMem_Free(self->in_slot.v); PyMem_Free(self->lens.v); PyMem_Free(self->leaf_did.v);
    for (Py_ssize_t i = 0; i < self->bk_n; i++) PyMem_Free(self->bk[i].nodes.v);
    PyMem_Free(self->bk); PyMem_Free(self->bk_tab);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *rec_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    if (require_setup() < 0) return NULL;
    RecObject *self = (RecObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->leaf_obj = PyList_New(0);
    self->leaf_py = PyList_New(0);
    self->pending_leaves = PyDict_New();
    self->views = PyDict_New();
    self->checked = PySet_New(NULL);
    self->max_steps = -1; self->max_pending = -1;
    self->instance = -1;
    self->ragged_on = 1;
    self->sig_table = 1;
    Py_INCREF(Py_None); self->runtime = Py_None;
    Py_INCREF(Py_None); self->factory_funcs = Py_None;
    Py_INCREF(Py_None); self->factory_device = Py_None;
    self->dev_dids = PyDict_New();
    if (!self->dev_dids || !self->leaf_obj || !self->leaf_py || !self->pending_leaves || !self->views || !self->checked) {
        Py_DECREF(self); return NULL;
    }
    return (PyObject *)self;
}

#define GROW(field, type) do { type *p_ = (type *)PyMem_Realloc(self->field, nc * sizeof(type)); \
    if (!p_) { PyErr_NoMemory(); return -1; } self->field = p_; } while (0)

static int rec_grow_to(RecObject *self, Py_ssize_t nc) {
    GROW(sid, int32_t); GROW(depth, int32_t); GROW(phase, int32_t); GROW(inst, int32_t); GROW(in_count, int32_t);
    GROW(lens_start, int32_t); GROW(loc_buf, int32_t); GROW(loc_row, int32_t); GROW(leaf_idx, int32_t);
    GROW(in_start, int64_t); GROW(rgbits, uint64_t); GROW(live, uint64_t);
    self->cap = nc;
    return 0;
}

static int rec_reserve(RecObject *self) {
    if (self->n < self->cap) return 0;
    return rec_grow_to(self, self->cap ? self->cap * 2 : 1024);
}

static int ivec_reserve(IVec *a, Py_ssize_t n) {
    if (a->cap >= n) return 0;
    int32_t *nv = (int32_t *)PyMem_Realloc(a->v, n * sizeof(int32_t));
    if (!nv) { PyErr_NoMemory(); return -1; }
    a->v = nv; a->cap = n;
    return 0;
}

/* reserve(nodes, inputs): room for that many nodes and node inputs up front (an autobatch object
   passes its last call's counts: the arrays are not grown, copied and grown again every call) */
static PyObject *rec_reserve_py(RecObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "reserve(nodes, inputs)"); return NULL; }
    Py_ssize_t nodes = PyLong_AsSsize_t(args[0]), inputs = PyLong_AsSsize_t(args[1]);
    if ((nodes == -1 || inputs == -1) && PyErr_Occurred()) return NULL;
    if (nodes > self->cap && rec_grow_to(self, nodes) < 0) return NULL;
    if (inputs > 0 && (ivec_reserve(&self->in_node, inputs) < 0 || ivec_reserve(&self->in_slot, inputs) < 0)) return NULL;
    Py_RETURN_NONE;
}

/* (nodes, inputs) recorded so far: the sizes reserve() takes */
/* clear_checked(): every block's fingerprint is checked again at its next call (a default dtype or
   device changed: RecorderBase.forget_block_checks) */
static PyObject *rec_clear_checked(RecObject *self, PyObject *noargs) {
    self->chk_n = 0;
    if (PySet_Clear(self->checked) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *rec_sizes(RecObject *self, PyObject *noargs) {
    return Py_BuildValue("(nn)", self->n, self->in_node.n);
}

static Bucket *bucket_for(RecObject *self, int32_t phase, int32_t depth, int32_t sid) {
    uint64_t h = ((uint64_t)(uint32_t)phase * 1000003ull) ^ ((uint64_t)(uint32_t)depth * 0x9E3779B97F4A7C15ull)
                 ^ ((uint64_t)(uint32_t)sid << 20);
    h ^= h >> 31;
    if (self->bk_tab_cap) {
        Py_ssize_t mask = self->bk_tab_cap - 1, i = (Py_ssize_t)(h & mask);
        for (;;) {
            Py_ssize_t k = self->bk_tab[i];
            if (!k) break;
            Bucket *b = &self->bk[k - 1];
            if (b->phase == phase && b->depth == depth && b->sid == sid) return b;
            i = (i + 1) & mask;
        }
    }
    /* new bucket */
    if (self->bk_n == self->bk_cap) {
        Py_ssize_t nc = self->bk_cap ? self->bk_cap * 2 : 64;
        Bucket *nb = (Bucket *)PyMem_Realloc(self->bk, nc * sizeof(Bucket));
        if (!nb) { PyErr_NoMemory(); return NULL; }
        self->bk = nb; self->bk_cap = nc;
    }
    if ((self->bk_n + 1) * 2 > self->bk_tab_cap) {
        Py_ssize_t nc = self->bk_tab_cap ? self->bk_tab_cap * 2 : 128;
        Py_ssize_t *nt = (Py_ssize_t *)PyMem_Calloc(nc, sizeof(Py_ssize_t));
        if (!nt) { PyErr_NoMemory(); return NULL; }
        for (Py_ssize_t k = 0; k < self->bk_n; k++) {
            Bucket *b = &self->bk[k];
            uint64_t hh = ((uint64_t)(uint32_t)b->phase * 1000003ull) ^ ((uint64_t)(uint32_t)b->depth * 0x9E3779B97F4A7C15ull)
                          ^ ((uint64_t)(uint32_t)b->sid << 20);
            hh ^= hh >> 31;
            Py_ssize_t j = (Py_ssize_t)(hh & (nc - 1));
            while (nt[j]) j = (j + 1) & (nc - 1);
            nt[j] = k + 1;
        }
        PyMem_Free(self->bk_tab);
        self->bk_tab = nt; self->bk_tab_cap = nc;
    }
    Bucket *b = &self->bk[self->bk_n];
    b->phase = phase; b->depth = depth; b->sid = sid;
    b->nodes.v = NULL; b->nodes.n = 0; b->nodes.cap = 0;
    self->bk_n++;
    Py_ssize_t mask = self->bk_tab_cap - 1, i = (Py_ssize_t)(h & mask);
    while (self->bk_tab[i]) i = (i + 1) & mask;
    self->bk_tab[i] = self->bk_n;
    return b;
}

/* Append a node; returns its index or -1. `leaves` are lazy objects (borrowed). */
static Py_ssize_t append_node(RecObject *self, int sid, uint64_t rg_mask, const uint64_t *deps, int n_dep,
                              PyObject *const *leaves, Py_ssize_t nleaves, const int32_t *lens, int nlens) {
    if (rec_reserve(self) < 0) return -1;
    int32_t depth = 0, phase = self->rphase;
    uint64_t bits = rg_mask;
    Py_ssize_t start = self->in_node.n;
    for (Py_ssize_t j = 0; j < nleaves; j++) {
        LazyObject *x = (LazyObject *)leaves[j];
        Py_ssize_t p = x->node;
        if (ivec_push(&self->in_node, (int32_t)p) < 0 || ivec_push(&self->in_slot, x->slot) < 0) return -1;
        if (self->loc_buf[p] < 0 && self->sid[p] != 0) {
            int32_t ph = self->phase[p];
            if (ph > phase) { phase = ph; depth = self->depth[p]; }
            else if (ph == phase && self->depth[p] > depth) depth = self->depth[p];
        }
        if (deps && j < n_dep && ((self->rgbits[p] >> x->slot) & 1)) bits |= deps[j];
    }
    if (self->max_steps >= 0) {
        self->inst_steps++;
        if (self->inst_steps > self->max_steps) {
            PyObject *r = PyObject_CallMethodNoArgs((PyObject *)self, s_step_limit);
            Py_XDECREF(r);
            return -1;
        }
    }
    Py_ssize_t node = self->n++;
    self->sid[node] = sid; self->depth[node] = depth + 1; self->phase[node] = phase; self->inst[node] = self->instance;
    self->rgbits[node] = bits; self->in_start[node] = start; self->in_count[node] = (int32_t)nleaves;
    self->loc_buf[node] = -1; self->loc_row[node] = -1; self->leaf_idx[node] = -1; self->live[node] = 0;
    if (nlens > 0) {
        self->lens_start[node] = (int32_t)self->lens.n;
        if (ivec_push(&self->lens, nlens) < 0) return -1;
        for (int k = 0; k < nlens; k++) if (ivec_push(&self->lens, lens[k]) < 0) return -1;
    } else {
        self->lens_start[node] = -1;
    }
    Bucket *b = bucket_for(self, phase, depth + 1, sid);
    if (!b || ivec_push(&b->nodes, (int32_t)node) < 0) return -1;
    self->n_pending++;
    self->ops_recorded++;
    return node;
}

/* d[key], a list made and stored there if missing (borrowed; NULL with an error set) */
static PyObject *list_at(PyObject *d, PyObject *key) {
    PyObject *lst = PyDict_GetItemWithError(d, key);
    if (lst || PyErr_Occurred()) return lst;
    lst = PyList_New(0);
    if (!lst) return NULL;
    int r = PyDict_SetItem(d, key, lst);
    Py_DECREF(lst);  /* (the dict holds it) */
    return r < 0 ? NULL : lst;
}

static int register_view(RecObject *self, LazyObject *out, PyObject *base) {
    Py_INCREF(base);
    Py_XSETREF(out->base, base);
    PyObject *key = PyLong_FromVoidPtr(base);
    if (!key) return -1;
    PyObject *lst = list_at(self->views, key);
    Py_DECREF(key);
    if (!lst) return -1;
    PyObject *w = PyWeakref_NewRef((PyObject *)out, NULL);
    if (!w) return -1;
    int r = PyList_Append(lst, w);
    Py_DECREF(w);
    return r;
}

/* Outputs of node for entry e. */
static PyObject *make_outputs(RecObject *self, SigEntry *e, Py_ssize_t node, PyObject *base) {
    if (e->kind == 0) {
        LazyObject *x = new_lazy((PyObject *)self, node, 0, e->out_dids[0]);
        if (x && e->view && register_view(self, x, base) < 0) { Py_DECREF(x); return NULL; }
        return (PyObject *)x;
    }
    PyObject *t = PyTuple_New(e->n_out);
    if (!t) return NULL;
    for (int s = 0; s < e->n_out; s++) {
        LazyObject *x = new_lazy((PyObject *)self, node, s, e->out_dids[s]);
        if (!x) { Py_DECREF(t); return NULL; }
        if (e->view && register_view(self, x, base) < 0) { Py_DECREF(x); Py_DECREF(t); return NULL; }
        PyTuple_SET_ITEM(t, s, (PyObject *)x);
    }
    if (e->kind == 1) return t;
    PyObject *it = PyObject_GetIter(t);
    Py_DECREF(t);
    if (!it) return NULL;
    PyObject *r = PyObject_CallFunctionObjArgs(g_rebuild, e->out_struct, it, NULL);
    Py_DECREF(it);
    return r;
}

static int after_append(RecObject *self) {
    if (self->max_pending >= 0 && self->n_pending >= self->max_pending && self->runtime != Py_None) {
        PyObject *r = PyObject_CallMethodNoArgs(self->runtime, s_pending_limit);
        if (!r) return -1;
        Py_DECREF(r);
    }
    return 0;
}

/* state word: grad mode, inference mode and autocast's id (each key's signature was inferred
   under them); returns 1 when the slow path must be taken (autocast without an id), -1 on an error */
static inline int state_word(uint64_t *out) {
    int grad = q_grad();
    if (grad < 0) return -1;
    int im = q_inference();
    if (im < 0) return -1;
    uint64_t ac_id = 0;
    int ac = q_any_autocast();
    if (ac < 0) return -1;
    if (ac) {
        int r = autocast_id(&ac_id);
        if (r) return r;
    }
    *out = TAG(K_STATE, (uint64_t)grad | ((uint64_t)im << 1) | (ac_id << 2));
    return 0;
}

typedef struct { uint64_t w[MAXW]; int n; int ok; PyObject *leaves[MAXLEAVES]; Py_ssize_t nleaves; } KeyBuf;

static inline void kpush(KeyBuf *k, uint64_t v) { if (k->n < MAXW) k->w[k->n++] = v; else k->ok = 0; }

/* Encode one argument; lists/tuples of simple items one level deep. */
static void encode_arg(KeyBuf *k, RecObject *rec, PyObject *a, int depth) {
    PyTypeObject *t = Py_TYPE(a);
    if (t == g_LazyType) {
        LazyObject *x = (LazyObject *)a;
        if (x->rec != (PyObject *)rec || k->nleaves >= MAXLEAVES) { k->ok = 0; return; }
        k->leaves[k->nleaves++] = a;
        kpush(k, TAG(K_LAZY, x->did));
    } else if (t == &PyFloat_Type) {
        double d = PyFloat_AS_DOUBLE(a);
        uint64_t bits; memcpy(&bits, &d, 8);
        kpush(k, TAG(K_FLOAT, 0)); kpush(k, bits);
    } else if (t == &PyLong_Type) {
        int of = 0;
        long long v = PyLong_AsLongLongAndOverflow(a, &of);
        if (of || (v == -1 && PyErr_Occurred())) { PyErr_Clear(); k->ok = 0; return; }
        kpush(k, TAG(K_INT, 0)); kpush(k, (uint64_t)v);
    } else if (t == &PyBool_Type) {
        kpush(k, TAG(K_BOOL, a == Py_True));
    } else if (a == Py_None) {
        kpush(k, TAG(K_NONE, 0));
    } else if (a == Py_Ellipsis) {
        kpush(k, TAG(K_ELL, 0));
    } else if ((t == &PyList_Type || t == &PyTuple_Type) && depth == 0) {
        Py_ssize_t n = t == &PyList_Type ? PyList_GET_SIZE(a) : PyTuple_GET_SIZE(a);
        kpush(k, TAG(t == &PyList_Type ? K_LIST : K_TUPLE, n));
        for (Py_ssize_t i = 0; i < n && k->ok; i++)
            encode_arg(k, rec, t == &PyList_Type ? PyList_GET_ITEM(a, i) : PyTuple_GET_ITEM(a, i), 1);
    } else if (t == &PySlice_Type && depth <= 1) {
        PySliceObject *s = (PySliceObject *)a;
        kpush(k, TAG(K_SLICE, 0));
        PyObject *parts[3] = {s->start, s->stop, s->step};
        for (int i = 0; i < 3 && k->ok; i++) {
            PyObject *p = parts[i];
            if (p == Py_None) kpush(k, TAG(K_NONE, 0));
            else if (Py_TYPE(p) == &PyLong_Type) {
                int of = 0;
                long long v = PyLong_AsLongLongAndOverflow(p, &of);
                if (of || (v == -1 && PyErr_Occurred())) { PyErr_Clear(); k->ok = 0; return; }
                kpush(k, TAG(K_INT, 0)); kpush(k, (uint64_t)v);
            } else k->ok = 0;
        }
    } else if (t == &PyUnicode_Type) {
        kpush(k, TAG(K_STR, 0)); kpush(k, (uint64_t)(uintptr_t)a);
    } else if ((PyObject *)t == g_DtypeType) {
        kpush(k, TAG(K_OBJ, 0)); kpush(k, (uint64_t)(uintptr_t)a);
    } else if (PyObject_TypeCheck(a, (PyTypeObject *)g_TensorType) && depth == 0) {
        PyObject *rg = PyObject_GetAttr(a, s_requires_grad);
        if (!rg) { PyErr_Clear(); k->ok = 0; return; }
        kpush(k, TAG(K_TENSOR, rg == Py_True)); kpush(k, (uint64_t)(uintptr_t)a);
        Py_DECREF(rg);
    } else {
        k->ok = 0;
    }
}

/* Slow path: Python general() -> (out, info); registers the key when a node was recorded. */
static PyObject *slow_record(RecObject *self, PyObject *func, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwargs, KeyBuf *k) {
    PyObject *t = PyTuple_New(nargs);
    if (!t) return NULL;
    for (Py_ssize_t i = 0; i < nargs; i++) { Py_INCREF(args[i]); PyTuple_SET_ITEM(t, i, args[i]); }
    PyObject *kw = kwargs ? kwargs : PyDict_New();
    PyObject *res = kw ? PyObject_CallMethodObjArgs((PyObject *)self, s_general, func, t, kw, NULL) : NULL;
    if (!kwargs) Py_XDECREF(kw);
    Py_DECREF(t);
    if (!res) return NULL;
    PyObject *out = PyTuple_GET_ITEM(res, 0), *info = PyTuple_GET_ITEM(res, 1);
    Py_INCREF(out);
    if (k && k->ok && info != Py_None) {
        PyObject *desc = PyObject_CallMethodOneArg((PyObject *)self, s_sig_entry, info);
        if (!desc) { Py_DECREF(res); Py_DECREF(out); return NULL; }
        uint64_t h = hash_words(k->w, k->n);
        if (desc != Py_None && !tab_insert(k->w, k->n, h, desc)) {
            Py_DECREF(desc); Py_DECREF(res); Py_DECREF(out); return NULL;
        }
        Py_DECREF(desc);
    }
    Py_DECREF(res);
    return out;
}

static PyObject *rec_record_impl(PyObject *recobj, PyObject *func, PyObject *const *args, Py_ssize_t nargs,
                                 PyObject *kwargs) {
    RecObject *self = (RecObject *)recobj;
    if (!self->sig_table) return slow_record(self, func, args, nargs, kwargs, NULL);
    KeyBuf k;
    k.n = 0; k.ok = 1; k.nleaves = 0;
    kpush(&k, (uint64_t)(uintptr_t)func);
    kpush(&k, TAG(K_TUPLE, nargs));
    for (Py_ssize_t i = 0; i < nargs && k.ok; i++) encode_arg(&k, self, args[i], 0);
    if (k.ok && kwargs) {
        Py_ssize_t pos = 0; PyObject *kk, *vv;
        kpush(&k, TAG(K_KW, PyDict_GET_SIZE(kwargs)));
        while (k.ok && PyDict_Next(kwargs, &pos, &kk, &vv)) {
            kpush(&k, (uint64_t)(uintptr_t)kk);
            encode_arg(&k, self, vv, 0);
        }
    }
    if (k.ok && k.nleaves == 0) k.ok = 0;   /* no lazy argument: concrete call, on the slow path */
    if (k.ok) {
        uint64_t sw;
        int r = state_word(&sw);
        if (r < 0) return NULL;
        if (r > 0) k.ok = 0; else kpush(&k, sw);
    }
    if (!k.ok) return slow_record(self, func, args, nargs, kwargs, NULL);
    uint64_t h = hash_words(k.w, k.n);
    SigEntry *e = tab_find(k.w, k.n, h);
    if (!e) return slow_record(self, func, args, nargs, kwargs, &k);
    Py_ssize_t node = append_node(self, e->sid, e->rg_mask, e->n_dep ? e->rg_dep : NULL, e->n_dep,
                                  k.leaves, k.nleaves, NULL, 0);
    if (node < 0) return NULL;
    PyObject *out = make_outputs(self, e, node, k.leaves[0]);
    if (!out) return NULL;
    if (after_append(self) < 0) { Py_DECREF(out); return NULL; }
    return out;
}

static PyObject *rec_record(RecObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 2 || nargs > 3) { PyErr_SetString(PyExc_TypeError, "record(func, args, kwargs)"); return NULL; }
    PyObject *fargs = args[1];
    PyObject *kwargs = nargs == 3 && args[2] != Py_None && PyDict_GET_SIZE(args[2]) ? args[2] : NULL;
    PyObject *t = PySequence_Tuple(fargs);
    if (!t) return NULL;
    PyObject *r = rec_record_impl((PyObject *)self, args[0], &PyTuple_GET_ITEM(t, 0), PyTuple_GET_SIZE(t), kwargs);
    Py_DECREF(t);
    return r;
}

/* append(info_desc, leaves, lens): the slow paths' append (desc from _sig_entry). */
static PyObject *rec_append(RecObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) { PyErr_SetString(PyExc_TypeError, "append_desc(desc, leaves, lens, base)"); return NULL; }
    PyObject *desc = args[0], *leaves = args[1], *lens = args[2];
    SigEntry e; memset(&e, 0, sizeof(e));
    PyObject *dids, *deps, *ostruct; unsigned long long rgm;
    if (!PyArg_ParseTuple(desc, "iiOKOiiO", &e.kind, &e.sid, &dids, &rgm, &deps, &e.view, &e.ragged, &ostruct))
        return NULL;
    e.rg_mask = rgm;
    e.n_out = (int)PyTuple_GET_SIZE(dids);
    e.n_dep = (int)PyTuple_GET_SIZE(deps);
    int *out_dids = (int *)PyMem_Malloc((e.n_out + 1) * sizeof(int));
    uint64_t *rg_dep = (uint64_t *)PyMem_Malloc((e.n_dep + 1) * sizeof(uint64_t));
    if (!out_dids || !rg_dep) { PyMem_Free(out_dids); PyMem_Free(rg_dep); return PyErr_NoMemory(); }
    for (int i = 0; i < e.n_out; i++) out_dids[i] = (int)PyLong_AsLong(PyTuple_GET_ITEM(dids, i));
    e.out_dids = out_dids;
    for (int i = 0; i < e.n_dep; i++) rg_dep[i] = PyLong_AsUnsignedLongLongMask(PyTuple_GET_ITEM(deps, i));
    e.rg_dep = rg_dep;
    e.out_struct = ostruct;
    PyObject *seq = PySequence_Fast(leaves, "leaves must be a sequence");
    if (!seq) { PyMem_Free(out_dids); PyMem_Free(rg_dep); return NULL; }
    int32_t lv[64]; int nl = 0;
    if (lens != Py_None) {
        Py_ssize_t m = PySequence_Size(lens);
        if (m > 64) { Py_DECREF(seq); PyMem_Free(out_dids); PyMem_Free(rg_dep); PyErr_SetString(PyExc_ValueError, "too many list arguments"); return NULL; }
        for (Py_ssize_t i = 0; i < m; i++) {
            PyObject *o = PySequence_GetItem(lens, i);
            lv[nl++] = (int32_t)PyLong_AsLong(o);
            Py_XDECREF(o);
        }
    }
    Py_ssize_t nleaves = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < nleaves; i++)
        if (!IS_LAZY(items[i]) || ((LazyObject *)items[i])->rec != (PyObject *)self) {
            Py_DECREF(seq); PyMem_Free(out_dids); PyMem_Free(rg_dep);
            PyErr_SetString(PyExc_TypeError, "append: leaves must be this recorder's lazy values");
            return NULL;
        }
    Py_ssize_t node = append_node(self, e.sid, e.rg_mask, e.n_dep ? e.rg_dep : NULL, e.n_dep, items, nleaves,
                                  lv, nl);
    PyObject *base = args[3];
    PyObject *out = node < 0 ? NULL : make_outputs(self, &e, node, base);
    Py_DECREF(seq);
    PyMem_Free(out_dids); PyMem_Free(rg_dep);
    if (!out) return NULL;
    if (after_append(self) < 0) { Py_DECREF(out); return NULL; }
    return out;
}

/* add_leaf(value, pyvalue, did, rg) -> node */
/* A leaf node (value: tensor or None, pyvalue: Python scalar or None), pending under `did`:
   its index, or -1 with an error. */
static Py_ssize_t add_leaf_c(RecObject *self, PyObject *value, PyObject *pyvalue, int did, int rg) {
    if (rec_reserve(self) < 0) return -1;
    PyObject *lst = self->last_leaf_list;  /* (a model makes its leaves of one or two dids) */
    if (!lst || self->last_leaf_did != did) {
        PyObject *key = PyLong_FromLong(did);
        if (!key) return -1;
        lst = list_at(self->pending_leaves, key);
        Py_DECREF(key);
        if (!lst) return -1;
        self->last_leaf_did = did; self->last_leaf_list = lst;
    }
    Py_ssize_t node = self->n;
    PyObject *nd = PyLong_FromSsize_t(node);
    if (!nd) return -1;
    int r = PyList_Append(lst, nd);
    Py_DECREF(nd);
    if (r < 0 || ivec_push(&self->leaf_did, did) < 0) return -1;
    if (PyList_Append(self->leaf_obj, value) < 0 || PyList_Append(self->leaf_py, pyvalue) < 0) return -1;
    self->n++;
    self->sid[node] = 0; self->depth[node] = 0; self->phase[node] = -1; self->inst[node] = self->instance;
    self->rgbits[node] = rg ? 1 : 0; self->in_start[node] = self->in_node.n; self->in_count[node] = 0;
    self->loc_buf[node] = -1; self->loc_row[node] = -1; self->lens_start[node] = -1; self->live[node] = 0;
    self->leaf_idx[node] = (int32_t)(self->leaf_did.n - 1);
    return node;
}

static PyObject *rec_add_leaf(RecObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) { PyErr_SetString(PyExc_TypeError, "add_leaf(value, pyvalue, did, rg)"); return NULL; }
    int did = (int)PyLong_AsLong(args[2]);
    if (did == -1 && PyErr_Occurred()) return NULL;
    int rg = PyObject_IsTrue(args[3]);
    if (rg < 0) return NULL;
    Py_ssize_t node = add_leaf_c(self, args[0], args[1], did, rg);
    return node < 0 ? NULL : PyLong_FromSsize_t(node);
}

/* did of torch.tensor(v) on the CPU with the default dtype: -1 error, 0 the Python path (an int
   that does not fit int64: eager's error is raised there) */
static int default_cpu_did(PyObject *v) {
    PyTypeObject *t = Py_TYPE(v);
    if (t == &PyBool_Type) return g_bool_did;
    if (t == &PyLong_Type) {
        int of = 0;
        PyLong_AsLongLongAndOverflow(v, &of);
        return of ? 0 : g_int_did;
    }
    PyObject *dt = PyObject_CallNoArgs(g_get_default_dtype);
    if (!dt) return -1;
    PyObject *d = PyDict_GetItemWithError(g_float_dids, dt);
    Py_DECREF(dt);
    if (!d) return PyErr_Occurred() ? -1 : 0;
    return (int)PyLong_AsLong(d);
}

/* 1 when func is one of consts.CONST_FACTORIES (torch.zeros, ones, full, arange, eye) */
static inline int is_const_factory(PyObject *func) {
    if (!g_const_factories) return 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(g_const_factories); i++)
        if (PyTuple_GET_ITEM(g_const_factories, i) == func) return 1;
    return 0;
}

/* 1 when a leaf without a tensor (scalar, list, constant: made at the flush, outside the
   instance's thread state) may stand for a factory's result: the instance runs in the caller's
   inference mode, so the tensor made later is what eager's call made (an inference tensor or
   not); 0: the call makes its tensor now (the general path), -1 on error (reliability #266) */
static inline int leaf_mode_ok(RecObject *rec) {
    int im = q_inference();
    return im < 0 ? -1 : im == rec->caller_inference;
}

/* did of torch.tensor(v, dtype=dt, device=dev) (dt, dev NULL or None when not given): the C path
   for CPU leaves and for devices the Python path has seen this call (rec->dev_dids); 0: the Python
   path; -1: error. Without device=, a DeviceContext's device applies (rec->factory_device). */
static PyObject *g_last_cpu_dev = NULL;  /* a torch.device object last found equal to the CPU */
static int scalar_did(RecObject *rec, PyObject *v, PyObject *dt, PyObject *dev) {
    if (dt == Py_None) dt = NULL;
    if (!dev || dev == Py_None) dev = rec->factory_device;
    PyTypeObject *t = Py_TYPE(v);
    /* a float into int64 fails for nan, inf and 1e30: eager raises at the call, the Python path
       too (recorder.converts_safely); a leaf would convert at the flush (reliability #256) */
    if (dt == g_int64_dtype && t == &PyFloat_Type) return 0;
    if (t == &PyLong_Type) {
        int of = 0;
        PyLong_AsLongLongAndOverflow(v, &of);
        if (of) return 0;
    }
    int cpu = !dev || dev == Py_None || dev == g_cpu_device || dev == g_last_cpu_dev;
    if (!cpu && Py_TYPE(dev) == Py_TYPE(g_cpu_device)) {
        /* `device=p.device` makes a new device object per forward call: remember the last one
           found equal to the CPU (devices are immutable; held, so its address is not reused) */
        cpu = PyObject_RichCompareBool(dev, g_cpu_device, Py_EQ);
        if (cpu < 0) return -1;
        if (cpu) { Py_INCREF(dev); Py_XSETREF(g_last_cpu_dev, dev); }
    }
    if (cpu) {
        if (!dt) return default_cpu_did(v);
        PyObject *d = PyDict_GetItemWithError(g_scalar_dids, dt);
        if (!d) { if (PyErr_Occurred()) PyErr_Clear(); return 0; }
        return (int)PyLong_AsLong(d);
    }
    PyObject *tab = PyDict_GetItemWithError(rec->dev_dids, dev);
    if (!tab) { if (PyErr_Occurred()) PyErr_Clear(); return 0; }
    PyObject *key = dt, *own = NULL;
    if (!key) {
        if (t == &PyBool_Type) key = g_bool_dtype;
        else if (t == &PyLong_Type) key = g_int64_dtype;
        else { own = key = PyObject_CallNoArgs(g_get_default_dtype); if (!own) return -1; }
    }
    PyObject *d = PyDict_GetItemWithError(tab, key);
    Py_XDECREF(own);
    if (!d) { if (PyErr_Occurred()) PyErr_Clear(); return 0; }
    return (int)PyLong_AsLong(d);
}

/* scalar leaf made in C: torch.tensor(int | bool | float) with descriptor `forced_did` (0: the CPU's
   default for v); NULL without an error: the caller takes the Python path */
static PyObject *scalar_leaf(RecObject *self, PyObject *v, int forced_did) {
    int did = forced_did ? forced_did : default_cpu_did(v);
    if (did < 0) return NULL;
    if (!did) return NULL;
    Py_ssize_t nd = add_leaf_c(self, Py_None, v, did, 0);
    return nd < 0 ? NULL : (PyObject *)new_lazy((PyObject *)self, nd, 0, did);
}

/* torch.tensor([word_id]) made in C (recorder.RecorderBase.list_leaf): a list or tuple of 1 to
   MAX_LIST_LEAF Python scalars of one exact type (ints within int64), dtype= NULL/None or one that
   holds any Python scalar (g_scalar_dids: a narrow integer dtype can overflow, and eager raises at
   the call), device= as scalar_did takes it. A leaf of shape (n,) holding a copy of the values
   (the caller may change its list afterwards); gather.stack_leaves makes the leaves of one
   descriptor one tensor. NULL without an error: the caller takes another path. */
#define MAX_LIST_LEAF 64
static PyObject *list_leaf_c(RecObject *self, PyObject *v, PyObject *dt, PyObject *dev) {
    if (!PyList_CheckExact(v) && !PyTuple_CheckExact(v)) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(v);
    if (n < 1 || n > MAX_LIST_LEAF) return NULL;
    PyObject **items = PySequence_Fast_ITEMS(v);
    PyTypeObject *t0 = Py_TYPE(items[0]);
    if (t0 != &PyLong_Type && t0 != &PyFloat_Type && t0 != &PyBool_Type) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (Py_TYPE(items[i]) != t0) return NULL;
        if (t0 == &PyLong_Type) {
            int of = 0;
            PyLong_AsLongLongAndOverflow(items[i], &of);
            if (of) return NULL;
        }
    }
    if (dt == Py_None) dt = NULL;
    if (dt) {
        int known = PyDict_Contains(g_scalar_dids, dt);
        if (known <= 0) { if (known < 0) PyErr_Clear(); return NULL; }
    }
    int elem = scalar_did(self, items[0], dt, dev);
    if (elem <= 0) return NULL;  /* (-1: its error stands) */
    PyObject *key = PyLong_FromLong((long)elem * 128 + (long)n);
    if (!key) return NULL;
    PyObject *d = PyDict_GetItemWithError(g_list_dids, key);  /* borrowed */
    if (!d) {
        if (PyErr_Occurred()) { Py_DECREF(key); return NULL; }
        d = PyObject_CallFunction(g_list_did, "in", elem, n);
        if (!d || PyDict_SetItem(g_list_dids, key, d) < 0) { Py_XDECREF(d); Py_DECREF(key); return NULL; }
        Py_DECREF(d);  /* (the dict holds it) */
    }
    Py_DECREF(key);
    int did = (int)PyLong_AsLong(d);
    if (did <= 0) return NULL;
    PyObject *vals = PyTuple_CheckExact(v) ? Py_NewRef(v) : PyList_AsTuple(v);
    if (!vals) return NULL;
    Py_ssize_t nd = add_leaf_c(self, Py_None, vals, did, 0);
    Py_DECREF(vals);
    return nd < 0 ? NULL : (PyObject *)new_lazy((PyObject *)self, nd, 0, did);
}

/* ---- static-block calls ---------------------------------------------------------------------- */
static PyObject *block_slow(RecObject *self, PyObject *block, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwargs, KeyBuf *kr, KeyBuf *kp) {
    /* Python: block._record_slow(rec, args, kwargs) -> (out, info, ragged: bool | None) */
    PyObject *t = PyTuple_New(nargs);
    if (!t) return NULL;
    for (Py_ssize_t i = 0; i < nargs; i++) { Py_INCREF(args[i]); PyTuple_SET_ITEM(t, i, args[i]); }
    PyObject *kw = kwargs ? kwargs : PyDict_New();
    PyObject *res = kw ? PyObject_CallMethodObjArgs(block, s_block_slow, (PyObject *)self, t, kw, NULL) : NULL;
    if (!kwargs) Py_XDECREF(kw);
    Py_DECREF(t);
    if (!res) return NULL;
    PyObject *out = PyTuple_GET_ITEM(res, 0), *info = PyTuple_GET_ITEM(res, 1), *mode = PyTuple_GET_ITEM(res, 2);
    Py_INCREF(out);
    if (info != Py_None) {
        PyObject *desc = PyObject_CallMethodOneArg((PyObject *)self, s_sig_entry, info);
        if (!desc) { Py_DECREF(res); Py_DECREF(out); return NULL; }
        if (desc != Py_None) {
            if (mode == Py_True && kr && kr->ok) {
                if (!tab_insert(kr->w, kr->n, hash_words(kr->w, kr->n), desc)) goto fail;
            } else if (mode == Py_False && kp && kp->ok) {
                if (!tab_insert(kp->w, kp->n, hash_words(kp->w, kp->n), desc)) goto fail;
                if (kr && kr->ok) {  /* the ragged spelling of this pattern: "use the per-length key" */
                    PyObject *marker = Py_BuildValue("iiNKNiiO", 3, 0, PyTuple_New(0), 0ull, PyTuple_New(0), 0, 0, Py_None);
                    SigEntry *e = marker ? tab_insert(kr->w, kr->n, hash_words(kr->w, kr->n), marker) : NULL;
                    Py_XDECREF(marker);
                    if (!e) goto fail;
                }
            }
        }
        Py_DECREF(desc);
    }
    Py_DECREF(res);
    return out;
fail:
    Py_DECREF(res); Py_DECREF(out);
    return NULL;
}

static inline int lazy_rg(RecObject *self, LazyObject *x) { return (int)((self->rgbits[x->node] >> x->slot) & 1); }

/* Record a call of static block `block` with positional args. */
static PyObject *record_block(RecObject *self, PyObject *block, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwargs) {
    int contains = 0;
    for (int c = 0; c < self->chk_n; c++) if (self->chk_last[c] == block) { contains = 1; break; }
    if (!contains && (contains = PySet_Contains(self->checked, block)) < 0) return NULL;
    if (!contains) {
        PyObject *r = PyObject_CallMethodNoArgs(block, s_check_fp);
        if (!r) return NULL;
        Py_DECREF(r);
        if (PySet_Add(self->checked, block) < 0) return NULL;
        if (self->chk_n < 4) self->chk_last[self->chk_n++] = block;
    }
    /* two spellings: ragged (lists keyed empty/non-empty) and per-length */
    KeyBuf kr, kp;   /* on this frame: a fiber may switch inside the slow path */
    kr.n = 0; kr.ok = self->ragged_on && kwargs == NULL && self->sig_table; kr.nleaves = 0;
    kp.n = 0; kp.ok = kwargs == NULL && self->sig_table; kp.nleaves = 0;
    kpush(&kr, (uint64_t)(uintptr_t)block); kpush(&kp, (uint64_t)(uintptr_t)block);
    kpush(&kr, TAG(K_BLOCK, nargs)); kpush(&kp, TAG(K_BLOCK, nargs));
    int has_list = 0;
    int32_t lens[64]; int nlens = 0;
    PyObject *members[MAXLEAVES]; Py_ssize_t nmem = 0;
    for (Py_ssize_t i = 0; i < nargs && (kr.ok || kp.ok); i++) {
        PyObject *a = args[i];
        PyTypeObject *t = Py_TYPE(a);
        if (t == g_LazyType) {
            LazyObject *x = (LazyObject *)a;
            if (x->rec != (PyObject *)self || kp.nleaves >= MAXLEAVES) { kr.ok = kp.ok = 0; break; }
            uint64_t w = TAG(K_LAZYRG, ((uint64_t)x->did << 1) | lazy_rg(self, x));
            kr.leaves[kr.nleaves++] = a; kp.leaves[kp.nleaves++] = a;
            kpush(&kr, w); kpush(&kp, w);
        } else if (t == &PyList_Type) {
            Py_ssize_t n = PyList_GET_SIZE(a);
            has_list = 1;
            kpush(&kp, TAG(K_LIST, n));
            int did = -1, rg = -1, uniform = 1;
            for (Py_ssize_t j = 0; j < n; j++) {
                PyObject *b = PyList_GET_ITEM(a, j);
                if (Py_TYPE(b) != g_LazyType || ((LazyObject *)b)->rec != (PyObject *)self || kp.nleaves >= MAXLEAVES) {
                    kr.ok = kp.ok = 0; break;
                }
                LazyObject *x = (LazyObject *)b;
                int r = lazy_rg(self, x);
                if (did < 0) { did = x->did; rg = r; }
                else if (x->did != did || r != rg) uniform = 0;
                kp.leaves[kp.nleaves++] = b;
                kpush(&kp, TAG(K_LAZYRG, ((uint64_t)x->did << 1) | r));
            }
            if (!kr.ok && !kp.ok) break;
            if (n == 0) kpush(&kr, TAG(K_RLIST, 0));
            else if (!uniform || nlens >= 64 || nmem + n > MAXLEAVES) kr.ok = 0;
            else {
                kpush(&kr, TAG(K_RLIST, 1)); kpush(&kr, ((uint64_t)did << 1) | rg);
                lens[nlens++] = (int32_t)n;
                for (Py_ssize_t j = 0; j < n; j++) members[nmem++] = PyList_GET_ITEM(a, j);
            }
        } else if (t == &PyTuple_Type) {
            /* a state tuple (h, c): per-length key only (the ragged spelling takes no tuples);
               its lazies are leaves in flatten order, keyed with requires_grad like top-level ones */
            Py_ssize_t n = PyTuple_GET_SIZE(a);
            kr.ok = 0;
            kpush(&kp, TAG(K_TUPLE, n));
            for (Py_ssize_t j = 0; j < n && kp.ok; j++) {
                PyObject *b = PyTuple_GET_ITEM(a, j);
                if (Py_TYPE(b) == g_LazyType) {
                    LazyObject *x = (LazyObject *)b;
                    if (x->rec != (PyObject *)self || kp.nleaves >= MAXLEAVES) { kp.ok = 0; break; }
                    kp.leaves[kp.nleaves++] = b;
                    kpush(&kp, TAG(K_LAZYRG, ((uint64_t)x->did << 1) | lazy_rg(self, x)));
                } else {
                    Py_ssize_t nl = kp.nleaves;
                    encode_arg(&kp, self, b, 1);
                    if (kp.nleaves != nl) kp.ok = 0;
                }
            }
        } else {
            Py_ssize_t before_r = kr.n, before_p = kp.n;
            KeyBuf *bufs[2] = {&kr, &kp};
            for (int q = 0; q < 2; q++) {
                KeyBuf *kb = bufs[q];
                if (!kb->ok) continue;
                Py_ssize_t nl = kb->nleaves;
                encode_arg(kb, self, a, 1);
                if (kb->nleaves != nl) kb->ok = 0;  /* lazies nested in other containers: slow path */
            }
            (void)before_r; (void)before_p;
        }
    }
    if (kr.ok) {
        if (!has_list || nlens == 0) kr.ok = 0;   /* no non-empty list: the per-length spelling */
        else {
            /* length classes: lists with equal lengths share segment ids */
            int32_t firsts[64]; int nf = 0;
            kpush(&kr, TAG(K_CLASS, nlens));
            for (int i = 0; i < nlens; i++) {
                int c = -1;
                for (int q = 0; q < nf; q++) if (firsts[q] == lens[i]) { c = q; break; }
                if (c < 0) { firsts[nf] = lens[i]; c = nf++; }
                kpush(&kr, (uint64_t)c);
            }
            for (Py_ssize_t j = 0; j < nmem; j++) {
                if (kr.nleaves >= MAXLEAVES) { kr.ok = 0; break; }
                kr.leaves[kr.nleaves++] = members[j];
            }
        }
    }
    if (kr.ok || kp.ok) {
        uint64_t sw;
        int r = state_word(&sw);
        if (r < 0) return NULL;
        if (r > 0) { kr.ok = kp.ok = 0; }
        else { kpush(&kr, sw); kpush(&kp, sw); }
    }
    if (kp.ok && kp.nleaves == 0) kr.ok = kp.ok = 0;
    if (kr.ok) {
        SigEntry *e = tab_find(kr.w, kr.n, hash_words(kr.w, kr.n));
        if (e && e->kind != 3) {
            Py_ssize_t node = append_node(self, e->sid, e->rg_mask, NULL, 0, kr.leaves, kr.nleaves, lens, nlens);
            if (node < 0) return NULL;
            PyObject *out = make_outputs(self, e, node, NULL);
            if (out && after_append(self) < 0) { Py_DECREF(out); return NULL; }
            return out;
        }
        if (!e) return block_slow(self, block, args, nargs, kwargs, &kr, kp.ok ? &kp : NULL);
    }
    if (kp.ok) {
        SigEntry *e = tab_find(kp.w, kp.n, hash_words(kp.w, kp.n));
        if (e && e->kind != 3) {
            Py_ssize_t node = append_node(self, e->sid, e->rg_mask, NULL, 0, kp.leaves, kp.nleaves, NULL, 0);
            if (node < 0) return NULL;
            PyObject *out = make_outputs(self, e, node, NULL);
            if (out && after_append(self) < 0) { Py_DECREF(out); return NULL; }
            return out;
        }
        return block_slow(self, block, args, nargs, kwargs, NULL, &kp);
    }
    return block_slow(self, block, args, nargs, kwargs, NULL, NULL);
}

/* ---- execution support ------------------------------------------------------------------------ */
static PyObject *rec_take_buckets(RecObject *self, PyObject *noargs) {
    PyObject *out = PyList_New(self->bk_n);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < self->bk_n; i++) {
        Bucket *b = &self->bk[i];
        PyObject *nodes = PyList_New(b->nodes.n);
        if (!nodes) { Py_DECREF(out); return NULL; }
        for (Py_ssize_t j = 0; j < b->nodes.n; j++) PyList_SET_ITEM(nodes, j, PyLong_FromLong(b->nodes.v[j]));
        PyObject *item = Py_BuildValue("((iii)N)", b->phase, b->depth, b->sid, nodes);
        if (!item) { Py_DECREF(out); return NULL; }
        PyList_SET_ITEM(out, i, item);
        PyMem_Free(b->nodes.v);
    }
    self->bk_n = 0;
    if (self->bk_tab) memset(self->bk_tab, 0, self->bk_tab_cap * sizeof(Py_ssize_t));
    self->n_pending = 0;
    return out;
}

static int nodes_from(PyObject *nodes, IVec *out) {
    PyObject *seq = PySequence_Fast(nodes, "nodes must be a sequence");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    out->v = (int32_t *)PyMem_Malloc((n + 1) * sizeof(int32_t));
    out->n = n; out->cap = n;
    if (!out->v) { Py_DECREF(seq); PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < n; i++) out->v[i] = (int32_t)PyLong_AsLong(items[i]);
    Py_DECREF(seq);
    return PyErr_Occurred() ? -1 : 0;
}

/* ensure a pending leaf has a location (Python stacks the leaves of its descriptor) */
static int ensure_leaf(RecObject *self, Py_ssize_t p) {
    if (self->loc_buf[p] >= 0) return 0;
    int did = self->leaf_did.v[self->leaf_idx[p]];
    PyObject *r = PyObject_CallMethod((PyObject *)self, "materialize_leaves", "i", did);
    if (!r) return -1;
    Py_DECREF(r);
    if (self->loc_buf[p] < 0) { PyErr_SetString(PyExc_RuntimeError, "batchcraft: leaf without location"); return -1; }
    return 0;
}

static PyObject *bytes_of(const int64_t *v, Py_ssize_t n) {
    return PyByteArray_FromStringAndSize((const char *)v, n * (Py_ssize_t)sizeof(int64_t));
}

/* The plan (see plan.py) for rows rows[i] of buffers bufs[i]. */
static PyObject *plan_rows(const int32_t *bufs, const int64_t *rows, Py_ssize_t n) {
    int32_t b0 = bufs[0];
    Py_ssize_t i;
    for (i = 0; i < n; i++) if (bufs[i] != b0) break;
    if (i == n) {
        int64_t r0 = rows[0];
        int inorder = rows[n - 1] - r0 == n - 1;
        for (i = 0; inorder && i < n; i++) if (rows[i] != r0 + i) inorder = 0;
        if (inorder) return Py_BuildValue("(siLn)", "view", b0, (long long)r0, n);
        return Py_BuildValue("(siN)", "index", b0, bytes_of(rows, n));
    }
    /* several sources (any number: a per-instance sequence iterated with `for x in seq` makes one
       buffer per instance and step): pieces in order of first appearance, then a permutation */
    Py_ssize_t cap = 16;
    int32_t *srcs = (int32_t *)PyMem_Malloc(cap * sizeof(int32_t));
    Py_ssize_t *counts = (Py_ssize_t *)PyMem_Malloc(cap * sizeof(Py_ssize_t));
    int ns = 0, last = -1;
    int32_t *which = (int32_t *)PyMem_Malloc(n * sizeof(int32_t));
    if (!which || !srcs || !counts) { PyMem_Free(which); PyMem_Free(srcs); PyMem_Free(counts); return PyErr_NoMemory(); }
    for (i = 0; i < n; i++) {
        int s = (last >= 0 && srcs[last] == bufs[i]) ? last : -1;  /* runs of one source are common */
        for (int q = 0; s < 0 && q < ns; q++) if (srcs[q] == bufs[i]) s = q;
        if (s < 0) {
            if (ns == cap) {
                cap *= 2;
                int32_t *ns_ = (int32_t *)PyMem_Realloc(srcs, cap * sizeof(int32_t));
                if (ns_) srcs = ns_;
                Py_ssize_t *nc_ = ns_ ? (Py_ssize_t *)PyMem_Realloc(counts, cap * sizeof(Py_ssize_t)) : NULL;
                if (nc_) counts = nc_;
                if (!ns_ || !nc_) { PyMem_Free(which); PyMem_Free(srcs); PyMem_Free(counts); return PyErr_NoMemory(); }
            }
            srcs[ns] = bufs[i]; counts[ns] = 0; s = ns++;
        }
        which[i] = s; counts[s]++; last = s;
    }
    int64_t **prow = (int64_t **)PyMem_Malloc(ns * sizeof(int64_t *));
    Py_ssize_t *fill = (Py_ssize_t *)PyMem_Calloc(ns, sizeof(Py_ssize_t));
    Py_ssize_t *offs = (Py_ssize_t *)PyMem_Malloc(ns * sizeof(Py_ssize_t));
    int64_t *perm = (int64_t *)PyMem_Malloc(n * sizeof(int64_t));
    PyObject *pieces = PyList_New(ns);
    Py_ssize_t acc = 0;
    for (int q = 0; q < ns; q++) { prow[q] = (int64_t *)PyMem_Malloc((counts[q] + 1) * sizeof(int64_t)); offs[q] = acc; acc += counts[q]; }
    int identity = 1;
    for (i = 0; i < n; i++) {
        int s = which[i];
        perm[i] = offs[s] + fill[s];
        if (perm[i] != i) identity = 0;
        prow[s][fill[s]++] = rows[i];
    }
    for (int q = 0; q < ns; q++) {
        PyList_SET_ITEM(pieces, q, Py_BuildValue("(iN)", srcs[q], bytes_of(prow[q], counts[q])));
        PyMem_Free(prow[q]);
    }
    PyObject *res = identity ? Py_BuildValue("(sNO)", "multi", pieces, Py_None)
                             : Py_BuildValue("(sNN)", "multi", pieces, bytes_of(perm, n));
    PyMem_Free(prow); PyMem_Free(fill); PyMem_Free(offs); PyMem_Free(perm); PyMem_Free(which);
    PyMem_Free(srcs); PyMem_Free(counts);
    return res;
}

/* plan_group(nodes, n_single, n_ragged) -> list of plans (ragged: (plan, seg bytes, counts bytes)) */
static PyObject *rec_plan_group(RecObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "plan_group(nodes, n_single, n_ragged)"); return NULL; }
    IVec nodes;
    if (nodes_from(args[0], &nodes) < 0) return NULL;
    Py_ssize_t n = nodes.n;
    int n_single = (int)PyLong_AsLong(args[1]), n_ragged = (int)PyLong_AsLong(args[2]);
    PyObject *plans = PyList_New(0);
    int32_t *bufs = NULL; int64_t *rows = NULL;
    if (!plans) goto fail;
    bufs = (int32_t *)PyMem_Malloc((n + 1) * sizeof(int32_t));
    rows = (int64_t *)PyMem_Malloc((n + 1) * sizeof(int64_t));
    if (!bufs || !rows) { PyErr_NoMemory(); goto fail; }
    for (int j = 0; j < n_single; j++) {
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t nd = nodes.v[i];
            Py_ssize_t q = self->in_start[nd] + j;
            Py_ssize_t p = self->in_node.v[q];
            if (self->loc_buf[p] < 0 && ensure_leaf(self, p) < 0) goto fail;
            bufs[i] = self->loc_buf[p] + self->in_slot.v[q];
            rows[i] = self->loc_row[p];
        }
        PyObject *pl = plan_rows(bufs, rows, n);
        if (!pl || PyList_Append(plans, pl) < 0) { Py_XDECREF(pl); goto fail; }
        Py_DECREF(pl);
    }
    for (int r = 0; r < n_ragged; r++) {
        Py_ssize_t total = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            int32_t ls = self->lens_start[nodes.v[i]];
            total += self->lens.v[ls + 1 + r];
        }
        int32_t *mb = (int32_t *)PyMem_Malloc((total + 1) * sizeof(int32_t));
        int64_t *mr = (int64_t *)PyMem_Malloc((total + 1) * sizeof(int64_t));
        int64_t *seg = (int64_t *)PyMem_Malloc((total + 1) * sizeof(int64_t));
        int64_t *cnt = (int64_t *)PyMem_Malloc((n + 1) * sizeof(int64_t));
        if (!mb || !mr || !seg || !cnt) { PyMem_Free(mb); PyMem_Free(mr); PyMem_Free(seg); PyMem_Free(cnt); PyErr_NoMemory(); goto fail; }
        Py_ssize_t k = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t nd = nodes.v[i];
            int32_t ls = self->lens_start[nd];
            Py_ssize_t off = self->in_start[nd] + n_single;
            for (int q = 0; q < r; q++) off += self->lens.v[ls + 1 + q];
            int32_t len = self->lens.v[ls + 1 + r];
            cnt[i] = len;
            for (int32_t m = 0; m < len; m++) {
                Py_ssize_t qq = off + m;
                Py_ssize_t p = self->in_node.v[qq];
                if (self->loc_buf[p] < 0 && ensure_leaf(self, p) < 0) {
                    PyMem_Free(mb); PyMem_Free(mr); PyMem_Free(seg); PyMem_Free(cnt); goto fail;
                }
                mb[k] = self->loc_buf[p] + self->in_slot.v[qq];
                mr[k] = self->loc_row[p];
                seg[k] = i;
                k++;
            }
        }
        PyObject *pl = plan_rows(mb, mr, total);
        PyObject *item = pl ? Py_BuildValue("(NNN)", pl, bytes_of(seg, total), bytes_of(cnt, n)) : NULL;
        PyMem_Free(mb); PyMem_Free(mr); PyMem_Free(seg); PyMem_Free(cnt);
        if (!item || PyList_Append(plans, item) < 0) { Py_XDECREF(item); goto fail; }
        Py_DECREF(item);
    }
    PyMem_Free(bufs); PyMem_Free(rows); PyMem_Free(nodes.v);
    return plans;
fail:
    PyMem_Free(bufs); PyMem_Free(rows); PyMem_Free(nodes.v);
    Py_XDECREF(plans);
    return NULL;
}

/* plan_slots(nodes, slots) -> plans of the given single input slots only */
static PyObject *rec_plan_slots(RecObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "plan_slots(nodes, slots)"); return NULL; }
    IVec nodes, slots;
    if (nodes_from(args[0], &nodes) < 0) return NULL;
    if (nodes_from(args[1], &slots) < 0) { PyMem_Free(nodes.v); return NULL; }
    Py_ssize_t n = nodes.n;
    PyObject *plans = PyList_New(0);
    int32_t *bufs = (int32_t *)PyMem_Malloc((n + 1) * sizeof(int32_t));
    int64_t *rows = (int64_t *)PyMem_Malloc((n + 1) * sizeof(int64_t));
    if (!plans || !bufs || !rows) { PyErr_NoMemory(); goto fail; }
    for (Py_ssize_t q = 0; q < slots.n; q++) {
        int j = slots.v[q];
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t nd = nodes.v[i];
            Py_ssize_t k = self->in_start[nd] + j;
            Py_ssize_t p = self->in_node.v[k];
            if (self->loc_buf[p] < 0 && self->sid[p] == 0 && ensure_leaf(self, p) < 0) goto fail;
            if (self->loc_buf[p] < 0) { PyErr_SetString(PyExc_RuntimeError, "batchcraft: hoisted input not computed"); goto fail; }
            bufs[i] = self->loc_buf[p] + self->in_slot.v[k];
            rows[i] = self->loc_row[p];
        }
        PyObject *pl = plan_rows(bufs, rows, n);
        if (!pl || PyList_Append(plans, pl) < 0) { Py_XDECREF(pl); goto fail; }
        Py_DECREF(pl);
    }
    PyMem_Free(bufs); PyMem_Free(rows); PyMem_Free(nodes.v); PyMem_Free(slots.v);
    return plans;
fail:
    PyMem_Free(bufs); PyMem_Free(rows); PyMem_Free(nodes.v); PyMem_Free(slots.v);
    Py_XDECREF(plans);
    return NULL;
}

/* input_depths(nodes, n_single) -> (min node depth, [deepest pending producer per single slot]) */
static PyObject *rec_input_depths(RecObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "input_depths(nodes, n_single)"); return NULL; }
    IVec nodes;
    if (nodes_from(args[0], &nodes) < 0) return NULL;
    int n_single = (int)PyLong_AsLong(args[1]);
    int32_t mind = INT32_MAX;
    int32_t *deep = (int32_t *)PyMem_Calloc(n_single + 1, sizeof(int32_t));
    if (!deep) { PyMem_Free(nodes.v); return PyErr_NoMemory(); }
    for (Py_ssize_t i = 0; i < nodes.n; i++) {
        Py_ssize_t nd = nodes.v[i];
        if (self->depth[nd] < mind) mind = self->depth[nd];
        for (int j = 0; j < n_single && j < self->in_count[nd]; j++) {
            Py_ssize_t p = self->in_node.v[self->in_start[nd] + j];
            if (self->loc_buf[p] >= 0 || self->sid[p] == 0 || self->phase[p] < self->phase[nd]) continue;
            int32_t d = self->phase[p] > self->phase[nd] ? INT32_MAX - 1 : self->depth[p];
            if (d > deep[j]) deep[j] = d;
        }
    }
    PyObject *lst = PyList_New(n_single);
    for (int j = 0; lst && j < n_single; j++) PyList_SET_ITEM(lst, j, PyLong_FromLong(deep[j]));
    PyMem_Free(deep); PyMem_Free(nodes.v);
    return lst ? Py_BuildValue("(iN)", mind == INT32_MAX ? 0 : mind, lst) : NULL;
}

/* relevel(items) -> the new depth of each item, or None. `items` are the node lists of a flush's
   schedule in run order (a group's nodes, or all nodes of a fused recurrence). An item's depth is
   one more than the deepest pending input of the same phase from another item (DyNet's depth
   rule, with a fused recurrence one step deep), and every node of the item is given it, so the
   readers of a recurrence's outputs, recorded at per-step depths, share one depth (schedule.py).
   None (nothing changed) when a node is in two items or an item reads a later one. */
static PyObject *rec_relevel(RecObject *self, PyObject *items) {
    PyObject *seq = PySequence_Fast(items, "relevel(items): a list of node lists");
    if (!seq) return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
    PyObject **its = PySequence_Fast_ITEMS(seq);
    IVec *lists = (IVec *)PyMem_Calloc(m + 1, sizeof(IVec));
    int32_t *member = (int32_t *)PyMem_Malloc((self->n + 1) * sizeof(int32_t));
    int32_t *level = (int32_t *)PyMem_Malloc((m + 1) * sizeof(int32_t));
    PyObject *out = NULL;
    Py_ssize_t got = 0;
    if (!lists || !member || !level) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t k = 0; k < self->n; k++) member[k] = -1;
    int ok = 1;
    for (; got < m; got++) {
        if (nodes_from(its[got], &lists[got]) < 0) { got++; goto done; }
        for (Py_ssize_t i = 0; ok && i < lists[got].n; i++) {
            int32_t nd = lists[got].v[i];
            if (nd < 0 || nd >= self->n) { PyErr_SetString(PyExc_ValueError, "relevel: node out of range"); got++; goto done; }
            if (member[nd] >= 0) ok = 0;
            member[nd] = (int32_t)got;
        }
    }
    for (Py_ssize_t k = 0; ok && k < m; k++) {
        int32_t deep = 0;
        for (Py_ssize_t i = 0; ok && i < lists[k].n; i++) {
            int32_t nd = lists[k].v[i];
            for (int32_t j = 0; j < self->in_count[nd]; j++) {
                int32_t p = self->in_node.v[self->in_start[nd] + j];
                int32_t q = member[p];
                if (q < 0 || q == k || self->phase[p] != self->phase[nd]) continue;
                if (q > k) { ok = 0; break; }
                if (level[q] > deep) deep = level[q];
            }
        }
        level[k] = deep + 1;
    }
    if (!ok) { Py_INCREF(Py_None); out = Py_None; goto done; }
    out = PyList_New(m);
    for (Py_ssize_t k = 0; out && k < m; k++) {
        PyObject *v = PyLong_FromLong(level[k]);
        if (!v) { Py_CLEAR(out); break; }
        PyList_SET_ITEM(out, k, v);
        for (Py_ssize_t i = 0; i < lists[k].n; i++) self->depth[lists[k].v[i]] = level[k];
    }
done:
    if (lists) for (Py_ssize_t k = 0; k < got; k++) PyMem_Free(lists[k].v);
    PyMem_Free(lists); PyMem_Free(member); PyMem_Free(level); Py_DECREF(seq);
    return out;
}

/* place(nodes, buf, base): node i's outputs are row base + i of buffers buf, buf+1...; base may
   instead be a bytes-like object of one int64 row per node (a deduplicated group's rows). */
static PyObject *rec_place(RecObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "place(nodes, buf, base)"); return NULL; }
    IVec nodes;
    if (nodes_from(args[0], &nodes) < 0) return NULL;
    int buf = (int)PyLong_AsLong(args[1]);
    if (buf == -1 && PyErr_Occurred()) { PyMem_Free(nodes.v); return NULL; }
    if (PyLong_Check(args[2])) {
        long base = PyLong_AsLong(args[2]);
        if (base == -1 && PyErr_Occurred()) { PyMem_Free(nodes.v); return NULL; }
        for (Py_ssize_t i = 0; i < nodes.n; i++) {
            self->loc_buf[nodes.v[i]] = buf;
            self->loc_row[nodes.v[i]] = (int32_t)(base + i);
        }
    } else {
        Py_buffer view;
        if (PyObject_GetBuffer(args[2], &view, PyBUF_SIMPLE) < 0) { PyMem_Free(nodes.v); return NULL; }
        if (view.len != nodes.n * (Py_ssize_t)sizeof(int64_t)) {
            PyBuffer_Release(&view); PyMem_Free(nodes.v);
            PyErr_SetString(PyExc_ValueError, "place: one int64 row per node expected");
            return NULL;
        }
        const int64_t *rows = (const int64_t *)view.buf;
        for (Py_ssize_t i = 0; i < nodes.n; i++) {
            if (rows[i] < 0 || rows[i] > INT32_MAX) {
                PyBuffer_Release(&view); PyMem_Free(nodes.v);
                PyErr_SetString(PyExc_ValueError, "place: row out of range");
                return NULL;
            }
            self->loc_buf[nodes.v[i]] = buf;
            self->loc_row[nodes.v[i]] = (int32_t)rows[i];
        }
        PyBuffer_Release(&view);
    }
    PyMem_Free(nodes.v);
    Py_RETURN_NONE;
}

/* chains(nodes, x_slot, h_slot, c_slot) -> per node, the position of its predecessor in `nodes`
   (-1: a chain head), or None when the nodes are not chains that one recurrent-layer call can run
   (chains.py). Node i continues node p when its state inputs are p's outputs (h = slot 0, c =
   slot 1; c_slot -1 for one-state cells). Refused: a node twice, an x input from the nodes, a
   state split between a node and elsewhere, two successors, and (two-state cells) a c output of
   a non-final node read by any other recorded input or held by a live lazy value: the layer call
   returns only the last c of each chain. */
static PyObject *rec_chains(RecObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) { PyErr_SetString(PyExc_TypeError, "chains(nodes, x_slot, h_slot, c_slot)"); return NULL; }
    IVec nodes;
    if (nodes_from(args[0], &nodes) < 0) return NULL;
    int xs = (int)PyLong_AsLong(args[1]), hs = (int)PyLong_AsLong(args[2]), cs = (int)PyLong_AsLong(args[3]);
    if (PyErr_Occurred()) { PyMem_Free(nodes.v); return NULL; }
    Py_ssize_t n = nodes.n;
    int need = xs > hs ? xs : hs;
    if (cs > need) need = cs;
    int32_t *pos = (int32_t *)PyMem_Malloc((self->n + 1) * sizeof(int32_t));
    int32_t *pred = (int32_t *)PyMem_Malloc((n + 1) * sizeof(int32_t));
    int32_t *nsucc = (int32_t *)PyMem_Calloc(n + 1, sizeof(int32_t));
    int32_t *readers = (int32_t *)PyMem_Calloc(n + 1, sizeof(int32_t));
    PyObject *out = NULL;
    if (!pos || !pred || !nsucc || !readers) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t k = 0; k < self->n; k++) pos[k] = -1;
    int ok = 1;
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        Py_ssize_t nd = nodes.v[i];
        if (nd < 0 || nd >= self->n || pos[nd] >= 0 || self->in_count[nd] <= need) ok = 0;
        else pos[nd] = (int32_t)i;
    }
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        Py_ssize_t b = self->in_start[nodes.v[i]];
        if (pos[self->in_node.v[b + xs]] >= 0) { ok = 0; break; }
        Py_ssize_t ph = self->in_node.v[b + hs];
        if (pos[ph] >= 0) {
            if (self->in_slot.v[b + hs] != 0) { ok = 0; break; }
            if (cs >= 0 && (self->in_node.v[b + cs] != ph || self->in_slot.v[b + cs] != 1)) { ok = 0; break; }
            pred[i] = pos[ph];
            if (++nsucc[pred[i]] > 1) { ok = 0; break; }
        } else {
            pred[i] = -1;
            if (cs >= 0 && pos[self->in_node.v[b + cs]] >= 0) { ok = 0; break; }
        }
    }
    if (ok && cs >= 0) {
        for (Py_ssize_t q = 0; q < self->in_node.n; q++) {
            int32_t p = self->in_node.v[q];
            if (self->in_slot.v[q] == 1 && p >= 0 && p < self->n && pos[p] >= 0) readers[pos[p]]++;
        }
        for (Py_ssize_t i = 0; ok && i < n; i++) {
            if (!nsucc[i]) continue;
            if (readers[i] != 1 || ((self->live[nodes.v[i]] >> 16) & 0xFFFFull) != 0) ok = 0;
        }
    }
    if (!ok) { Py_INCREF(Py_None); out = Py_None; goto done; }
    out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *v = PyLong_FromLong(pred[i]);
        if (!v) { Py_CLEAR(out); break; }
        PyList_SET_ITEM(out, i, v);
    }
done:
    PyMem_Free(pos); PyMem_Free(pred); PyMem_Free(nsucc); PyMem_Free(readers); PyMem_Free(nodes.v);
    return out;
}

/* dead_last(nodes, slot) -> (nodes, live) with the nodes whose output `slot` is dead moved to the
   end (each part in its order), `live` the count of the others; None when none is dead (or slot
   > 3, a node twice, out of range). Dead: read by no recorded input and held by no live lazy
   object (the C core counts them per node and slot < 4). Nothing can read such a row later: a
   later operation reaches a value only through its lazy object. The executor then computes that
   output only for the first `live` rows where the program's products allow it (execute.py). */
static PyObject *rec_dead_last(RecObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "dead_last(nodes, slot)"); return NULL; }
    IVec nodes;
    if (nodes_from(args[0], &nodes) < 0) return NULL;
    long slot = PyLong_AsLong(args[1]);
    if (slot == -1 && PyErr_Occurred()) { PyMem_Free(nodes.v); return NULL; }
    Py_ssize_t n = nodes.n;
    PyObject *out = NULL;
    int32_t *pos = NULL;
    uint8_t *read = NULL;
    if (slot < 0 || slot > 3 || n == 0 || !self->live) goto none;
    pos = (int32_t *)PyMem_Malloc((self->n + 1) * sizeof(int32_t));
    read = (uint8_t *)PyMem_Calloc(n + 1, 1);
    if (!pos || !read) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t k = 0; k < self->n; k++) pos[k] = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t nd = nodes.v[i];
        if (nd < 0 || nd >= self->n || pos[nd] >= 0) goto none;
        pos[nd] = (int32_t)i;
    }
    for (Py_ssize_t q = 0; q < self->in_node.n; q++) {
        int32_t p = self->in_node.v[q];
        if (self->in_slot.v[q] == slot && p >= 0 && p < self->n && pos[p] >= 0) read[pos[p]] = 1;
    }
    Py_ssize_t live = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!read[i] && ((self->live[nodes.v[i]] >> (16 * slot)) & 0xFFFFull) == 0) read[i] = 2;  /* dead */
        else live++;
    }
    if (live == n) goto none;
    PyObject *lst = PyList_New(n);
    if (!lst) goto done;
    Py_ssize_t a = 0, b = live;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromSsize_t(nodes.v[i]);
        if (!v) { Py_DECREF(lst); goto done; }
        PyList_SET_ITEM(lst, read[i] == 2 ? b++ : a++, v);
    }
    out = Py_BuildValue("(Nn)", lst, live);
    goto done;
none:
    Py_INCREF(Py_None);
    out = Py_None;
done:
    PyMem_Free(pos); PyMem_Free(read); PyMem_Free(nodes.v);
    return out;
}

/* order_by_input(nodes, j) -> the nodes sorted by where their j-th input lives (buffer, row), or
   None when they already are or an input has no location yet. A group's nodes are independent,
   so any order computes the same values; in this one the j-th argument's gather reads each
   source buffer's rows in order (a view or one index_select per buffer, no permutation). */
typedef struct { int64_t key; int32_t node; } OrdItem;

static int ord_cmp(const void *a, const void *b) {
    const OrdItem *x = (const OrdItem *)a, *y = (const OrdItem *)b;
    if (x->key != y->key) return x->key < y->key ? -1 : 1;
    return x->node < y->node ? -1 : (x->node > y->node);
}

static PyObject *rec_order_by_input(RecObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "order_by_input(nodes, j)"); return NULL; }
    IVec nodes;
    if (nodes_from(args[0], &nodes) < 0) return NULL;
    int j = (int)PyLong_AsLong(args[1]);
    if (j < 0 && PyErr_Occurred()) { PyMem_Free(nodes.v); return NULL; }
    Py_ssize_t n = nodes.n;
    OrdItem *it = (OrdItem *)PyMem_Malloc((n + 1) * sizeof(OrdItem));
    if (!it) { PyMem_Free(nodes.v); return PyErr_NoMemory(); }
    int sorted = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t nd = nodes.v[i];
        if (nd < 0 || nd >= self->n || j >= self->in_count[nd]) goto none;
        Py_ssize_t q = self->in_start[nd] + j;
        Py_ssize_t p = self->in_node.v[q];
        if (self->loc_buf[p] < 0) goto none;
        it[i].key = ((int64_t)(self->loc_buf[p] + self->in_slot.v[q]) << 32) | (uint32_t)self->loc_row[p];
        it[i].node = (int32_t)nd;
        if (i && it[i].key < it[i - 1].key) sorted = 0;
    }
    if (sorted) goto none;
    qsort(it, (size_t)n, sizeof(OrdItem), ord_cmp);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *v = PyLong_FromLong(it[i].node);
        if (!v) { Py_CLEAR(out); break; }
        PyList_SET_ITEM(out, i, v);
    }
    PyMem_Free(it); PyMem_Free(nodes.v);
    return out;
none:
    PyMem_Free(it); PyMem_Free(nodes.v);
    Py_RETURN_NONE;
}

/* order_by_consumers(groups, eligible) -> number of groups reordered. groups: node lists in
   execution order; each eligible one is reordered in place so that its rows are in the order later
   groups read them through single (non-list) arguments: consumer group by consumer group in
   execution order, each slot by slot in its node order; then the nodes nothing later reads, in their old order.
   Groups are visited last to first, so every consumer's order is final when its producers are
   ordered. The Python core's order_by_consumers is the reference. */
typedef struct { int32_t g, node; } ReqItem;
typedef struct { ReqItem *v; Py_ssize_t n, cap; } ReqVec;

static int reqvec_push(ReqVec *a, int32_t g, int32_t node) {
    if (a->n == a->cap) {
        Py_ssize_t nc = a->cap ? a->cap * 2 : 64;
        ReqItem *nv = (ReqItem *)PyMem_Realloc(a->v, nc * sizeof(ReqItem));
        if (!nv) { PyErr_NoMemory(); return -1; }
        a->v = nv; a->cap = nc;
    }
    a->v[a->n].g = g; a->v[a->n].node = node; a->n++;
    return 0;
}

static PyObject *rec_order_by_consumers(RecObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "order_by_consumers(groups: list, eligible)");
        return NULL;
    }
    PyObject *groups = args[0];
    Py_ssize_t G = PyList_GET_SIZE(groups);
    PyObject *elig = PySequence_Fast(args[1], "eligible must be a sequence");
    if (!elig) return NULL;
    if (PySequence_Fast_GET_SIZE(elig) != G) {
        Py_DECREF(elig);
        PyErr_SetString(PyExc_ValueError, "order_by_consumers: one eligible flag per group");
        return NULL;
    }
    long changed = 0;
    int32_t *owner = NULL; char *seen = NULL; ReqVec *req = NULL; int32_t *order = NULL;
    char *el = (char *)PyMem_Calloc((size_t)G + 1, 1);
    if (!el) { Py_DECREF(elig); return PyErr_NoMemory(); }
    int any = 0;
    for (Py_ssize_t g = 0; g < G; g++) {
        int t = PyObject_IsTrue(PySequence_Fast_GET_ITEM(elig, g));
        if (t < 0) goto fail;
        if (t && !PyList_Check(PyList_GET_ITEM(groups, g))) {
            PyErr_SetString(PyExc_TypeError, "order_by_consumers: an eligible group is not a list");
            goto fail;
        }
        el[g] = (char)t; any |= t;
    }
    if (!any) goto done;
    owner = (int32_t *)PyMem_Malloc((self->n + 1) * sizeof(int32_t));
    seen = (char *)PyMem_Calloc((size_t)self->n + 1, 1);
    req = (ReqVec *)PyMem_Calloc((size_t)G + 1, sizeof(ReqVec));
    if (!owner || !seen || !req) { PyErr_NoMemory(); goto fail; }
    for (Py_ssize_t i = 0; i < self->n; i++) owner[i] = -1;
    for (Py_ssize_t g = 0; g < G; g++) {
        if (!el[g]) continue;
        PyObject *lst = PyList_GET_ITEM(groups, g);
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(lst); i++) {
            long nd = PyLong_AsLong(PyList_GET_ITEM(lst, i));
            if (nd == -1 && PyErr_Occurred()) goto fail;
            if (nd < 0 || nd >= self->n) { PyErr_Format(PyExc_IndexError, "node %ld out of range", nd); goto fail; }
            owner[nd] = (int32_t)g;
        }
    }
    for (Py_ssize_t g = G - 1; g >= 0; g--) {
        PyObject *lst = PyList_GET_ITEM(groups, g);
        PyObject *seq = PySequence_Fast(lst, "a group must be a sequence of nodes");
        if (!seq) goto fail;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        if (el[g] && req[g].n) {
            order = (int32_t *)PyMem_Malloc((n + 1) * sizeof(int32_t));
            if (!order) { Py_DECREF(seq); PyErr_NoMemory(); goto fail; }
            Py_ssize_t k = 0, end = req[g].n;
            ReqItem *rv = req[g].v;
            while (end > 0) {  /* chunks of one consumer group, in execution order */
                Py_ssize_t start = end - 1;
                while (start > 0 && rv[start - 1].g == rv[end - 1].g) start--;
                for (Py_ssize_t q = start; q < end; q++) {
                    int32_t p = rv[q].node;
                    if (!seen[p]) { seen[p] = 1; if (k < n) order[k++] = p; }
                }
                end = start;
            }
            int same = 1;
            for (Py_ssize_t i = 0; i < n; i++) {
                long nd = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
                if (!seen[nd] && k < n) order[k++] = (int32_t)nd;
            }
            for (Py_ssize_t i = 0; i < n && same; i++)
                if (PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i)) != order[i]) same = 0;
            Py_DECREF(seq);
            if (k != n) {
                PyErr_SetString(PyExc_RuntimeError, "order_by_consumers: a group's nodes are not distinct");
                goto fail;
            }
            if (!same) {
                for (Py_ssize_t i = 0; i < n; i++) {
                    PyObject *v = PyLong_FromLong(order[i]);
                    if (!v) goto fail;
                    PyList_SetItem(lst, i, v);  /* steals v */
                }
                changed++;
            }
            PyMem_Free(order); order = NULL;
            PyMem_Free(req[g].v); req[g].v = NULL; req[g].n = 0;
            seq = PySequence_Fast(lst, "a group must be a sequence of nodes");
            if (!seq) goto fail;
            n = PySequence_Fast_GET_SIZE(seq);
        }
        /* slot by slot, each in node order: every slot a consumer reads from one producer is
           then a contiguous run of its rows (MV-RNN's left and right children) */
        int32_t max_cnt = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            long nd = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
            if (nd < 0 || nd >= self->n) {
                Py_DECREF(seq);
                if (!PyErr_Occurred()) PyErr_Format(PyExc_IndexError, "node %ld out of range", nd);
                goto fail;
            }
            if (self->in_count[nd] > max_cnt) max_cnt = self->in_count[nd];
        }
        for (int32_t j = 0; j < max_cnt; j++) {
            for (Py_ssize_t i = 0; i < n; i++) {
                long nd = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
                int32_t cnt = self->in_count[nd];
                int32_t ls = self->lens_start[nd];
                if (ls >= 0) {
                    int32_t m = self->lens.v[ls];
                    for (int32_t r = 0; r < m; r++) cnt -= self->lens.v[ls + 1 + r];
                }
                if (j >= cnt) continue;
                int32_t p = self->in_node.v[self->in_start[nd] + j];
                int32_t o = owner[p];
                if (o >= 0 && o < g && reqvec_push(&req[o], (int32_t)g, p) < 0) { Py_DECREF(seq); goto fail; }
            }
        }
        Py_DECREF(seq);
    }
done:
    if (req) for (Py_ssize_t g = 0; g < G; g++) PyMem_Free(req[g].v);
    PyMem_Free(req); PyMem_Free(owner); PyMem_Free(seen); PyMem_Free(el); PyMem_Free(order);
    Py_DECREF(elig);
    return PyLong_FromLong(changed);
fail:
    if (req) for (Py_ssize_t g = 0; g < G; g++) PyMem_Free(req[g].v);
    PyMem_Free(req); PyMem_Free(owner); PyMem_Free(seen); PyMem_Free(el); PyMem_Free(order);
    Py_DECREF(elig);
    return NULL;
}

/* ---- accessors for the Python slow paths ------------------------------------------------------- */
static int check_node(RecObject *self, Py_ssize_t nd) {
    if (nd < 0 || nd >= self->n) { PyErr_Format(PyExc_IndexError, "node %zd out of range", nd); return -1; }
    return 0;
}

#define NODE_ARG(name) Py_ssize_t nd = PyLong_AsSsize_t(arg); if (nd == -1 && PyErr_Occurred()) return NULL; \
    if (check_node(self, nd) < 0) return NULL;

static PyObject *rec_node_sid(RecObject *self, PyObject *arg) { NODE_ARG(); return PyLong_FromLong(self->sid[nd]); }
static PyObject *rec_node_inst(RecObject *self, PyObject *arg) { NODE_ARG(); return PyLong_FromLong(self->inst[nd]); }
static PyObject *rec_is_done(RecObject *self, PyObject *arg) { NODE_ARG(); return PyBool_FromLong(self->loc_buf[nd] >= 0); }
static PyObject *rec_location(RecObject *self, PyObject *arg) {
    NODE_ARG(); return Py_BuildValue("(ii)", self->loc_buf[nd], self->loc_row[nd]);
}
static PyObject *rec_node_inputs(RecObject *self, PyObject *arg) {
    NODE_ARG();
    int32_t c = self->in_count[nd];
    PyObject *t = PyTuple_New(c);
    if (!t) return NULL;
    for (int32_t i = 0; i < c; i++) {
        Py_ssize_t q = self->in_start[nd] + i;
        PyTuple_SET_ITEM(t, i, Py_BuildValue("(ii)", self->in_node.v[q], self->in_slot.v[q]));
    }
    return t;
}
static PyObject *rec_node_lens(RecObject *self, PyObject *arg) {
    NODE_ARG();
    int32_t ls = self->lens_start[nd];
    if (ls < 0) Py_RETURN_NONE;
    int32_t m = self->lens.v[ls];
    PyObject *t = PyTuple_New(m);
    for (int32_t i = 0; t && i < m; i++) PyTuple_SET_ITEM(t, i, PyLong_FromLong(self->lens.v[ls + 1 + i]));
    return t;
}
static PyObject *rec_rg_bit(RecObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t nd = PyLong_AsSsize_t(args[0]); int s = (int)PyLong_AsLong(args[1]);
    if (PyErr_Occurred() || check_node(self, nd) < 0) return NULL;
    return PyLong_FromLong((long)((self->rgbits[nd] >> s) & 1));
}
static PyObject *rec_set_rg_bit(RecObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t nd = PyLong_AsSsize_t(args[0]); int s = (int)PyLong_AsLong(args[1]); int v = PyObject_IsTrue(args[2]);
    if (PyErr_Occurred() || check_node(self, nd) < 0) return NULL;
    if (v) self->rgbits[nd] |= (1ull << s); else self->rgbits[nd] &= ~(1ull << s);
    Py_RETURN_NONE;
}
static PyObject *rec_leaf_did(RecObject *self, PyObject *arg) {
    NODE_ARG();
    if (self->leaf_idx[nd] < 0) { PyErr_SetString(PyExc_ValueError, "not a leaf"); return NULL; }
    return PyLong_FromLong(self->leaf_did.v[self->leaf_idx[nd]]);
}
static PyObject *rec_leaf_record(RecObject *self, PyObject *arg) {
    /* [tensor or None, pyvalue or None, did] (a new list; set_leaf writes back) */
    NODE_ARG();
    int32_t li = self->leaf_idx[nd];
    if (li < 0) { PyErr_SetString(PyExc_ValueError, "not a leaf"); return NULL; }
    return Py_BuildValue("[OOi]", PyList_GET_ITEM(self->leaf_obj, li), PyList_GET_ITEM(self->leaf_py, li),
                         self->leaf_did.v[li]);
}
static PyObject *rec_set_leaf(RecObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "set_leaf(node, tensor, pyvalue)"); return NULL; }
    Py_ssize_t nd = PyLong_AsSsize_t(args[0]);
    if (PyErr_Occurred() || check_node(self, nd) < 0) return NULL;
    int32_t li = self->leaf_idx[nd];
    if (li < 0) { PyErr_SetString(PyExc_ValueError, "not a leaf"); return NULL; }
    Py_INCREF(args[1]); PyList_SetItem(self->leaf_obj, li, args[1]);
    Py_INCREF(args[2]); PyList_SetItem(self->leaf_py, li, args[2]);
    Py_RETURN_NONE;
}
static PyObject *rec_take_pending_leaves(RecObject *self, PyObject *arg) {
    /* the pending leaf nodes of descriptor `arg` (removed), as a list */
    PyObject *lst = PyDict_GetItemWithError(self->pending_leaves, arg);
    if (!lst) { if (PyErr_Occurred()) return NULL; return PyList_New(0); }
    Py_INCREF(lst);
    self->last_leaf_list = NULL;
    if (PyDict_DelItem(self->pending_leaves, arg) < 0) { Py_DECREF(lst); return NULL; }
    return lst;
}
/* take_scalar_values(did) -> (nodes, values bytearray, is_float) for pending scalar leaves of `did`
   made by torch.tensor(python scalar), or None when any of them holds a tensor (untouched then) */
static PyObject *rec_take_scalar_values(RecObject *self, PyObject *arg) {
    PyObject *lst = PyDict_GetItemWithError(self->pending_leaves, arg);
    if (!lst) { if (PyErr_Occurred()) return NULL; Py_RETURN_NONE; }
    Py_ssize_t n = PyList_GET_SIZE(lst);
    int is_float = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t nd = PyLong_AsSsize_t(PyList_GET_ITEM(lst, i));
        int32_t li = self->leaf_idx[nd];
        PyObject *obj = PyList_GET_ITEM(self->leaf_obj, li), *py = PyList_GET_ITEM(self->leaf_py, li);
        if (obj != Py_None) Py_RETURN_NONE;
        int f = Py_TYPE(py) == &PyFloat_Type;
        if (!f && Py_TYPE(py) != &PyLong_Type && Py_TYPE(py) != &PyBool_Type) Py_RETURN_NONE;
        if (is_float < 0) is_float = f; else if (is_float != f) Py_RETURN_NONE;
    }
    PyObject *buf = PyByteArray_FromStringAndSize(NULL, n * 8);
    if (!buf) return NULL;
    char *data = PyByteArray_AS_STRING(buf);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t nd = PyLong_AsSsize_t(PyList_GET_ITEM(lst, i));
        PyObject *py = PyList_GET_ITEM(self->leaf_py, self->leaf_idx[nd]);
        if (is_float) { double d = PyFloat_AS_DOUBLE(py); memcpy(data + 8 * i, &d, 8); }
        else {
            int of = 0;
            long long v = PyLong_AsLongLongAndOverflow(py, &of);
            if (of) { Py_DECREF(buf); Py_RETURN_NONE; }
            memcpy(data + 8 * i, &v, 8);
        }
    }
    Py_INCREF(lst);
    self->last_leaf_list = NULL;
    if (PyDict_DelItem(self->pending_leaves, arg) < 0) { Py_DECREF(lst); Py_DECREF(buf); return NULL; }
    return Py_BuildValue("(NNO)", lst, buf, is_float ? Py_True : Py_False);
}

static PyObject *rec_group_instances(RecObject *self, PyObject *arg) {
    IVec nodes;
    if (nodes_from(arg, &nodes) < 0) return NULL;
    PyObject *out = PyList_New(nodes.n);
    for (Py_ssize_t i = 0; out && i < nodes.n; i++) PyList_SET_ITEM(out, i, PyLong_FromLong(self->inst[nodes.v[i]]));
    PyMem_Free(nodes.v);
    return out;
}
static PyObject *rec_mode_scalar(RecObject *self, PyObject *v) {
    PyObject *r = scalar_leaf(self, v, 0);
    if (!r && !PyErr_Occurred()) Py_RETURN_NONE;
    return r;
}
static PyObject *rec_record_block(RecObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "record_block(block, args, kwargs)"); return NULL; }
    PyObject *t = PySequence_Tuple(args[1]);
    if (!t) return NULL;
    PyObject *kw = args[2] != Py_None && PyDict_GET_SIZE(args[2]) ? args[2] : NULL;
    PyObject *r = record_block(self, args[0], &PyTuple_GET_ITEM(t, 0), PyTuple_GET_SIZE(t), kw);
    Py_DECREF(t);
    return r;
}

static PyObject *rec_get_max(RecObject *self, void *which) {
    Py_ssize_t v = which ? self->max_pending : self->max_steps;
    if (v < 0) Py_RETURN_NONE;
    return PyLong_FromSsize_t(v);
}
static int rec_set_max(RecObject *self, PyObject *value, void *which) {
    Py_ssize_t v = (value == NULL || value == Py_None) ? -1 : PyLong_AsSsize_t(value);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (which) self->max_pending = v; else self->max_steps = v;
    return 0;
}
static PyObject *rec_get_dict(RecObject *self, void *closure) {
    if (!self->dict) { self->dict = PyDict_New(); if (!self->dict) return NULL; }
    Py_INCREF(self->dict);
    return self->dict;
}

static PyGetSetDef rec_getset[] = {
    {"max_steps", (getter)rec_get_max, (setter)rec_set_max, "per-instance step limit", NULL},
    {"max_pending", (getter)rec_get_max, (setter)rec_set_max, "pending-node limit", (void *)1},
    {"__dict__", (getter)rec_get_dict, NULL, NULL, NULL},
    {NULL}
};

static PyMemberDef rec_members[] = {
    {"instance", T_INT, offsetof(RecObject, instance), 0, "instance now recording"},
    {"phase", T_INT, offsetof(RecObject, rphase), 0, "its phase"},
    {"inst_steps", T_INT, offsetof(RecObject, inst_steps), 0, "its steps"},
    {"ops_recorded", T_PYSSIZET, offsetof(RecObject, ops_recorded), 0, "operations recorded"},
    {"n_pending", T_PYSSIZET, offsetof(RecObject, n_pending), READONLY, "nodes waiting"},
    {"n_nodes", T_PYSSIZET, offsetof(RecObject, n), READONLY, "nodes recorded (leaves included)"},
    {"n_lazies", T_PYSSIZET, offsetof(RecObject, n_lazies), READONLY,
     "lazy values of this recorder alive now (runtime.py: none beyond the outputs means none was stored)"},
    {"ragged_on", T_INT, offsetof(RecObject, ragged_on), 0, "ragged block keys enabled"},
    {"sig_table", T_INT, offsetof(RecObject, sig_table), 0,
     "0: every call takes the Python path (signatures of a call under a transform stay in its own namespace)"},
    {"fast_factories", T_INT, offsetof(RecObject, fast_factories), 0, "torch.tensor reads give fast_tensor in this recorder's thread"},
    {"caller_inference", T_INT, offsetof(RecObject, caller_inference), 0, "the caller's inference mode (0/1)"},
    {"runtime", T_OBJECT, offsetof(RecObject, runtime), 0, "owning runtime"},
    {"views", T_OBJECT, offsetof(RecObject, views), READONLY, "id(base) -> weakrefs of its views"},
    {"checked_blocks", T_OBJECT, offsetof(RecObject, checked), READONLY, "blocks checked this call (emptied by clear_checked only)"},
    {"factory_device", T_OBJECT, offsetof(RecObject, factory_device), 0,
     "None, or the device factory calls without device= use (a DeviceContext below the mode)"},
    {"dev_dids", T_OBJECT, offsetof(RecObject, dev_dids), READONLY,
     "device -> dtype -> did of scalar leaves on that device (filled by RecorderBase.scalar_leaf)"},
    {"factory_funcs", T_OBJECT, offsetof(RecObject, factory_funcs), 0,
     "None, or a set of factory functions that the mode sends to mode_call (a default device applies)"},
    {"mode", T_OBJECT, offsetof(RecObject, mode), 0, "the recording torch-function mode, or None"},
    {NULL}
};

static PyMethodDef rec_methods[] = {
    {"record", (PyCFunction)(void (*)(void))rec_record, METH_FASTCALL, "record(func, args, kwargs)"},
    {"append_desc", (PyCFunction)(void (*)(void))rec_append, METH_FASTCALL, "append_desc(desc, leaves, lens, base)"},
    {"add_leaf", (PyCFunction)(void (*)(void))rec_add_leaf, METH_FASTCALL, "add_leaf(value, pyvalue, did, rg)"},
    {"record_block", (PyCFunction)(void (*)(void))rec_record_block, METH_FASTCALL, "record_block(block, args, kwargs)"},
    {"take_buckets", (PyCFunction)rec_take_buckets, METH_NOARGS, "remove and return the pending buckets"},
    {"plan_group", (PyCFunction)(void (*)(void))rec_plan_group, METH_FASTCALL, "gather plans of a group"},
    {"chains", (PyCFunction)(void (*)(void))rec_chains, METH_FASTCALL,
     "chains(nodes, x_slot, h_slot, c_slot) -> predecessor positions (-1: head), or None (chains.py)"},
    {"order_by_input", (PyCFunction)(void (*)(void))rec_order_by_input, METH_FASTCALL,
     "order_by_input(nodes, j) -> nodes sorted by their j-th input's (buffer, row), or None"},
    {"order_by_consumers", (PyCFunction)(void (*)(void))rec_order_by_consumers, METH_FASTCALL,
     "order_by_consumers(groups, eligible) -> groups reordered in place so rows are in their readers' order"},
    {"dead_last", (PyCFunction)(void (*)(void))rec_dead_last, METH_FASTCALL,
     "dead_last(nodes, slot) -> (nodes, live) with the nodes whose output slot is dead last, or None"},
    {"place", (PyCFunction)(void (*)(void))rec_place, METH_FASTCALL, "place(nodes, buf, base)"},
    {"plan_slots", (PyCFunction)(void (*)(void))rec_plan_slots, METH_FASTCALL, "plans of some single slots"},
    {"input_depths", (PyCFunction)(void (*)(void))rec_input_depths, METH_FASTCALL, "depths of pending inputs"},
    {"relevel", (PyCFunction)rec_relevel, METH_O, "relevel(items): one depth per item of a schedule"},
    {"node_sid", (PyCFunction)rec_node_sid, METH_O, NULL},
    {"node_inst", (PyCFunction)rec_node_inst, METH_O, NULL},
    {"node_inputs", (PyCFunction)rec_node_inputs, METH_O, NULL},
    {"node_lens", (PyCFunction)rec_node_lens, METH_O, NULL},
    {"is_done", (PyCFunction)rec_is_done, METH_O, NULL},
    {"location", (PyCFunction)rec_location, METH_O, NULL},
    {"rg_bit", (PyCFunction)(void (*)(void))rec_rg_bit, METH_FASTCALL, NULL},
    {"set_rg_bit", (PyCFunction)(void (*)(void))rec_set_rg_bit, METH_FASTCALL, NULL},
    {"leaf_did", (PyCFunction)rec_leaf_did, METH_O, NULL},
    {"leaf_record", (PyCFunction)rec_leaf_record, METH_O, NULL},
    {"set_leaf", (PyCFunction)(void (*)(void))rec_set_leaf, METH_FASTCALL, NULL},
    {"take_pending_leaves", (PyCFunction)rec_take_pending_leaves, METH_O, NULL},
    {"reserve", (PyCFunction)(void (*)(void))rec_reserve_py, METH_FASTCALL, NULL},
    {"sizes", (PyCFunction)rec_sizes, METH_NOARGS, NULL},
    {"clear_checked", (PyCFunction)rec_clear_checked, METH_NOARGS, "forget which blocks' fingerprints were checked"},
    {"group_instances", (PyCFunction)rec_group_instances, METH_O, NULL},
    {"take_scalar_values", (PyCFunction)rec_take_scalar_values, METH_O, NULL},
    {"mode_scalar", (PyCFunction)rec_mode_scalar, METH_O, NULL},
    {NULL}
};

static PyTypeObject RecorderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "batchcraft.autobatching._core.Recorder",
    .tp_basicsize = sizeof(RecObject),
    .tp_dictoffset = offsetof(RecObject, dict),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The graph of one autobatch call in C arrays, and its recording hot path.",
    .tp_traverse = (traverseproc)rec_traverse,
    .tp_clear = (inquiry)rec_clear_refs,
    .tp_dealloc = (destructor)rec_dealloc,
    .tp_new = rec_new,
    .tp_methods = rec_methods,
    .tp_members = rec_members,
    .tp_getset = rec_getset,
};

/* ------------------------------------------------------------------------------------------ */
/* Mode: the recording torch-function mode                                                    */
/* ------------------------------------------------------------------------------------------ */
/* depth: the torch-function stack's length right after this mode was pushed (see fast_tensor) */
typedef struct { PyObject_HEAD PyObject *recorder; PyObject *dict; Py_ssize_t depth; } ModeObject;

/* a keyword of torch.tensor(scalar, ...) that the C path takes: device= and dtype= (borrowed) */
static int scalar_kws(PyObject *k, PyObject *val, PyObject **dt, PyObject **dev) {
    /* (keyword names from code objects are interned: a pointer compare finds them) */
    static PyObject *s_device = NULL, *s_dtype = NULL;
    if (!s_device) {
        s_device = PyUnicode_InternFromString("device"); s_dtype = PyUnicode_InternFromString("dtype");
        if (!s_device || !s_dtype) PyErr_Clear();  /* (the compares below still answer) */
    }
    if (k == s_device) { *dev = val; return 1; }
    if (k == s_dtype) { *dt = val; return 1; }
    if (PyUnicode_CompareWithASCIIString(k, "device") == 0) { *dev = val; return 1; }
    if (PyUnicode_CompareWithASCIIString(k, "dtype") == 0) { *dt = val; return 1; }
    return 0;
}

/* 1 when the torch call that the mode sees comes from a `__torch_function__` handler (a mode of
   the user's calling `func(*args)` with lazy values), torch's own frames between skipped
   (`handle_torch_function`, `F.relu`); 0 otherwise. The recorder's `for_handler` checks the
   handler's owner (bug #56). A few pointer compares for a call from user code. */
static inline int code_is_handler(PyCodeObject *co) {
    return co->co_name == s_dunder_tf || PyUnicode_Compare(co->co_name, s_dunder_tf) == 0;
}

static inline int code_in_torch(PyCodeObject *co) {
    return g_torch_dir && PyUnicode_Tailmatch(co->co_filename, g_torch_dir, 0, PY_SSIZE_T_MAX, -1) == 1;
}

/* Who made the torch call the mode sees, torch's own frames skipped: 1, a `__torch_function__`
   handler (a mode of the user's calling `func(*args)` with lazy values; the recorder's
   `for_handler` checks the handler's owner, bug #56); 2, the body of a module being imported
   (an import inside instance code: `EPS = torch.tensor(1e-3)` at module level, whose tensor eager
   keeps as a plain tensor, reliability #313; class bodies and exec'd code run per instance and
   record as functions do); 0, anything else (the common case). */
#define CALLER_FUNCTION 0
#define CALLER_HANDLER 1
#define CALLER_MODULE_CODE 2

/* 1 when frame f runs the body of a module that is being imported (its globals' __spec__ has
   _initializing set, as importlib sets it while the module's code runs) */
static int importing_body(PyFrameObject *f, PyCodeObject *co) {
    static PyObject *s_module = NULL, *s_spec = NULL, *s_init = NULL;
    if (!s_module) {
        s_module = PyUnicode_InternFromString("<module>"); s_spec = PyUnicode_InternFromString("__spec__");
        s_init = PyUnicode_InternFromString("_initializing");
        if (!s_module || !s_spec || !s_init) { PyErr_Clear(); s_module = NULL; return 0; }
    }
    if ((co->co_flags & CO_OPTIMIZED) || PyUnicode_Compare(co->co_name, s_module) != 0) return 0;
    PyObject *g = PyFrame_GetGlobals(f);
    if (!g) { PyErr_Clear(); return 0; }
    PyObject *spec = PyDict_Check(g) ? PyDict_GetItemWithError(g, s_spec) : NULL;  /* borrowed */
    int res = 0;
    if (spec && spec != Py_None) {
        PyObject *v = PyObject_GetAttr(spec, s_init);
        res = v ? PyObject_IsTrue(v) == 1 : 0;
        Py_XDECREF(v);
    }
    Py_DECREF(g);
    if (PyErr_Occurred()) PyErr_Clear();
    return res;
}

static int caller_kind(void) {
    PyFrameObject *f = PyEval_GetFrame();
    if (!f || !g_torch_dir) return CALLER_FUNCTION;
    Py_INCREF(f);
    int res = CALLER_FUNCTION, own = 0;
    for (int hop = 0; hop < 8 && f; hop++) {
        PyCodeObject *co = PyFrame_GetCode(f);
        int tf = !own && code_is_handler(co);
        int in_torch = !tf && code_in_torch(co);
        /* (batchcraft's own frames, a module call's Python path, are skipped only to find an
           imported module's body: a handler is looked for up to the first other frame) */
        int in_own = !tf && !in_torch && g_own_dir
                     && PyUnicode_Tailmatch(co->co_filename, g_own_dir, 0, PY_SSIZE_T_MAX, -1) == 1;
        int body = !tf && !in_torch && !in_own && importing_body(f, co);
        Py_DECREF(co);
        if (tf) { res = CALLER_HANDLER; break; }
        if (!in_torch && !in_own) { res = body ? CALLER_MODULE_CODE : CALLER_FUNCTION; break; }
        if (in_own) own = 1;
        if (hop >= 3 && !own) break;  /* (as before: a handler is at most four frames up) */
        PyFrameObject *b = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = b;
    }
    Py_XDECREF(f);
    if (PyErr_Occurred()) PyErr_Clear();
    return res;
}

/* 1 when a lazy value is among the arguments: in them, in lists, tuples and dicts inside them (to
   a depth of 4, 256 items each), or a keyword's value; 1 also where the walk stops early (unsure) */
static int lazy_inside(PyObject *a, int depth) {
    if (PyObject_TypeCheck(a, &LazyBaseType)) return 1;
    if (PyList_CheckExact(a) || PyTuple_CheckExact(a)) {
        Py_ssize_t m = PySequence_Fast_GET_SIZE(a);
        if (m == 0) return 0;
        if (depth >= 4 || m > 256) return 1;
        for (Py_ssize_t j = 0; j < m; j++) if (lazy_inside(PySequence_Fast_GET_ITEM(a, j), depth + 1)) return 1;
    } else if (PyDict_CheckExact(a)) {
        if (PyDict_GET_SIZE(a) == 0) return 0;
        if (depth >= 4 || PyDict_GET_SIZE(a) > 256) return 1;
        Py_ssize_t pos = 0; PyObject *k, *v;
        while (PyDict_Next(a, &pos, &k, &v)) if (lazy_inside(v, depth + 1)) return 1;
    }
    return 0;
}

static int any_lazy_arg(PyObject *targs, PyObject *fkw) {
    if (lazy_inside(targs, 0)) return 1;
    return fkw ? lazy_inside(fkw, 0) : 0;
}

/* A factory call while a default device applies (the recorder's factory_funcs is a set holding
   func): 1, the Python mode_call adds device= as torch's DeviceContext would; 0: the C paths may
   take it; -1: error. */
static int is_device_factory(RecObject *rec, PyObject *func) {
    if (rec->factory_funcs == Py_None || !rec->factory_funcs) return 0;
    return PySet_Contains(rec->factory_funcs, func);
}

/* rec.mode_call(func, args, kwargs or {}): the Python recorder's handling of a call the mode saw */
static PyObject *py_mode_call(PyObject *rec, PyObject *func, PyObject *targs, PyObject *fkw) {
    PyObject *kw = fkw ? fkw : PyDict_New();
    PyObject *r = kw ? PyObject_CallMethodObjArgs(rec, s_mode_call, func, targs, kw, NULL) : NULL;
    if (!fkw) Py_XDECREF(kw);
    return r;
}

/* 1 when no torch-function mode is on the stack (in a mode's handler: torch stashed that mode, so
   a call made now dispatches to nothing), 0 if one is, -1 on error (PyErr_Occurred tells the
   caller; the callers below then answer NULL) */
static int stack_empty(void) {
    Py_ssize_t depth = q_tf_len();
    return depth == 0 ? 1 : (depth < 0 && PyErr_Occurred() ? -1 : 0);
}

/* A property of a tensor from outside the instance (`weight.device` in a model's forward, once
   per instance) read through the mode: nothing to record, nothing written. Torch stashes the mode
   while its handler runs, so with no other mode on the stack and a plain Tensor or Parameter
   (no handler of its own) the getter runs as under DisableTorchFunction, as the Python path
   (RecorderBase.general -> run_concrete) runs it. NULL without error: a tensor result (.data,
   .grad, .T alias shared state: run_concrete keeps them shared) or another case; the Python path
   reads the getter again (getters have no side effects). */
static PyObject *plain_property(PyObject *func, PyObject *a) {
    PyObject *t = (PyObject *)Py_TYPE(a);
    if ((t != g_plain_tensor && t != g_parameter) || stack_empty() != 1) return NULL;
    PyObject *r = PyObject_CallOneArg(func, a);
    if (!r || !PyObject_TypeCheck(r, (PyTypeObject *)g_TensorType)) return r;
    Py_DECREF(r);
    return NULL;
}

/* torch.tensor(a list or tuple of Python ints, floats and bools, dtype=, device=) with the mode
   stashed and no other on the stack: made at once and kept as a per-instance leaf, as the Python
   path (RecorderBase.general -> run_concrete -> leaf) makes it, without that path's two walks
   over the list (Berxit's token ids and key mask: 30 values a sentence, 6 µs a call). NULL
   without error: another case. */
static PyObject *list_tensor_leaf(PyObject *rec, PyObject *func, PyObject *targs, PyObject *fkw) {
    PyObject *v = PyTuple_GET_ITEM(targs, 0);
    if (!PyList_CheckExact(v) && !PyTuple_CheckExact(v)) return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(v);
    PyObject **items = PySequence_Fast_ITEMS(v);
    for (Py_ssize_t i = 0; i < m; i++) {
        PyTypeObject *t = Py_TYPE(items[i]);
        if (t != &PyLong_Type && t != &PyFloat_Type && t != &PyBool_Type) return NULL;
    }
    if (fkw) {
        Py_ssize_t pos = 0; PyObject *k, *val, *dt = NULL, *dev = NULL;
        while (PyDict_Next(fkw, &pos, &k, &val))
            if (!scalar_kws(k, val, &dt, &dev)) return NULL;
    }
    if (stack_empty() != 1) return NULL;
    PyObject *out = PyObject_Call(func, targs, fkw);
    if (!out) return NULL;
    PyObject *r = PyObject_CallMethodOneArg(rec, s_leaf, out);
    Py_DECREF(out);
    return r;
}

/* A constant factory's call (consts.py: torch.zeros((1, h)), torch.full((3,), 2.0), torch.arange(n))
   with Python ints, floats, bools and tuples or lists of ints as arguments and at most dtype= as a
   keyword: a leaf standing for the call's template, found by the call's key (the function, each
   argument with its type, floats by their bits, the dtype and the default dtype) in a cache that
   rec.const_entry fills. const_entry answers anything else itself (a leaf of a tensor made now,
   or the general path's value); NULL without error: the caller takes the Python path. */
static PyObject *const_leaf_c(RecObject *self, PyObject *func, PyObject *targs, PyObject *fkw) {
    uint64_t w[64];
    int n = 0;
    w[n++] = (uint64_t)(uintptr_t)func;
    Py_ssize_t na = PyTuple_GET_SIZE(targs);
    for (Py_ssize_t i = 0; i < na; i++) {
        PyObject *a = PyTuple_GET_ITEM(targs, i);
        PyTypeObject *t = Py_TYPE(a);
        if (n > 52) return NULL;
        if (t == &PyBool_Type) w[n++] = TAG(K_BOOL, a == Py_True);
        else if (t == &PyLong_Type || t == &PyFloat_Type) {
            uint64_t bits;
            if (t == &PyLong_Type) {
                int of = 0;
                long long v = PyLong_AsLongLongAndOverflow(a, &of);
                if (of || (v == -1 && PyErr_Occurred())) { PyErr_Clear(); return NULL; }
                bits = (uint64_t)v;
            } else {
                double d = PyFloat_AS_DOUBLE(a);
                memcpy(&bits, &d, 8);
            }
            w[n++] = TAG(t == &PyLong_Type ? K_INT : K_FLOAT, 0);
            w[n++] = bits;
        } else if (t == &PyTuple_Type || t == &PyList_Type) {
            Py_ssize_t m = PySequence_Fast_GET_SIZE(a);
            PyObject **items = PySequence_Fast_ITEMS(a);
            if (m > 8) return NULL;
            w[n++] = TAG(K_TUPLE, m);
            for (Py_ssize_t j = 0; j < m; j++) {
                if (Py_TYPE(items[j]) != &PyLong_Type) return NULL;
                int of = 0;
                long long v = PyLong_AsLongLongAndOverflow(items[j], &of);
                if (of || (v == -1 && PyErr_Occurred())) { PyErr_Clear(); return NULL; }
                w[n++] = (uint64_t)v;
            }
        } else return NULL;
    }
    if (fkw) {
        Py_ssize_t pos = 0; PyObject *k, *v;
        while (PyDict_Next(fkw, &pos, &k, &v)) {
            if (PyUnicode_CompareWithASCIIString(k, "dtype") != 0) return NULL;
            if (v != Py_None && (PyObject *)Py_TYPE(v) != g_DtypeType) return NULL;
            w[n++] = TAG(K_OBJ, 0); w[n++] = (uint64_t)(uintptr_t)v;  /* (dtypes live as long as torch) */
        }
    }
    PyObject *dd = PyObject_CallNoArgs(g_get_default_dtype);
    if (!dd) return NULL;
    w[n++] = (uint64_t)(uintptr_t)dd;
    Py_DECREF(dd);
    PyObject *key = PyBytes_FromStringAndSize((const char *)w, (Py_ssize_t)n * 8);
    if (!key) return NULL;
    PyObject *entry = PyDict_GetItemWithError(g_const_cache, key);  /* borrowed */
    if (entry) Py_INCREF(entry);
    else {
        if (PyErr_Occurred()) { Py_DECREF(key); return NULL; }
        PyObject *kw = fkw ? Py_NewRef(fkw) : PyDict_New();
        entry = kw ? PyObject_CallMethodObjArgs((PyObject *)self, s_const_entry, func, targs, kw, NULL) : NULL;
        Py_XDECREF(kw);
        if (!entry || !PyTuple_CheckExact(entry)) { Py_DECREF(key); return entry; }  /* an error, or the value */
        if (PyDict_GET_SIZE(g_const_cache) < MAX_CONST_KEYS && PyDict_SetItem(g_const_cache, key, entry) < 0) {
            Py_DECREF(entry); Py_DECREF(key); return NULL;
        }
    }
    Py_DECREF(key);
    int did = PyTuple_GET_SIZE(entry) == 2 ? (int)PyLong_AsLong(PyTuple_GET_ITEM(entry, 0)) : -1;
    Py_ssize_t nd = did > 0 ? add_leaf_c(self, Py_None, PyTuple_GET_ITEM(entry, 1), did, 0) : -1;
    PyObject *r = nd < 0 ? NULL : (PyObject *)new_lazy((PyObject *)self, nd, 0, did);
    Py_DECREF(entry);
    if (!r && !PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "batchcraft: bad constant entry");
    return r;
}

static PyObject *mode_torch_function(ModeObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *func = nargs > 0 ? args[0] : NULL;
    PyObject *fargs = nargs > 2 ? args[2] : NULL;
    PyObject *fkw = nargs > 3 ? args[3] : NULL;
    if (kwnames) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kwnames); i++) {
            PyObject *k = PyTuple_GET_ITEM(kwnames, i);
            if (PyUnicode_CompareWithASCIIString(k, "args") == 0) fargs = args[nargs + i];
            else if (PyUnicode_CompareWithASCIIString(k, "kwargs") == 0) fkw = args[nargs + i];
        }
    }
    if (!func) { PyErr_SetString(PyExc_TypeError, "__torch_function__: missing func"); return NULL; }
    if (fkw == Py_None || (fkw && PyDict_GET_SIZE(fkw) == 0)) fkw = NULL;
    PyObject *targs = fargs && fargs != Py_None ? PySequence_Tuple(fargs) : PyTuple_New(0);
    if (!targs) return NULL;
    PyObject *rec = current_rec();
    PyObject *r = NULL;
    int kind = CALLER_FUNCTION;
    if (!rec) {
        r = PyObject_Call(func, targs, fkw);
    } else if ((kind = caller_kind()) == CALLER_HANDLER) {
        PyObject *kw = fkw ? fkw : PyDict_New();
        r = kw ? PyObject_CallMethodObjArgs(rec, s_for_handler, func, targs, kw, NULL) : NULL;
        if (!fkw) Py_XDECREF(kw);
    } else if (kind == CALLER_MODULE_CODE && !any_lazy_arg(targs, fkw)) {
        r = PyObject_Call(func, targs, fkw);  /* import-time code: plain tensors, as in eager */
    } else if (PyObject_TypeCheck(rec, &RecorderType)) {
        Py_ssize_t n = PyTuple_GET_SIZE(targs);
        if (func == g_set_grad_enabled && n == 1 && !fkw && PyBool_Check(PyTuple_GET_ITEM(targs, 0))) {
            /* `with torch.no_grad():` in instance code (and the runtime's own state restore): the
               Python path's run_concrete calls it under DisableTorchFunction, 4.7 µs; with no
               other mode on the stack that is this plain call (each op reads grad mode itself) */
            int e = stack_empty();
            if (e < 0) { Py_DECREF(targs); return NULL; }
            if (e == 1) {
                r = PyObject_Call(func, targs, NULL);
                Py_DECREF(targs);
                return r;
            }
        }
        if (n == 1 && !fkw && (PyObject *)Py_TYPE(func) == g_method_wrapper) {
            r = plain_property(func, PyTuple_GET_ITEM(targs, 0));
            if (r || PyErr_Occurred()) { Py_DECREF(targs); return r; }
        }
        int is_const = is_const_factory(func);
        if (is_const || func == g_torch_tensor || func == g_torch_as_tensor) {
            int same = leaf_mode_ok((RecObject *)rec);
            if (same <= 0) {  /* (another inference mode: the Python path makes its tensor now) */
                r = same < 0 ? NULL : py_mode_call(rec, func, targs, fkw);
                Py_DECREF(targs);
                return r;
            }
        }
        if ((func == g_torch_tensor || func == g_torch_as_tensor) && n == 1) {
            PyObject *v0 = PyTuple_GET_ITEM(targs, 0);
            if (PyList_CheckExact(v0) || PyTuple_CheckExact(v0)) {
                PyObject *ldt = NULL, *ldev = NULL, *k, *val;
                int kw_ok = 1;
                Py_ssize_t pos = 0;
                while (kw_ok && fkw && PyDict_Next(fkw, &pos, &k, &val)) kw_ok = scalar_kws(k, val, &ldt, &ldev);
                if (kw_ok) {
                    r = list_leaf_c((RecObject *)rec, v0, ldt, ldev);
                    if (r || PyErr_Occurred()) { Py_DECREF(targs); return r; }
                }
            }
            r = list_tensor_leaf(rec, func, targs, fkw);
            if (r || PyErr_Occurred()) { Py_DECREF(targs); return r; }
            PyObject *v = PyTuple_GET_ITEM(targs, 0);
            PyTypeObject *t = Py_TYPE(v);
            int ok = t == &PyLong_Type || t == &PyFloat_Type || t == &PyBool_Type;
            PyObject *dt = NULL, *dev = NULL;
            if (ok && fkw) {
                Py_ssize_t pos = 0; PyObject *k, *val;
                while (ok && PyDict_Next(fkw, &pos, &k, &val)) ok = scalar_kws(k, val, &dt, &dev);
            }
            if (ok) {
                int did = scalar_did((RecObject *)rec, v, dt, dev);
                if (did < 0) { Py_DECREF(targs); return NULL; }
                if (did > 0) {
                    r = scalar_leaf((RecObject *)rec, v, did);
                    if (r || PyErr_Occurred()) { Py_DECREF(targs); return r; }
                }
                /* a (device, dtype) not seen yet, or an int beyond int64: the Python mode_call (a
                   scalar leaf on that device, registered for the C path; or eager's error) */
                r = py_mode_call(rec, func, targs, fkw);
                Py_DECREF(targs);
                return r;
            }
        }
        int dfac = is_device_factory((RecObject *)rec, func);
        if (dfac < 0) { Py_DECREF(targs); return NULL; }
        if (dfac) {
            r = py_mode_call(rec, func, targs, fkw);
            Py_DECREF(targs);
            return r;
        }
        if (is_const) {  /* torch.zeros((1, h)), torch.full((3,), 2.0), torch.arange(n): consts.py */
            r = const_leaf_c((RecObject *)rec, func, targs, fkw);
            if (!r && !PyErr_Occurred()) r = py_mode_call(rec, func, targs, fkw);
            Py_DECREF(targs);
            return r;
        }
        r = rec_record_impl(rec, func, &PyTuple_GET_ITEM(targs, 0), n, fkw);
    } else {
        r = py_mode_call(rec, func, targs, fkw);
    }
    Py_DECREF(targs);
    return r;
}

/* the dict names nn.Module.__getattr__ searches (ModuleAttr below) */
static PyObject *s_key_params = NULL, *s_key_buffers = NULL, *s_key_modules = NULL;

/* tp_descr_get of the C callables set on classes (BlockCall): bound to the instance
   like a Python function */
static PyObject *bind_to_instance(PyObject *self, PyObject *obj, PyObject *type) {
    if (obj == NULL || obj == Py_None) { Py_INCREF(self); return self; }
    return PyMethod_New(self, obj);
}

/* ModuleAttr: a non-data descriptor set on an nn.Module subclass `owner` for one submodule /
   parameter / buffer name while a call records (attrs.py). Python 3.11's attribute lookup on a
   class with __getattr__ formats and clears an AttributeError before calling __getattr__ (about
   1 µs a read); found on the class, the name skips that: the descriptor does
   nn.Module.__getattr__'s lookups (_parameters, _buffers, _modules, in that order) on the live
   dicts. The instance __dict__ still comes first (non-data descriptor). A type that reaches the
   descriptor but has `name` further along its MRO (a mixin after `owner`) gets that definition, as
   without the descriptor, at every read (a base class may be given the name during the call;
   `verified`, the types checked at install, is kept only for the constructor). A miss, or a type
   whose __getattr__ is not `guard`
   (nn.Module's own), raises a bare AttributeError, and the type's __getattr__ then runs. */
typedef struct {
    PyObject_HEAD PyObject *name; PyObject *guard; PyObject *owner; PyObject *verified;
    PyTypeObject *clear_type; unsigned int clear_tag;  /* a type whose MRO walk found nothing, at version tag */
#if DICT_TAGS
    /* the last hit (Python 3.11): the instance __dict__ and its three tables at their version tags,
       and the value found. Borrowed pointers, read only while the __dict__ is the same object at
       the same tag (CPython gives every change, and every new dict, a new tag): it then still holds
       the same tables, and unchanged tables still hold the value. */
    PyObject *c_dict; uint64_t c_dtag;
    PyObject *c_tb[3]; uint64_t c_tbtag[3];
    PyObject *c_value;
#endif
} ModuleAttrObject;

/* the first definition of `name` after `owner` in type t's MRO (borrowed), or NULL */
static PyObject *modattr_after(ModuleAttrObject *self, PyTypeObject *t) {
    PyObject *mro = t->tp_mro;
    if (!mro || !PyTuple_Check(mro)) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(mro), i = 0;
    while (i < n && PyTuple_GET_ITEM(mro, i) != self->owner) i++;
    for (i++; i < n; i++) {
        PyObject *d = ((PyTypeObject *)PyTuple_GET_ITEM(mro, i))->tp_dict;
        PyObject *v = d ? PyDict_GetItemWithError(d, self->name) : NULL;
        if (v) return v;
        if (PyErr_Occurred()) return NULL;
    }
    return NULL;
}

static PyObject *modattr_get(ModuleAttrObject *self, PyObject *obj, PyObject *type) {
    PyTypeObject *t = (obj == NULL || obj == Py_None) ? (type && PyType_Check(type) ? (PyTypeObject *)type : NULL)
                                                      : Py_TYPE(obj);
    if (t) {
        /* every read: a class further along the MRO may have been given the name during the call
           (a base class's property set meanwhile, reliability #139); a walk of a few dicts */
        /* the walk's "nothing later" is kept per type version: any change to the type or a base
           (a class attribute set) gives the type a new tag (CPython's PyType_Modified) */
        /* also kept: whether the type's __getattribute__ is object's. A type with its own (a
           subclass of a class with descriptors) may answer eager's AttributeError itself, before
           __getattr__: for it the descriptor misses (a hostile helper's find, stop 51) */
        static PyObject *s_gab = NULL, *obj_gab = NULL;
        if (!s_gab) {
            if (!(s_gab = PyUnicode_InternFromString("__getattribute__"))) return NULL;
            obj_gab = _PyType_Lookup(&PyBaseObject_Type, s_gab);
        }
        int tagged = (t->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG) != 0;
        int cached = tagged && t == self->clear_type && t->tp_version_tag == self->clear_tag;
        PyObject *later = cached ? NULL : modattr_after(self, t);
        int own_gab = 0;
        if (!cached && !later && !PyErr_Occurred()) {
            own_gab = _PyType_Lookup(t, s_gab) != obj_gab;
            if (!own_gab && tagged) { self->clear_type = t; self->clear_tag = t->tp_version_tag; }
        }
        if (later) {  /* what the lookup finds without the descriptor */
            descrgetfunc f = Py_TYPE(later)->tp_descr_get;
            if (f) return f(later, (obj == Py_None) ? NULL : obj, (PyObject *)t);
            Py_INCREF(later);
            return later;
        }
        if (PyErr_Occurred()) return NULL;
        if (own_gab && obj != NULL && obj != Py_None) goto miss;
    }
    if (obj == NULL || obj == Py_None) {
        PyErr_Format(PyExc_AttributeError, "type object '%s' has no attribute '%U'", t ? t->tp_name : "?", self->name);
        return NULL;
    }
    static PyObject *s_getattr = NULL;
    if (!s_getattr && !(s_getattr = PyUnicode_InternFromString("__getattr__"))) return NULL;
    if (_PyType_Lookup(Py_TYPE(obj), s_getattr) != self->guard) goto miss;
    if (!s_key_params) {
        s_key_params = PyUnicode_InternFromString("_parameters");
        s_key_buffers = PyUnicode_InternFromString("_buffers");
        s_key_modules = PyUnicode_InternFromString("_modules");
        if (!s_key_params || !s_key_buffers || !s_key_modules) return NULL;
    }
    PyObject **dp = _PyObject_GetDictPtr(obj);
    PyObject *d = dp ? *dp : NULL;
    if (!d) goto miss;
#if DICT_TAGS
    /* the same lookups as before give the same value while nothing they read changed: about 800
       instructions a read (six dict lookups) become a few compares, two reads a TreeLSTM node */
    if (d == self->c_dict && PyDict_CheckExact(d) && dict_tag(d) == self->c_dtag) {
        int same = 1;
        for (int i = 0; i < 3 && same; i++)
            same = !self->c_tb[i] || dict_tag(self->c_tb[i]) == self->c_tbtag[i];
        if (same) return Py_NewRef(self->c_value);
    }
    /* tags taken before each lookup and checked again after the hit: a lookup can run Python code
       (a key's __eq__) that changes a table already read; then the hit is not remembered (a
       hostile helper's find, stop 51) */
    uint64_t dtag0 = PyDict_CheckExact(d) ? dict_tag(d) : 0;
    uint64_t seen_tag[3] = {0, 0, 0};
    int cacheable = PyDict_CheckExact(d);
#endif
    PyObject *seen[3] = {NULL, NULL, NULL};  /* the tables read, held while in use */
    PyObject *keys[3] = {s_key_params, s_key_buffers, s_key_modules};
    PyObject *result = NULL;
    int found = 0;
    Py_INCREF(d);
    for (int i = 0; i < 3 && !found; i++) {
        PyObject *tb = PyDict_GetItemWithError(d, keys[i]);
        if (!tb) { if (PyErr_Occurred()) goto done; continue; }
        Py_INCREF(tb);
        seen[i] = tb;
        if (PyDict_CheckExact(tb)) {  /* the common case: no Python-level __contains__ to call */
#if DICT_TAGS
            seen_tag[i] = dict_tag(tb);
#endif
            PyObject *r = PyDict_GetItemWithError(tb, self->name);
            if (!r) { if (PyErr_Occurred()) goto done; continue; }
            result = Py_NewRef(r);
            found = 1;
#if DICT_TAGS
            int unchanged = cacheable && dict_tag(d) == dtag0;
            for (int j = 0; j <= i && unchanged; j++)
                unchanged = !seen[j] || dict_tag(seen[j]) == seen_tag[j];
            if (unchanged) {
                /* (the tables after this one are not read: a change to them cannot change the value) */
                self->c_dict = d; self->c_dtag = dtag0;
                for (int j = 0; j < 3; j++) { self->c_tb[j] = seen[j]; self->c_tbtag[j] = seen[j] ? seen_tag[j] : 0; }
                self->c_value = r;
            }
#endif
            continue;
        }
#if DICT_TAGS
        cacheable = 0;
#endif
        int c = PySequence_Contains(tb, self->name);
        if (c < 0) goto done;
        if (c) { result = PyObject_GetItem(tb, self->name); found = 1; if (!result) goto done; }
    }
done:
    for (int j = 0; j < 3; j++) Py_XDECREF(seen[j]);
    Py_DECREF(d);
    if (found || PyErr_Occurred()) return result;
miss:
    PyErr_SetObject(PyExc_AttributeError, self->name);
    return NULL;
}

static int modattr_traverse(ModuleAttrObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->name); Py_VISIT(self->guard); Py_VISIT(self->owner); Py_VISIT(self->verified);
    return 0;
}

static int modattr_clear(ModuleAttrObject *self) {
    Py_CLEAR(self->name); Py_CLEAR(self->guard); Py_CLEAR(self->owner); Py_CLEAR(self->verified);
    return 0;
}

static void modattr_dealloc(ModuleAttrObject *self) {
    PyObject_GC_UnTrack(self);
    modattr_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *modattr_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    PyObject *name, *guard, *owner, *verified;
    if (!PyArg_ParseTuple(args, "UOO!O!:ModuleAttr", &name, &guard, &PyType_Type, &owner, &PySet_Type, &verified))
        return NULL;
    ModuleAttrObject *self = (ModuleAttrObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    Py_INCREF(name); PyUnicode_InternInPlace(&name); self->name = name;
    Py_INCREF(guard); self->guard = guard;
    Py_INCREF(owner); self->owner = owner;
    Py_INCREF(verified); self->verified = verified;
    return (PyObject *)self;
}

static PyObject *modattr_repr(ModuleAttrObject *self) {
    return PyUnicode_FromFormat("<batchcraft module attribute %R>", self->name);
}

static PyMemberDef modattr_members[] = {
    {"name", T_OBJECT, offsetof(ModuleAttrObject, name), READONLY, "the attribute name"},
    {NULL},
};

static PyTypeObject ModuleAttrType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "batchcraft.autobatching._core.ModuleAttr",
    .tp_basicsize = sizeof(ModuleAttrObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)modattr_traverse,
    .tp_clear = (inquiry)modattr_clear,
    .tp_dealloc = (destructor)modattr_dealloc,
    .tp_descr_get = (descrgetfunc)modattr_get,
    .tp_new = modattr_new,
    .tp_repr = (reprfunc)modattr_repr,
    .tp_members = modattr_members,
    .tp_doc = "ModuleAttr(name, guard, owner, verified): nn.Module.__getattr__'s lookup of one name, as a class attribute.",
};

/* 1 when torch-function modes are enabled and the innermost one is recorder `rec`'s mode (what a
   torch.tensor call would dispatch to), 0 if not, -1 on error. The stack holding exactly as many
   modes as right after that mode was pushed means it is on top: fibers restore the same stack, and
   a mode pushed by instance code makes it longer. */
static int rec_mode_on_top(PyObject *rec) {
    int enabled = q_tf_mode_enabled();
    if (enabled <= 0) return enabled;
    PyObject *mode = rec_mode_ref(rec);
    if (!mode) { PyErr_Clear(); return 0; }
    int is_mode = Py_TYPE(mode) == &ModeType && ((ModeObject *)mode)->recorder == rec;
    Py_ssize_t depth = is_mode ? ((ModeObject *)mode)->depth : -1;
    Py_DECREF(mode);
    if (!is_mode || depth <= 0) return 0;
    Py_ssize_t len = q_tf_len();
    if (len < 0 && PyErr_Occurred()) return -1;
    return len == depth;
}

/* torch.tensor while a call records (ccore.FAST_FACTORIES installs it as torch.tensor): a Python
   scalar becomes a scalar leaf without torch's dispatch to the mode (about 1 µs here); any other
   call, thread or state goes to torch.tensor, which dispatches as usual */
static PyObject *py_fast_tensor(PyObject *m, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *rec = current_rec();
    int same = g_ready && rec && nargs == 1 && PyObject_TypeCheck(rec, &RecorderType) ? leaf_mode_ok((RecObject *)rec) : 0;
    if (same < 0) return NULL;
    if (same) {
        PyObject *v = args[0];
        PyTypeObject *t = Py_TYPE(v);
        int ok = t == &PyLong_Type || t == &PyFloat_Type || t == &PyBool_Type;
        int seq = !ok && (t == &PyList_Type || t == &PyTuple_Type);
        PyObject *dt = NULL, *dev = NULL;
        int kw_ok = 1;
        for (Py_ssize_t i = 0; kw_ok && (ok || seq) && kwnames && i < PyTuple_GET_SIZE(kwnames); i++)
            kw_ok = scalar_kws(PyTuple_GET_ITEM(kwnames, i), args[nargs + i], &dt, &dev);
        if (!kw_ok) ok = seq = 0;
        if (seq) {
            int top = rec_mode_on_top(rec);
            if (top < 0) return NULL;
            if (top) {
                PyObject *r = list_leaf_c((RecObject *)rec, v, dt, dev);
                if (r || PyErr_Occurred()) return r;
            }
        }
        if (ok) {
            int top = rec_mode_on_top(rec);
            if (top < 0) return NULL;
            int did = top ? scalar_did((RecObject *)rec, v, dt, dev) : 0;
            if (did < 0) return NULL;
            if (did > 0) {
                PyObject *r = scalar_leaf((RecObject *)rec, v, did);
                if (r || PyErr_Occurred()) return r;
            }
        }
    }
    return PyObject_Vectorcall(g_torch_tensor, args, nargsf, kwnames);
}

/* ---- RecordingAttr: one module attribute seen differently by the recording thread ------------
   A data descriptor on a ModuleType subclass that ccore.FAST_FACTORIES makes `torch`'s class while
   calls record: `torch.tensor` reads the module's own dict as usual, except that in a thread whose
   C recorder has fast_factories on and whose recording mode is the innermost torch-function mode,
   an unchanged entry reads as `fast`. Other threads, a mode of the user's on top (also when torch
   looks the function up to hand it to that mode), DisableTorchFunction, and any value set after
   install (mock.patch) see the module's dict: `func is torch.tensor` holds for them. An optional
   `other`, a descriptor, answers for an unchanged entry where `fast` does not apply
   (sizeargs.SizeArg: `torch.zeros(n, 2)` with a lazy `n` from a static block's trace). */
typedef struct {
    PyObject_HEAD PyObject *name, *original, *fast, *other;
    /* the module dict's entry at the dict's version tag (Python 3.11; borrowed, held by the dict
       while the tag is unchanged): `torch`'s dict is large, a lookup costs about 180 instructions */
    PyObject *c_dict; uint64_t c_tag; PyObject *c_value;
} RecAttrObject;

/* 1 when the innermost Python frame is a function (not a module or class body, whose names may
   outlive the call: `from torch import tensor` in a module first imported by instance code), not
   a `__torch_function__` handler (a mode of the user's, stashed while it runs, compares `func is
   torch.tensor`), and not torch's own code (TorchScript resolves the function by identity). */
static PyCodeObject *g_last_code = NULL;  /* the code read_by_user_function judged last (a reference) */
static int g_last_ok = 0;

/* The code object of the innermost Python frame, a new reference (NULL: none). PyEval_GetFrame
   makes a frame object for the interpreter's frame (about 45 ns, and its teardown when the
   function returns: once per TreeLSTM node); on CPython 3.11 the code is read from the thread's
   current interpreter frame instead, whose first fields are f_func, f_globals, f_builtins,
   f_locals, f_code (Include/internal/pycore_frame.h). The layout is checked once against
   PyEval_GetFrame (g_iframe_ok) and not used if it differs. */
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
typedef struct { PyObject *f_func, *f_globals, *f_builtins, *f_locals; PyCodeObject *f_code; } IFrameHead;
static int g_iframe_ok = -1;  /* -1 not checked yet, 0 the layout differs, 1 use it */
static PyCodeObject *iframe_code(void) {
    PyThreadState *ts = PyThreadState_Get();
    IFrameHead *f = ts->cframe ? (IFrameHead *)ts->cframe->current_frame : NULL;
    return f ? f->f_code : NULL;
}
#endif
static PyCodeObject *current_code(void) {
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
    if (g_iframe_ok == 1) {
        PyCodeObject *co = iframe_code();
        if (co && PyCode_Check(co)) { Py_INCREF(co); return co; }
    }
#endif
    PyFrameObject *f = PyEval_GetFrame();  /* borrowed */
    if (!f) return NULL;
    PyCodeObject *co = PyFrame_GetCode(f);
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
    if (g_iframe_ok < 0) g_iframe_ok = iframe_code() == co;
#endif
    return co;
}

/* frame_reader() -> 1 when current_code reads the interpreter frame directly, 0 when it asks
   PyEval_GetFrame (another Python, the layout differs), -1 when not checked yet */
static PyObject *py_frame_reader(PyObject *m, PyObject *noargs) {
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
    return PyLong_FromLong(g_iframe_ok);
#else
    return PyLong_FromLong(0);
#endif
}

static int read_by_user_function(void) {
    PyCodeObject *co = current_code();
    if (!co) return 0;
    if (co == g_last_code) { Py_DECREF(co); return g_last_ok; }  /* a recursive model asks from one function */
    int ok = (co->co_flags & CO_OPTIMIZED) && !code_is_handler(co) && !code_in_torch(co);
    if (PyErr_Occurred()) { PyErr_Clear(); ok = 0; }
    Py_XSETREF(g_last_code, co);  /* keeps it alive: the pointer is not reused meanwhile */
    g_last_ok = ok;
    return ok;
}

static PyObject *recattr_get(RecAttrObject *self, PyObject *obj, PyObject *type) {
    if (!obj) { Py_INCREF(self); return (PyObject *)self; }
    PyObject *d = PyModule_Check(obj) ? PyModule_GetDict(obj) : NULL;  /* borrowed */
    PyObject *v;
#if DICT_TAGS
    if (d && d == self->c_dict && dict_tag(d) == self->c_tag) v = self->c_value;
    else {
        uint64_t tag0 = d ? dict_tag(d) : 0;
        v = d ? PyDict_GetItemWithError(d, self->name) : NULL;
        if (v && dict_tag(d) == tag0) {  /* (nothing changed it meanwhile) */
            self->c_dict = d; self->c_tag = tag0; self->c_value = v;
        }
    }
#else
    v = d ? PyDict_GetItemWithError(d, self->name) : NULL;
#endif
    if (!v) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_AttributeError, self->name);  /* module __getattr__ next */
        return NULL;
    }
    if (v == self->original) {
        PyObject *rec = current_rec();
        if (rec && PyObject_TypeCheck(rec, &RecorderType) && ((RecObject *)rec)->fast_factories) {
            int top = rec_mode_on_top(rec);
            if (top < 0) return NULL;
            if (top && read_by_user_function()) { Py_INCREF(self->fast); return self->fast; }
        }
        if (self->other && Py_TYPE(self->other)->tp_descr_get)
            return Py_TYPE(self->other)->tp_descr_get(self->other, obj, type);
    }
    Py_INCREF(v);
    return v;
}


static int recattr_set(RecAttrObject *self, PyObject *obj, PyObject *value) {
    PyObject *d = PyModule_Check(obj) ? PyModule_GetDict(obj) : NULL;
    if (!d) { PyErr_SetString(PyExc_TypeError, "RecordingAttr: not a module"); return -1; }
    /* the value instance code read (the fast one) written back, `torch.tanh = saved`: the
       module keeps torch's function, as in eager */
    if (value && value == self->fast) value = self->original;
    if (value && self->other && Py_TYPE(self->other)->tp_descr_set)  /* (its own wrapper written back) */
        return Py_TYPE(self->other)->tp_descr_set(self->other, obj, value);
    if (value) return PyDict_SetItem(d, self->name, value);
    if (PyDict_DelItem(d, self->name) < 0) {
        if (PyErr_ExceptionMatches(PyExc_KeyError)) { PyErr_Clear(); PyErr_SetObject(PyExc_AttributeError, self->name); }
        return -1;
    }
    return 0;
}

static int recattr_traverse(RecAttrObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->name); Py_VISIT(self->original); Py_VISIT(self->fast); Py_VISIT(self->other);
    return 0;
}

static int recattr_clear(RecAttrObject *self) {
    Py_CLEAR(self->name); Py_CLEAR(self->original); Py_CLEAR(self->fast); Py_CLEAR(self->other);
    return 0;
}

static void recattr_dealloc(RecAttrObject *self) {
    PyObject_GC_UnTrack(self);
    recattr_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *recattr_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    PyObject *name, *original, *fast, *other = NULL;
    if (!PyArg_ParseTuple(args, "UOO|O:RecordingAttr", &name, &original, &fast, &other)) return NULL;
    RecAttrObject *self = (RecAttrObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    Py_INCREF(name); PyUnicode_InternInPlace(&name); self->name = name;
    Py_INCREF(original); self->original = original;
    Py_INCREF(fast); self->fast = fast;
    self->other = other == Py_None ? NULL : Py_XNewRef(other);
    return (PyObject *)self;
}

static PyObject *recattr_repr(RecAttrObject *self) {
    return PyUnicode_FromFormat("<batchcraft recording attribute %R>", self->name);
}

static PyMemberDef recattr_members[] = {
    {"name", T_OBJECT, offsetof(RecAttrObject, name), READONLY, "the attribute name"},
    {"original", T_OBJECT, offsetof(RecAttrObject, original), READONLY, "the value every other reader sees"},
    {"fast", T_OBJECT, offsetof(RecAttrObject, fast), READONLY, "the value the recording thread sees"},
    {NULL},
};

static PyTypeObject RecAttrType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "batchcraft.autobatching._core.RecordingAttr",
    .tp_basicsize = sizeof(RecAttrObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)recattr_traverse,
    .tp_clear = (inquiry)recattr_clear,
    .tp_dealloc = (destructor)recattr_dealloc,
    .tp_descr_get = (descrgetfunc)recattr_get,
    .tp_descr_set = (descrsetfunc)recattr_set,
    .tp_new = recattr_new,
    .tp_repr = (reprfunc)recattr_repr,
    .tp_members = recattr_members,
    .tp_doc = "RecordingAttr(name, original, fast, other=None): a module attribute that reads as `fast` in a thread recording with fast_factories, else through the descriptor `other` if given.",
};

/* named like the function it stands in for (__name__ "tensor", __module__ "torch"), so messages,
   repr and pickle (by name) read as torch.tensor's */
static PyMethodDef fast_tensor_def = {
    "tensor", (PyCFunction)(void (*)(void))py_fast_tensor, METH_FASTCALL | METH_KEYWORDS,
    "torch.tensor while a call records (batchcraft's fast_tensor): scalar leaves made without torch's mode dispatch."};

static int require_setup(void) {
    if (!g_ready) { PyErr_SetString(PyExc_RuntimeError, "batchcraft C core used before setup() (import ccore)"); return -1; }
    return 0;
}

static PyObject *mode_enter(ModeObject *self, PyObject *noargs) {
    if (require_setup() < 0) return NULL;
    PyObject *r = PyObject_CallOneArg(g_tf_push, (PyObject *)self);
    if (!r) return NULL;
    Py_DECREF(r);
    self->depth = q_tf_len();
    if (self->depth < 0 && PyErr_Occurred()) return NULL;
    Py_INCREF(self);
    return (PyObject *)self;
}

static PyObject *mode_exit(ModeObject *self, PyObject *args) {
    if (require_setup() < 0) return NULL;
    PyObject *r = PyObject_CallNoArgs(g_tf_pop);
    if (!r) return NULL;
    Py_DECREF(r);
    Py_RETURN_FALSE;
}

static int mode_init(ModeObject *self, PyObject *args, PyObject *kw) {
    PyObject *rec = Py_None;
    if (!PyArg_ParseTuple(args, "|O", &rec)) return -1;
    Py_INCREF(rec);
    Py_XSETREF(self->recorder, rec);
    return 0;
}

static int mode_traverse(ModeObject *self, visitproc visit, void *arg) { Py_VISIT(self->recorder); Py_VISIT(self->dict); return 0; }
static int mode_clear(ModeObject *self) { Py_CLEAR(self->recorder); Py_CLEAR(self->dict); return 0; }
static void mode_dealloc(ModeObject *self) { PyObject_GC_UnTrack(self); mode_clear(self); Py_TYPE(self)->tp_free((PyObject *)self); }

static PyMethodDef mode_methods[] = {
    {"__torch_function__", (PyCFunction)(void (*)(void))mode_torch_function, METH_FASTCALL | METH_KEYWORDS,
     "Send a torch call of instance code to the active recorder."},
    {"__enter__", (PyCFunction)mode_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)mode_exit, METH_VARARGS, NULL},
    {NULL}
};
static PyMemberDef mode_members[] = {{"recorder", T_OBJECT, offsetof(ModeObject, recorder), 0, NULL}, {NULL}};

static PyTypeObject ModeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "batchcraft.autobatching._core.Mode",
    .tp_basicsize = sizeof(ModeObject),
    .tp_dictoffset = offsetof(ModeObject, dict),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The recording torch-function mode (C).",
    .tp_traverse = (traverseproc)mode_traverse,
    .tp_clear = (inquiry)mode_clear,
    .tp_dealloc = (destructor)mode_dealloc,
    .tp_init = (initproc)mode_init,
    .tp_new = PyType_GenericNew,
    .tp_methods = mode_methods,
    .tp_members = mode_members,
};

/* ------------------------------------------------------------------------------------------ */
/* BlockCall: __call__ of static blocks and static-block modules                               */
/* ------------------------------------------------------------------------------------------ */
static int require_setup(void);

typedef struct { PyObject_HEAD vectorcallfunc vectorcall; } BlockCallObject;

/* The block of a static-block module is its __dict__'s `_batchcraft_block`. A few (module, dict,
   dict version) -> block pairs are kept: on CPython 3.11 a dict's version tag is unique over the
   process and changes with any change to the dict, so an equal triple is the same unchanged entry
   (the dict holds the block; nothing here holds a reference). Other versions look it up each call. */
#if DICT_TAGS
#define BC_CACHE 32
/* two ways a set: two block modules whose addresses share a set (a TreeLSTM's input and cell
   blocks, one run in 16) do not evict each other at every call */
static struct { PyObject *self, *dict, *block; uint64_t ver; } g_bc_cache[BC_CACHE];
#endif

static PyObject *blockcall_vectorcall(BlockCallObject *bc, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 1) { PyErr_SetString(PyExc_TypeError, "block call needs self"); return NULL; }
    if (require_setup() < 0) return NULL;
    PyObject *self = args[0];
    PyObject *block = NULL;
#ifdef BC_CACHE
    unsigned slot = (unsigned)(((uintptr_t)self >> 4) % (BC_CACHE / 2)) * 2;
    PyObject **dp = Py_TYPE(self)->tp_dictoffset ? _PyObject_GetDictPtr(self) : NULL;
    PyObject *d0 = dp ? *dp : NULL;
    int way = -1;
    for (int w = 0; d0 && w < 2; w++)
        if (g_bc_cache[slot + w].self == self && g_bc_cache[slot + w].dict == d0
            && g_bc_cache[slot + w].ver == dict_tag(d0)) { way = w; break; }
    if (way >= 0) {
        block = g_bc_cache[slot + way].block;
        Py_INCREF(block);
    } else
#endif
    if (PyObject_TypeCheck(self, (PyTypeObject *)g_StaticBlock)) { block = self; Py_INCREF(block); }
    else {
        PyObject *d = PyObject_GenericGetDict(self, NULL);
        if (!d) return NULL;
        block = PyDict_GetItemWithError(d, s_batchcraft_block);
        Py_XINCREF(block);
#ifdef BC_CACHE
        if (block && PyDict_CheckExact(d)) {  /* the set's newer entry becomes its older one */
            if (g_bc_cache[slot].self != self) g_bc_cache[slot + 1] = g_bc_cache[slot];
            g_bc_cache[slot].self = self; g_bc_cache[slot].dict = d; g_bc_cache[slot].block = block;
            g_bc_cache[slot].ver = dict_tag(d);
        }
#endif
        Py_DECREF(d);
        if (!block) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_AttributeError, "static block module without its block");
            return NULL;
        }
    }
    PyObject *rec = current_rec();
    PyObject *r;
    int user = 0;
    if (!rec) {
        PyObject *fn = PyObject_GetAttr(block, s_fn);
        r = fn ? PyObject_Vectorcall(fn, args + 1, (nargs - 1) | PY_VECTORCALL_ARGUMENTS_OFFSET, kwnames) : NULL;
        Py_XDECREF(fn);
    } else if (PyObject_TypeCheck(rec, &RecorderType) && (user = user_mode_on_top(rec)) == 0) {
        /* (a mode of the user's innermost: StaticBlock.record_in refuses it, reliability #170) */
        PyObject *kw = NULL;
        if (kwnames && PyTuple_GET_SIZE(kwnames)) { kw = kwnames_to_dict(args, nargs, kwnames); if (!kw) { Py_DECREF(block); return NULL; } }
        r = record_block((RecObject *)rec, block, args + 1, nargs - 1, kw);
        Py_XDECREF(kw);
    } else if (user < 0) {
        r = NULL;
    } else {
        PyObject *t = PyTuple_New(nargs - 1);
        for (Py_ssize_t i = 1; t && i < nargs; i++) { Py_INCREF(args[i]); PyTuple_SET_ITEM(t, i - 1, args[i]); }
        PyObject *kw = (kwnames && PyTuple_GET_SIZE(kwnames)) ? kwnames_to_dict(args, nargs, kwnames) : PyDict_New();
        r = (t && kw) ? PyObject_CallMethod(block, "record_in", "OOO", rec, t, kw) : NULL;
        Py_XDECREF(t); Py_XDECREF(kw);
    }
    Py_DECREF(block);
    return r;
}

static PyObject *blockcall_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    BlockCallObject *self = (BlockCallObject *)type->tp_alloc(type, 0);
    if (self) self->vectorcall = (vectorcallfunc)blockcall_vectorcall;
    return (PyObject *)self;
}

static PyTypeObject BlockCallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "batchcraft.autobatching._core.BlockCall",
    .tp_basicsize = sizeof(BlockCallObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_METHOD_DESCRIPTOR | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(BlockCallObject, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_descr_get = bind_to_instance,
    .tp_new = blockcall_new,
};

/* The recorder's mode off the torch-function stack while batchcraft records on its own (as torch
   does around a mode's handler): pop_mode returns the mode (a new reference) or NULL; push_mode
   puts it back (stealing it), keeping an error that the work in between set, and returns `out`. */
static PyObject *pop_mode(PyObject *rec) {
    PyObject *mode = rec_mode_ref(rec);
    if (!mode) return NULL;
    PyObject *r = PyObject_CallNoArgs(g_tf_pop);
    if (!r) { Py_DECREF(mode); return NULL; }
    Py_DECREF(r);
    return mode;
}

static PyObject *push_mode(PyObject *mode, PyObject *out) {
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *r = PyObject_CallOneArg(g_tf_push, mode);
    Py_DECREF(mode);
    if (!r) { Py_XDECREF(et); Py_XDECREF(ev); Py_XDECREF(tb); Py_XDECREF(out); return NULL; }
    Py_DECREF(r);
    PyErr_Restore(et, ev, tb);
    return out;
}

/* ---- TensorMeta: a metadata property of plain tensors while calls record (tensormeta.py) --------
   `W.device`, `W.shape` of a parameter read by instance code: with the recording mode on the
   torch-function stack, torch hands every such read to the mode through Python-level machinery
   (about 1 µs, against 0.09 µs plainly), and the mode answers with the plain read (plain_property).
   Set on torch.Tensor over TensorBase's getset descriptor, this one makes the plain read itself,
   with the mode briefly off the stack, where the mode would: a plain Tensor or Parameter, in a
   thread whose C recorder's mode is the only one on the stack and enabled. Anything else (a
   subclass, another thread, a mode of the user's, DisableTorchFunction, the class itself) reads
   through the original descriptor. */
typedef struct { PyObject_HEAD PyObject *orig; } TensorMetaObject;

static PyObject *tmeta_get(TensorMetaObject *self, PyObject *obj, PyObject *type) {
    descrgetfunc get = Py_TYPE(self->orig)->tp_descr_get;
    if (obj && obj != Py_None) {
        PyObject *t = (PyObject *)Py_TYPE(obj);
        PyObject *rec = (t == g_plain_tensor || t == g_parameter) ? current_rec() : NULL;
        if (rec && PyObject_TypeCheck(rec, &RecorderType)) {
            /* the stack is exactly [the recorder's mode] (by identity: a DeviceContext that
               set_default_device put below the mode may be all that is left while it is off) */
            int en = q_tf_mode_enabled();
            if (en < 0) return NULL;
            Py_ssize_t len = en ? q_tf_len() : 0;
            if (len < 0 && PyErr_Occurred()) return NULL;
            PyObject *mode = len == 1 ? rec_mode_ref(rec) : NULL;
            if (len == 1 && !mode) PyErr_Clear();
            if (mode) {
                PyObject *top = PyObject_CallFunction(g_tf_at, "n", (Py_ssize_t)0);
                if (!top) { Py_DECREF(mode); return NULL; }
                int ours = top == mode;
                Py_DECREF(top);
                if (ours) {
                    PyObject *r = PyObject_CallNoArgs(g_tf_pop);
                    if (!r) { Py_DECREF(mode); return NULL; }
                    Py_DECREF(r);
                    return push_mode(mode, get(self->orig, obj, type));  /* (steals mode) */
                }
                Py_DECREF(mode);
            }
        }
    }
    return get(self->orig, obj, type);
}

static int tmeta_set(TensorMetaObject *self, PyObject *obj, PyObject *value) {
    descrsetfunc set = Py_TYPE(self->orig)->tp_descr_set;
    if (!set) { PyErr_SetString(PyExc_AttributeError, "read-only attribute"); return -1; }
    return set(self->orig, obj, value);
}

static int tmeta_traverse(TensorMetaObject *self, visitproc visit, void *arg) { Py_VISIT(self->orig); return 0; }
static int tmeta_clear(TensorMetaObject *self) { Py_CLEAR(self->orig); return 0; }
static void tmeta_dealloc(TensorMetaObject *self) { PyObject_GC_UnTrack(self); tmeta_clear(self); Py_TYPE(self)->tp_free((PyObject *)self); }

static PyObject *tmeta_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    PyObject *orig;
    if (!PyArg_ParseTuple(args, "O:TensorMeta", &orig)) return NULL;
    if (!Py_TYPE(orig)->tp_descr_get) { PyErr_SetString(PyExc_TypeError, "TensorMeta: not a descriptor"); return NULL; }
    TensorMetaObject *self = (TensorMetaObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    Py_INCREF(orig); self->orig = orig;
    return (PyObject *)self;
}

static PyMemberDef tmeta_members[] = {{"original", T_OBJECT, offsetof(TensorMetaObject, orig), READONLY, NULL}, {NULL}};

static PyTypeObject TensorMetaType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "batchcraft.autobatching._core.TensorMeta",
    .tp_basicsize = sizeof(TensorMetaObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A plain tensor's metadata property, read without the recording mode's dispatch.",
    .tp_traverse = (traverseproc)tmeta_traverse,
    .tp_clear = (inquiry)tmeta_clear,
    .tp_dealloc = (destructor)tmeta_dealloc,
    .tp_descr_get = (descrgetfunc)tmeta_get,
    .tp_descr_set = (descrsetfunc)tmeta_set,
    .tp_new = tmeta_new,
    .tp_members = tmeta_members,
};

/* ---- FastFn: a torch function read by the recording thread (ccore.FAST_FACTORIES) ------------
   torch.sigmoid(x) on a lazy value goes through torch's dispatch to the innermost mode, the
   recorder's (about 0.7 µs here before the recording itself). Read through a RecordingAttr by the
   recording thread, `torch.<name>` is this object: a call whose first argument is a lazy value of
   the active C recorder (or a list / tuple starting with one: cat, stack), with the recorder's mode
   innermost and torch functions enabled, not from a user mode's handler, is recorded as the mode
   would record it (mode_torch_function: func = the original, the mode off the stack meanwhile);
   every other call goes to the original. Attributes read through to the original. */
typedef struct { PyObject_HEAD vectorcallfunc vectorcall; PyObject *original; } FastFnObject;

/* 1 when a positional or keyword argument is a tensor (lazy or not): not a constant call */
static int kwnames_have_lazy(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Py_ssize_t n = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
    for (Py_ssize_t i = 0; i < n; i++)
        if (IS_LAZY(args[i]) || PyObject_TypeCheck(args[i], (PyTypeObject *)g_TensorType)) return 1;
    return 0;
}


static PyObject *fastfn_vectorcall(FastFnObject *ff, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *rec = current_rec();
    if (g_ready && rec && nargs >= 1 && PyObject_TypeCheck(rec, &RecorderType)) {
        PyObject *a0 = args[0];
        int lazy = IS_LAZY(a0) && ((LazyObject *)a0)->rec == rec;
        if (!lazy && (PyList_CheckExact(a0) || PyTuple_CheckExact(a0)) && PySequence_Fast_GET_SIZE(a0) > 0) {
            PyObject *e = PySequence_Fast_GET_ITEM(a0, 0);
            lazy = IS_LAZY(e) && ((LazyObject *)e)->rec == rec;
        }
        if (!lazy && is_const_factory(ff->original) && !kwnames_have_lazy(args, nargs, kwnames)) {
            /* torch.zeros((1, h)) and the other constant factories (consts.py): the cached
               template's leaf, without torch's dispatch to the mode (about 1 µs) */
            int enabled = q_tf_enabled();
            if (enabled < 0) return NULL;
            if (enabled) enabled = leaf_mode_ok((RecObject *)rec);  /* else the mode's path decides */
            if (enabled < 0) return NULL;
            int top = enabled ? rec_mode_on_top(rec) : 0;
            if (top < 0) return NULL;
            int dfac = top ? is_device_factory((RecObject *)rec, ff->original) : 1;
            if (dfac < 0) return NULL;
            if (!dfac && caller_kind() == CALLER_FUNCTION) {
                PyObject *kw = NULL;
                if (kwnames && PyTuple_GET_SIZE(kwnames)) {
                    kw = kwnames_to_dict(args, nargs, kwnames);
                    if (!kw) return NULL;
                }
                PyObject *targs = PyTuple_New(nargs);
                for (Py_ssize_t i = 0; targs && i < nargs; i++) PyTuple_SET_ITEM(targs, i, Py_NewRef(args[i]));
                PyObject *mode = targs ? pop_mode(rec) : NULL;
                if (!mode) { Py_XDECREF(targs); Py_XDECREF(kw); return NULL; }
                PyObject *out = const_leaf_c((RecObject *)rec, ff->original, targs, kw);
                if (!out && !PyErr_Occurred()) out = py_mode_call(rec, ff->original, targs, kw);
                Py_DECREF(targs);
                Py_XDECREF(kw);
                return push_mode(mode, out);
            }
        }
        if (lazy) {
            /* DisableTorchFunctionSubclass: torch's dispatch would not reach the mode either */
            int enabled = q_tf_enabled();
            if (enabled < 0) return NULL;
            int top = enabled ? rec_mode_on_top(rec) : 0;
            if (top < 0) return NULL;
            if (top && caller_kind() == CALLER_FUNCTION) {
                PyObject *kw = NULL;
                if (kwnames && PyTuple_GET_SIZE(kwnames)) {
                    kw = kwnames_to_dict(args, nargs, kwnames);
                    if (!kw) return NULL;
                }
                PyObject *mode = pop_mode(rec);
                if (!mode) { Py_XDECREF(kw); return NULL; }
                PyObject *out = rec_record_impl(rec, ff->original, args, nargs, kw);
                Py_XDECREF(kw);
                return push_mode(mode, out);
            }
        }
    }
    return PyObject_Vectorcall(ff->original, args, nargsf, kwnames);
}

static PyObject *fastfn_getattro(FastFnObject *self, PyObject *name) {
    if (PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, "__doc__") == 0)
        return PyObject_GetAttr(self->original, name);  /* torch's docstring, not this type's */
    PyObject *r = PyObject_GenericGetAttr((PyObject *)self, name);
    if (r || !PyErr_ExceptionMatches(PyExc_AttributeError)) return r;
    PyErr_Clear();
    return PyObject_GetAttr(self->original, name);
}

static int fastfn_traverse(FastFnObject *self, visitproc visit, void *arg) { Py_VISIT(self->original); return 0; }
static int fastfn_clear(FastFnObject *self) { Py_CLEAR(self->original); return 0; }
static void fastfn_dealloc(FastFnObject *self) {
    PyObject_GC_UnTrack(self);
    fastfn_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *fastfn_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    PyObject *original;
    if (!PyArg_ParseTuple(args, "O:FastFn", &original)) return NULL;
    FastFnObject *self = (FastFnObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->vectorcall = (vectorcallfunc)fastfn_vectorcall;
    Py_INCREF(original);
    self->original = original;
    return (PyObject *)self;
}

static PyObject *fastfn_repr(FastFnObject *self) { return PyObject_Repr(self->original); }

/* equal to (and hashed as) the original, so `fn == torch.sigmoid`, `fn in (torch.relu, ...)` and
   dict keys read as in eager; pickled and copied as the original (`is` cannot be made to agree) */
static PyObject *fastfn_richcompare(FastFnObject *self, PyObject *other, int op) {
    if (op != Py_EQ && op != Py_NE) Py_RETURN_NOTIMPLEMENTED;
    PyObject *o = Py_TYPE(other) == Py_TYPE(self) ? ((FastFnObject *)other)->original : other;
    return PyObject_RichCompare(self->original, o, op);
}

static Py_hash_t fastfn_hash(FastFnObject *self) { return PyObject_Hash(self->original); }

static PyObject *fastfn_reduce(FastFnObject *self, PyObject *noargs) {
    return PyObject_CallMethod(self->original, "__reduce__", NULL);
}

static PyMethodDef fastfn_methods[] = {
    {"__reduce__", (PyCFunction)fastfn_reduce, METH_NOARGS, NULL},
    {NULL},
};

static PyMemberDef fastfn_members[] = {
    {"__wrapped__", T_OBJECT, offsetof(FastFnObject, original), READONLY, "the torch function"},
    {NULL},
};

static PyTypeObject FastFnType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "batchcraft.autobatching._core.FastFn",
    .tp_basicsize = sizeof(FastFnObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_HAVE_GC,
    .tp_vectorcall_offset = offsetof(FastFnObject, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_getattro = (getattrofunc)fastfn_getattro,
    .tp_new = fastfn_new,
    .tp_traverse = (traverseproc)fastfn_traverse,
    .tp_clear = (inquiry)fastfn_clear,
    .tp_dealloc = (destructor)fastfn_dealloc,
    .tp_repr = (reprfunc)fastfn_repr,
    .tp_richcompare = (richcmpfunc)fastfn_richcompare,
    .tp_hash = (hashfunc)fastfn_hash,
    .tp_methods = fastfn_methods,
    .tp_members = fastfn_members,
    .tp_doc = "FastFn(torch_function): the function as the recording thread reads it (records lazy calls directly).",
};

/* ------------------------------------------------------------------------------------------ */
/* FastCall: __call__ of nn.Linear / nn.Embedding / the cell modules while a call records       */
/* ------------------------------------------------------------------------------------------ */
/* modcalls.py's _linear_call / _embedding_call / the cells' __call__ in C: when nothing would make
   Module.__call__ do more than the plain forward (no hook of the module or global, no compiled call,
   no instance forward / _call_impl, no JIT tracing, class verdict cached per type version tag, plain
   registered parameters, the recorder's mode innermost), the operation is recorded directly (Linear,
   Embedding) or the class's forward is called without Module.__call__'s frames (cells). Anything else,
   and any recorder but the C core's, goes to `fallback`, the Python function with the same rules,
   which ends in nn.Module.__call__. */
enum { FC_LINEAR = 0, FC_EMBEDDING = 1, FC_CELL = 2 };

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    int kind;
    PyObject *fallback;        /* fallback(self, *args, **kwargs) */
    PyObject *forward;         /* the class forward this call stands for (Linear / Embedding), or None */
    PyObject *func;            /* F.linear / F.embedding, or None */
    PyObject *names;           /* tuple: the registered parameter names forward reads */
    PyObject *verdicts;        /* dict cls -> (type version tag, ok), filled by class_calls_own */
    PyObject *class_calls_own; /* class_calls_own(cls, names, verdicts) -> bool */
    PyObject *module_ns;       /* torch.nn.modules.module's namespace: the global hook dicts */
    PyObject *tracing;         /* torch._C._get_tracing_state */
    PyObject *plain;           /* tuple of the plain parameter types (torch.Tensor, nn.Parameter) */
    PyObject *f_ns;            /* torch.nn.functional's namespace: F.linear / F.embedding replaced -> forward's path */
    PyObject *linear;          /* cells: F.linear (the input projection), or None */
    int n_states;              /* cells: 2 (LSTM) or 1 (GRU / RNN) */
} FastCallObject;

static PyObject *s_forward = NULL, *s_parameters = NULL, *s_weight = NULL, *s_bias = NULL, *s_max_norm = NULL,
    *s_padding_idx = NULL, *s_norm_type = NULL, *s_scale_grad = NULL, *s_sparse = NULL, *s_compiled_call = NULL,
    *s_call_impl = NULL;
static PyObject *s_hook_names[4], *s_global_hook_names[4];
static PyObject *s_cells_checked = NULL, *s_linear = NULL, *s_embedding = NULL;

/* 1 when d[key] is missing or true (Module.__call__ would run hooks), 0 if not, -1 on error */
static int missing_or_true(PyObject *d, PyObject *key) {
    PyObject *v = PyDict_GetItemWithError(d, key);
    if (!v) return PyErr_Occurred() ? -1 : 1;
    return PyObject_IsTrue(v);
}

/* 1 when Module.__call__ on an instance with dict d would only call its forward, as far as the
   instance and the process tell: no hook of its own or global (`ns`: torch.nn.modules.module's
   namespace), no compiled call, no instance-level forward or _call_impl, none of `names` (NULL:
   none) in d, no JIT tracing (`tracing()` is None); 0 if not, -1 on error (modcalls._hooked) */
static int forward_only(PyObject *d, PyObject *ns, PyObject *names, PyObject *tracing) {
    for (int i = 0; i < 4; i++) {
        int r = missing_or_true(d, s_hook_names[i]);
        if (r) return r < 0 ? -1 : 0;
        PyObject *g = PyDict_GetItemWithError(ns, s_global_hook_names[i]);
        if (!g) return PyErr_Occurred() ? -1 : 0;
        r = PyObject_IsTrue(g);
        if (r) return r < 0 ? -1 : 0;
    }
    PyObject *v = PyDict_GetItemWithError(d, s_compiled_call);
    if (v && v != Py_None) return 0;
    if (!v && PyErr_Occurred()) return -1;
    int r = PyDict_Contains(d, s_forward);
    if (r) return r < 0 ? -1 : 0;
    r = PyDict_Contains(d, s_call_impl);
    if (r) return r < 0 ? -1 : 0;
    Py_ssize_t nn = names ? PyTuple_GET_SIZE(names) : 0;
    for (Py_ssize_t i = 0; i < nn; i++) {
        r = PyDict_Contains(d, PyTuple_GET_ITEM(names, i));
        if (r) return r < 0 ? -1 : 0;
    }
    PyObject *tr = PyObject_CallNoArgs(tracing);
    if (!tr) return -1;
    int traced = tr != Py_None;
    Py_DECREF(tr);
    return !traced;
}

/* 1 when the plain forward is all Module.__call__ would run for this instance (dict d), 0 if
   not, -1 on error: modcalls._hooked and _own_call */
static int fc_plain_call(FastCallObject *fc, PyObject *self, PyObject *d) {
    int r = forward_only(d, fc->module_ns, fc->names, fc->tracing);
    if (r <= 0) return r;
    PyTypeObject *cls = Py_TYPE(self);
    PyObject *got = PyDict_GetItemWithError(fc->verdicts, (PyObject *)cls);
    if (!got && PyErr_Occurred()) return -1;
    if (got && PyTuple_CheckExact(got) && PyTuple_GET_SIZE(got) == 2 && cls->tp_version_tag) {
        unsigned long ver = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(got, 0));
        if (ver == (unsigned long)-1 && PyErr_Occurred()) return -1;
        if (ver == (unsigned long)cls->tp_version_tag) return PyObject_IsTrue(PyTuple_GET_ITEM(got, 1));
    }
    PyObject *ok = PyObject_CallFunctionObjArgs(fc->class_calls_own, (PyObject *)cls, fc->names, fc->verdicts, NULL);
    if (!ok) return -1;
    r = PyObject_IsTrue(ok);
    Py_DECREF(ok);
    return r;
}

static int fc_plain_param(FastCallObject *fc, PyObject *p) {
    PyObject *t = (PyObject *)Py_TYPE(p);
    Py_ssize_t n = PyTuple_GET_SIZE(fc->plain);
    for (Py_ssize_t i = 0; i < n; i++)
        if (PyTuple_GET_ITEM(fc->plain, i) == t) return 1;
    return 0;
}

/* rec.record(func, args, kwargs) with the recorder's mode off the stack, as the mode's handler
   runs it (modcalls._record_on_top); *declined = 1 when the mode is not innermost (rec_mode_on_top) */
static PyObject *record_on_top(PyObject *rec, PyObject *func, PyObject *const *a, Py_ssize_t n, PyObject *kw,
                               int *declined) {
    *declined = 1;
    int top = rec_mode_on_top(rec);
    if (top <= 0) return NULL;
    *declined = 0;
    PyObject *mode = pop_mode(rec);
    if (!mode) return NULL;
    return push_mode(mode, rec_record_impl(rec, func, a, n, kw));
}

/* A cell's patched forward (cells._fast_cell) in C, for its common case only: positional (input,
   hx) on this recorder's lazy values, and a check of the same module, gates, weights and value
   descriptors that passed before in this call (the forward's `_cells_checked` cache: the same
   keys). It records the input projection and the gates as the forward does; anything else
   (*declined = 1) runs the forward itself. */
static PyObject *cell_direct(FastCallObject *fc, PyObject *rec, PyObject *self, PyObject *d, PyObject *const *args,
                             Py_ssize_t nargs, PyObject *kwnames, int *declined) {
    *declined = 1;
    if (nargs != 3 || (kwnames && PyTuple_GET_SIZE(kwnames)) || fc->func == Py_None) return NULL;
    PyObject *x = args[1], *hx = args[2];
    PyObject *states[2];
    if (fc->n_states == 1) {
        states[0] = hx;
    } else {
        if (!(PyTuple_CheckExact(hx) || PyList_CheckExact(hx)) || PySequence_Fast_GET_SIZE(hx) != 2) return NULL;
        states[0] = PySequence_Fast_GET_ITEM(hx, 0);
        states[1] = PySequence_Fast_GET_ITEM(hx, 1);
    }
    for (int i = 0; i < fc->n_states; i++)
        if (!IS_LAZY(states[i]) || ((LazyObject *)states[i])->rec != rec) return NULL;
    PyObject *params = PyDict_GetItemWithError(d, s_parameters);
    if (!params || !PyDict_Check(params)) return NULL;
    static const char *wn[4] = {"weight_ih", "weight_hh", "bias_ih", "bias_hh"};
    PyObject *w[4];
    for (int i = 0; i < 4; i++) {
        w[i] = PyDict_GetItemString(params, wn[i]);  /* borrowed; NULL: absent (the forward decides) */
        if (!w[i]) return NULL;
    }
    PyObject *rd = ((RecObject *)rec)->dict;  /* the recorder's __dict__ (cells._checked keeps the cache there) */
    PyObject *checked = rd ? PyDict_GetItemWithError(rd, s_cells_checked) : NULL;
    if (!checked || !PyDict_Check(checked)) return NULL;
    PyObject *key = PyTuple_New(3 + fc->n_states);
    if (!key) return NULL;
    PyObject *id = PyLong_FromVoidPtr(self);
    if (!id) { Py_DECREF(key); return NULL; }
    PyTuple_SET_ITEM(key, 0, id);
    Py_INCREF(fc->func); PyTuple_SET_ITEM(key, 1, fc->func);
    PyObject *did = PyLong_FromLong(((LazyObject *)x)->did);
    if (!did) { Py_DECREF(key); return NULL; }
    PyTuple_SET_ITEM(key, 2, did);
    for (int i = 0; i < fc->n_states; i++) {
        did = PyLong_FromLong(((LazyObject *)states[i])->did);
        if (!did) { Py_DECREF(key); return NULL; }
        PyTuple_SET_ITEM(key, 3 + i, did);
    }
    PyObject *seen = PyDict_GetItemWithError(checked, key);
    Py_DECREF(key);
    if (!seen || !PyTuple_CheckExact(seen) || PyTuple_GET_SIZE(seen) != 4) return NULL;
    for (int i = 0; i < 4; i++)
        if (PyTuple_GET_ITEM(seen, i) != w[i]) return NULL;
    /* as the forward: the recorder's mode innermost, else torch's forward (a mode of the user's) */
    int top = rec_mode_on_top(rec);
    if (top <= 0) return NULL;
    PyObject *mode = pop_mode(rec);
    if (!mode) return NULL;
    *declined = 0;
    PyObject *pa[3] = {x, w[0], w[2]};
    for (int i = 0; i < 4; i++) Py_INCREF(w[i]);
    PyObject *out = NULL;
    PyObject *gi = rec_record_impl(rec, fc->linear, pa, 3, NULL);
    if (gi) {
        PyObject *ga[5];
        int n = 0;
        ga[n++] = gi;
        for (int i = 0; i < fc->n_states; i++) ga[n++] = states[i];
        ga[n++] = w[1];
        ga[n++] = w[3];
        out = rec_record_impl(rec, fc->func, ga, n, NULL);
        Py_DECREF(gi);
    }
    for (int i = 0; i < 4; i++) Py_DECREF(w[i]);
    return push_mode(mode, out);
}

static PyObject *fc_fast(FastCallObject *fc, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                         int *declined) {
    *declined = 1;
    PyObject *self = args[0], *x = args[1];
    PyObject *rec = current_rec();
    if (!rec || !PyObject_TypeCheck(rec, &RecorderType) || !IS_LAZY(x) || ((LazyObject *)x)->rec != rec)
        return NULL;
    if (fc->kind != FC_CELL && _PyType_Lookup(Py_TYPE(self), s_forward) != fc->forward) return NULL;
    PyObject *d = PyObject_GenericGetDict(self, NULL);
    if (!d) return NULL;
    PyObject *out = NULL;
    int r = fc_plain_call(fc, self, d);
    if (r <= 0) goto done;
    if (fc->kind == FC_CELL) {
        PyObject *fwd = _PyType_Lookup(Py_TYPE(self), s_forward);
        if (!fwd || !PyFunction_Check(fwd)) goto done;
        if (fwd == fc->forward) {  /* batchcraft's own forward (cells.FAST_CELLS): its common case here */
            out = cell_direct(fc, rec, self, d, args, nargs, kwnames, declined);
            if (out || !*declined || PyErr_Occurred()) goto done;
        }
        Py_INCREF(fwd);
        *declined = 0;
        out = PyObject_Vectorcall(fwd, args, nargs, kwnames);
        Py_DECREF(fwd);
        goto done;
    }
    /* forward calls F.linear / F.embedding as torch.nn.functional holds it now */
    PyObject *fnow = PyDict_GetItemWithError(fc->f_ns, fc->kind == FC_LINEAR ? s_linear : s_embedding);
    if (fnow != fc->func) goto done;
    PyObject *params = PyDict_GetItemWithError(d, s_parameters);
    if (!params) goto done;
    if (!PyDict_Check(params)) goto done;
    PyObject *w = PyDict_GetItemWithError(params, s_weight);
    if (!w || !fc_plain_param(fc, w)) goto done;
    if (fc->kind == FC_LINEAR) {
        PyObject *b = PyDict_GetItemWithError(params, s_bias);
        if (!b || (b != Py_None && !fc_plain_param(fc, b))) goto done;
        PyObject *a[3] = {x, w, b};
        Py_INCREF(w); Py_INCREF(b);
        out = record_on_top(rec, fc->func, a, 3, NULL, declined);
        Py_DECREF(w); Py_DECREF(b);
        goto done;
    }
    /* FC_EMBEDDING: the weight held first (the reads below run properties, which may replace
       it), then the settings by plain attribute lookup in forward's order, passed as F.embedding
       passes them; max_norm renorms the table in place: torch's path */
    Py_INCREF(w);
    PyObject *kw = PyDict_New();
    PyObject *names[5] = {s_padding_idx, s_max_norm, s_norm_type, s_scale_grad, s_sparse};
    int bad = !kw;
    for (int i = 0; i < 5 && !bad; i++) {
        PyObject *v = PyObject_GetAttr(self, names[i]);
        bad = !v || PyDict_SetItem(kw, names[i], v) < 0;
        if (i == 1 && v && v != Py_None) bad = 1;
        Py_XDECREF(v);
    }
    if (!bad) {
        PyObject *a[2] = {x, w};
        out = record_on_top(rec, fc->func, a, 2, kw, declined);
    }
    Py_XDECREF(kw);
    Py_DECREF(w);
done:
    Py_DECREF(d);
    return out;
}

static PyObject *fastcall_vectorcall(FastCallObject *fc, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (g_ready && nargs >= 2 && (fc->kind == FC_CELL || (nargs == 2 && nkw == 0))) {
        int declined;
        PyObject *out = fc_fast(fc, args, nargs, kwnames, &declined);
        if (out || !declined) return out;
        if (PyErr_Occurred()) return NULL;
    }
    return PyObject_Vectorcall(fc->fallback, args, nargs, kwnames);
}

static int fastcall_traverse(FastCallObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->fallback); Py_VISIT(self->forward); Py_VISIT(self->func); Py_VISIT(self->names);
    Py_VISIT(self->verdicts); Py_VISIT(self->class_calls_own); Py_VISIT(self->module_ns); Py_VISIT(self->tracing);
    Py_VISIT(self->plain); Py_VISIT(self->linear); Py_VISIT(self->f_ns);
    return 0;
}

static int fastcall_clear(FastCallObject *self) {
    Py_CLEAR(self->fallback); Py_CLEAR(self->forward); Py_CLEAR(self->func); Py_CLEAR(self->names);
    Py_CLEAR(self->verdicts); Py_CLEAR(self->class_calls_own); Py_CLEAR(self->module_ns); Py_CLEAR(self->tracing);
    Py_CLEAR(self->plain); Py_CLEAR(self->linear); Py_CLEAR(self->f_ns);
    return 0;
}

static void fastcall_dealloc(FastCallObject *self) {
    PyObject_GC_UnTrack(self);
    fastcall_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *fastcall_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    int kind;
    PyObject *fallback, *forward, *func, *names, *verdicts, *cco, *ns, *tracing, *plain, *f_ns, *linear = Py_None;
    int n_states = 1;
    if (!PyArg_ParseTuple(args, "iOOOO!O!OO!OO!O!|Oi:FastCall", &kind, &fallback, &forward, &func, &PyTuple_Type,
                          &names, &PyDict_Type, &verdicts, &cco, &PyDict_Type, &ns, &tracing, &PyTuple_Type, &plain,
                          &PyDict_Type, &f_ns, &linear, &n_states))
        return NULL;
    if (n_states != 1 && n_states != 2) { PyErr_SetString(PyExc_ValueError, "FastCall: n_states 1 or 2"); return NULL; }
    if (kind < FC_LINEAR || kind > FC_CELL) { PyErr_SetString(PyExc_ValueError, "FastCall: kind 0, 1 or 2"); return NULL; }
    FastCallObject *self = (FastCallObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->vectorcall = (vectorcallfunc)fastcall_vectorcall;
    self->kind = kind;
#define KEEP(f, v) do { Py_INCREF(v); self->f = v; } while (0)
    KEEP(fallback, fallback); KEEP(forward, forward); KEEP(func, func); KEEP(names, names); KEEP(verdicts, verdicts);
    KEEP(class_calls_own, cco); KEEP(module_ns, ns); KEEP(tracing, tracing); KEEP(plain, plain);
    KEEP(linear, linear); KEEP(f_ns, f_ns);
    self->n_states = n_states;
#undef KEEP
    return (PyObject *)self;
}

static PyObject *fastcall_repr(FastCallObject *self) {
    return PyUnicode_FromFormat("<batchcraft fast __call__ (%s), else %R>",
                                self->kind == FC_LINEAR ? "linear" : self->kind == FC_EMBEDDING ? "embedding" : "cell",
                                self->fallback);
}

/* __name__, __qualname__, __doc__, __module__ and other attributes read as the fallback's */
static PyObject *fastcall_getattro(FastCallObject *self, PyObject *name) {
    if (PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, "__doc__") == 0)
        return PyObject_GetAttr(self->fallback, name);
    PyObject *r = PyObject_GenericGetAttr((PyObject *)self, name);
    if (r || !PyErr_ExceptionMatches(PyExc_AttributeError)) return r;
    PyErr_Clear();
    return PyObject_GetAttr(self->fallback, name);
}

static PyMemberDef fastcall_members[] = {
    {"fallback", T_OBJECT, offsetof(FastCallObject, fallback), READONLY, "the Python path (same rules)"},
    {"__wrapped__", T_OBJECT, offsetof(FastCallObject, fallback), READONLY, NULL},
    {NULL},
};

static PyTypeObject FastCallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "batchcraft.autobatching._core.FastCall",
    .tp_basicsize = sizeof(FastCallObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_METHOD_DESCRIPTOR | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_HAVE_GC,
    .tp_vectorcall_offset = offsetof(FastCallObject, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_descr_get = bind_to_instance,
    .tp_new = fastcall_new,
    .tp_traverse = (traverseproc)fastcall_traverse,
    .tp_clear = (inquiry)fastcall_clear,
    .tp_dealloc = (destructor)fastcall_dealloc,
    .tp_repr = (reprfunc)fastcall_repr,
    .tp_getattro = (getattrofunc)fastcall_getattro,
    .tp_members = fastcall_members,
    .tp_doc = "FastCall(kind, fallback, forward, func, names, verdicts, class_calls_own, module_ns, tracing, plain, f_ns[, linear, n_states]): "
              "a module class's __call__ while a call records (modcalls.py).",
};

/* ------------------------------------------------------------------------------------------ */
/* module                                                                                      */
/* ------------------------------------------------------------------------------------------ */
static PyObject *py_setup(PyObject *m, PyObject *args) {
    PyObject *d;
    if (!PyArg_ParseTuple(args, "O!", &PyDict_Type, &d)) return NULL;
#define GET(var, key) do { PyObject *o_ = PyDict_GetItemString(d, key); \
    if (!o_) { PyErr_Format(PyExc_KeyError, "setup: missing %s", key); return NULL; } Py_INCREF(o_); Py_XSETREF(var, o_); } while (0)
    GET(g_TensorType, "Tensor"); GET(g_DtypeType, "dtype"); GET(g_torch_tensor, "tensor"); GET(g_torch_as_tensor, "as_tensor");
    GET(g_set_grad_enabled, "set_grad_enabled");
    GET(g_is_grad_q, "is_grad_enabled"); GET(g_any_autocast_q, "any_autocast"); GET(g_is_inference_q, "is_inference");
    GET(g_tf_push, "tf_push"); GET(g_tf_pop, "tf_pop"); GET(g_get_default_dtype, "get_default_dtype");
    GET(g_rebuild, "rebuild"); GET(g_escape, "escape"); GET(g_StaticBlock, "StaticBlock"); GET(g_float_dids, "float_dids");
    GET(g_scalar_dids, "scalar_dids"); GET(g_cpu_device, "cpu_device"); GET(g_list_did, "list_did");
    if (!g_list_dids && !(g_list_dids = PyDict_New())) return NULL;
    GET(g_int64_dtype, "int64_dtype"); GET(g_bool_dtype, "bool_dtype");
    GET(g_tf_mode_enabled_q, "tf_mode_enabled"); GET(g_tf_len_q, "tf_len"); GET(g_tf_at, "tf_at");
    GET(g_tf_enabled_q, "tf_enabled");
    GET(g_plain_tensor, "plain_tensor"); GET(g_parameter, "parameter"); GET(g_method_wrapper, "method_wrapper");
    g_is_grad_q_fn = noarg_fn(g_is_grad_q); g_any_autocast_q_fn = noarg_fn(g_any_autocast_q);
    g_is_inference_q_fn = noarg_fn(g_is_inference_q); g_tf_mode_enabled_q_fn = noarg_fn(g_tf_mode_enabled_q);
    g_tf_len_q_fn = noarg_fn(g_tf_len_q); g_tf_enabled_q_fn = noarg_fn(g_tf_enabled_q);
    GET(g_torch_dir, "torch_dir"); GET(g_own_dir, "own_dir");
    PyObject *o = PyDict_GetItemString(d, "const_factories");
    Py_XINCREF(o); Py_XSETREF(g_const_factories, o);
    if (!g_const_cache && !(g_const_cache = PyDict_New())) return NULL;
    o = PyDict_GetItemString(d, "int_did");
    g_int_did = o ? (int)PyLong_AsLong(o) : 0;
    o = PyDict_GetItemString(d, "bool_did");
    g_bool_did = o ? (int)PyLong_AsLong(o) : 0;
    g_ready = 1;
    Py_RETURN_NONE;
#undef GET
}

/* set_state_readers((grad, inference, tf_mode_enabled, tf_disabled_state, tf_len) addresses) or
   None: use torch's C++ accessors at those addresses, or the builtins again */
static PyObject *py_set_state_readers(PyObject *m, PyObject *arg) {
    if (arg == Py_None) {
        sr_grad = sr_inference = sr_tf_mode = NULL; sr_tf_state = NULL; sr_tf_len = NULL;
        Py_RETURN_NONE;
    }
    void *a[5];
    if (!PyTuple_Check(arg) || PyTuple_GET_SIZE(arg) != 5) {
        PyErr_SetString(PyExc_TypeError, "set_state_readers: a tuple of 5 addresses or None");
        return NULL;
    }
    for (int i = 0; i < 5; i++) {
        a[i] = PyLong_AsVoidPtr(PyTuple_GET_ITEM(arg, i));
        if (!a[i]) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "set_state_readers: a null address");
            return NULL;
        }
    }
    sr_grad = (_Bool (*)(void))a[0]; sr_inference = (_Bool (*)(void))a[1]; sr_tf_mode = (_Bool (*)(void))a[2];
    sr_tf_state = (int (*)(void))a[3]; sr_tf_len = (int64_t (*)(void))a[4];
    Py_RETURN_NONE;
}

/* (grad, inference, any autocast, torch functions enabled, function modes enabled, function stack length) as
   the core reads them now (statereaders.py compares them with torch's builtins) */
static PyObject *py_read_state(PyObject *m, PyObject *noargs) {
    int g = q_grad(), i = g < 0 ? -1 : q_inference(), a = i < 0 ? -1 : q_any_autocast();
    int e = a < 0 ? -1 : q_tf_enabled(), md = e < 0 ? -1 : q_tf_mode_enabled();
    if (md < 0) return NULL;
    Py_ssize_t n = q_tf_len();
    if (n < 0 && PyErr_Occurred()) return NULL;
    return Py_BuildValue("(NNNNNn)", PyBool_FromLong(g), PyBool_FromLong(i), PyBool_FromLong(a), PyBool_FromLong(e),
                         PyBool_FromLong(md), n);
}

static PyObject *py_state_readers_on(PyObject *m, PyObject *noargs) {
#ifdef HAVE_DLSYM
    return Py_BuildValue("(NN)", PyBool_FromLong(sr_grad != NULL), PyBool_FromLong(g_ac_fast));
#else
    return Py_BuildValue("(NN)", PyBool_FromLong(sr_grad != NULL), PyBool_FromLong(0));
#endif
}

/* set_autocast_reader((handle, symbol, mask, off)) or None; see q_any_autocast */
static PyObject *py_set_autocast_reader(PyObject *m, PyObject *arg) {
#ifdef HAVE_DLSYM
    g_ac_fast = 0;
    if (arg == Py_None) Py_RETURN_NONE;
    PyObject *handle; const char *symbol; unsigned long long mask, off;
    if (!PyArg_ParseTuple(arg, "OsKK:set_autocast_reader", &handle, &symbol, &mask, &off)) return NULL;
    void *h = PyLong_AsVoidPtr(handle);
    if (!h && PyErr_Occurred()) return NULL;
    if (strlen(symbol) >= sizeof(g_dks_symbol)) { PyErr_SetString(PyExc_ValueError, "symbol too long"); return NULL; }
    if (h != g_dks_lib || strcmp(symbol, g_dks_symbol) != 0) {
        /* other threads' cached addresses would be stale: refused (statereaders sets it once) */
        if (g_dks_lib) { PyErr_SetString(PyExc_RuntimeError, "set_autocast_reader: another library was set before"); return NULL; }
        g_dks_lib = h;
        strcpy(g_dks_symbol, symbol);
    }
    if (!dks_words()) { PyErr_Format(PyExc_OSError, "dlsym: %s not found", symbol); return NULL; }
    g_ac_mask = mask; g_ac_off = off; g_ac_fast = mask != 0;
    Py_RETURN_NONE;
#else
    if (arg == Py_None) Py_RETURN_NONE;
    PyErr_SetString(PyExc_OSError, "no dlsym on this platform");
    return NULL;
#endif
}

/* (included, excluded) words of this thread's local dispatch-key set (after set_autocast_reader) */
static PyObject *py_dispatch_key_words(PyObject *m, PyObject *noargs) {
#ifdef HAVE_DLSYM
    const uint64_t *p = g_dks_lib ? dks_words() : NULL;
    if (p) return Py_BuildValue("(KK)", (unsigned long long)p[0], (unsigned long long)p[1]);
#endif
    PyErr_SetString(PyExc_RuntimeError, "no autocast reader set");
    return NULL;
}

static PyObject *py_clear_const_cache(PyObject *m, PyObject *noargs) {
    if (g_const_cache) PyDict_Clear(g_const_cache);
    Py_RETURN_NONE;
}

/* set_autocast_key(callable | None): statereaders.AutocastKeys, used while the autocast reader is set */
static PyObject *py_set_autocast_key(PyObject *m, PyObject *arg) {
    if (arg != Py_None && !PyCallable_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "set_autocast_key: a callable or None");
        return NULL;
    }
    PyObject *old = g_autocast_key;
    g_autocast_key = arg == Py_None ? NULL : Py_NewRef(arg);
    Py_XDECREF(old);
    Py_RETURN_NONE;
}

/* plain_forward(module, arg, calls, module_ns, tracing, declined): module.forward(arg) where
   calling the module would run only that: its type's __call__ and _call_impl are `calls`
   (nn.Module's), no
   hook of its own or global (`module_ns`: torch.nn.modules.module's namespace), no compiled call,
   no instance-level forward or _call_impl, no JIT tracing (`tracing()` is None), as
   Module._call_impl's own test (and modcalls' FastCall). Else `declined`, for the caller to call
   the module. The per-instance call of a model (runtime: about 0.8 µs of Module.__call__'s two
   Python frames and hook reads each instance). */
static PyObject *py_plain_forward(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) { PyErr_SetString(PyExc_TypeError, "plain_forward(module, arg, calls, module_ns, tracing, declined)"); return NULL; }
    PyObject *mod = args[0], *arg = args[1], *mcall = args[2], *ns = args[3], *tracing = args[4], *declined = args[5];
    static PyObject *s_call = NULL;
    if (!s_call && !(s_call = PyUnicode_InternFromString("__call__"))) return NULL;
    /* mcall: (Module.__call__, Module._call_impl) as torch defines them */
    if (!PyTuple_CheckExact(mcall) || PyTuple_GET_SIZE(mcall) != 2 || !PyDict_Check(ns)
        || _PyType_Lookup(Py_TYPE(mod), s_call) != PyTuple_GET_ITEM(mcall, 0)
        || _PyType_Lookup(Py_TYPE(mod), s_call_impl) != PyTuple_GET_ITEM(mcall, 1)) goto decline;
    PyObject **dp = _PyObject_GetDictPtr(mod);
    PyObject *d = dp ? *dp : NULL;
    if (!d || !PyDict_CheckExact(d)) goto decline;
    int r = forward_only(d, ns, NULL, tracing);
    if (r < 0) return NULL;
    if (!r) goto decline;
    return PyObject_CallMethodOneArg(mod, s_forward, arg);
decline:
    Py_INCREF(declined);
    return declined;
}

static PyObject *py_any_autocast(PyObject *m, PyObject *noargs) {
    int r = q_any_autocast();
    return r < 0 ? NULL : PyBool_FromLong(r);
}

static PyObject *py_setup_lazy(PyObject *m, PyObject *args) {
    PyObject *cls, *methods, *inplace;
    if (!PyArg_ParseTuple(args, "O!O!O!", &PyType_Type, &cls, &PyDict_Type, &methods, &PyDict_Type, &inplace)) return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)cls, &LazyBaseType)) { PyErr_SetString(PyExc_TypeError, "not a LazyBase subclass"); return NULL; }
    Py_INCREF(cls);
    g_LazyType = (PyTypeObject *)cls;
    {
        PyTypeObject *t = (PyTypeObject *)cls;
        /* no added slots, dict or finaliser: the subclass's instances are LazyBase's (see
           lazy_subtype_dealloc); the object-cache of the type is unaffected */
        if (t->tp_basicsize == LazyBaseType.tp_basicsize && t->tp_dictoffset == 0 && t->tp_finalize == NULL
            && t->tp_del == NULL && t->tp_base == &LazyBaseType && (t->tp_flags & Py_TPFLAGS_HEAPTYPE))
            t->tp_dealloc = (destructor)lazy_subtype_dealloc;
    }
    for (int i = 0; i < OP_COUNT; i++) {
        PyObject *f = PyDict_GetItemString(methods, op_names[i]);
        if (!f) f = PyDict_GetItemString(inplace, op_names[i]);
        if (!f) { PyErr_Format(PyExc_KeyError, "setup_lazy: missing %s", op_names[i]); return NULL; }
        Py_INCREF(f);
        Py_XSETREF(op_funcs[i], f);
    }
    Py_ssize_t pos = 0; PyObject *k, *v;
    while (PyDict_Next(methods, &pos, &k, &v)) {
        const char *name = PyUnicode_AsUTF8(k);
        if (!name || (name[0] == '_' && name[1] == '_')) continue;
        PyObject *desc = PyObject_CallFunction((PyObject *)&LazyMethodType, "Oi", v, 0);
        if (!desc || PyObject_SetAttr(cls, k, desc) < 0) { Py_XDECREF(desc); return NULL; }
        Py_DECREF(desc);
    }
    Py_RETURN_NONE;
}

static PyObject *py_clear_signatures(PyObject *m, PyObject *noargs) {
    tab_clear();
    Py_RETURN_NONE;
}

static PyObject *py_table_size(PyObject *m, PyObject *noargs) { return PyLong_FromSsize_t(g_tab_n); }

/* type_version(cls): the type's version tag, which CPython renews whenever the type or one of its
   bases is modified (0: none assigned yet). modcalls.py keys its per-class verdicts by it. */
static PyObject *py_type_version(PyObject *m, PyObject *cls) {
    if (!PyType_Check(cls)) { PyErr_SetString(PyExc_TypeError, "type_version: a type is required"); return NULL; }
    return PyLong_FromUnsignedLong((unsigned long)((PyTypeObject *)cls)->tp_version_tag);
}

/* tree_token(modules, guard): bytes naming, for each module of the list, its type, whether its
   type's __getattr__ is `guard` and its __getattribute__ object's, and its __dict__ and _parameters/_buffers/_modules tables at
   their version tags (Python 3.11, where every change to a dict, and every new dict, gets a new
   tag); None elsewhere, or where a __dict__ or table is not a dict. Equal tokens of the same
   module list: the same tree below it (a walk follows _modules), the same classes and the same
   table keys, so attrs.plan's answer stands (the list holds the modules: no address is reused). */
static PyObject *py_tree_token(PyObject *m, PyObject *args) {
    PyObject *mods, *guard;
    if (!PyArg_ParseTuple(args, "O!O:tree_token", &PyList_Type, &mods, &guard)) return NULL;
#if DICT_TAGS
    static PyObject *s_ga = NULL, *s_gab = NULL;
    if (!s_ga && !(s_ga = PyUnicode_InternFromString("__getattr__"))) return NULL;
    if (!s_gab && !(s_gab = PyUnicode_InternFromString("__getattribute__"))) return NULL;
    PyObject *obj_gab = _PyType_Lookup(&PyBaseObject_Type, s_gab);  /* (plan's test: object's own) */
    if (!s_key_params) {
        s_key_params = PyUnicode_InternFromString("_parameters");
        s_key_buffers = PyUnicode_InternFromString("_buffers");
        s_key_modules = PyUnicode_InternFromString("_modules");
        if (!s_key_params || !s_key_buffers || !s_key_modules) return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(mods);
    uint64_t *w = PyMem_Malloc((size_t)(n > 0 ? n : 1) * 10 * sizeof(uint64_t));
    if (!w) return PyErr_NoMemory();
    Py_ssize_t k = 0;
    PyObject *keys[3] = {s_key_params, s_key_buffers, s_key_modules};
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyList_GET_ITEM(mods, i);
        PyTypeObject *t = Py_TYPE(o);
        w[k++] = (uint64_t)(uintptr_t)t;
        w[k++] = (_PyType_Lookup(t, s_ga) == guard) | ((_PyType_Lookup(t, s_gab) == obj_gab) << 1);
        PyObject **dp = _PyObject_GetDictPtr(o);
        PyObject *d = dp ? *dp : NULL;
        if (!d || !PyDict_CheckExact(d)) { PyMem_Free(w); Py_RETURN_NONE; }
        w[k++] = (uint64_t)(uintptr_t)d;
        w[k++] = dict_tag(d);
        for (int j = 0; j < 3; j++) {
            PyObject *tb = PyDict_GetItemWithError(d, keys[j]);
            if (!tb && PyErr_Occurred()) { PyMem_Free(w); return NULL; }
            if (tb && !PyDict_CheckExact(tb)) { PyMem_Free(w); Py_RETURN_NONE; }
            w[k++] = (uint64_t)(uintptr_t)tb;
            w[k++] = tb ? dict_tag(tb) : 0;
        }
    }
    PyObject *r = PyBytes_FromStringAndSize((const char *)w, k * (Py_ssize_t)sizeof(uint64_t));
    PyMem_Free(w);
    return r;
#else
    Py_RETURN_NONE;
#endif
}

static PyMethodDef module_methods[] = {
    {"plain_forward", (PyCFunction)(void (*)(void))py_plain_forward, METH_FASTCALL, "module.forward(arg) where calling the module runs only that"},
    {"tree_token", py_tree_token, METH_VARARGS, "tree_token(modules, guard): bytes that change when the module tree's tables or classes do (Python 3.11), else None"},
    {"frame_reader", py_frame_reader, METH_NOARGS, "how the innermost frame's code is read (1: directly)"},
    {"current", py_current, METH_NOARGS, "The innermost active recorder of this thread, or None."},
    {"type_version", py_type_version, METH_O, "type_version(cls): the type's version tag (renewed when it or a base changes; 0: none yet)."},
    {"push", py_push, METH_O, "Make a recorder (or None) the active one of this thread."},
    {"pop", py_pop, METH_NOARGS, "Undo the last push of this thread."},
    {"setup", py_setup, METH_VARARGS, "Give the core the torch objects it needs."},
    {"set_state_readers", py_set_state_readers, METH_O,
     "set_state_readers(addresses | None): torch's C++ state accessors (statereaders.py), or the builtins."},
    {"read_state", py_read_state, METH_NOARGS,
     "read_state() -> (grad, inference, any autocast, torch functions on, function modes on, function stack length)."},
    {"state_readers_on", py_state_readers_on, METH_NOARGS,
     "(C++ accessors in use, autocast read from the dispatch-key set) as booleans."},
    {"set_autocast_reader", py_set_autocast_reader, METH_O,
     "set_autocast_reader((dlopen handle, symbol, mask, off) | None): read autocast from torch's dispatch-key set."},
    {"dispatch_key_words", py_dispatch_key_words, METH_NOARGS, "(included, excluded) of this thread's local dispatch-key set."},
    {"clear_const_cache", py_clear_const_cache, METH_NOARGS, "Forget the constant factories' calls (consts.clear)."},
    {"set_autocast_key", py_set_autocast_key, METH_O,
     "set_autocast_key(keys | None): word of the devices' autocast switches -> id (statereaders.AutocastKeys)."},
    {"any_autocast", py_any_autocast, METH_NOARGS, "Whether any device's autocast is on, as the core reads it."},
    {"setup_lazy", py_setup_lazy, METH_VARARGS, "setup_lazy(LazyTensor, methods, inplace)"},
    {"clear_signatures", py_clear_signatures, METH_NOARGS, "Forget every fast signature entry."},
    {"table_size", py_table_size, METH_NOARGS, "Entries in the fast signature table."},
    {NULL}
};

static struct PyModuleDef coremodule = {PyModuleDef_HEAD_INIT, "_core",
    "batchcraft's C recording core (see ccore.py).", -1, module_methods};

PyMODINIT_FUNC PyInit__core(void) {
    if (PyThread_tss_create(&g_tss) != 0) return NULL;
    if (PyType_Ready(&LazyBaseType) < 0 || PyType_Ready(&LazyMethodType) < 0 || PyType_Ready(&RecorderType) < 0
        || PyType_Ready(&ModeType) < 0 || PyType_Ready(&TensorMetaType) < 0 || PyType_Ready(&BlockCallType) < 0 || PyType_Ready(&ModuleAttrType) < 0
        || PyType_Ready(&RecAttrType) < 0 || PyType_Ready(&FastCallType) < 0
        || PyType_Ready(&FastFnType) < 0) return NULL;
#define INTERN(var, s) do { var = PyUnicode_InternFromString(s); if (!var) return NULL; } while (0)
    INTERN(s_record, "record"); INTERN(s_general, "general"); INTERN(s_requires_grad, "requires_grad");
    INTERN(s_sig_entry, "_sig_entry"); INTERN(s_materialize_leaves, "materialize_leaves");
    INTERN(s_pending_limit, "pending_limit"); INTERN(s_step_limit, "step_limit"); INTERN(s_inplace, "inplace");
    INTERN(s_mode_call, "mode_call"); INTERN(s_leaf, "leaf"); INTERN(s_mode, "mode"); INTERN(s_under_user_mode, "under_user_mode"); INTERN(s_block_slow, "_record_slow"); INTERN(s_const_entry, "const_entry"); INTERN(s_check_fp, "_check_fingerprint");
    INTERN(s_batchcraft_block, "_batchcraft_block"); INTERN(s_fn, "fn"); INTERN(s_register_view, "register_view"); INTERN(s_dunder_tf, "__torch_function__"); INTERN(s_for_handler, "for_handler");
    INTERN(s_forward, "forward"); INTERN(s_parameters, "_parameters"); INTERN(s_weight, "weight"); INTERN(s_bias, "bias");
    INTERN(s_max_norm, "max_norm"); INTERN(s_padding_idx, "padding_idx"); INTERN(s_norm_type, "norm_type");
    INTERN(s_scale_grad, "scale_grad_by_freq"); INTERN(s_sparse, "sparse"); INTERN(s_compiled_call, "_compiled_call_impl");
    INTERN(s_call_impl, "_call_impl"); INTERN(s_cells_checked, "_cells_checked");
    INTERN(s_linear, "linear"); INTERN(s_embedding, "embedding");
    {
        static const char *hooks[4] = {"_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"};
        static const char *ghooks[4] = {"_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                                        "_global_backward_pre_hooks"};
        for (int i = 0; i < 4; i++) { INTERN(s_hook_names[i], hooks[i]); INTERN(s_global_hook_names[i], ghooks[i]); }
    }
    PyObject *m = PyModule_Create(&coremodule);
    if (!m) return NULL;
    Py_INCREF(&LazyBaseType); PyModule_AddObject(m, "LazyBase", (PyObject *)&LazyBaseType);
    Py_INCREF(&LazyMethodType); PyModule_AddObject(m, "LazyMethod", (PyObject *)&LazyMethodType);
    Py_INCREF(&RecorderType); PyModule_AddObject(m, "Recorder", (PyObject *)&RecorderType);
    Py_INCREF(&ModeType); PyModule_AddObject(m, "Mode", (PyObject *)&ModeType);
    Py_INCREF(&BlockCallType); PyModule_AddObject(m, "BlockCall", (PyObject *)&BlockCallType);
    Py_INCREF(&TensorMetaType); PyModule_AddObject(m, "TensorMeta", (PyObject *)&TensorMetaType);
    Py_INCREF(&ModuleAttrType); PyModule_AddObject(m, "ModuleAttr", (PyObject *)&ModuleAttrType);
    Py_INCREF(&RecAttrType); PyModule_AddObject(m, "RecordingAttr", (PyObject *)&RecAttrType);
    Py_INCREF(&FastCallType); PyModule_AddObject(m, "FastCall", (PyObject *)&FastCallType);
    Py_INCREF(&FastFnType); PyModule_AddObject(m, "FastFn", (PyObject *)&FastFnType);
    {
        PyObject *modname = PyUnicode_FromString("torch");
        PyObject *ft = modname ? PyCFunction_NewEx(&fast_tensor_def, NULL, modname) : NULL;
        Py_XDECREF(modname);
        if (!ft || PyModule_AddObject(m, "fast_tensor", ft) < 0) { Py_XDECREF(ft); return NULL; }
    }
    return m;
}
