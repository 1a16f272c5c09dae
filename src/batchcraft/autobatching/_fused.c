/* batchcraft.autobatching._fused: fused elementwise tails of batched programs (float32, CPU).
 *
 * A batched program's elementwise steps (sigmoid, tanh, add, mul...) each cost a torch call: on
 * the tens of rows a tree level or a time step batches, the call (its dispatch, an output
 * allocation and one pass over memory) costs more than the maths. fuse.py finds clusters of such
 * steps and hands each one here as a Kernel: a list of operations over value slots, run row by row
 * with the row's intermediates in a small scratch buffer, one pass, no torch call.
 *
 * Also the row products of rowmm.py: per-node matrices read where they lie, by address (MKL's
 * pointer-array GEMM through its address, a vector-times-matrix loop, and an AVX-512 kernel for
 * rows times a shared matrix).
 *
 * Plain CPython C API and raw float pointers (no torch headers, so no tie to a torch version).
 * fuse.py checks every operand (float32, CPU, strided, unit element stride, no autograd) before a
 * call; anything else runs the program's own torch calls.
 *
 * Maths: add/sub/mul/neg/relu are IEEE single precision as in torch (one rounding per op;
 * -ffp-contract=off keeps the compiler from fusing a multiply and an add). exp, sigmoid and tanh
 * are polynomial approximations (Cephes' expf and tanhf coefficients, S. L. Moshier) within a few
 * units in the last place of torch's (which differ from one another by the same order: torch uses
 * Sleef or MKL's vector library depending on layout). NaN propagates, +-inf saturate as torch's.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <math.h>

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__) && defined(__linux__)
#define BC_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#define BC_VECTOR_MATHS 1  /* AVX-512 and AVX2 loops, chosen at import */
#include <immintrin.h>
#else
#define BC_CLONES
#define BC_VECTOR_MATHS 0
#endif

/* opcodes (fuse.py mirrors them in OPCODES) */
enum {
    OP_ADD = 0, OP_SUB = 1, OP_MUL = 2,            /* d = a op b */
    OP_ADD_S = 3, OP_SUB_S = 4, OP_MUL_S = 5,      /* d = a op s */
    OP_RSUB_S = 6,                                  /* d = s - a */
    OP_NEG = 7, OP_RELU = 8, OP_SIGMOID = 9, OP_TANH = 10, OP_EXP = 11,
    OP_COUNT = 12
};

static inline float f_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* e^x; Cephes expf: x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-7 polynomial, 2^n in two
 * halves so that results down to the denormals stay right. */
static inline float bc_exp(float x) {
    float xc = x > 88.72283935546875f ? 88.72283935546875f : x;   /* NaN passes both tests */
    xc = xc < -103.97208f ? -103.97208f : xc;
    float n = xc * 1.44269504088896341f;
    n = (n + 12582912.0f) - 12582912.0f;                             /* round to nearest */
    n = (n == n) ? n : 0.0f;                                         /* NaN: keep the int cast defined */
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float z = r * r;
    float p = 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * z + r + 1.0f;
    int32_t ni = (int32_t)n;
    int32_t n1 = ni / 2;
    int32_t n2 = ni - n1;
    float y = p * f_of((uint32_t)(n1 + 127) << 23) * f_of((uint32_t)(n2 + 127) << 23);
    y = x > 88.72283935546875f ? INFINITY : y;
    y = x < -103.97208f ? 0.0f : y;
    return y;
}

static inline float bc_sigmoid(float x) { return 1.0f / (1.0f + bc_exp(-x)); }

/* tanh: Cephes tanhf's odd polynomial below |x| = 0.625, else 1 - 2 / (e^2|x| + 1) with x's sign */
static inline float bc_tanh(float x) {
    float ax = fabsf(x);
    float z = x * x;
    float p = -5.70498872745E-3f;
    p = p * z + 2.06390887954E-2f;
    p = p * z - 5.37397155531E-2f;
    p = p * z + 1.33314422036E-1f;
    p = p * z - 3.33332819422E-1f;
    float small = p * z * x + x;
    float e = bc_exp(2.0f * ax);
    float large = copysignf(1.0f - 2.0f / (e + 1.0f), x);
    small = x == 0.0f ? x : small;                                   /* tanh(-0) = -0 */
    return ax < 0.625f ? small : large;                              /* NaN: large, which is NaN */
}

BC_CLONES static void k_add(float *restrict d, const float *a, const float *b, Py_ssize_t w) {
    for (Py_ssize_t i = 0; i < w; i++) d[i] = a[i] + b[i];
}
BC_CLONES static void k_sub(float *restrict d, const float *a, const float *b, Py_ssize_t w) {
    for (Py_ssize_t i = 0; i < w; i++) d[i] = a[i] - b[i];
}
BC_CLONES static void k_mul(float *restrict d, const float *a, const float *b, Py_ssize_t w) {
    for (Py_ssize_t i = 0; i < w; i++) d[i] = a[i] * b[i];
}
BC_CLONES static void k_add_s(float *restrict d, const float *a, float s, Py_ssize_t w) {
    for (Py_ssize_t i = 0; i < w; i++) d[i] = a[i] + s;
}
BC_CLONES static void k_sub_s(float *restrict d, const float *a, float s, Py_ssize_t w) {
    for (Py_ssize_t i = 0; i < w; i++) d[i] = a[i] - s;
}
BC_CLONES static void k_mul_s(float *restrict d, const float *a, float s, Py_ssize_t w) {
    for (Py_ssize_t i = 0; i < w; i++) d[i] = a[i] * s;
}
BC_CLONES static void k_rsub_s(float *restrict d, const float *a, float s, Py_ssize_t w) {
    for (Py_ssize_t i = 0; i < w; i++) d[i] = s - a[i];
}
BC_CLONES static void k_neg(float *restrict d, const float *a, Py_ssize_t w) {
    for (Py_ssize_t i = 0; i < w; i++) d[i] = -a[i];
}
BC_CLONES static void k_relu(float *restrict d, const float *a, Py_ssize_t w) {
    /* as torch: relu(NaN) = NaN, relu(-0.0) = -0.0 */
    for (Py_ssize_t i = 0; i < w; i++) d[i] = a[i] < 0.0f ? 0.0f : a[i];
}
BC_CLONES static void k_sigmoid(float *restrict d, const float *a, Py_ssize_t w) {
    for (Py_ssize_t i = 0; i < w; i++) d[i] = bc_sigmoid(a[i]);
}
BC_CLONES static void k_tanh(float *restrict d, const float *a, Py_ssize_t w) {
    for (Py_ssize_t i = 0; i < w; i++) d[i] = bc_tanh(a[i]);
}
BC_CLONES static void k_exp(float *restrict d, const float *a, Py_ssize_t w) {
    for (Py_ssize_t i = 0; i < w; i++) d[i] = bc_exp(a[i]);
}

typedef void (*unary_fn)(float *restrict, const float *, Py_ssize_t);
static unary_fn f_sigmoid = k_sigmoid, f_tanh = k_tanh, f_exp = k_exp;

#if BC_VECTOR_MATHS
/* Cephes expf's e^r (|r| <= ln2 / 2, degree 7) and tanhf's odd polynomial in z = x^2, written
 * once for every vector width: FMADD, MUL, ADD and SET1 are that width's intrinsics. */
#define EXPF_POLY(p, r, FMADD, MUL, ADD, SET1)                                                 \
    do {                                                                                      \
        p = SET1(1.9875691500E-4f);                                                           \
        p = FMADD(p, r, SET1(1.3981999507E-3f));                                              \
        p = FMADD(p, r, SET1(8.3334519073E-3f));                                              \
        p = FMADD(p, r, SET1(4.1665795894E-2f));                                              \
        p = FMADD(p, r, SET1(1.6666665459E-1f));                                              \
        p = FMADD(p, r, SET1(5.0000001201E-1f));                                              \
        p = FMADD(p, MUL(r, r), ADD(r, SET1(1.0f)));                                          \
    } while (0)
#define TANHF_POLY(p, z, FMADD, SET1)                                                         \
    do {                                                                                      \
        p = SET1(-5.70498872745E-3f);                                                         \
        p = FMADD(p, z, SET1(2.06390887954E-2f));                                             \
        p = FMADD(p, z, SET1(-5.37397155531E-2f));                                            \
        p = FMADD(p, z, SET1(1.33314422036E-1f));                                             \
        p = FMADD(p, z, SET1(-3.33332819422E-1f));                                            \
    } while (0)

/* The same maths, 16 lanes with AVX-512F: vscalefps scales by 2^n with the right overflow to inf
 * and underflow through the denormals, so the clamps only keep the polynomial's argument small. */
#define T512 __attribute__((target("avx512f")))
T512 static inline __m512 exp16(__m512 x) {
    __m512 xc = _mm512_min_ps(_mm512_set1_ps(89.0f), x);             /* min/max(c, NaN) = NaN */
    xc = _mm512_max_ps(_mm512_set1_ps(-104.0f), xc);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p;
    EXPF_POLY(p, r, _mm512_fmadd_ps, _mm512_mul_ps, _mm512_add_ps, _mm512_set1_ps);
    return _mm512_scalef_ps(p, n);
}
T512 static inline __m512 sigmoid16(__m512 x) {
    __m512 one = _mm512_set1_ps(1.0f);
    return _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}
