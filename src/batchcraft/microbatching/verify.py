"""End-to-end verification of a plan: time the whole model with each admissible variant, keep the fastest.

The optimisers add per-layer times measured in isolation; a whole model does not always run at
that sum (caches warmed by the previous layer or not, allocator reuse, a noisy sample that made
one division look faster than it is). So after planning, :func:`verify_plan` runs the *whole*
model with

* ``planned``: the optimiser's choice (after the per-layer confirmation race, WR),
* ``undivided``: the best plan without division under the same budget and policy, and
* ``default``: PyTorch's own algorithm everywhere, only when its measured workspace fits the
  budget (WR: every layer-pass; WD: their sum),

in interleaved rounds (one call of each per round, the starting variant rotating), and keeps
the fastest by median, where a more elaborate variant (order ``default``, ``undivided``,
``planned``) replaces a simpler one only if it is faster by more than the measurement can
resolve: by more than ``tolerance`` (1%) and more than twice the standard error of the
difference of the two medians (each estimated from its rounds' IQR: SE = 1.253 * IQR / 1.349 /
sqrt(rounds)). On 2 shared cores, whole-model medians of 7 rounds of ResNet-18 training move by
3-5% between two measurements of the same model; a plan chosen on a 3% lead was then measured
2.7% *slower* than the default in the benchmark's own rounds. The simpler variant is the one
whose speed does not rest on our measurements (the default is PyTorch's own call). Every
variant timed is within the budget, so the kept one is too. The rule is conservative: under
heavy outside load the margin grows with the spread and the simplest admissible variant is
kept even when the plan is much faster (seen once at load ~3: AlexNet forward at 8 MiB kept
the undivided plan at 220 ms over the plan's 145 ms, IQR 286 ms); plan on quiet cores.

The model runs as the caller will run it: an inference plan as a forward pass under ``no_grad``
in eval mode; a training plan in the model's own train/eval modes as ``model(x)`` then
``backward()`` of the sum of its floating outputs, gradients written into ``.grad`` (as an
optimiser step would see them). An eval-mode stand-in through ``torch.autograd.grad`` was tried
first; on ResNet-18 it put the plan 5-9% ahead of the undivided plan where train-mode steps had
them level, so the real step is timed. Nothing leaks out: every buffer (BatchNorm running statistics, counters) is copied
before and written back after, ``.grad`` fields are restored, the CPU random state (dropout)
is forked and restored, and the modules' train/eval flags end as they began.

Source: μ-cuDNN (Oyama et al., arXiv 1804.04806) §IV compares against the undivided and the
framework's default choice; this makes that comparison part of planning.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
from torch import nn

from batchcraft.errors import ConfigurationError
from batchcraft.measure.race import Race

__all__ = ["VARIANTS", "Verification", "verify_plan", "wall_clock_ms", "disagreement", "DISAGREEMENT_TOLERANCE"]

VARIANTS = ("default", "undivided", "planned")  # simplest first: the order ties are broken in
TOLERANCE = 0.01  # relative: the least lead over a simpler variant that counts (see _choose)
# relative to the slower whole-model time: how far measured and predicted differences between two
# variants may differ before the cached per-layer times are called into question (see disagreement).
# Not smaller: predictions are sums of per-pass minima, whole-model times are medians, and the
# default runs both backward passes as one fused call (cheaper than its two separate measurements);
# at 10% small test models (a few ms) were flagged for a 0.4-0.7 ms miss.
DISAGREEMENT_TOLERANCE = 0.25


@dataclass
class Verification:
    """Whole-model times of the variants raced after planning, and which one was kept.

    Attributes:
        kept (str): ``"planned"``, ``"undivided"`` or ``"default"``.
        times_ms (dict[str, float]): median whole-model time per variant timed, ms.
        iqr_ms (dict[str, float]): interquartile range per variant, ms.
        repeats (int): timed rounds.
        mode (str): ``"inference"`` (forward) or ``"training"`` (forward + backward).
        identical (dict[str, str]): variant -> the variant it equals step for step (timed once).
        excluded (dict[str, str]): variant -> why it was not timed (e.g. the default exceeds the budget).
        tolerance (float): smallest relative lead that lets a more elaborate variant replace a simpler one.
        margins (dict[str, float]): variant -> relative lead it needed over the variant kept before it
            (max of ``tolerance`` and two standard errors of the difference), for the record.
        samples_ms (dict[str, list[float]]): every timed round per variant, ms, in round order.
    """

    kept: str
    times_ms: dict[str, float]
    iqr_ms: dict[str, float]
    repeats: int
    mode: str
    identical: dict[str, str] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)
    tolerance: float = TOLERANCE
    margins: dict[str, float] = field(default_factory=dict)
    samples_ms: dict[str, list[float]] = field(default_factory=dict)

    def speedup(self, baseline: str) -> float | None:
        """Measured time of ``baseline`` / time of the kept variant (None if not timed)."""
        t = self.times_ms.get(baseline)
        return None if t is None else t / self.times_ms[self.kept]

    @classmethod
    def from_dict(cls, d: Mapping) -> "Verification":
        return cls(str(d["kept"]), dict(d["times_ms"]), dict(d["iqr_ms"]), int(d["repeats"]), str(d["mode"]),
                   dict(d.get("identical", {})), dict(d.get("excluded", {})), float(d.get("tolerance", TOLERANCE)),
                   dict(d.get("margins", {})), {k: list(v) for k, v in d.get("samples_ms", {}).items()})

    def to_dict(self) -> dict:
        return {"kept": self.kept, "times_ms": dict(self.times_ms), "iqr_ms": dict(self.iqr_ms),
                "repeats": self.repeats, "mode": self.mode, "identical": dict(self.identical),
                "excluded": dict(self.excluded), "tolerance": self.tolerance, "margins": dict(self.margins),
                "samples_ms": {k: list(v) for k, v in self.samples_ms.items()},
                "speedup_vs_default": self.speedup("default"), "speedup_vs_undivided": self.speedup("undivided")}


def wall_clock_ms(variant: str, fn: Callable[[], object]) -> float:
    """Default timer: wall-clock of one call of ``fn``, ms (``variant`` is for custom timers)."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _floating_sum(out) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out.sum() if out.is_floating_point() and out.requires_grad else None
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    parts = [s for s in (_floating_sum(v) for v in items) if s is not None]
    return sum(parts) if parts else None


