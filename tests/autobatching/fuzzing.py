"""Random per-instance programs for differential fuzzing of ``batchcraft.autobatch`` against eager.

A *program* is a plain data structure (tuples of strings and numbers) drawn by hypothesis, so
that hypothesis can shrink a failing program to a small one. :func:`compile_program` turns it
into ordinary per-instance PyTorch code over a state vector ``h`` of shape ``(D,)``; each
statement maps ``h`` to a new ``h`` using the instance and shared parameters. Statement kinds
cover what the runtime must handle: elementwise maths, scalar constants (per program and per
instance), reductions, linear algebra, cat/stack/split, indexing, embedding lookups, shape and
dtype operations, static blocks, recursion over random trees, loops of instance-dependent
length, recurrent cells, branches and while-loops on tensor values, value-dependent shapes and
program phases.

An instance is a dict: ``x`` (L, D) float (optionally requiring grad), ``ids`` (list of ints),
``n`` (int loop count), ``k`` (0-d int64 tensor), ``c`` (a Python float), ``tree`` (nested
``(word_id, (children...))`` tuples).

Branches on float values are decided the same way in eager and batched runs only if the value
is not within rounding of the threshold; the eager run records the smallest such margin in
:data:`MARGIN` and the test discards programs whose margin is too small.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

import batchcraft
from batchcraft import static_block

VOCAB = 11

# Statements that hit a bug still open in /work/notes/autobatch-bugs.md (number -> statements).
# The fuzzer leaves them out while the bug is open; each bug has its own xfail regression test.
# Remove a number here once the lead marks the bug fixed.
OPEN_BUGS = {
}
CHECK_REQUIRES_GRAD = 2 not in OPEN_BUGS  # bug #2 (fixed): requires_grad is compared
_BLOCKED = {s for stmts in OPEN_BUGS.values() for s in stmts}


def _allowed(kind, names):
    return tuple(n for n in names if (kind, n) not in _BLOCKED)


CONSTS = (-2.0, -0.5, 0.5, 1, 3, 2.5)


class Margin:
    """Smallest distance of a float branch value from its threshold, seen while tracking."""

    tracking = False
    smallest = math.inf

    @classmethod
    def see(cls, t):
        if cls.tracking:
            cls.smallest = min(cls.smallest, abs(float(t.detach() if isinstance(t, torch.Tensor) else t)))


MARGIN = Margin

# ---------------------------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------------------------
UNARY = ("tanh", "sigmoid", "relu", "neg", "abs", "sin", "exp_clamped", "square", "gelu", "silu",
         "softplus", "clamp", "leaky_where", "method_tanh", "log1p_abs", "sqrt_abs", "erf", "pos_op")
SCALAR = ("add", "radd", "sub", "rsub", "mul", "rmul", "div", "pow2", "add_inst", "mul_inst", "torch_add_alpha")
LINEAR = ("module", "f_linear", "h_at_M", "M_at_h", "matmul", "rowvec_mm", "mv", "lerp_param", "bilinear_row")
REDUCE = ("sum", "mean", "amax", "max_values", "min_dim", "logsumexp", "norm", "softmax", "log_softmax",
          "cumsum", "var", "prod_tanh", "sort_values", "topk1")
CATSPLIT = ("rotate", "stack_sum", "split_flip", "chunk_swap", "cat_param", "cat_stack_mean")
INDEX = ("perm_tensor", "index_select", "gather", "scalar_broadcast", "inst_index", "flip", "slice_pad",
         "k_index", "count_zeros", "count_repeat", "count_narrow")  # count_*: a per-instance 0-d int as a size
SHAPE = ("reshape_t", "expand_mean", "view_squeeze", "repeat_view", "permute3", "flatten", "transpose_mm")
DTYPE = ("double", "to_double", "half_round_trip_free", "type_as")
SEQ = ("x_at_M", "x_mean", "attention", "masked_rows", "x_row_k")
# *_block: chains.py; gru_block_seq, bi_block: every step's output read after the loop (chains.relevel);
# stacked_block: a recurrence over another's per-step outputs (chains.fuse's second pass)
CELL = ("gru", "lstm", "rnn_tanh", "lstm_block", "lstm_block_keep", "gru_block", "gru_block_seq", "bi_block",
        "stacked_block")
BRANCH_COND = ("k_gt", "sum_gt", "any_gt", "item_int", "argmax_table", "inst_c")
MISC = ("einsum", "outer", "dot", "layer_norm", "normalize", "conv1d", "T_prop", "zeros_created", "int_ops",
        "where_inst", "nested_block", "same_output_twice", "dropout_eval", "cross_entropy", "shared_buffer",
        "copysign_inst", "memo", "param_row_n", "param_view_mix", "row_products", "mv_compose")
NEWFACT = ("new_ones", "zeros_like", "full_like", "new_full", "where_const",
           "full_tuple", "arange_pos", "zeros_inplace", "eye_mv")  # (the last four: constant leaves)
# issue 15: thread state, in-place writes, hooks, buffers; issue 14: ragged blocks
GRADCTX = ("no_grad", "enable_grad", "set_grad_false")
INPLACE = ("setitem", "mask_fill", "add_chain", "iadd", "view_write", "clamp_relu_")
HOOK = ("scale", "clip", "noop")
TREE = ("childsum", "stack", "branchy", "ragged_block", "ragged_block_mean")
VALDEP = ("mask_sum", "nonzero_n", "branch_sum")


def _statement(depth: int):
    simple = st.one_of(
        st.tuples(st.just("unary"), st.sampled_from(UNARY)),
        st.tuples(st.just("scalar"), st.sampled_from(SCALAR), st.sampled_from(CONSTS)),
        st.tuples(st.just("linear"), st.sampled_from(LINEAR), st.integers(0, 2)),
        st.tuples(st.just("reduce"), st.sampled_from(REDUCE)),
        st.tuples(st.just("catsplit"), st.sampled_from(CATSPLIT), st.integers(0, 5)),
        st.tuples(st.just("index"), st.sampled_from(_allowed("index", INDEX)), st.integers(0, 5)),
        st.tuples(st.just("shape"), st.sampled_from(SHAPE)),
        st.tuples(st.just("dtype"), st.sampled_from(DTYPE)),
        st.tuples(st.just("newfact"), st.sampled_from(NEWFACT)),
        st.tuples(st.just("embed"), st.sampled_from(("one", "all", "f_embedding", "block_proj", "one_list",
                                                     "as_tensor_pair", "float_list")),
                  st.integers(0, 3)),
        st.tuples(st.just("seq"), st.sampled_from(_allowed("seq", SEQ))),
        st.tuples(st.just("cell"), st.sampled_from(CELL)),
        st.tuples(st.just("tree"), st.sampled_from(TREE)),
        st.tuples(st.just("inplace"), st.sampled_from(INPLACE), st.integers(0, 4)),
        st.tuples(st.just("hook"), st.sampled_from(HOOK)),
        st.tuples(st.just("buffer"), st.sampled_from(("bn_train", "bn_eval"))),
        st.tuples(st.just("phase"),),
        st.tuples(st.just("misc"), st.sampled_from(_allowed("misc", MISC))),
    )
    if depth <= 0:
        return simple
    body = st.lists(_statement(depth - 1), min_size=1, max_size=3).map(tuple)
    straight = st.lists(st.one_of(
        st.tuples(st.just("unary"), st.sampled_from(UNARY)),
        st.tuples(st.just("scalar"), st.sampled_from(SCALAR[:8]), st.sampled_from(CONSTS)),
        st.tuples(st.just("linear"), st.sampled_from(LINEAR), st.integers(0, 2)),
        st.tuples(st.just("reduce"), st.sampled_from(REDUCE[:10])),
        st.tuples(st.just("catsplit"), st.sampled_from(CATSPLIT), st.integers(0, 5)),
        st.tuples(st.just("shape"), st.sampled_from(SHAPE)),
        # writes inside a block make it run unblocked (blocks.py, reliability #82/#91)
        st.tuples(st.just("inplace"), st.sampled_from(INPLACE), st.integers(0, 4)),
        st.tuples(st.just("buffer"), st.sampled_from(("bn_train", "bn_eval"))),
        # an output shape that depends on values makes a block run unblocked (#242)
        st.tuples(st.just("valdep"), st.sampled_from(VALDEP)),
    ), min_size=1, max_size=4).map(tuple)
    return st.one_of(
        simple,
        st.tuples(st.just("gradctx"), st.sampled_from(GRADCTX), body),
        st.tuples(st.just("autocast"), body),
        st.tuples(st.just("block"), st.sampled_from(("fn", "fn_pair", "module")), straight),
        st.tuples(st.just("loop"), st.sampled_from(("n", "L", "while_k")), body),
        st.tuples(st.just("branch"), st.sampled_from(BRANCH_COND), body, body),
    )


def _kinds(stmts, out: set) -> set:
    for s in stmts:
        out.add(s[:2] if s[0] == "misc" else s[:1])
        if s[0] == "loop" or s[0] == "gradctx":
            _kinds(s[2], out)
        elif s[0] == "autocast":
            _kinds(s[1], out)
        elif s[0] == "branch":
            _kinds(s[2], out)
            _kinds(s[3], out)
    return out


@st.composite
def programs(draw, max_statements: int = 6):
    """A random program: (hidden size D, statements, output form)."""
    d = draw(st.integers(1, 5))
    stmts = tuple(draw(st.lists(_statement(2), min_size=1, max_size=max_statements)))
    if 10 in OPEN_BUGS:
        kinds = _kinds(stmts, set())
        if ("misc", "memo") in kinds and ("phase",) in kinds:
            stmts = tuple(s for s in stmts if s[0] != "phase") or (("unary", "tanh"),)
            kinds = _kinds(stmts, set())
            if ("misc", "memo") in kinds and ("phase",) in kinds:  # a phase nested in a loop/branch
                stmts = (("unary", "tanh"),)
    out = draw(st.sampled_from(("h", "tuple", "dict", "list_int")))
    return (d, stmts, out)


trees = st.recursive(
    st.tuples(st.integers(0, VOCAB - 1), st.just(())),
    lambda kids: st.tuples(st.integers(0, VOCAB - 1), st.lists(kids, min_size=1, max_size=3).map(tuple)),
    max_leaves=6,
)

instance_specs = st.fixed_dictionaries({
    "L": st.integers(1, 4),
    "n": st.integers(0, 4),
    "k": st.integers(0, 3),
    "ids": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4),
    "c": st.sampled_from((-1.5, 0.25, 2.0, 3, 0.0) + (() if 9 in OPEN_BUGS else (-0.0,))),
    "tree": trees,
    "x_grad": st.booleans(),
    "seed": st.integers(0, 2 ** 16),
})


def make_instance(spec: dict, d: int) -> dict:
    g = torch.Generator().manual_seed(spec["seed"])
    x = torch.randn(spec["L"], d, generator=g, device="cpu").to(torch.empty(0).device)  # the default device
    if spec["x_grad"]:
        x.requires_grad_(True)
    return {"x": x, "ids": list(spec["ids"]), "n": spec["n"], "k": torch.tensor(spec["k"]),
            "c": spec["c"], "tree": spec["tree"]}


# ---------------------------------------------------------------------------------------------
# parameters shared by all instances of one program
# ---------------------------------------------------------------------------------------------
class Params(nn.Module):
    """The shared tensors a program may use, seeded for reproducibility."""

    def __init__(self, d: int, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.d = d
        self.lins = nn.ModuleList([nn.Linear(d, d) for _ in range(3)])
        self.M = nn.Parameter(torch.randn(d, d) / max(1.0, math.sqrt(d)))
        self.v = nn.Parameter(torch.randn(d))
        self.emb = nn.Embedding(VOCAB, d)
        self.tree_lin = nn.Linear(d, d)
        self.gru = nn.GRUCell(d, d)
        self.lstm = nn.LSTMCell(d, d)
        self.rnn = nn.RNNCell(d, d)
        self.table = nn.Parameter(torch.randn(max(d, 4)))
        self.conv_w = nn.Parameter(torch.randn(d, d, 3) * 0.3)
        self.buf = torch.randn(d).requires_grad_()  # not registered: a shared tensor, not a parameter
        self.bn = nn.BatchNorm1d(d, momentum=0.3)
        self.bn_eval = nn.BatchNorm1d(d).eval()
        with torch.no_grad():
            self.bn_eval.running_mean.uniform_(-0.5, 0.5)
            self.bn_eval.running_var.uniform_(0.5, 2.0)
        # cell static blocks (after the others: their seeds stay as they were): per-step chains
        # of these run as one recurrent-layer call where chains.py proves it equivalent
        self.lstm_b = static_block(nn.LSTMCell(d, d))
        self.gru_b = static_block(nn.GRUCell(d, d))
        self.autocast_used = False
        self.autocast_off = False  # float32 reference runs of the harness (test_fuzz._assert_close)
        self.blocks: dict = {}
        self.memo: dict = {}  # filled by "memo" statements; cleared before each run


# ---------------------------------------------------------------------------------------------
# compilation of a program into per-instance code
# ---------------------------------------------------------------------------------------------
def _unary(name, h):
    if name == "tanh":
        return torch.tanh(h)
    if name == "sigmoid":
        return torch.sigmoid(h)
    if name == "relu":
        return F.relu(h)
    if name == "neg":
        return -h
    if name == "abs":
        return h.abs()
    if name == "sin":
        return torch.sin(h)
    if name == "exp_clamped":
        return torch.exp(h.clamp(-3, 3))
    if name == "square":
        return torch.square(h) * 0.5
    if name == "gelu":
        return F.gelu(h)
    if name == "silu":
        return F.silu(h)
    if name == "softplus":
        return F.softplus(h)
    if name == "clamp":
        return torch.clamp(h, min=-1.0, max=1.0)
    if name == "leaky_where":
        return torch.where(h > 0, h, 0.1 * h)
    if name == "method_tanh":
        return h.tanh()
    if name == "log1p_abs":
        return torch.log1p(h.abs())
    if name == "sqrt_abs":
        return torch.sqrt(h.abs() + 0.1)
    if name == "erf":
        return torch.erf(h)
    if name == "pos_op":
        return +h
    raise AssertionError(name)


def _scalar(name, c, h, inst):
    if name == "add":
        return h + c
    if name == "radd":
        return c + h
    if name == "sub":
        return h - c
    if name == "rsub":
        return c - h
    if name == "mul":
        return h * c
    if name == "rmul":
        return c * h
    if name == "div":
        return h / c
    if name == "pow2":
        return h.pow(2) if c > 0 else h ** 1
    if name == "add_inst":  # the constant differs per instance (DyNet #555)
        return h + inst["c"]
    if name == "mul_inst":
        return torch.mul(h, inst["c"])
    if name == "torch_add_alpha":
        return torch.add(h, h.tanh(), alpha=c)
    raise AssertionError(name)


def _linear(name, j, h, P):
    lin = P.lins[j]
    if name == "module":
        return lin(h)
    if name == "f_linear":
        return F.linear(h, lin.weight, lin.bias)
    if name == "h_at_M":
        return h @ P.M
    if name == "M_at_h":
        return P.M @ h
    if name == "matmul":
        return torch.matmul(h, lin.weight.t())
    if name == "rowvec_mm":
        return torch.mm(h.unsqueeze(0), P.M).squeeze(0)
    if name == "mv":
        return torch.mv(P.M, h)
    if name == "lerp_param":
        return torch.lerp(h, P.v, 0.25)
    if name == "bilinear_row":
        return h * (h @ P.v)
    raise AssertionError(name)


def _see_top2(h, largest=True):
    """A selecting reduction's gradient goes to the selected element: where the best two are
    within rounding, eager and batched rounding may select different ones (a kink, as a branch
    at its threshold), so the eager run records their gap as a margin."""
    if MARGIN.tracking and h.dim() == 1 and h.shape[0] > 1:
        top = torch.topk(h.detach().float(), 2, largest=largest).values
        MARGIN.see(top[0] - top[1])


def _see_top2_rows(k):
    """:func:`_see_top2` per column of ``k`` (rows: a node's children), for the ragged block's
    ``amax`` over the children. Eager run only (the block's argument is a tensor there; inside
    autobatch the block is traced on lazy values and tracking is off). Without it, children whose
    states tie within rounding (frequent under bf16) sent the amax gradient to different children
    in eager and batched runs: reliability #27."""
    if MARGIN.tracking and isinstance(k, torch.Tensor) and k.dim() == 2 and k.shape[0] > 1:
        top = torch.topk(k.detach().float(), 2, dim=0).values
        gap = top[0] - top[1]
        if k.dtype in (torch.bfloat16, torch.float16):  # within a few units of the last place: a tie
            gap = (gap - 4 * torch.finfo(k.dtype).eps * top[0].abs()).clamp_min(0)
        MARGIN.see(gap.min())


def _reduce(name, h):
    if name == "sum":
        return h + h.sum()
    if name == "mean":
        return h - h.mean()
    if name == "amax":
        _see_top2(h)
        return h - torch.amax(h, 0)
    if name == "max_values":
        _see_top2(h)
        return h + h.max(0).values
    if name == "min_dim":
        _see_top2(h, largest=False)
        return h + torch.min(h, dim=0)[0]
    if name == "logsumexp":
        return h - torch.logsumexp(h, 0)
    if name == "norm":
        return h / (h.norm() + 1.0)
    if name == "softmax":
        return torch.softmax(h, dim=0)
    if name == "log_softmax":
        return F.log_softmax(h, dim=-1)
    if name == "cumsum":
        return torch.cumsum(h, 0) * 0.5
    if name == "var":
        return h + h.var(unbiased=False)
    if name == "prod_tanh":
        return h + torch.tanh(h).prod()
    if name == "sort_values":
        return torch.sort(h, descending=True).values
    if name == "topk1":
        return h + h.topk(1).values
    raise AssertionError(name)


def _catsplit(name, a, h, P):
    d = h.shape[0]
    k = a % (d + 1)
    if name == "rotate":
        return torch.cat([h[k:], h[:k]])
    if name == "stack_sum":
        return torch.stack([h, torch.tanh(h)], dim=1).sum(1)
    if name == "split_flip":
        parts = h.split(max(1, k))
        return torch.cat(list(parts[::-1]))
    if name == "chunk_swap":
        parts = torch.chunk(h, 2)
        return torch.cat(parts[::-1], dim=0)
    if name == "cat_param":
        return torch.cat([h, P.v]).reshape(2, d).mean(0)
    if name == "cat_stack_mean":
        return torch.stack([h, P.v, h * 2]).mean(dim=0)
    raise AssertionError(name)


def _index(name, a, h, inst):
    d = h.shape[0]
    k = a % d
    if name == "count_zeros":  # sizes one by one, the first per-instance (sizeargs.py)
        n = inst["k"] + 1
        return (torch.zeros(n, d) + h).sum(0) / n
    if name == "count_repeat":  # an output shaped by a per-instance value (infer.py)
        return h.repeat(inst["k"] + 1, 1).mean(0)
    if name == "count_narrow":
        return h + h.narrow(0, 0, inst["k"] % d + 1).sum() * 0.5
    if name == "perm_tensor":
        perm = [(i + k) % d for i in range(d)]
        return h[torch.tensor(perm)]
    if name == "index_select":
        idx = torch.tensor([(i * 2 + k) % d for i in range(d)])
        return torch.index_select(h, 0, idx)
    if name == "gather":
        idx = torch.tensor([(d - 1 - i + k) % d for i in range(d)])
        return h.gather(0, idx)
    if name == "scalar_broadcast":
        return h + h[k]
    if name == "inst_index":  # index that differs per instance
        return h * h[inst["ids"][0] % d]
    if name == "flip":
        return torch.flip(h, dims=(0,))
    if name == "slice_pad":
        return F.pad(h[k:], (0, k))
    if name == "k_index":  # a tensor index from the instance
        return h + h[inst["k"] % d]
    raise AssertionError(name)


def _shape(name, h):
    d = h.shape[0]
    if name == "reshape_t":
        return h.reshape(d, 1).t().reshape(-1)
    if name == "expand_mean":
        return h.unsqueeze(0).expand(3, d).mean(0)
    if name == "view_squeeze":
        return h.view(1, d).squeeze(0)
    if name == "repeat_view":
        return h.repeat(2).view(2, d).sum(0) * 0.5
    if name == "permute3":
        return h.view(1, d, 1).permute(2, 0, 1).flatten()
    if name == "flatten":
        return torch.flatten(h.unsqueeze(-1))
    if name == "transpose_mm":
        m = h.unsqueeze(1)  # (d, 1)
        return (m @ m.transpose(0, 1)).sum(1) * 0.1 + h
    raise AssertionError(name)


def _dtype(name, h):
    if name == "double":
        return (h.double() * 1.5).float()
    if name == "to_double":
        return h.to(torch.float64).tanh().to(torch.float32)
    if name == "half_round_trip_free":
        return h.long().float() * 0.0 + h  # an integer detour that contributes nothing
    if name == "type_as":
        return (h.double() + 1).type_as(h)
    raise AssertionError(name)


def _newfact(name, h):
    if name == "new_ones":
        return h + h.new_ones(h.shape[0])
    if name == "zeros_like":
        return h + torch.zeros_like(h)
    if name == "full_like":
        return h * torch.full_like(h, 0.5)
    if name == "new_full":
        return h - h.new_full((h.shape[0],), 0.25)
    if name == "where_const":
        return torch.where(h > 0.5, torch.ones_like(h), h)
    d = h.shape[0]
    if name == "full_tuple":
        return h * torch.full((d,), 0.5)
    if name == "arange_pos":
        return h + torch.arange(d) * 0.01
    if name == "zeros_inplace":
        z = torch.zeros(d, dtype=h.dtype)
        z += h
        return z
    if name == "eye_mv":
        return torch.eye(d, dtype=h.dtype) @ h
    raise AssertionError(name)


def _embed(name, j, h, inst, P):
    ids = inst["ids"]
    if name == "one":
        return h + P.emb(torch.tensor(ids[j % len(ids)]))
    if name == "all":
        return h + P.emb(torch.tensor(ids)).sum(0)
    if name == "f_embedding":
        return h * F.embedding(torch.tensor(ids[-1]), P.emb.weight).tanh()
    if name == "one_list":  # a (1,) id tensor, as tutorials write it (a list leaf)
        return h + P.emb(torch.tensor([ids[j % len(ids)]]))[0]
    if name == "as_tensor_pair":
        return h + P.emb(torch.as_tensor([ids[0], ids[-1]])).mean(0)
    if name == "float_list":  # per-instance Python floats as a tensor (a float list leaf)
        return h * torch.tensor([1.0 / (1 + i) for i in ids[:2]]).sum()
    if name == "block_proj":  # a token-id block: run once per distinct id where no grad flows (dedup.py)
        blk = P.blocks.get("embed_proj")
        if blk is None:
            blk = P.blocks["embed_proj"] = static_block(lambda t: torch.tanh(P.lins[0](P.emb(t))))
        return h + blk(torch.tensor(ids[j % len(ids)]))
    raise AssertionError(name)


def _seq(name, h, inst, P):
    x = inst["x"]
    if name == "x_at_M":
        return h + torch.tanh(x @ P.M).sum(0)
    if name == "x_mean":
        return h + x.mean(0)
    if name == "attention":
        a = torch.softmax(x @ h, dim=0)
        return h + a @ x
    if name == "masked_rows":  # shape depends on values: runs eagerly
        return h + x[x.sum(-1) > 0].sum(0)
    if name == "x_row_k":
        return h + x[int(inst["k"]) % x.shape[0]]
    raise AssertionError(name)


def _cell(name, h, inst, P):
    x = inst["x"]
    if name == "gru":
        for t in range(x.shape[0]):
            h = P.gru(x[t], h)
        return h
    if name == "lstm":
        c = torch.zeros_like(h)
        for t in range(x.shape[0]):
            h, c = P.lstm(x[t], (h, c))
        return h + c
    if name == "rnn_tanh":
        for t in range(x.shape[0]):
            h = P.rnn(x[t], h)
        return h
    if name in ("lstm_block", "lstm_block_keep"):
        c = torch.zeros_like(h)
        cs = []
        for t in range(x.shape[0]):
            h, c = P.lstm_b(x[t], (h, c))
            if name == "lstm_block_keep":
                cs.append(c)  # every step's c is read: the chain cannot be one layer call
        return h + c + sum(cs) * 0.5 if cs else h + c
    if name == "gru_block":
        for t in range(x.shape[0]):
            h = P.gru_b(x[t], h)
        return h
    if name == "gru_block_seq":
        hs = []
        for t in range(x.shape[0]):
            h = P.gru_b(x[t], h)
            hs.append(h)
        return torch.stack([torch.tanh(P.lins[0](v)) for v in hs]).mean(0)
    if name == "bi_block":  # a BiRNN tagger's shape: step t of each direction read together
        c = torch.zeros_like(h)
        fw = []
        for t in range(x.shape[0]):
            h, c = P.lstm_b(x[t], (h, c))
            fw.append(h)
        g = torch.zeros_like(h)
        bw = [None] * x.shape[0]
        for t in range(x.shape[0] - 1, -1, -1):
            g = P.gru_b(x[t], g)
            bw[t] = g
        return sum(P.lins[1](f * b + f) for f, b in zip(fw, bw)) * 0.5 + c
    if name == "stacked_block":
        c = torch.zeros_like(h)
        hs = []
        for t in range(x.shape[0]):
            h, c = P.lstm_b(x[t], (h, c))
            hs.append(torch.tanh(h))
        g = torch.zeros_like(h)
        for v in hs:
            g = P.gru_b(v, g)
        return g + c
    raise AssertionError(name)


def _misc(name, h, inst, P):
    d = h.shape[0]
    x = inst["x"]
    if name == "einsum":
        return torch.einsum("i,ij->j", h, P.M) + torch.einsum("li,i->l", x, h).sum()
    if name == "outer":
        return torch.outer(h, P.v).sum(1) * 0.2
    if name == "dot":
        return h * torch.dot(h, P.v)
    if name == "layer_norm":
        return F.layer_norm(h, (d,), P.v, None) if d > 1 else h + F.layer_norm(h, (d,)).sum()
    if name == "normalize":
        return F.normalize(h, dim=0)
    if name == "conv1d":  # over the instance's sequence: length differs per instance
        y = F.conv1d(x.t().unsqueeze(0), P.conv_w, padding=1)  # (1, d, L)
        return h + y.squeeze(0).mean(-1)
    if name == "T_prop":
        return (P.M.T @ h.unsqueeze(1)).squeeze(1) + x.T.sum(1)
    if name == "zeros_created":
        z = torch.zeros(d, dtype=h.dtype)
        o = torch.ones(d, dtype=torch.float32) * inst["n"]
        return h + z + o * 0.1
    if name == "int_ops":
        i = torch.argmax(h)
        j = (i * 2 + inst["k"]) % d
        return h + h[j] * (i.float() + 1) * 0.1
    if name == "where_inst":
        return torch.where(inst["k"] > 1, h, -h)
    if name == "param_row_n":  # views of one parameter at per-instance offsets (bug #42's keys)
        return h * P.M[inst["n"] % d]
    if name == "param_view_mix":  # views made per call: transposed, reshaped, sliced
        return (h @ P.M.t()) * P.v.view(-1) + P.M.T[0] + P.M[:, :1].reshape(-1)
    if name == "row_products":  # per-node matrices only products read: rows read in place (rowmm.py)
        blk = P.blocks.get("row_products")
        if blk is None:
            def body(v, A, B):
                return (v.unsqueeze(-2) @ B).squeeze(-2) + (A @ P.M.t() + B @ P.M).sum(-2) * 0.1
            blk = P.blocks["row_products"] = static_block(body)
        # (A made at a depth per instance, read at one depth: its rows come from several buffers)
        A = torch.outer(h, torch.tanh(h)) * 0.5
        for _ in range(inst["k"]):
            A = torch.tanh(A) * 1.5 if inst["k"] % 2 else torch.sigmoid(A) - 0.25
        g = h
        for _ in range(4):
            g = g * 0.5 + 0.1
        return h + blk(g, A, torch.sigmoid(A)) * 0.1
    if name == "mv_compose":  # MV-RNN: a sum of row products joined (rowmm.sum_of_products); the
        blk = P.blocks.get("mv_compose")  # last matrix dropped for even n (dead rows, execute.py)
        if blk is None:
            def body(a, A, b, B):
                p = torch.tanh((a.unsqueeze(-2) @ B).squeeze(-2) + (b.unsqueeze(-2) @ A).squeeze(-2))
                return p, A @ P.M.t() + B @ P.M
            blk = P.blocks["mv_compose"] = static_block(body)
        v, Mx = h, torch.outer(h, torch.tanh(h)) * 0.5
        for j in range(1 + len(inst["ids"]) % 3):  # (Python ints: a value wait would keep Mx held)
            v, Mx = blk(v, Mx, torch.tanh(v + 0.1 * j), torch.sigmoid(Mx))
        return v + Mx.sum(0) * 0.01 if inst["n"] % 2 else v
    if name == "nested_block":
        outer = P.blocks.get("nested")
        if outer is None:
            inner = static_block(lambda a: torch.tanh(P.lins[0](a)))
            outer = P.blocks["nested"] = static_block(lambda a, b: inner(a) * 0.5 + inner(b) * 0.25)
        return outer(h, x[0])
    if name == "same_output_twice":
        y = torch.tanh(h)
        return torch.stack([y, y, h]).sum(0)
    if name == "dropout_eval":
        return F.dropout(h, p=0.5, training=False) + F.dropout(h, p=0.0, training=True)
    if name == "cross_entropy":
        target = torch.tensor(inst["ids"][0] % d)
        return h + F.cross_entropy(h.unsqueeze(0), target.unsqueeze(0))
    if name == "copysign_inst":  # the sign of a per-instance constant, incl. -0.0 (DyNet #555)
        return torch.copysign(h, inst["c"])
    if name == "memo":  # a cache of lazy values shared by all instances of the call
        wid = inst["ids"][0]
        if wid not in P.memo:
            P.memo[wid] = torch.tanh(P.lins[1](P.emb(torch.tensor(wid))))
        return h + P.memo[wid]
    if name == "shared_buffer":  # a captured non-parameter tensor that requires grad
        return h * P.buf
    raise AssertionError(name)


def _tree(name, h, inst, P):
    def childsum(node):
        wid, kids = node
        s = P.emb(torch.tensor(wid))
        for c in kids:
            s = s + childsum(c)
        return torch.tanh(P.tree_lin(s))

    def stacked(node):
        wid, kids = node
        s = P.emb(torch.tensor(wid))
        if kids:
            s = s + torch.stack([stacked(c) for c in kids]).mean(0)
        return torch.tanh(P.tree_lin(s))

    def branchy(node):  # a branch on a tensor value at every node
        wid, kids = node
        s = P.emb(torch.tensor(wid))
        for c in kids:
            s = s + branchy(c)
        t = P.tree_lin(s)
        m = t.sum()
        MARGIN.see(m)
        return torch.tanh(t) if m > 0 else torch.sigmoid(t)

    def ragged(node):  # a static block over the children's states: one ragged group per depth
        wid, kids = node
        states = [ragged(c) for c in kids]
        return _ragged_cell(P, name)(P.emb(torch.tensor(wid)), states)

    fn = {"childsum": childsum, "stack": stacked, "branchy": branchy, "ragged_block": ragged,
          "ragged_block_mean": ragged}[name]
    return h + fn(inst["tree"])


def _ragged_cell(P, name):
    blk = P.blocks.get(name)
    if blk is None:
        lin = P.tree_lin

        def cell(x, kids):
            if kids:
                k = torch.stack(kids, dim=-2)                      # (k, D): members of a list
                if name == "ragged_block":
                    att = torch.softmax((k * x.unsqueeze(-2)).sum(-1), dim=-1)   # attention over children
                    _see_top2_rows(k)  # amax over the children selects, as a branch does
                    x = x + (att.unsqueeze(-1) * torch.tanh(lin(k))).sum(-2) + k.amax(-2)
                else:
                    x = x + k.mean(-2) * torch.sigmoid(lin(x))
            return torch.tanh(lin(x))

        blk = P.blocks[name] = static_block(cell)
    return blk


def _inplace(name, i, h, inst, P):
    d = h.shape[0]
    i = i % d
    if name == "setitem":
        y = torch.zeros(d)
        y[i] = h[i] * 2
        y[(i + 1) % d] = 0.5
        return h + y
    if name == "mask_fill":
        y = h.clone()
        y[y > 0.2] = 0.2
        return y
    if name == "add_chain":
        y = h * 1.0
        y.add_(1).mul_(0.5)
        return y
    if name == "iadd":
        y = P.lins[0](h)
        y += h
        return y
    if name == "view_write":
        y = h.clone()
        v = y[i:]
        v.mul_(2)
        return y + v.sum()
    if name == "clamp_relu_":
        y = h - 0.1
        y.clamp_(min=-0.5)
        F.relu(y, inplace=True)
        return y
    raise AssertionError(name)


def _hook(name, h):
    y = h * 1.0
    if not y.requires_grad:
        return y  # eager would raise: a hook on a tensor that does not require grad
    if name == "scale":
        y.register_hook(lambda g: g * 0.5)
    elif name == "clip":
        y.register_hook(lambda g: g.clamp(-0.1, 0.1))
    else:
        y.register_hook(lambda g: None)
    return y


def _cond(name, h, inst, P):
    """A Python bool decided by a tensor value (the fiber yields here)."""
    if name == "k_gt":
        return bool(inst["k"] > 1)
    if name == "sum_gt":
        s = h.sum()
        MARGIN.see(s)
        return bool(s > 0)
    if name == "any_gt":
        MARGIN.see((h - 0.3).abs().min())
        return bool((h > 0.3).any())
    if name == "item_int":
        return (inst["k"] * 2).item() % 3 == 0
    if name == "argmax_table":
        top = torch.topk(h, min(2, h.shape[0])).values
        if top.shape[0] > 1:
            MARGIN.see(top[0] - top[1])
        return int(torch.argmax(h)) % 2 == 0
    if name == "inst_c":
        return bool(torch.tensor(inst["c"]) > 0)
    raise AssertionError(name)


class BlockBody(nn.Module):
    """A module static block: its own Linear, then a straight-line sub-program."""

    def __init__(self, P, body):
        super().__init__()
        self.lin = nn.Linear(P.d, P.d)
        self.body = body
        self.shared = [P]  # a list, so that P is not registered as a submodule

    def forward(self, h, x0):
        h = self.lin(h) + x0
        for stmt in self.body:
            h = run_statement(stmt, h, None, self.shared[0])
        return h


def _block(kind, body, P, key):
    """A static block made of a straight-line sub-program, cached per program."""
    blk = P.blocks.get(key)
    if blk is not None:
        return blk
    if kind == "module":
        blk = static_block(BlockBody(P, body))
    else:
        def fn(h, x0):
            h = h + x0 * 0.5
            for stmt in body:
                h = run_statement(stmt, h, None, P)
            return (h, h.sum()) if kind == "fn_pair" else h

        blk = static_block(fn)
    P.blocks[key] = blk
    return blk


def run_statement(stmt, h, inst, P):
    kind = stmt[0]
    if kind == "unary":
        return _unary(stmt[1], h)
    if kind == "scalar":
        return _scalar(stmt[1], stmt[2], h, inst)
    if kind == "linear":
        return _linear(stmt[1], stmt[2], h, P)
    if kind == "reduce":
        return _reduce(stmt[1], h)
    if kind == "catsplit":
        return _catsplit(stmt[1], stmt[2], h, P)
    if kind == "index":
        return _index(stmt[1], stmt[2], h, inst)
    if kind == "shape":
        return _shape(stmt[1], h)
    if kind == "dtype":
        return _dtype(stmt[1], h)
    if kind == "newfact":
        return _newfact(stmt[1], h)
    if kind == "embed":
        return _embed(stmt[1], stmt[2], h, inst, P)
    if kind == "seq":
        return _seq(stmt[1], h, inst, P)
    if kind == "cell":
        return _cell(stmt[1], h, inst, P)
    if kind == "tree":
        return _tree(stmt[1], h, inst, P)
    if kind == "misc":
        return _misc(stmt[1], h, inst, P)
    if kind == "phase":
        batchcraft.phase()
        return h
    if kind == "inplace":
        return _inplace(stmt[1], stmt[2], h, inst, P)
    if kind == "hook":
        return _hook(stmt[1], h)
    if kind == "valdep":
        if stmt[1] == "branch_sum":  # a branch on a value (inside a block: it runs unblocked)
            MARGIN.see(h.sum())
            return torch.tanh(h) * 2 if h.sum() > 0 else h - 0.5
        MARGIN.see((h - 0.2).abs().min())  # (a value at the threshold could flip between the runs)
        if stmt[1] == "mask_sum":
            return h + h[h > 0.2].sum() * 0.1
        return h * (1.0 + 0.1 * (h > 0.2).nonzero().shape[0])
    if kind == "buffer":
        if stmt[1] == "bn_train":
            return P.bn(torch.stack([h, h * 0.5 + 1.0, torch.tanh(h)]))[0]  # (the sum over rows is ~0: a kink)
        return P.bn_eval(h.unsqueeze(0))[0]
    if kind == "gradctx":
        how, body = stmt[1], stmt[2]
        if how == "set_grad_false":
            prev = torch.is_grad_enabled()
            torch.set_grad_enabled(False)
            try:
                for s in body:
                    h = run_statement(s, h, inst, P)
            finally:
                torch.set_grad_enabled(prev)
            return h
        with (torch.no_grad() if how == "no_grad" else torch.enable_grad()):
            for s in body:
                h = run_statement(s, h, inst, P)
        return h
    if kind == "autocast":
        P.autocast_used = True
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not P.autocast_off):
            for s in stmt[1]:
                h = run_statement(s, h, inst, P)
        return h.float()
    if kind == "block":
        blk = _block(stmt[1], stmt[2], P, id(stmt))
        out = blk(h, inst["x"][0])
        return out[0] + out[1] if isinstance(out, tuple) else out
    if kind == "loop":
        how, body = stmt[1], stmt[2]
        if how == "while_k":  # a loop whose condition is a tensor value
            c = inst["k"]
            while c > 0:
                for s in body:
                    h = run_statement(s, h, inst, P)
                h = torch.tanh(h)
                c = c - 1
            return h
        count = inst["n"] if how == "n" else inst["x"].shape[0]
        for _ in range(count):
            for s in body:
                h = run_statement(s, h, inst, P)
            h = torch.tanh(h)  # keep values bounded across iterations
        return h
    if kind == "branch":
        take = _cond(stmt[1], h, inst, P)
        for s in (stmt[2] if take else stmt[3]):
            h = run_statement(s, h, inst, P)
        return h
    raise AssertionError(kind)


def compile_program(program, P: Params):
    """Per-instance function of ``program``: ``fn(instance) -> outputs``."""
    _, stmts, out = program

    def fn(inst):
        h = torch.tanh(inst["x"].sum(0))
        trail = []
        for s in stmts:
            h = run_statement(s, h, inst, P)
            trail.append(h)
        if out == "tuple":
            return h, trail[0]
        if out == "dict":
            return {"h": h, "first": trail[0], "n": inst["n"]}
        if out == "list_int":
            return [h, len(trail)]
        return h

    return fn


def count_statements(stmts) -> int:
    n = 0
    for s in stmts:
        n += 1
        if s[0] in ("loop",):
            n += count_statements(s[2])
        elif s[0] == "branch":
            n += count_statements(s[2]) + count_statements(s[3])
        elif s[0] == "block":
            n += len(s[2])
        elif s[0] == "gradctx":
            n += count_statements(s[2])
        elif s[0] == "autocast":
            n += count_statements(s[1])
    return n