T512 static inline __m512 tanh16(__m512 x) {
    __m512 sign = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u)));
    __m512 ax = _mm512_castsi512_ps(_mm512_andnot_si512(_mm512_set1_epi32((int)0x80000000u), _mm512_castps_si512(x)));
    __m512 z = _mm512_mul_ps(x, x);
    __m512 p;
    TANHF_POLY(p, z, _mm512_fmadd_ps, _mm512_set1_ps);
    __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, z), x, x);
    small = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_EQ_OQ), small, x);  /* tanh(-0) = -0 */
    __m512 e = exp16(_mm512_add_ps(ax, ax));
    __m512 large = _mm512_sub_ps(_mm512_set1_ps(1.0f), _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
    large = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(large), _mm512_castps_si512(sign)));
    __mmask16 m = _mm512_cmp_ps_mask(ax, _mm512_set1_ps(0.625f), _CMP_LT_OQ);   /* NaN: large (NaN) */
    return _mm512_mask_blend_ps(m, large, small);
}
#define LOOP16(NAME, FN)                                                                      \
    T512 static void NAME(float *restrict d, const float *a, Py_ssize_t w) {                 \
        Py_ssize_t i = 0;                                                                     \
        for (; i + 16 <= w; i += 16) _mm512_storeu_ps(d + i, FN(_mm512_loadu_ps(a + i)));    \
        if (i < w) {                                                                          \
            __mmask16 m = (__mmask16)((1u << (w - i)) - 1u);                                  \
            _mm512_mask_storeu_ps(d + i, m, FN(_mm512_maskz_loadu_ps(m, a + i)));             \
        }                                                                                     \
    }
LOOP16(k_sigmoid512, sigmoid16)
LOOP16(k_tanh512, tanh16)
LOOP16(k_exp512, exp16)

/* The same maths, 8 lanes with AVX2 and FMA, for CPUs without AVX-512 (AMD Zen 1-3, many Intel
 * desktops), where the portable loops ran 5-10x slower than torch's own vector kernels. As the
 * AVX-512 loops: the polynomials by FMA (within a few ulp of the portable loops); 2^n as two
 * exponent-field products, exact down to one rounding in the denormals as vscalefps. */
#define T256 __attribute__((target("avx2,fma")))
#define V8(c) _mm256_set1_ps(c)
T256 static inline __m256 exp8(__m256 x) {
    const __m256 hi = V8(88.72283935546875f), lo = V8(-103.97208f);
    const __m256 over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ), under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    __m256 xc = _mm256_blendv_ps(_mm256_blendv_ps(x, hi, over), lo, under);  /* NaN passes both */
    __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, V8(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    n = _mm256_and_ps(n, _mm256_cmp_ps(n, n, _CMP_ORD_Q));                  /* NaN -> 0 */
    __m256 r = _mm256_fnmadd_ps(n, V8(0.693359375f), xc);
    r = _mm256_fnmadd_ps(n, V8(-2.12194440e-4f), r);
    __m256 p;
    EXPF_POLY(p, r, _mm256_fmadd_ps, _mm256_mul_ps, _mm256_add_ps, _mm256_set1_ps);
    __m256i ni = _mm256_cvtps_epi32(n);                                     /* n is integral */
    __m256i n1 = _mm256_srai_epi32(_mm256_add_epi32(ni, _mm256_srli_epi32(ni, 31)), 1);  /* ni / 2 */
    __m256i n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23))),
                             _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23)));
    return _mm256_blendv_ps(_mm256_blendv_ps(y, V8(INFINITY), over), _mm256_setzero_ps(), under);
}
T256 static inline __m256 sigmoid8(__m256 x) {
    return _mm256_div_ps(V8(1.0f), _mm256_add_ps(V8(1.0f), exp8(_mm256_xor_ps(x, V8(-0.0f)))));
}
T256 static inline __m256 tanh8(__m256 x) {
    const __m256 signbit = V8(-0.0f);
    __m256 ax = _mm256_andnot_ps(signbit, x);
    __m256 z = _mm256_mul_ps(x, x);
    __m256 p;
    TANHF_POLY(p, z, _mm256_fmadd_ps, _mm256_set1_ps);
    __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), x, x);
    small = _mm256_blendv_ps(small, x, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_EQ_OQ));  /* -0 */
    __m256 e = exp8(_mm256_add_ps(ax, ax));
    __m256 large = _mm256_sub_ps(V8(1.0f), _mm256_div_ps(V8(2.0f), _mm256_add_ps(e, V8(1.0f))));
    large = _mm256_or_ps(_mm256_andnot_ps(signbit, large), _mm256_and_ps(signbit, x));  /* copysign */
    return _mm256_blendv_ps(large, small, _mm256_cmp_ps(ax, V8(0.625f), _CMP_LT_OQ));  /* NaN: large */
}
#define LOOP8(NAME, FN, SCALAR)                                                               \
    T256 static void NAME(float *restrict d, const float *a, Py_ssize_t w) {                 \
        Py_ssize_t i = 0;                                                                     \
        for (; i + 8 <= w; i += 8) _mm256_storeu_ps(d + i, FN(_mm256_loadu_ps(a + i)));      \
        for (; i < w; i++) d[i] = SCALAR(a[i]);                                               \
    }
LOOP8(k_sigmoid256, sigmoid8, bc_sigmoid)
LOOP8(k_tanh256, tanh8, bc_tanh)
LOOP8(k_exp256, exp8, bc_exp)
#endif

/* The vector maths this CPU runs: AVX-512F (16 lanes), else AVX2 with FMA (8 lanes), else the
 * portable loops; the vector ones are within a few ulp of the portable loops.
 * BATCHCRAFT_FUSED_PORTABLE=1 forces the portable loops, =avx2 at most AVX2 (tests). */
static const char *vector_maths = "portable";
static int gemm_shared_on = 0;  /* AVX-512F and not BATCHCRAFT_FUSED_PORTABLE: gemm_shared runs */

static void choose_kernels(void) {
#if BC_VECTOR_MATHS
    const char *cap = getenv("BATCHCRAFT_FUSED_PORTABLE");
    int allow512 = 1, allow256 = 1;
    if (cap && *cap && strcmp(cap, "0") != 0) {
        allow512 = 0;
        allow256 = strcmp(cap, "avx2") == 0;
    }
    __builtin_cpu_init();
    if (allow512 && __builtin_cpu_supports("avx512f")) {
        f_sigmoid = k_sigmoid512; f_tanh = k_tanh512; f_exp = k_exp512;
        vector_maths = "avx512f";
        gemm_shared_on = 1;
    } else if (allow256 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        f_sigmoid = k_sigmoid256; f_tanh = k_tanh256; f_exp = k_exp256;
        vector_maths = "avx2";
    }
#endif
}

/* ---- Kernel ------------------------------------------------------------------------------------
 * Slots 0..n_slots-1, each a row of `width` floats:
 *   input j   (kind 0): an operand; row r at ptr_j + (index ? index[r] : r) * row_stride_j
 *   scratch   (kind 1): computed, read only inside the kernel: a buffer reused for every row
 *   output j  (kind 2): computed and returned: row r at out_j + r * width
 *   view      (kind 3): columns [offset, offset + width) of an earlier slot (a chunk)
 * An op: (code, dst, a, b, scalar); b is -1 for unary and scalar ops. */

static int check_index(const int64_t *ix, Py_ssize_t rows, Py_ssize_t limit, const char *what);

typedef struct { int code, dst, a, b; float s; } Op;
typedef struct { int kind, ref; Py_ssize_t width, offset; } Slot;

typedef struct {
    PyObject_HEAD
    int n_ops, n_slots, n_in, n_out;
    Op *ops;
    Slot *slots;
    Py_ssize_t scratch_floats;
    Py_ssize_t *scratch_off;     /* per slot: offset in the scratch buffer (kind 1) */
} Kernel;

static void kernel_dealloc(Kernel *k) {
    PyMem_Free(k->ops);
    PyMem_Free(k->slots);
    PyMem_Free(k->scratch_off);
    Py_TYPE(k)->tp_free((PyObject *)k);
}

