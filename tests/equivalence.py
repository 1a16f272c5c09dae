"""Test helpers: random trees and the eager-equivalence check (import: from equivalence import ...)."""

from __future__ import annotations

import random

import torch
from torch.overrides import TorchFunctionMode

from batchcraft.data import Sentence


def make_tree(parents: list[int], vocab_size: int = 50, seed: int = 0) -> Sentence:
    """A Sentence whose word i has head parents[i] (-1 for the root)."""
    rng = random.Random(seed)
    n = len(parents)
    children = [[] for _ in range(n)]
    for i, p in enumerate(parents):
        if p >= 0:
            children[p].append(i)
    s = Sentence(words=[f"w{i}" for i in range(n)], upos=["NOUN"] * n, heads=list(parents),
                 deprels=["dep"] * n, children=children, root=parents.index(-1), source="random")
    s.word_ids = [rng.randrange(vocab_size) for _ in range(n)]
    s.upos_ids = [rng.randrange(18) for _ in range(n)]
    return s


def random_tree(n: int, seed: int) -> Sentence:
    rng = random.Random(seed)
    return make_tree([-1] + [rng.randrange(i) for i in range(1, n)], seed=seed)


def flat_tensors(x):
    """The tensors of a nested output (dicts in key order), flattened."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for k in sorted(x) for t in flat_tensors(x[k])]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in flat_tensors(v)]
    return []


def assert_matches_eager(fn, instances, params, *, atol=1e-5, rtol_grad=1e-4, **options):
    """Forward values and gradients of ``autobatch(fn)`` equal running ``fn`` per instance."""
    from batchcraft import autobatch

    params = [p for p in params if p.requires_grad]
    f = autobatch(fn, **options)
    out = f(instances)
    ref = [fn(x) for x in instances]
    assert len(out) == len(ref)
    for i, (o, r) in enumerate(zip(out, ref)):
        fo, fr = flat_tensors(o), flat_tensors(r)
        assert len(fo) == len(fr), f"instance {i}: output structure differs"
        for a, b in zip(fo, fr):
            assert a.shape == b.shape, f"instance {i}: shape {a.shape} vs {b.shape}"
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, atol=atol, rtol=1e-5, msg=f"instance {i}")
    if not params:
        return f
    g = torch.Generator().manual_seed(1)

    def loss(outs):
        total = 0
        for o in outs:
            for t in flat_tensors(o):
                if t.is_floating_point():
                    w = torch.randn(t.shape, generator=g)
                    total = total + (t * w).sum()
        return total

    l_b = loss(out)
    gb = torch.autograd.grad(l_b, params, allow_unused=True)
    g.manual_seed(1)
    l_e = loss(ref)
    ge = torch.autograd.grad(l_e, params, allow_unused=True)
    for p, a, b in zip(params, gb, ge):
        if a is None or b is None:
            assert a is None and b is None or (a is None and b.abs().max() == 0) or (b is None and a.abs().max() == 0)
            continue
        scale = b.abs().max().clamp_min(1e-6)
        assert ((a - b).abs().max() / scale) <= rtol_grad, f"gradient of {tuple(p.shape)} differs"
    return f


def available_cores() -> list:
    """The recording cores this install has: ``["c", "python"]``, or ``["python"]`` without the C core."""
    from batchcraft.autobatching import _native

    return ["c", "python"] if _native.available else ["python"]


CORES = available_cores()


def check_inputs_against_eager(fn, xs, core, params=()):
    """``autobatch(fn)`` on ``xs`` and ``fn`` per instance on copies: the outputs (values,
    ``requires_grad``, other items equal), the caller's tensors afterwards (values,
    ``requires_grad``, ``is_leaf``) and, after a backward through the outputs that require grad,
    the inputs' and ``params``' gradients."""
    from batchcraft import autobatch

    xe = [x.detach().clone().requires_grad_(x.requires_grad) for x in xs]
    out = autobatch(fn, core=core)(xs)
    grads_b = None
    losses = [t.sum() for o in out for t in (o if isinstance(o, tuple) else (o,))
              if isinstance(t, torch.Tensor) and t.requires_grad]
    if losses:
        sum(losses).backward()
        grads_b = [None if p.grad is None else p.grad.clone() for p in params]
        for p in params:
            p.grad = None
    ref = [fn(x) for x in xe]
    for o, r in zip(out, ref):
        o, r = (o, r) if isinstance(o, tuple) else ((o,), (r,))
        assert len(o) == len(r)
        for a, b in zip(o, r):
            if isinstance(b, torch.Tensor):
                torch.testing.assert_close(a.detach(), b.detach())
                assert a.requires_grad == b.requires_grad
            else:
                assert a == b
    for x, y in zip(xs, xe):  # the caller's tensors: changed as eager changed them
        torch.testing.assert_close(x.detach(), y.detach())
        assert (x.requires_grad, x.is_leaf) == (y.requires_grad, y.is_leaf)
    losses = [t.sum() for r in ref for t in (r if isinstance(r, tuple) else (r,))
              if isinstance(t, torch.Tensor) and t.requires_grad]
    assert bool(losses) == (grads_b is not None)
    if losses:
        sum(losses).backward()
        for x, y in zip(xs, xe):
            assert (x.grad is None) == (y.grad is None)
            if y.grad is not None:
                torch.testing.assert_close(x.grad, y.grad)
        for g, p in zip(grads_b, params):
            assert (g is None) == (p.grad is None)
            if g is not None:
                torch.testing.assert_close(g, p.grad)
            p.grad = None



class NameLog(TorchFunctionMode):
    """A torch-function mode that logs every call it sees: the ``__name__`` (``.names``) and the
    function object (``.funcs``, optionally a list shared by several of these modes)."""

    def __init__(self, funcs: list | None = None):
        super().__init__()
        self.names = []
        self.funcs = [] if funcs is None else funcs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


def general_path_calls(fn, instances, monkeypatch, *, core="c"):
    """``(outputs, names)``: a steady call of ``autobatch(fn)`` under ``no_grad`` (after one that
    infers the signatures) and the operations it sent through the general recording path
    (``RecorderBase.general``), the call's own grad-mode set-up left out."""
    from batchcraft import autobatch
    from batchcraft.autobatching import recorder

    calls = []
    general = recorder.RecorderBase.general
    monkeypatch.setattr(recorder.RecorderBase, "general",
                        lambda self, *a: calls.append(getattr(a[0], "__name__", a[0])) or general(self, *a))
    f = autobatch(fn, core=core)
    with torch.no_grad():
        f(instances)
        calls.clear()
        out = f(instances)
    return out, [c for c in calls if c != "_set_grad_enabled"]