def _runner(model: nn.Module, x: torch.Tensor, training: bool) -> Callable[[], None]:
    if not training:
        def forward():
            with torch.no_grad():
                model(x)
        return forward
    params = [p for p in model.parameters() if p.requires_grad]
    # a leaf of our own: dX is computed exactly when the caller's input asks for it (then the
    # first layer's backward-data runs, as in the caller's step), never into the caller's .grad
    x = x.detach().requires_grad_(x.requires_grad or not params)
    if x.requires_grad:
        params.append(x)

    def forward_backward():
        for p in params:
            p.grad = None
        with torch.enable_grad():
            loss = _floating_sum(model(x))
            if loss is not None:
                loss.backward()
    return forward_backward


def _iqr(ts: list[float]) -> float:
    if len(ts) < 4:
        return max(ts) - min(ts)
    q = statistics.quantiles(ts, n=4)
    return q[2] - q[0]


def _relative_se(median: float, iqr: float, n: int) -> float:
    """Standard error of a median relative to it, from the IQR (normal approximation)."""
    if median <= 0 or n < 1:
        return 0.0
    return 1.2533 * (iqr / 1.349) / n ** 0.5 / median


def _choose(timed: list[str], med: dict, iqr: dict, n: int, tolerance: float) -> tuple[str, dict]:
    """Simplest first; a later variant takes over only with a lead the measurement resolves."""
    kept, margins = timed[0], {}
    for v in timed[1:]:
        se = (_relative_se(med[kept], iqr[kept], n) ** 2 + _relative_se(med[v], iqr[v], n) ** 2) ** 0.5
        margins[v] = max(tolerance, 2.0 * se)
        if med[v] < med[kept] * (1.0 - margins[v]):
            kept = v
    return kept, margins