static int as_int(PyObject *seq, Py_ssize_t i, long *out) {
    PyObject *o = PySequence_GetItem(seq, i);
    if (!o) return -1;
    *out = PyLong_AsLong(o);
    Py_DECREF(o);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* Kernel(slots, ops, n_in, n_out): slots [(kind, ref, width, offset)], ops [(code, dst, a, b, s)] */
static PyObject *kernel_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *slots, *ops;
    int n_in, n_out;
    if (!PyArg_ParseTuple(args, "OOii:Kernel", &slots, &ops, &n_in, &n_out)) return NULL;
    Py_ssize_t ns = PySequence_Size(slots), no = PySequence_Size(ops);
    if (ns < 0 || no < 0) return NULL;
    if (ns > 4096 || no > 4096 || n_in < 0 || n_out < 0) {
        PyErr_SetString(PyExc_ValueError, "Kernel: too many slots or ops");
        return NULL;
    }
    Kernel *k = (Kernel *)type->tp_alloc(type, 0);
    if (!k) return NULL;
    k->n_slots = (int)ns; k->n_ops = (int)no; k->n_in = n_in; k->n_out = n_out;
    k->slots = PyMem_Calloc(ns ? ns : 1, sizeof(Slot));
    k->ops = PyMem_Calloc(no ? no : 1, sizeof(Op));
    k->scratch_off = PyMem_Calloc(ns ? ns : 1, sizeof(Py_ssize_t));
    if (!k->slots || !k->ops || !k->scratch_off) { Py_DECREF(k); return PyErr_NoMemory(); }
    int seen_in = 0, seen_out = 0;
    for (Py_ssize_t i = 0; i < ns; i++) {
        PyObject *t = PySequence_GetItem(slots, i);
        if (!t) { Py_DECREF(k); return NULL; }
        long v[4];
        int bad = 0;
        for (int q = 0; q < 4 && !bad; q++) bad = as_int(t, q, &v[q]);
        Py_DECREF(t);
        if (bad) { Py_DECREF(k); return NULL; }
        Slot *s = &k->slots[i];
        s->kind = (int)v[0]; s->ref = (int)v[1]; s->width = v[2]; s->offset = v[3];
        int ok = s->width > 0 && s->offset >= 0;
        if (s->kind == 0) ok = ok && s->ref == seen_in++ ;
        else if (s->kind == 2) ok = ok && s->ref == seen_out++;
        else if (s->kind == 3) ok = ok && s->ref >= 0 && s->ref < i && s->offset + s->width <= k->slots[s->ref].width;
        else if (s->kind != 1) ok = 0;
        if (!ok) { Py_DECREF(k); PyErr_Format(PyExc_ValueError, "Kernel: bad slot %zd", i); return NULL; }
        if (s->kind == 1) { k->scratch_off[i] = k->scratch_floats; k->scratch_floats += s->width; }
    }
    if (seen_in != n_in || seen_out != n_out) {
        Py_DECREF(k);
        PyErr_SetString(PyExc_ValueError, "Kernel: input / output slots do not match n_in / n_out");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < no; i++) {
        PyObject *t = PySequence_GetItem(ops, i);
        if (!t) { Py_DECREF(k); return NULL; }
        long v[4];
        int bad = 0;
        for (int q = 0; q < 4 && !bad; q++) bad = as_int(t, q, &v[q]);
        double sv = 0.0;
        if (!bad) {
            PyObject *so = PySequence_GetItem(t, 4);
            if (!so) bad = 1;
            else { sv = PyFloat_AsDouble(so); Py_DECREF(so); bad = sv == -1.0 && PyErr_Occurred(); }
        }
        Py_DECREF(t);
        if (bad) { Py_DECREF(k); return NULL; }
        Op *o = &k->ops[i];
        o->code = (int)v[0]; o->dst = (int)v[1]; o->a = (int)v[2]; o->b = (int)v[3]; o->s = (float)sv;
        int binary = o->code <= OP_MUL;
        int ok = o->code >= 0 && o->code < OP_COUNT && o->dst >= 0 && o->dst < ns && o->a >= 0 && o->a < ns
                 && (k->slots[o->dst].kind == 1 || k->slots[o->dst].kind == 2)
                 && k->slots[o->a].width == k->slots[o->dst].width
                 && (binary ? (o->b >= 0 && o->b < ns && k->slots[o->b].width == k->slots[o->dst].width) : o->b == -1);
        if (!ok) { Py_DECREF(k); PyErr_Format(PyExc_ValueError, "Kernel: bad op %zd", i); return NULL; }
    }
    return (PyObject *)k;
}


/* ---- rows over torch's OpenMP team ---------------------------------------------------------------
 * A kernel's rows are independent, so they split into contiguous ranges, one per thread, with the
 * same maths per row (the same bits as one thread). The threads are torch's own: openmp.py hands
 * over the addresses of GOMP_parallel and omp_get_max_threads / omp_get_thread_num /
 * omp_get_num_threads of the OpenMP runtime torch loaded, so the team is the one torch's intra-op
 * kernels use (already spinning after the last product, no thread of ours to wake) and its size is
 * torch.get_num_threads() of the calling thread. Small calls stay on one thread: below
 * TEAM_GRAIN floats a row range per thread (torch's GRAIN_SIZE for elementwise kernels is 32768
 * elements) the team's start costs more than it saves. */
#define MAX_TEAM 64
#define TEAM_GRAIN 16384
typedef void (*gomp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
typedef int (*omp_int_fn)(void);
static struct {
    gomp_parallel_fn parallel;
    omp_int_fn max_threads, thread_num, num_threads;
} omp = {NULL, NULL, NULL, NULL};

typedef struct {
    Kernel *k;
    Py_ssize_t rows;
    char **base;
    Py_ssize_t *stride;
    const int64_t **index;
    float *scratch;
    float **ptr;
    int team;
} RowJob;

/* floats one row of the kernel touches (every op's width): the work per row */
static Py_ssize_t kernel_floats(Kernel *k) {
    Py_ssize_t w = 0;
    for (int q = 0; q < k->n_ops; q++) w += k->slots[k->ops[q].dst].width;
    return w;
}

/* threads for `work` floats over `rows` rows: 1 without a runtime or below the grain */
static int team_size(Py_ssize_t rows, Py_ssize_t work) {
    if (!omp.parallel || rows < 2 || work < 2 * TEAM_GRAIN) return 1;
    int t = omp.max_threads();
    Py_ssize_t by_work = work / TEAM_GRAIN;
    if (t > by_work) t = (int)by_work;
    if (t > rows) t = (int)rows;
    if (t > MAX_TEAM) t = MAX_TEAM;
    return t < 1 ? 1 : t;
}

static void run_rows(Kernel *k, char **base, Py_ssize_t *stride, const int64_t **index, float **ptr,
                     float *scratch, Py_ssize_t r0, Py_ssize_t r1) {
    int ns = k->n_slots;
    for (Py_ssize_t r = r0; r < r1; r++) {
        for (int i = 0; i < ns; i++) {
            const Slot *s = &k->slots[i];
            if (s->kind == 1) {
                ptr[i] = scratch + k->scratch_off[i];          /* this thread's scratch rows */
            } else if (s->kind == 3) {
                ptr[i] = ptr[s->ref] + s->offset;              /* columns of an earlier slot's row */
            } else {
                Py_ssize_t row = index[i] ? (Py_ssize_t)index[i][r] : r;
                ptr[i] = (float *)(base[i] + row * stride[i]);
            }
        }
        for (int q = 0; q < k->n_ops; q++) {
            const Op *o = &k->ops[q];
            float *d = ptr[o->dst];
            const float *a = ptr[o->a];
            Py_ssize_t w = k->slots[o->dst].width;
            switch (o->code) {
            case OP_ADD: k_add(d, a, ptr[o->b], w); break;
            case OP_SUB: k_sub(d, a, ptr[o->b], w); break;
            case OP_MUL: k_mul(d, a, ptr[o->b], w); break;
            case OP_ADD_S: k_add_s(d, a, o->s, w); break;
            case OP_SUB_S: k_sub_s(d, a, o->s, w); break;
            case OP_MUL_S: k_mul_s(d, a, o->s, w); break;
            case OP_RSUB_S: k_rsub_s(d, a, o->s, w); break;
            case OP_NEG: k_neg(d, a, w); break;
            case OP_RELU: k_relu(d, a, w); break;
            case OP_SIGMOID: f_sigmoid(d, a, w); break;
            case OP_TANH: f_tanh(d, a, w); break;
            default: f_exp(d, a, w); break;
            }
        }
    }
}

/* This team member's share [*a, *b) of [0, total), cut in whole units of `unit` (the last may be
 * short), or 0 when it has none. `team`: the members asked for (the runtime may give fewer). */
static int member_range(int team, Py_ssize_t total, Py_ssize_t unit, Py_ssize_t *a, Py_ssize_t *b) {
    int id = omp.thread_num(), n = omp.num_threads();
    if (n > team) n = team;
    if (id >= n) return 0;
    Py_ssize_t per = ((total + unit - 1) / unit + n - 1) / n * unit;
    *a = id * per > total ? total : id * per;
    *b = *a + per > total ? total : *a + per;
    return *a < *b;
}

static void rows_worker(void *arg) {
    RowJob *j = (RowJob *)arg;
    Py_ssize_t r0, r1;
    if (!member_range(j->team, j->rows, 1, &r0, &r1)) return;
    int id = omp.thread_num(), ns = j->k->n_slots;
    Py_ssize_t sf = j->k->scratch_floats ? j->k->scratch_floats : 1;
    run_rows(j->k, j->base, j->stride, j->index, j->ptr + (Py_ssize_t)id * ns, j->scratch + (Py_ssize_t)id * sf, r0, r1);
}

/* kernel(rows, in_ptrs, in_row_strides, in_index_ptrs, in_rows, out_ptrs): in_index_ptrs[j] is 0
 * or the address of `rows` int64 row numbers (a gather), each checked against in_rows[j] (the
 * gathered tensor's rows); the addresses are the caller's, checked by fuse.py. */
static PyObject *kernel_call(Kernel *k, PyObject *args, PyObject *kwds) {
    Py_ssize_t rows;
    PyObject *ip, *is, *ix, *il, *op;
    if (!PyArg_ParseTuple(args, "nO!O!O!O!O!:Kernel", &rows, &PyTuple_Type, &ip, &PyTuple_Type, &is,
                          &PyTuple_Type, &ix, &PyTuple_Type, &il, &PyTuple_Type, &op))
        return NULL;
    if (PyTuple_GET_SIZE(ip) != k->n_in || PyTuple_GET_SIZE(is) != k->n_in || PyTuple_GET_SIZE(ix) != k->n_in
        || PyTuple_GET_SIZE(il) != k->n_in || PyTuple_GET_SIZE(op) != k->n_out || rows < 0) {
        PyErr_SetString(PyExc_ValueError, "Kernel: wrong number of inputs or outputs");
        return NULL;
    }
    int ns = k->n_slots;
    char **base = PyMem_Malloc(sizeof(char *) * ns);
    Py_ssize_t *stride = PyMem_Malloc(sizeof(Py_ssize_t) * ns);      /* bytes per row */
    const int64_t **index = PyMem_Calloc(ns, sizeof(int64_t *));
    /* one scratch row set and one pointer array per team member */
    int team = team_size(rows, rows * kernel_floats(k));
    float *scratch = PyMem_Malloc(sizeof(float) * (k->scratch_floats ? k->scratch_floats : 1) * team);
    float **ptr = PyMem_Malloc(sizeof(float *) * ns * team);
    if (!base || !stride || !index || !scratch || !ptr) {
        PyMem_Free(base); PyMem_Free(stride); PyMem_Free(index); PyMem_Free(scratch); PyMem_Free(ptr);
        return PyErr_NoMemory();
    }
    int err = 0;
    for (int i = 0; i < ns && !err; i++) {
        Slot *s = &k->slots[i];
        if (s->kind == 0) {
            base[i] = PyLong_AsVoidPtr(PyTuple_GET_ITEM(ip, s->ref));
            stride[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(is, s->ref)) * (Py_ssize_t)sizeof(float);
            void *xp = PyLong_AsVoidPtr(PyTuple_GET_ITEM(ix, s->ref));
            index[i] = (const int64_t *)xp;
            err = PyErr_Occurred() != NULL || base[i] == NULL;
            if (!err && xp != NULL) {
                Py_ssize_t limit = PyLong_AsSsize_t(PyTuple_GET_ITEM(il, s->ref));
                err = (limit == -1 && PyErr_Occurred()) || check_index(index[i], rows, limit, "Kernel") < 0;
                if (err) { PyMem_Free(base); PyMem_Free(stride); PyMem_Free(index); PyMem_Free(scratch); PyMem_Free(ptr); return NULL; }
            }
        } else if (s->kind == 1) {
            base[i] = (char *)(scratch + k->scratch_off[i]);
            stride[i] = 0;
        } else if (s->kind == 2) {
            base[i] = PyLong_AsVoidPtr(PyTuple_GET_ITEM(op, s->ref));
            stride[i] = s->width * (Py_ssize_t)sizeof(float);
            err = PyErr_Occurred() != NULL || (base[i] == NULL && rows > 0);
        } else {
            base[i] = base[s->ref] + s->offset * (Py_ssize_t)sizeof(float);
            stride[i] = stride[s->ref];
            index[i] = index[s->ref];
        }
    }
    if (err) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "Kernel: a null address");
        PyMem_Free(base); PyMem_Free(stride); PyMem_Free(index); PyMem_Free(scratch); PyMem_Free(ptr);
        return NULL;
    }
    RowJob job = {k, rows, base, stride, index, scratch, ptr};
    Py_BEGIN_ALLOW_THREADS
    if (team > 1) {
        job.team = team;
        omp.parallel(rows_worker, &job, (unsigned)team, 0);
    } else {
        run_rows(k, base, stride, index, ptr, scratch, 0, rows);
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(base); PyMem_Free(stride); PyMem_Free(index); PyMem_Free(scratch); PyMem_Free(ptr);
    Py_RETURN_NONE;
}

