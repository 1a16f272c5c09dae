"""Math-library knobs: which kernels run a model's linear and convolution layers.

PyTorch's CPU wheels ship two matrix-multiply libraries and choose for the user: ``nn.Linear``
in float32 calls ``aten::addmm``, which is MKL's ``sgemm`` on a weight it transposes on every
call; convolutions go to oneDNN (``aten::mkldnn_convolution``) in the input's memory format.
What torch exposes that really changes the kernel (checked with ``torch.profiler``, see
tests/parallel/test_backends.py):

``matmul`` (``nn.Linear`` layers):
    * ``"default"``: ``aten::addmm`` (MKL ``sgemm``).
    * ``"mkl-packed"``: ``mkl::_mkl_linear`` on a weight packed once by
      ``torch.ops.mkl._mkl_reorder_linear_weight`` for the batch's row count (MKL's packed GEMM,
      what Inductor's freezing pass uses). Other row counts fall back to ``aten::addmm`` inside
      the op, with the same values.
    * ``"onednn"``: ``mkldnn::_linear_pointwise`` on a weight reordered once by
      ``torch.ops.mkldnn._reorder_linear_weight`` (oneDNN's inner-product primitive); any row
      count uses the reordered weight.
``conv`` (``nn.Conv2d`` layers):
    * ``"default"``: oneDNN in the input's layout (NCHW: oneDNN reorders to its blocked layout
      and back around every convolution).
    * ``"channels-last"``: input and weight in NHWC (``torch.channels_last``), oneDNN's native
      layout; later layers keep it, so only the first convolution converts.
    * ``"native"``: ``torch.backends.mkldnn`` off for the call: ``aten::_slow_conv2d_forward``
      (im2col + BLAS). Slower for every model measured here; the tuner leaves it out unless asked.

The switched kernels compute the same products in another order: values agree with the default
to float32 rounding (checked on the example input before a variant is used), not bit for bit.
They run only where no gradient is needed (``torch.no_grad`` / ``torch.inference_mode``, or no
input requiring grad) on float32 CPU tensors; otherwise the layer runs its default kernel.

One forward function per knob serves both uses: :func:`convert` gives a model whose layers use
it (the tuner's worker processes hold several variants side by side, sharing the weights where
the layout does not change), and :func:`install` patches ``nn.Linear`` / ``nn.Conv2d`` for a
whole process (``batchcraft launch`` does that before the user's program runs).

Source: Wang et al. (arXiv 1908.04705) list the math library among the knobs of CPU inference.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.autograd.forward_ad as _fwad
import torch.nn.functional as F
from torch import nn

from batchcraft.autobatching.openmp import team_ok
from batchcraft.errors import ConfigurationError
from batchcraft.measure.poison import fresh_inputs, poisoned_call

__all__ = ["MATMUL_BACKENDS", "CONV_BACKENDS", "available_matmul", "convert", "install", "uninstall",
           "relevant_knobs", "BackendLinear", "BackendConv2d"]

MATMUL_BACKENDS = ("default", "mkl-packed", "onednn")
CONV_BACKENDS = ("default", "channels-last", "native")
MAX_PACKS = 3  # row counts (batch sizes) packed per layer: the tuner's three batch sizes
KNOB_FLOPS_FRACTION = 0.1  # a layer kind with less of the heavy FLOPs than this does not get its knob tried

_ORIGINAL = {"linear": nn.Linear.forward, "conv": nn.Conv2d.forward}
_PROCESS = {"matmul": "default", "conv": "default"}  # what install() set for the whole process


@functools.lru_cache(maxsize=None)
def available_matmul() -> tuple[str, ...]:
    """The ``matmul`` backends this torch build can run and that give ``F.linear``'s values, tried
    once on a tiny product and on one big enough to run on several threads (torch's oneDNN linear
    leaves rows unwritten under ``OMP_THREAD_LIMIT=1`` or ``OMP_DYNAMIC=true``, reliability #211)."""
    out = ["default"]
    threads = torch.get_num_threads()
    for kind in MATMUL_BACKENDS[1:]:
        try:
            ok = True
            for t in sorted({threads, max(2, threads)}):  # (the bug shows only on several threads)
                torch.set_num_threads(t)
                ok = ok and _right(kind)
            if ok:
                out.append(kind)
        except (RuntimeError, AttributeError, NotImplementedError):
            pass
        finally:
            torch.set_num_threads(threads)
    return tuple(out)


def _right(kind: str) -> bool:
    """Does ``kind``'s packed linear give ``x @ w.T`` at the current thread count, on a tiny product
    and on one big enough for several threads? Checked as :mod:`batchcraft.measure.poison` says
    (fresh inputs, a poisoned output block, the reference after the call)."""
    ok = True
    with torch._C.DisableTorchFunction(), torch.no_grad():  # (the user's modes must not see the check)
        for m, k, n in ((2, 3, 4), (64, 256, 768)):
            w, x = fresh_inputs((n, k), (m, k))
            y = poisoned_call(torch.empty(m, n), lambda: _packed_call(kind, x, _pack(kind, w, m), w, None, m))
            ok = ok and bool(torch.allclose(y, x @ w.t(), rtol=1e-4, atol=1e-4))
    return ok


_ONEDNN_AT: dict = {}  # thread count -> does oneDNN's linear give F.linear's values there


def _onednn_right_at(threads: int) -> bool:
    """:func:`_right` for oneDNN at ``threads`` intra-op threads (the current count), once per count:
    under ``OMP_THREAD_LIMIT`` or ``OMP_DYNAMIC`` torch's oneDNN linear leaves rows unwritten from
    some thread count on (reliability #211, #213)."""
    ok = _ONEDNN_AT.get(threads)
    if ok is None:
        try:
            ok = _right("onednn")
        except (RuntimeError, AttributeError, NotImplementedError):
            ok = False
        _ONEDNN_AT[threads] = ok
    return ok


def _check(matmul: str, conv: str) -> None:
    if matmul not in MATMUL_BACKENDS:
        raise ConfigurationError(f"matmul backend must be one of {MATMUL_BACKENDS}, got {matmul!r}")
    if conv not in CONV_BACKENDS:
        raise ConfigurationError(f"conv backend must be one of {CONV_BACKENDS}, got {conv!r}")
    if matmul not in available_matmul():
        raise ConfigurationError(f"matmul backend {matmul!r} is not available in this torch build "
                                 f"(available: {', '.join(available_matmul())})")


# -- kernels ----------------------------------------------------------------------------------
def _pack(kind: str, weight: torch.Tensor, rows: int):
    if kind == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    return torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)