def verify_plan(model: nn.Module, example_input: torch.Tensor, install: Callable[[str], None],
                variants: Mapping[str, object], *, training: bool, repeats: int = 5,
                tolerance: float = TOLERANCE, timer: Callable[[str, Callable[[], object]], float] = wall_clock_ms,
                excluded: Mapping[str, str] | None = None, progress: bool = False) -> Verification:
    """Race ``variants`` on the whole model; install the kept one and return it.

    Args:
        model (nn.Module): the model whose ``Conv2d`` are already :class:`PlannedConv2d`.
        example_input (Tensor of shape (N, C, H, W)): the batch the plan was made for.
        install (callable(variant name)): makes the planned layers run that variant's steps.
        variants (dict[str, object]): variant name (of :data:`VARIANTS`) -> its steps (any value
            comparable with ``==``: equal values are timed once). Every variant must be within
            the budget: the caller only passes admissible ones.
        training (bool): forward + backward (model in its own modes) if True, else an eval-mode
            forward under ``no_grad``.
        repeats (int): interleaved timed rounds (>= 1) after one untimed call per variant. Default: 5.
        tolerance (float): smallest relative lead for a more elaborate variant to be kept. Default: 0.01.
        timer (callable(variant, fn) -> ms): measures one call. Default: wall clock.
        excluded (dict[str, str]): variants not raced and why (recorded only).
    Returns:
        Verification: kept variant and median whole-model times (ms).
    """
    if not variants:
        raise ConfigurationError("verify_plan: no variant to time", hint="pass at least the plan itself")
    # identical variants are timed once
    distinct: dict[str, str] = {}
    identical: dict[str, str] = {}
    order = [v for v in VARIANTS if v in variants] + [v for v in variants if v not in VARIANTS]
    for v in order:
        twin = next((d for d in distinct if variants[d] == variants[v]), None)
        if twin is None:
            distinct[v] = v
        else:
            identical[v] = twin
    timed = list(distinct)

    modes = {m: m.training for m in model.modules()}
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    grads = [(p, p.grad) for p in model.parameters()]
    run = _runner(model, example_input, training)
    def timed_call(v):
        def go():
            install(v)
            return float(timer(v, run))
        return go

    # interleaved rounds with a rotating start (the shared race of batchcraft.measure.race)
    race = Race([timed_call(v) for v in timed], labels=timed, higher_is_better=False)
    try:
        with torch.random.fork_rng(devices=[]):  # dropout's draws do not move the caller's random state
            if not training:
                model.eval()
            for v in timed:  # warm-up: primitive caches, NNPACK threads, allocator
                install(v)
                run()
            rounds = max(1, int(repeats))
            for r in range(rounds):
                if progress:
                    print(f"\rmicrobatch: verifying end to end, round {r + 1}/{rounds}", end="", file=sys.stderr)
                race.run_round()
            if progress:
                print("\r" + " " * 60 + "\r", end="", file=sys.stderr)
    finally:  # buffers (BatchNorm statistics), .grad and train/eval flags as the caller left them
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for p, g in grads:
            p.grad = g
        for m, flag in modes.items():
            m.training = flag
    times = {v: race.values(i) for i, v in enumerate(timed)}
    med = {v: statistics.median(ts) for v, ts in times.items()}
    iqr = {v: _iqr(ts) for v, ts in times.items()}
    kept, margins = _choose(timed, med, iqr, max(1, int(repeats)), tolerance)
    for v, twin in identical.items():  # a twin was timed under its simpler name
        med[v], iqr[v] = med[twin], iqr[twin]
    install(kept)
    return Verification(kept, med, iqr, max(1, int(repeats)), "training" if training else "inference",
                        identical, dict(excluded or {}), tolerance, margins, times)


def disagreement(v: Verification, predicted_ms: Mapping[str, float],
                 tolerance: float = DISAGREEMENT_TOLERANCE) -> str | None:
    """Why the whole-model times contradict the per-layer predictions, or None if they agree within noise.

    The whole model also runs layers that are not planned, so a variant's measured time is its
    predicted convolution time plus a part common to every variant. Two variants' measured
    difference must therefore match their predicted difference; it may miss by two standard
    errors of the measured difference (from the rounds' IQRs) or by ``tolerance`` of the slower
    whole-model time, whichever is larger. A larger miss means some cached per-layer time is
    not what the layer costs now (e.g. measured while the machine was busy).

    Args:
        v (Verification): the whole-model race.
        predicted_ms (dict[str, float]): variant -> sum of its predicted per-layer-pass times, ms.
    """
    names = [k for k in VARIANTS if k in v.times_ms and k not in v.identical and k in predicted_ms]
    worst = None
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            measured = v.times_ms[a] - v.times_ms[b]
            predicted = predicted_ms[a] - predicted_ms[b]
            se = [1.2533 * (v.iqr_ms[k] / 1.349) / max(1, v.repeats) ** 0.5 for k in (a, b)]
            allowed = max(2.0 * (se[0] ** 2 + se[1] ** 2) ** 0.5, tolerance * max(v.times_ms[a], v.times_ms[b]))
            miss = abs(measured - predicted)
            if miss > allowed and (worst is None or miss - allowed > worst[0]):
                worst = (miss - allowed, a, b, measured, predicted, allowed)
    if worst is None:
        return None
    _, a, b, measured, predicted, allowed = worst
    return (f"the whole-model check disagrees with the cached per-layer times: {a} minus {b} was predicted "
            f"{predicted:+.1f} ms, measured {measured:+.1f} ms (allowed ±{allowed:.1f} ms)")