static PyTypeObject KernelType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "batchcraft.autobatching._fused.Kernel",
    .tp_basicsize = sizeof(Kernel),
    .tp_dealloc = (destructor)kernel_dealloc,
    .tp_call = (ternaryfunc)kernel_call,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Kernel(slots, ops, n_in, n_out): a fused elementwise program (see fuse.py).",
    .tp_new = kernel_new,
};

/* map(code, values): one op applied to a list of floats, for tests of the maths against torch */
static PyObject *fused_map(PyObject *self, PyObject *args) {
    int code, generic = 0;
    PyObject *vals;
    double s = 0.0;
    if (!PyArg_ParseTuple(args, "iO|dp:map", &code, &vals, &s, &generic)) return NULL;
    PyObject *seq = PySequence_Fast(vals, "map: a sequence of floats");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    float *x = PyMem_Malloc(sizeof(float) * (n ? n : 1)), *y = PyMem_Malloc(sizeof(float) * (n ? n : 1));
    if (!x || !y) { PyMem_Free(x); PyMem_Free(y); Py_DECREF(seq); return PyErr_NoMemory(); }
    for (Py_ssize_t i = 0; i < n; i++) {
        double v = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, i));
        if (v == -1.0 && PyErr_Occurred()) { PyMem_Free(x); PyMem_Free(y); Py_DECREF(seq); return NULL; }
        x[i] = (float)v;
    }
    Py_DECREF(seq);
    float sf = (float)s;
    switch (code) {
    case OP_NEG: k_neg(y, x, n); break;
    case OP_RELU: k_relu(y, x, n); break;
    case OP_SIGMOID: (generic ? k_sigmoid : f_sigmoid)(y, x, n); break;
    case OP_TANH: (generic ? k_tanh : f_tanh)(y, x, n); break;
    case OP_EXP: (generic ? k_exp : f_exp)(y, x, n); break;
    case OP_ADD_S: k_add_s(y, x, sf, n); break;
    case OP_MUL_S: k_mul_s(y, x, sf, n); break;
    case OP_SUB_S: k_sub_s(y, x, sf, n); break;
    case OP_RSUB_S: k_rsub_s(y, x, sf, n); break;
    default:
        PyMem_Free(x); PyMem_Free(y);
        PyErr_Format(PyExc_ValueError, "map: op %d is not unary", code);
        return NULL;
    }
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *f = PyFloat_FromDouble(y[i]);
        if (!f) { Py_CLEAR(out); break; }
        PyList_SET_ITEM(out, i, f);
    }
    PyMem_Free(x); PyMem_Free(y);
    return out;
}

/* seg_sum(out, x, seg, rows, width, x_row_stride, n): out = 0, then out[seg[j]] += x[j] for j in
 * order (torch's index_add_ on the CPU adds the rows in the same order: the same bits); out is
 * (n, width) contiguous; the addresses are the caller's (fuse.segment_sum), each segment
 * id is checked against n (IndexError, as index_add_ raises). */
BC_CLONES static void add_row(float *restrict d, const float *a, Py_ssize_t w) {
    for (Py_ssize_t i = 0; i < w; i++) d[i] += a[i];
}

static int check_index(const int64_t *ix, Py_ssize_t rows, Py_ssize_t limit, const char *what) {
    for (Py_ssize_t j = 0; j < rows; j++) {
        if (ix[j] < 0 || ix[j] >= limit) {
            PyErr_Format(PyExc_IndexError, "%s: row index %lld out of range for %zd rows", what,
                         (long long)ix[j], limit);
            return -1;
        }
    }
    return 0;
}

typedef struct {
    float *out;
    const float *x;
    const int64_t *seg;
    Py_ssize_t rows, width, xs, n_out;
    int team;
} SegJob;

static void seg_cols(SegJob *j, Py_ssize_t c0, Py_ssize_t c1) {
    for (Py_ssize_t r = 0; r < j->n_out; r++) memset(j->out + r * j->width + c0, 0, sizeof(float) * (size_t)(c1 - c0));
    for (Py_ssize_t r = 0; r < j->rows; r++) add_row(j->out + j->seg[r] * j->width + c0, j->x + r * j->xs + c0, c1 - c0);
}

static void seg_worker(void *arg) {
    SegJob *j = (SegJob *)arg;
    Py_ssize_t c0, c1;
    if (member_range(j->team, j->width, 16, &c0, &c1)) seg_cols(j, c0, c1);  /* whole 16-float vectors */
}