def _packed_call(kind, x2, packed, weight, bias, rows):
    if kind == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
    return torch.ops.mkl._mkl_linear(x2, packed, weight, bias, rows)


_peek_transform = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", lambda: None)


def _no_grad_needed(*tensors) -> bool:
    """No derivative can flow through the call: no autograd need, no forward-mode AD level (a
    ``dual_level``, ``torch.func.jvp``) and no ``torch.func`` transform. The packed kernels have no
    derivatives: torch would give their outputs a zero tangent, silently (reliability #206)."""
    if _fwad._current_level >= 0 or _peek_transform() is not None:
        return False
    return not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in tensors)


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter (and cannot change)
        return -1


def linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` with the layer's (or the process's) ``matmul`` backend.

    The packed weight is made for the call's row count (leading dimensions flattened), once per
    row count and at most MAX_PACKS row counts per layer; it is remade when the weight object or
    its contents change (version counter). Further row counts do not pack (no thrashing when a
    server sees many batch sizes): "onednn" uses the latest pack (any row count works with it),
    "mkl-packed" runs the default kernel.
    """
    kind = self.__dict__.get("_batchcraft_matmul", _PROCESS["matmul"])
    w, b = self.weight, self.bias
    if (kind == "default" or x.dim() < 2 or x.device.type != "cpu" or x.dtype != torch.float32
            or w.dtype != torch.float32 or not _no_grad_needed(x, w, b)
            or (kind == "onednn" and not (team_ok() and _onednn_right_at(torch.get_num_threads())))):
        return F.linear(x, w, b)
    rows = max(1, x.numel() // max(1, x.shape[-1]))
    packs = self.__dict__.get("_batchcraft_packs")
    stamp = (kind, id(w), _version(w))
    if packs is None or packs["stamp"] != stamp:
        packs = self.__dict__["_batchcraft_packs"] = {"stamp": stamp, "by_rows": {}, "latest": None}
    pack = packs["by_rows"].get(rows)
    if pack is None:
        if len(packs["by_rows"]) < MAX_PACKS:
            with torch.no_grad():
                pack = packs["by_rows"][rows] = _pack(kind, w.detach(), rows)
        elif kind == "onednn":
            pack = packs["latest"]
        else:
            return F.linear(x, w, b)
    packs["latest"] = pack
    x2 = x.reshape(rows, x.shape[-1])
    y = _packed_call(kind, x2, pack, w.detach(), None if b is None else b.detach(), rows)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def conv_forward(self: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """``nn.Conv2d.forward`` with the layer's (or the process's) ``conv`` backend."""
    kind = self.__dict__.get("_batchcraft_conv", _PROCESS["conv"])
    if kind == "default" or x.device.type != "cpu" or x.dim() != 4:
        return _ORIGINAL["conv"](self, x)
    if kind == "native":
        was = torch._C._get_mkldnn_enabled()
        torch._C._set_mkldnn_enabled(False)
        try:
            return _ORIGINAL["conv"](self, x)
        finally:
            torch._C._set_mkldnn_enabled(was)
    cl = torch.channels_last
    if not self.weight.is_contiguous(memory_format=cl):  # once: the layer's weight moves to NHWC
        with torch.no_grad():
            self.weight.data = self.weight.data.contiguous(memory_format=cl)
    return _ORIGINAL["conv"](self, x.contiguous(memory_format=cl))


class BackendLinear(nn.Linear):
    """An ``nn.Linear`` whose forward is :func:`linear_forward` (made by :func:`convert`)."""

    forward = linear_forward


class BackendConv2d(nn.Conv2d):
    """An ``nn.Conv2d`` whose forward is :func:`conv_forward` (made by :func:`convert`)."""

    forward = conv_forward


# -- whole models and whole processes ---------------------------------------------------------
def relevant_knobs(analysis, *, min_fraction: float = KNOB_FLOPS_FRACTION) -> dict[str, tuple[str, ...]]:
    """Backends worth trying for a model: a layer kind's knob only where that kind does at least
    ``min_fraction`` of the heavy FLOPs ("native" convolution never: it lost everywhere).

    Args:
        analysis (GraphAnalysis | None): the model's graph; None (not traceable): no knob.
        min_fraction (float): least share of the heavy FLOPs (0: any layer of the kind).
    Returns:
        dict: knob name -> values to try, "default" first.
    """
    out = {"matmul": ("default",), "conv": ("default",)}
    if analysis is None or not analysis.total_flops:
        return out
    share = {k: sum(h.flops for h in analysis.heavy_ops if h.kind == k) / analysis.total_flops
             for k in ("linear", "conv")}
    if share["linear"] > 0 and share["linear"] >= min_fraction:
        out["matmul"] = available_matmul()
    if share["conv"] > 0 and share["conv"] >= min_fraction:
        out["conv"] = ("default", "channels-last")
    return out


def convert(model: nn.Module, *, matmul: str = "default", conv: str = "default") -> nn.Module:
    """A copy of ``model`` whose ``nn.Linear`` / ``nn.Conv2d`` layers use the given backends.

    The copy shares the parameters and buffers with ``model`` except convolution weights under
    ``"channels-last"`` (their layout changes); packed weights are made on the first call.
    With both backends "default" the model itself is returned. A ``torch.fx.GraphModule`` works
    too (trace first, then convert: the converted layers are subclasses of ``nn.Linear`` /
    ``nn.Conv2d`` from this module, which torch.fx would trace into).

    Raises:
        ConfigurationError: unknown backend, or one this torch build lacks.
    """
    _check(matmul, conv)
    if matmul == "default" and conv == "default":
        return model
    memo = {}
    for m in model.modules():
        for t in [*m._parameters.values(), *m._buffers.values()]:
            if t is not None and not (conv == "channels-last" and isinstance(m, nn.Conv2d) and t is m.weight):
                memo[id(t)] = t
    new = copy.deepcopy(model, memo)
    for m in new.modules():
        m.__dict__.pop("_batchcraft_packs", None)
        if type(m) is nn.Linear and matmul != "default":
            m.__class__ = BackendLinear  # same state, another forward (fx still sees an nn.Linear)
            m.__dict__["_batchcraft_matmul"] = matmul
        elif type(m) is nn.Conv2d and conv != "default":
            m.__class__ = BackendConv2d
            m.__dict__["_batchcraft_conv"] = conv
    return new


def install(*, matmul: str = "default", conv: str = "default") -> None:
    """Make every ``nn.Linear`` / ``nn.Conv2d`` of this process use the given backends.

    For programs (``batchcraft launch`` calls it before the program starts); models built before
    or after are covered alike, since the classes' ``forward`` is replaced. "default" for both
    restores PyTorch's own forward.

    Raises:
        ConfigurationError: unknown backend, or one this torch build lacks.
    """
    _check(matmul, conv)
    _PROCESS.update(matmul=matmul, conv=conv)
    nn.Linear.forward = _ORIGINAL["linear"] if matmul == "default" else linear_forward
    nn.Conv2d.forward = _ORIGINAL["conv"] if conv == "default" else conv_forward


def uninstall() -> None:
    """Undo :func:`install`."""
    install()