static PyObject *fused_seg_sum(PyObject *self, PyObject *args) {
    PyObject *po, *px, *ps;
    Py_ssize_t rows, width, xs, n_out;
    if (!PyArg_ParseTuple(args, "OOOnnnn:seg_sum", &po, &px, &ps, &rows, &width, &xs, &n_out)) return NULL;
    float *out = PyLong_AsVoidPtr(po);
    const float *x = PyLong_AsVoidPtr(px);
    const int64_t *seg = PyLong_AsVoidPtr(ps);
    if (PyErr_Occurred()) return NULL;
    if (rows < 0 || width < 0 || n_out < 0 || (rows > 0 && (!x || !seg)) || (n_out > 0 && width > 0 && !out)) {
        PyErr_SetString(PyExc_ValueError, "seg_sum: bad sizes or a null address");
        return NULL;
    }
    if (check_index(seg, rows, n_out, "seg_sum") < 0) return NULL;
    SegJob job = {out, x, seg, rows, width, xs, n_out, 1};
    /* a team splits the columns, never the rows: each column's additions keep their order */
    job.team = team_size(width / 16, (rows + n_out) * width);
    Py_BEGIN_ALLOW_THREADS
    if (job.team > 1) omp.parallel(seg_worker, &job, (unsigned)job.team, 0);
    else seg_cols(&job, 0, width);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

typedef struct {
    char *dst;
    const int64_t *di;
    const char *src;
    const int64_t *si;
    Py_ssize_t row_bytes, src_stride, count;
    int team;
} CopyJob;

static void copy_bytes(CopyJob *j, Py_ssize_t b0, Py_ssize_t b1) {
    for (Py_ssize_t r = 0; r < j->count; r++)
        memcpy(j->dst + j->di[r] * j->row_bytes + b0, j->src + j->si[r] * j->src_stride + b0, (size_t)(b1 - b0));
}

static void copy_worker(void *arg) {
    CopyJob *j = (CopyJob *)arg;
    Py_ssize_t b0, b1;
    if (member_range(j->team, j->row_bytes, 64, &b0, &b1)) copy_bytes(j, b0, b1);  /* whole cache lines */
}

/* copy_rows(dst, dst_rows, src, src_rows, row_bytes, src_stride, count, dst_limit, src_limit):
   dst row dst_rows[j] (rows of row_bytes, contiguous) = src row src_rows[j] (rows src_stride bytes
   apart), for j < count; both index arrays int64 and bounds-checked. A gather from several
   buffers straight into its final row order (gather.py), one pass instead of gather + cat + gather. */
static PyObject *fused_copy_rows(PyObject *self, PyObject *args) {
    PyObject *pd, *pdi, *ps, *psi;
    Py_ssize_t row_bytes, src_stride, count, dst_limit, src_limit;
    if (!PyArg_ParseTuple(args, "OOOOnnnnn:copy_rows", &pd, &pdi, &ps, &psi, &row_bytes, &src_stride, &count,
                          &dst_limit, &src_limit)) return NULL;
    char *dst = PyLong_AsVoidPtr(pd);
    const int64_t *di = PyLong_AsVoidPtr(pdi);
    const char *src = PyLong_AsVoidPtr(ps);
    const int64_t *si = PyLong_AsVoidPtr(psi);
    if (PyErr_Occurred()) return NULL;
    if (count < 0 || row_bytes < 0 || src_stride < 0
        || (count > 0 && (!di || !si || (row_bytes > 0 && (!dst || !src))))) {
        PyErr_SetString(PyExc_ValueError, "copy_rows: bad sizes or a null address");
        return NULL;
    }
    if (check_index(di, count, dst_limit, "copy_rows") < 0 || check_index(si, count, src_limit, "copy_rows") < 0)
        return NULL;
    CopyJob job = {dst, di, src, si, row_bytes, src_stride, count, 1};
    /* a team splits each row's bytes, never the rows: a row written twice keeps its last copy */
    job.team = team_size(row_bytes / 64, count * row_bytes / 4);
    Py_BEGIN_ALLOW_THREADS
    if (job.team > 1) omp.parallel(copy_worker, &job, (unsigned)job.team, 0);
    else copy_bytes(&job, 0, row_bytes);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* gather_pieces(dst, total, row_bytes, pieces, perm): the rows of several buffers, in one call.
   pieces: a tuple of (address, row_stride_bytes, rows_limit, rows), rows an int64 bytearray or a
   list of ints (each checked against rows_limit); their concatenation, reordered by perm (None, or
   `total` int64s as a bytearray or a list: row i of dst is row perm[i] of the concatenation, each
   checked), is written to dst (total rows of row_bytes, contiguous). A group's gather from a few
   buffers (gather.py), where the torch calls of a copy per buffer and a reorder cost more than the
   rows: a tree's scalar and vector leaves of 2 to 12 rows. */
static int rows_of(PyObject *rows, Py_ssize_t *n, const int64_t **ro, int64_t **owned) {
    *owned = NULL;
    if (PyByteArray_Check(rows)) {
        Py_ssize_t b = PyByteArray_GET_SIZE(rows);
        if (b % 8) { PyErr_SetString(PyExc_ValueError, "gather_pieces: rows are not int64 bytes"); return -1; }
        *n = b / 8;
        *ro = (const int64_t *)PyByteArray_AS_STRING(rows);
        return 0;
    }
    PyObject *seq = PySequence_Fast(rows, "gather_pieces: rows must be a bytearray or a sequence of ints");
    if (!seq) return -1;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
    int64_t *v = PyMem_Malloc(sizeof(int64_t) * (m ? m : 1));
    if (!v) { Py_DECREF(seq); PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < m; i++) {
        long long x = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (x == -1 && PyErr_Occurred()) { PyMem_Free(v); Py_DECREF(seq); return -1; }
        v[i] = x;
    }
    Py_DECREF(seq);
    *n = m; *ro = v; *owned = v;
    return 0;
}

static PyObject *fused_gather_pieces(PyObject *self, PyObject *args) {
    PyObject *pd, *pieces, *perm;
    Py_ssize_t total, row_bytes;
    if (!PyArg_ParseTuple(args, "OnnO!O:gather_pieces", &pd, &total, &row_bytes, &PyTuple_Type, &pieces, &perm))
        return NULL;
    char *dst = PyLong_AsVoidPtr(pd);
    if (PyErr_Occurred()) return NULL;
    if (total < 0 || row_bytes < 0 || (total > 0 && row_bytes > 0 && !dst)) {
        PyErr_SetString(PyExc_ValueError, "gather_pieces: bad sizes or a null address");
        return NULL;
    }
    const char **src = PyMem_Malloc(sizeof(char *) * (total ? total : 1));   /* per concatenated row */
    if (!src) return PyErr_NoMemory();
    Py_ssize_t at = 0;
    int err = 0;
    for (Py_ssize_t q = 0; q < PyTuple_GET_SIZE(pieces) && !err; q++) {
        PyObject *pc = PyTuple_GET_ITEM(pieces, q);
        if (!PyTuple_Check(pc) || PyTuple_GET_SIZE(pc) != 4) {
            PyErr_SetString(PyExc_ValueError, "gather_pieces: a piece is (address, stride, rows_limit, rows)");
            err = 1; break;
        }
        const char *base = PyLong_AsVoidPtr(PyTuple_GET_ITEM(pc, 0));
        Py_ssize_t stride = PyLong_AsSsize_t(PyTuple_GET_ITEM(pc, 1));
        Py_ssize_t limit = PyLong_AsSsize_t(PyTuple_GET_ITEM(pc, 2));
        if (PyErr_Occurred()) { err = 1; break; }
        Py_ssize_t n;
        const int64_t *ro;
        int64_t *owned;
        if (rows_of(PyTuple_GET_ITEM(pc, 3), &n, &ro, &owned) < 0) { err = 1; break; }
        if (at + n > total) {
            PyErr_SetString(PyExc_ValueError, "gather_pieces: more rows than total");
            err = 1;
        } else if (n > 0 && row_bytes > 0 && (!base || stride < 0)) {
            PyErr_SetString(PyExc_ValueError, "gather_pieces: a null address or a negative stride");
            err = 1;
        } else if (check_index(ro, n, limit, "gather_pieces") < 0) {
            err = 1;
        } else {
            for (Py_ssize_t j = 0; j < n; j++) src[at + j] = base + ro[j] * stride;
            at += n;
        }
        PyMem_Free(owned);
    }
    if (!err && at != total) {
        PyErr_SetString(PyExc_ValueError, "gather_pieces: fewer rows than total");
        err = 1;
    }
    const int64_t *pr = NULL;
    int64_t *powned = NULL;
    if (!err && perm != Py_None) {
        Py_ssize_t np;
        if (rows_of(perm, &np, &pr, &powned) < 0) err = 1;
        else if (np != total) { PyErr_SetString(PyExc_ValueError, "gather_pieces: perm is not total rows"); err = 1; }
        else if (check_index(pr, np, total, "gather_pieces") < 0) err = 1;
    }
    if (err) { PyMem_Free(src); PyMem_Free(powned); return NULL; }
    if (pr) {
        for (Py_ssize_t i = 0; i < total; i++) memcpy(dst + i * row_bytes, src[pr[i]], (size_t)row_bytes);
    } else {
        for (Py_ssize_t i = 0; i < total; i++) memcpy(dst + i * row_bytes, src[i], (size_t)row_bytes);
    }
    PyMem_Free(src);
    PyMem_Free(powned);
    Py_RETURN_NONE;
}

/* gemm_batch(fn, count, trans_a, trans_b, m, n, k, alpha, a_addrs, a_base, a_stride, lda,
              b_addrs, b_base, b_stride, ldb, beta, c_base, c_stride, ldc)
   C_i = alpha op(A_i) op(B_i) + beta C_i for i < count (row-major float32; op: transposed when
   trans_x is 1), through `fn`, the address of a CBLAS `cblas_sgemm_batch` (MKL's, which torch's
   library exports; rowmm.py finds it and checks it). Operand i is X_addrs[i] when X_addrs is
   not 0 (the address of `count` int64 addresses: rows of several buffers, read in place), else
   X_base + i * X_stride bytes (0: one matrix for all). The caller (rowmm.py) owns the shapes,
   strides and the lifetime of every buffer; this only builds the pointer arrays. */
typedef void (*sgemm_batch_fn)(int, const int *, const int *, const int *, const int *, const int *,
                               const float *, const float **, const int *, const float **, const int *,
                               const float *, float **, const int *, int, const int *);

static PyObject *fused_gemm_batch(PyObject *self, PyObject *args) {
    PyObject *pfn, *pa_addrs, *pa, *pb_addrs, *pb, *pc;
    Py_ssize_t count, a_stride, b_stride, c_stride;
    int trans_a, trans_b, m, n, k, lda, ldb, ldc;
    float alpha, beta;
    if (!PyArg_ParseTuple(args, "OnppiiifOOniOOnifOni:gemm_batch", &pfn, &count, &trans_a, &trans_b,
                          &m, &n, &k, &alpha, &pa_addrs, &pa, &a_stride, &lda, &pb_addrs, &pb, &b_stride, &ldb,
                          &beta, &pc, &c_stride, &ldc)) return NULL;
    sgemm_batch_fn fn = (sgemm_batch_fn)PyLong_AsVoidPtr(pfn);
    const int64_t *a_addrs = PyLong_AsVoidPtr(pa_addrs);
    const char *a = PyLong_AsVoidPtr(pa);
    const int64_t *b_addrs = PyLong_AsVoidPtr(pb_addrs);
    const char *b = PyLong_AsVoidPtr(pb);
    char *c = PyLong_AsVoidPtr(pc);
    if (PyErr_Occurred()) return NULL;
    if (!fn || !c || count < 0 || count > INT32_MAX || m <= 0 || n <= 0 || k <= 0 || (!a_addrs && !a) || (!b_addrs && !b)) {
        PyErr_SetString(PyExc_ValueError, "gemm_batch: bad sizes or a null address");
        return NULL;
    }
    if (count == 0) Py_RETURN_NONE;
    const float **ap = malloc(sizeof(float *) * (size_t)count * 2);
    float **cp = malloc(sizeof(float *) * (size_t)count);
    if (!ap || !cp) { free(ap); free(cp); return PyErr_NoMemory(); }
    const float **bp = ap + count;
    for (Py_ssize_t i = 0; i < count; i++) {
        ap[i] = (const float *)(a_addrs ? (const char *)(intptr_t)a_addrs[i] : a + i * a_stride);
        bp[i] = (const float *)(b_addrs ? (const char *)(intptr_t)b_addrs[i] : b + i * b_stride);
        cp[i] = (float *)(c + i * c_stride);
    }
    const int ta = trans_a ? 112 : 111, tb = trans_b ? 112 : 111, group = (int)count;  /* CblasTrans / NoTrans */
    Py_BEGIN_ALLOW_THREADS
    fn(101 /* CblasRowMajor */, &ta, &tb, &m, &n, &k, &alpha, ap, &lda, bp, &ldb, &beta, cp, &ldc, 1, &group);
    Py_END_ALLOW_THREADS
    free(ap);
    free(cp);
    Py_RETURN_NONE;
}

/* gemv_rows(count, k, n, x, x_stride, b_addrs, ldb, out, out_stride): out_i (n floats) = x_i (k
   floats) times B_i (k x n floats, rows ldb floats apart, at address b_addrs[i], an int64 array),
   for i < count; x_i and out_i are rows x_stride and out_stride bytes apart. A row vector times
   each node's own matrix (MV-RNN's a^T B^T) reads every matrix once, row by row, where the
   pointer-array GEMM (gemm_batch) packs each 1-row product's matrix first (rowmm.py). Each
   output element is summed over r = 0..k-1 in order, one rounding per multiply and per add. */
typedef struct {
    Py_ssize_t count; int k, n, ldb; const char *x; Py_ssize_t xs; const int64_t *b; char *out; Py_ssize_t os;
    int team;
} GemvJob;

BC_CLONES static void gemv_range(const GemvJob *j, Py_ssize_t i0, Py_ssize_t i1) {
    const int k = j->k, n = j->n;
    for (Py_ssize_t i = i0; i < i1; i++) {
        const float *x = (const float *)(j->x + i * j->xs);
        const float *b = (const float *)(intptr_t)j->b[i];
        float *restrict y = (float *)(j->out + i * j->os);
        for (int c = 0; c < n; c++) y[c] = 0.0f;
        for (int r = 0; r < k; r++) {
            const float s = x[r];
            const float *restrict row = b + (Py_ssize_t)r * j->ldb;
            for (int c = 0; c < n; c++) y[c] += s * row[c];
        }
    }
}

static void gemv_worker(void *arg) {
    GemvJob *j = (GemvJob *)arg;
    Py_ssize_t i0, i1;
    if (member_range(j->team, j->count, 1, &i0, &i1)) gemv_range(j, i0, i1);
}

static PyObject *fused_gemv_rows(PyObject *self, PyObject *args) {
    PyObject *px, *pb, *po;
    Py_ssize_t count, xs, os;
    int k, n, ldb;
    if (!PyArg_ParseTuple(args, "niiOnOiOn:gemv_rows", &count, &k, &n, &px, &xs, &pb, &ldb, &po, &os)) return NULL;
    const char *x = PyLong_AsVoidPtr(px);
    const int64_t *b = PyLong_AsVoidPtr(pb);
    char *out = PyLong_AsVoidPtr(po);
    if (PyErr_Occurred()) return NULL;
    if (count < 0 || k <= 0 || n <= 0 || ldb < n || (count > 0 && (!x || !b || !out))) {
        PyErr_SetString(PyExc_ValueError, "gemv_rows: bad sizes or a null address");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!b[i]) { PyErr_SetString(PyExc_ValueError, "gemv_rows: a null matrix address"); return NULL; }
    }
    GemvJob job = {count, k, n, ldb, x, xs, b, out, os, 1};
    job.team = team_size(count, count * (Py_ssize_t)k * n);
    Py_BEGIN_ALLOW_THREADS
    if (job.team > 1) omp.parallel(gemv_worker, &job, (unsigned)job.team, 0);
    else gemv_range(&job, 0, count);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* gemm_shared(count, m, k, n, a_addrs, lda, w, w_trans, ldw, beta, c, c_stride, ldc) -> bool:
   C_i = A_i W (beta 0) or C_i += A_i W (beta 1), for i < count: A_i (m x k, rows lda floats
   apart) at a_addrs[i] (an int64 array: rows of several buffers, read in place), one shared W
   (k x n, rows ldw floats apart; w_trans: W is the transpose of a row-major (n x k) matrix), C_i
   at c + i * c_stride bytes (rows ldc floats apart). False (nothing written): this CPU has no
   AVX-512F, a beta other than 0 or 1, or BATCHCRAFT_FUSED_PORTABLE set; rowmm.py then calls
   MKL's pointer-array GEMM (gemm_batch).
   Why: a per-node product with a shared weight (MV-RNN's A^T W^T, 128 x 128 x 128 per node)
   through MKL's batch runs at 73-84 GFLOP/s a core on this AMD CPU (MKL's AMD code path is
   AVX2); W packed once per call into 32-column panels and an 8 x 32 AVX-512 register tile
   (16 accumulators, FMA) is what oneDNN's JIT kernels do (Goto & van de Geijn, "Anatomy of
   high-performance matrix multiplication", ACM TOMS 2008, section 5). Each element of C is its
   k products summed in order k = 0..k-1 (one rounding per FMA), then added to C for beta 1. */
#if BC_VECTOR_MATHS
#define GS_MR 8
#define GS_NR 32

typedef struct {
    Py_ssize_t count; int m, n, nt;                        /* nt terms: C_i = sum_t A_t,i W_t */
    int k[2], lda[2]; const int64_t *a[2]; const float *bp[2];
    int acc; char *c; Py_ssize_t cs; int ldc; int team;
} GsJob;

/* the masks of a panel's two 16-float halves when `left` columns of C remain from its start */
static inline void gs_masks(int left, __mmask16 *m0, __mmask16 *m1) {
    const int cols = left < GS_NR ? left : GS_NR;
    *m0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
    *m1 = cols <= 16 ? 0 : cols >= 32 ? 0xFFFF : (__mmask16)((1u << (cols - 16)) - 1);
}

/* rows ar[0..mr-1] (ar[r] for r >= mr repeat row 0: read, never stored) times one panel (k rows
   of 32 floats, bs floats apart: 32 packed, or a node's own matrix unpacked) into C's columns
   [0, 16) and [16, 32) under masks m0, m1 (acc: added) */
__attribute__((target("avx512f"), always_inline)) static inline void gs_tile_body(
        const float *const *ar, const float *bp, Py_ssize_t bs, int k, float *c, int ldc, int mr, __mmask16 m0,
        __mmask16 m1, int acc, const int packed) {
    __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00;
    __m512 c40 = c00, c41 = c00, c50 = c00, c51 = c00, c60 = c00, c61 = c00, c70 = c00, c71 = c00;
    const float *a0 = ar[0], *a1 = ar[1], *a2 = ar[2], *a3 = ar[3], *a4 = ar[4], *a5 = ar[5], *a6 = ar[6], *a7 = ar[7];
    for (int q = 0; q < k; q++) {
        /* (a packed panel: aligned loads; an unpacked one, rows bs floats apart, is read through
           masks no further than column n) */
        const __m512 b0 = packed ? _mm512_load_ps(bp + (Py_ssize_t)q * GS_NR) : _mm512_maskz_loadu_ps(m0, bp + q * bs);
        const __m512 b1 = packed ? _mm512_load_ps(bp + (Py_ssize_t)q * GS_NR + 16)
                                 : _mm512_maskz_loadu_ps(m1, bp + q * bs + 16);
        __m512 x;
#define GS_ROW(r) x = _mm512_set1_ps(a##r[q]); c##r##0 = _mm512_fmadd_ps(x, b0, c##r##0); c##r##1 = _mm512_fmadd_ps(x, b1, c##r##1);
        GS_ROW(0) GS_ROW(1) GS_ROW(2) GS_ROW(3) GS_ROW(4) GS_ROW(5) GS_ROW(6) GS_ROW(7)
#undef GS_ROW
    }
    const __m512 t[GS_MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}, {c60, c61}, {c70, c71}};
    for (int r = 0; r < mr; r++) {
        float *row = c + (Py_ssize_t)r * ldc;
        __m512 v0 = t[r][0], v1 = t[r][1];
        if (acc) {
            v0 = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, row), v0);
            v1 = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, row + 16), v1);
        }
        _mm512_mask_storeu_ps(row, m0, v0);
        if (m1) _mm512_mask_storeu_ps(row + 16, m1, v1);
    }
}

__attribute__((target("avx512f"))) static void gs_tile(const float *const *ar, const float *bp, Py_ssize_t bs, int k,
                                                        float *c, int ldc, int mr, __mmask16 m0, __mmask16 m1, int acc) {
    if (bs == GS_NR) gs_tile_body(ar, bp, bs, k, c, ldc, mr, m0, m1, acc, 1);  /* packed W */
    else gs_tile_body(ar, bp, bs, k, c, ldc, mr, m0, m1, acc, 0);              /* a node's own matrix */
}

/* units [u0, u1): unit u is rows [8 (u % blocks), +8) of node u / blocks, all of W's panels (a
   unit, not a node, is what threads share: a deep tree level has fewer nodes than threads) */
static void gs_range(const GsJob *j, Py_ssize_t u0, Py_ssize_t u1) {
    const int m = j->m, n = j->n, nt = j->nt, panels = (n + GS_NR - 1) / GS_NR, blocks = (m + GS_MR - 1) / GS_MR;
    const int rl[2] = {(j->k[0] * 4 + 63) / 64, (j->k[1] * 4 + 63) / 64};
    const float *ar[2][GS_MR];
    for (Py_ssize_t u = u0; u < u1; u++) {
        const Py_ssize_t i = u / blocks;
        const int r0 = (int)(u % blocks) * GS_MR, mr = m - r0 < GS_MR ? m - r0 : GS_MR;
        float *c = (float *)(j->c + i * j->cs);
        for (int t = 0; t < nt; t++) {
            const float *a = (const float *)(intptr_t)j->a[t][i];
            for (int r = 0; r < GS_MR; r++) ar[t][r] = a + (Py_ssize_t)(r0 + (r < mr ? r : 0)) * j->lda[t];
        }
        /* the next unit's rows are fetched while this one computes: a node's matrix comes from
           DRAM (written by earlier groups): 184 -> 200 GFLOP/s on 2 cores, MV-RNN's 128 x 128 */
        const char *next[2] = {NULL, NULL};
        int lines[2] = {0, 0};  /* cache lines of each term's next rows; rl: a row's */
        if (u + 1 < u1) {
            const Py_ssize_t i2 = (u + 1) / blocks;
            const int s0 = (int)((u + 1) % blocks) * GS_MR, next_rows = m - s0 < GS_MR ? m - s0 : GS_MR;
            for (int t = 0; t < nt; t++) {
                next[t] = (const char *)(intptr_t)j->a[t][i2] + (Py_ssize_t)s0 * j->lda[t] * 4;
                lines[t] = next_rows * rl[t];
            }
        }
        const int per_panel = (lines[0] + lines[1] + panels - 1) / panels;
        int t_next = 0, line = 0;  /* the next line to fetch: term t_next's line `line` */
        for (int p = 0; p < panels; p++) {
            for (int e = 0; e < per_panel && t_next < nt; e++) {
                if (line >= lines[t_next]) { t_next++; line = 0; continue; }
                __builtin_prefetch(next[t_next] + (Py_ssize_t)(line / rl[t_next]) * j->lda[t_next] * 4
                                   + (line % rl[t_next]) * 64, 0, 2);
                line++;
            }
            __mmask16 m0, m1;
            gs_masks(n - p * GS_NR, &m0, &m1);
            /* term by term: each product rounded on its own, then added to the tile, which stays in
               L1 (the two-call form's sums and roundings, so the same bits as eager's A W1 + B W2) */
            for (int t = 0; t < nt; t++)
                gs_tile(ar[t], j->bp[t] + (Py_ssize_t)p * j->k[t] * GS_NR, GS_NR, j->k[t],
                        c + (Py_ssize_t)r0 * j->ldc + p * GS_NR, j->ldc, mr, m0, m1, j->acc || t > 0);
        }
    }
}

static void gs_worker(void *arg) {
    GsJob *j = (GsJob *)arg;
    Py_ssize_t i0, i1;
    if (member_range(j->team, j->count * ((j->m + GS_MR - 1) / GS_MR), 1, &i0, &i1)) gs_range(j, i0, i1);
}

/* W (k x n; w_trans: the transpose of a row-major n x k) packed into 32-column panels, zero-padded */
static float *gs_pack(const float *w, int w_trans, int ldw, int k, int n) {
    const int panels = (n + GS_NR - 1) / GS_NR;
    size_t bytes = (size_t)panels * k * GS_NR * sizeof(float);
    float *bp = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!bp) return NULL;
    for (int p = 0; p < panels; p++) {
        float *dst = bp + (Py_ssize_t)p * k * GS_NR;
        for (int q = 0; q < k; q++) {
            for (int jj = 0; jj < GS_NR; jj++) {
                const int col = p * GS_NR + jj;
                dst[(Py_ssize_t)q * GS_NR + jj] = col >= n ? 0.0f
                    : w_trans ? w[(Py_ssize_t)col * ldw + q] : w[(Py_ssize_t)q * ldw + col];
            }
        }
    }
    return bp;
}

/* C_i = W B_i: a shared (m x k) W (row-major, rows ldw floats apart) times each node's own (k x n)
   B_i (rows ldb apart, read in place, unpacked: a 32-column panel of it, 16 KiB at k = 128, stays
   in L1 while every 8-row block of W runs over it). Units: (node, panel). */
typedef struct {
    Py_ssize_t count; int m, k, n, ldw, ldb, ldc, acc, team; const float *w; const int64_t *b; char *c; Py_ssize_t cs;
} GslJob;

static void gsl_range(const GslJob *j, Py_ssize_t u0, Py_ssize_t u1) {
    const int m = j->m, n = j->n, panels = (n + GS_NR - 1) / GS_NR;
    const float *ar[GS_MR];
    for (Py_ssize_t u = u0; u < u1; u++) {
        const Py_ssize_t i = u / panels;
        const int p = (int)(u % panels);
        __mmask16 m0, m1;
        gs_masks(n - p * GS_NR, &m0, &m1);
        const float *b = (const float *)(intptr_t)j->b[i] + p * GS_NR;
        float *c = (float *)(j->c + i * j->cs) + p * GS_NR;
        for (int r0 = 0; r0 < m; r0 += GS_MR) {
            const int mr = m - r0 < GS_MR ? m - r0 : GS_MR;
            for (int r = 0; r < GS_MR; r++) ar[r] = j->w + (Py_ssize_t)(r0 + (r < mr ? r : 0)) * j->ldw;
            gs_tile(ar, b, j->ldb, j->k, c + (Py_ssize_t)r0 * j->ldc, j->ldc, mr, m0, m1, j->acc);
        }
    }
}

static void gsl_worker(void *arg) {
    GslJob *j = (GslJob *)arg;
    Py_ssize_t i0, i1;
    if (member_range(j->team, j->count * ((j->n + GS_NR - 1) / GS_NR), 1, &i0, &i1)) gsl_range(j, i0, i1);
}
#endif

static PyObject *fused_gemm_shared(PyObject *self, PyObject *args) {
    PyObject *pa, *pw, *pc, *pa2 = NULL, *pw2 = NULL;
    Py_ssize_t count, cs;
    int m, k, n, lda, w_trans, ldw, ldc, k2 = 0, lda2 = 0, w2_trans = 0, ldw2 = 0;
    float beta;
    if (!PyArg_ParseTuple(args, "niiiOiOpifOni|iOiOpi:gemm_shared", &count, &m, &k, &n, &pa, &lda, &pw, &w_trans, &ldw,
                          &beta, &pc, &cs, &ldc, &k2, &pa2, &lda2, &pw2, &w2_trans, &ldw2)) return NULL;
    const int64_t *a = PyLong_AsVoidPtr(pa);
    const float *w = PyLong_AsVoidPtr(pw);
    char *c = PyLong_AsVoidPtr(pc);
    const int64_t *a2 = pa2 ? PyLong_AsVoidPtr(pa2) : NULL;
    const float *w2 = pw2 ? PyLong_AsVoidPtr(pw2) : NULL;
    if (PyErr_Occurred()) return NULL;
    const int two = pa2 != NULL;
    if (count < 0 || m <= 0 || k <= 0 || n <= 0 || lda < k || ldc < n || ldw < (w_trans ? k : n)
            || (count > 0 && (!a || !w || !c))
            || (two && (k2 <= 0 || lda2 < k2 || ldw2 < (w2_trans ? k2 : n) || (count > 0 && (!a2 || !w2))))) {
        PyErr_SetString(PyExc_ValueError, "gemm_shared: bad sizes or a null address");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!a[i] || (two && !a2[i])) {
            PyErr_SetString(PyExc_ValueError, "gemm_shared: a null matrix address");
            return NULL;
        }
    }
#if BC_VECTOR_MATHS
    if (!gemm_shared_on || (beta != 0.0f && beta != 1.0f)) Py_RETURN_FALSE;
    if (count == 0) Py_RETURN_TRUE;
    float *bp = gs_pack(w, w_trans, ldw, k, n), *bp2 = two ? gs_pack(w2, w2_trans, ldw2, k2, n) : NULL;
    if (!bp || (two && !bp2)) { free(bp); free(bp2); return PyErr_NoMemory(); }
    GsJob job = {count, m, n, 1 + two, {k, k2}, {lda, lda2}, {a, a2}, {bp, bp2}, beta != 0.0f, c, cs, ldc, 1};
    const Py_ssize_t units = count * ((m + GS_MR - 1) / GS_MR);
    job.team = team_size(units, count * (Py_ssize_t)m * n * (k + k2) / 16);
    Py_BEGIN_ALLOW_THREADS
    if (job.team > 1) omp.parallel(gs_worker, &job, (unsigned)job.team, 0);
    else gs_range(&job, 0, units);
    Py_END_ALLOW_THREADS
    free(bp);
    free(bp2);
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}

/* gemm_left_shared(count, m, k, n, w, ldw, b_addrs, ldb, beta, c, c_stride, ldc) -> bool: C_i = W B_i
   (beta 0) or C_i += W B_i (beta 1) for i < count: one shared row-major (m x k) W, each node's
   (k x n) B_i at b_addrs[i] (an int64 array), C_i at c + i * c_stride bytes. False (nothing
   written) as gemm_shared's. The product with the shared matrix on the left (MV-RNN as Socher
   wrote it, P = W_1 A + W_2 B); each element of C sums its k products in order, one FMA each. */
static PyObject *fused_gemm_left_shared(PyObject *self, PyObject *args) {
    PyObject *pw, *pb, *pc;
    Py_ssize_t count, cs;
    int m, k, n, ldw, ldb, ldc;
    float beta;
    if (!PyArg_ParseTuple(args, "niiiOiOifOni:gemm_left_shared", &count, &m, &k, &n, &pw, &ldw, &pb, &ldb, &beta, &pc,
                          &cs, &ldc)) return NULL;
    const float *w = PyLong_AsVoidPtr(pw);
    const int64_t *b = PyLong_AsVoidPtr(pb);
    char *c = PyLong_AsVoidPtr(pc);
    if (PyErr_Occurred()) return NULL;
    if (count < 0 || m <= 0 || k <= 0 || n <= 0 || ldw < k || ldb < n || ldc < n || (count > 0 && (!w || !b || !c))) {
        PyErr_SetString(PyExc_ValueError, "gemm_left_shared: bad sizes or a null address");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!b[i]) { PyErr_SetString(PyExc_ValueError, "gemm_left_shared: a null matrix address"); return NULL; }
    }
#if BC_VECTOR_MATHS
    if (!gemm_shared_on || (beta != 0.0f && beta != 1.0f)) Py_RETURN_FALSE;
    if (count == 0) Py_RETURN_TRUE;
    GslJob job = {count, m, k, n, ldw, ldb, ldc, beta != 0.0f, 1, w, b, c, cs};
    const Py_ssize_t units = count * ((n + GS_NR - 1) / GS_NR);
    job.team = team_size(units, count * (Py_ssize_t)m * n * k / 16);
    Py_BEGIN_ALLOW_THREADS
    if (job.team > 1) omp.parallel(gsl_worker, &job, (unsigned)job.team, 0);
    else gsl_range(&job, 0, units);
    Py_END_ALLOW_THREADS
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}

/* set_openmp(parallel, max_threads, thread_num, num_threads): the addresses of GOMP_parallel and
 * omp_get_max_threads / omp_get_thread_num / omp_get_num_threads in the OpenMP runtime torch loaded
 * (openmp.py finds and checks them); all 0: one thread, as without a runtime. */
static PyObject *fused_set_openmp(PyObject *self, PyObject *args) {
    PyObject *p[4];
    if (!PyArg_ParseTuple(args, "OOOO:set_openmp", &p[0], &p[1], &p[2], &p[3])) return NULL;
    void *a[4];
    int zeros = 0;
    for (int i = 0; i < 4; i++) {
        a[i] = PyLong_AsVoidPtr(p[i]);
        if (PyErr_Occurred()) return NULL;
        zeros += a[i] == NULL;
    }
    if (zeros != 0 && zeros != 4) {
        PyErr_SetString(PyExc_ValueError, "set_openmp: all four addresses or none");
        return NULL;
    }
    omp.parallel = (gomp_parallel_fn)a[0];
    omp.max_threads = (omp_int_fn)a[1];
    omp.thread_num = (omp_int_fn)a[2];
    omp.num_threads = (omp_int_fn)a[3];
    Py_RETURN_NONE;
}

/* team(rows, floats) -> the threads a call of that size would use (tests) */
static PyObject *fused_team(PyObject *self, PyObject *args) {
    Py_ssize_t rows, work;
    if (!PyArg_ParseTuple(args, "nn:team", &rows, &work)) return NULL;
    return PyLong_FromLong(team_size(rows, work));
}

static PyMethodDef methods[] = {
    {"set_openmp", fused_set_openmp, METH_VARARGS,
     "set_openmp(parallel, max_threads, thread_num, num_threads): torch's OpenMP entry points (openmp.py); all 0: one thread."},
    {"team", fused_team, METH_VARARGS, "team(rows, floats) -> threads a kernel call of that size uses (tests)."},
    {"gemm_batch", fused_gemm_batch, METH_VARARGS,
     "gemm_batch(fn, count, trans_a, trans_b, m, n, k, alpha, a_addrs, a_base, a_stride, lda, b_addrs, b_base, "
     "b_stride, ldb, beta, c_base, c_stride, ldc): a pointer-array batched GEMM (rowmm.py)."},
    {"gemm_shared", fused_gemm_shared, METH_VARARGS,
     "gemm_shared(count, m, k, n, a_addrs, lda, w, w_trans, ldw, beta, c, c_stride, ldc) -> bool: per-node rows times one "
     "shared matrix, AVX-512 (rowmm.py); False: not run here."},
    {"gemm_left_shared", fused_gemm_left_shared, METH_VARARGS,
     "gemm_left_shared(count, m, k, n, w, ldw, b_addrs, ldb, beta, c, c_stride, ldc) -> bool: one shared matrix times "
     "each node's own, AVX-512 (rowmm.py); False: not run here."},
    {"gemv_rows", fused_gemv_rows, METH_VARARGS,
     "gemv_rows(count, k, n, x, x_stride, b_addrs, ldb, out, out_stride): a row vector times each row's own matrix (rowmm.py)."},
    {"gather_pieces", fused_gather_pieces, METH_VARARGS,
     "gather_pieces(dst, total, row_bytes, pieces, perm): rows of several buffers, reordered, in one call (gather.py)."},
    {"copy_rows", fused_copy_rows, METH_VARARGS,
     "copy_rows(dst, dst_rows, src, src_rows, row_bytes, src_stride, count, dst_limit, src_limit): row copies (gather.py)."},
    {"seg_sum", fused_seg_sum, METH_VARARGS,
     "seg_sum(out, x, seg, rows, width, x_row_stride, n): out = 0; out[seg[j]] += x[j] over float32 rows (fuse.py)."},
    {"map", fused_map, METH_VARARGS,
     "map(code, values[, scalar[, generic]]) -> list: one op over floats (tests; generic: the portable loop)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "batchcraft.autobatching._fused",
    "Fused elementwise tails of batched programs (float32, CPU); see fuse.py.", -1, methods,
};

PyMODINIT_FUNC PyInit__fused(void) {
    choose_kernels();
    if (PyType_Ready(&KernelType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&KernelType);
    if (PyModule_AddObject(m, "Kernel", (PyObject *)&KernelType) < 0) { Py_DECREF(&KernelType); Py_DECREF(m); return NULL; }
    PyModule_AddIntConstant(m, "OP_COUNT", OP_COUNT);
    PyModule_AddStringConstant(m, "vector_maths", vector_maths);
    return m;
}
