"""Kernel selection for the batched matrix multiplies of auto-batched programs.

On some CPUs PyTorch's default fp32 matrix multiply (MKL's GEMM) runs well below oneDNN, which
torch also ships: REFERENCES §7 measured 106-112 GFLOP/s for MKL against 200-243 for
``torch.ops.mkldnn._linear_pointwise`` on one core of this machine kind. Which one wins depends
on the shape and the machine, so for each batched ``F.linear`` the selector measures both kernels
once per (machine, torch version, intra-op threads, dtype, autograd, bias, K, N, row bucket), keeps
the faster (oneDNN only with a clear lead), and caches the choice in SQLite beside the
micro-batching measurements (:func:`batchcraft.measure.cache_dir`).

:func:`onednn_linear` is differentiable (a custom autograd Function: the forward and the input
gradient through oneDNN, the weight gradient as a plain matrix product), so training stays
correct through the chosen kernel; results agree with ``F.linear`` within float32 rounding.
Before oneDNN is used, its results are checked against ``F.linear`` (process-wide, then per shape
class, reliability #211); a check that passed is stored with the settings that decide it
(:func:`runtime_fingerprint`: the OpenMP runtime's own thread limit and count, not only the
environment), so a new process under the same settings does not run it again (about 5 ms of a
TreeLSTM's first call here); where a region would not get its full OpenMP team (dynamic
adjustment, whose outcome follows the machine's load), nothing is stored and oneDNN does not run
(:func:`openmp.team_ok`, asked at each product). Autocast regions, non-CPU tensors, forward-mode
AD (a ``dual_level``, ``torch.func.jvp``) and ``torch.func`` transforms always use ``F.linear``: oneDNN's op has no forward derivative, and
torch silently gives its outputs a zero tangent (reliability #206).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from pathlib import Path

import torch

from batchcraft.autobatching import openmp as _openmp
from batchcraft.autobatching.threadstate import tangents_possible
from batchcraft.measure.machine import cache_dir, cpu_model
from batchcraft.measure.poison import fresh_inputs, poisoned_call

_lp = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)

#: torch's linear (``F.linear`` unless someone replaced it; a replacement is a Python function that
#: torch hands to modes in its own place: recorded and batched programs use torch's)
TORCH_LINEAR = torch._C._nn.linear
_LINEAR = TORCH_LINEAR
LEAD = 1.10            # oneDNN must be this much faster to be chosen (noise margin)
# shape classes below this many FLOPs per call keep the default kernel unmeasured: their time is
# fixed per-call overhead (tens of µs), and measuring each costs a first call 16 timed calls
MIN_MEASURED_FLOP = 4e6
SCHEMA = "kernels_v2"  # v2: interleaved measurement (v1 choices could come from a busy machine)
CHECKS = "onednn_checks_v1"  # oneDNN agreement checks that passed, keyed by runtime_fingerprint()
#: environment variables whose prefix marks them as settings of the threading runtimes or math
#: libraries (#211's triggers are OMP_THREAD_LIMIT and OMP_DYNAMIC): a stored check holds only
#: under the same values
_RUNTIME_ENV = ("OMP_", "GOMP_", "KMP_", "MKL_", "DNNL_", "ONEDNN_", "LD_PRELOAD")


_T = torch.Tensor
_grad_on = torch.is_grad_enabled
_tf_on = torch._C._is_torch_function_mode_enabled
_any_autocast = torch._C._is_any_autocast_enabled
_threads = torch.get_num_threads


def _onednn_built() -> bool:
    """Does this torch build have oneDNN's linear (never stored: another build may share a cache)?"""
    return _lp is not None and torch.backends.mkldnn.is_available()


def onednn_available() -> bool:
    """Does oneDNN's linear run here and give ``F.linear``'s values, on a product big enough for
    oneDNN to split over threads? (Under ``OMP_THREAD_LIMIT=1`` or ``OMP_DYNAMIC=true`` torch's
    oneDNN linear leaves rows unwritten: NaN or values off by tens, reliability #211.)"""
    if not _onednn_built():
        return False
    try:
        with torch._C.DisableTorchFunction():  # the user's or the recording's modes must not see this
            return all(_right(*fresh_inputs((m, k), (n, k), (n,))) for m, k, n in ((2, 3, 4), (64, 256, 768)))
    except Exception:  # the op exists but has no kernel in this build
        return False


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return _lp(x, w, b, "none", [], "")

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = gw = gb = None
        g2 = g.reshape(-1, g.shape[-1])
        if ctx.needs_input_grad[0]:
            gx = _lp(g2, w.t().contiguous(), None, "none", [], "").reshape(*g.shape[:-1], w.shape[1])
        if ctx.needs_input_grad[1]:
            gw = g2.t().mm(x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)
        return gx, gw, gb


def onednn_linear(x, weight, bias=None):
    """``F.linear(x, weight, bias)`` through oneDNN (differentiable). ``x`` (..., K), ``weight`` (N, K)."""
    if x.dim() != 2:
        lead = x.shape[:-1]
        return onednn_linear(x.reshape(-1, x.shape[-1]), weight, bias).reshape(*lead, weight.shape[0])
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return _OneDNNLinear.apply(x, weight, bias)
    return _lp(x, weight, bias, "none", [], "")


def _agrees(k, w, b) -> bool:
    """Does oneDNN's linear give ``F.linear``'s values for the shape class ``k`` (:meth:`Selector.key`)
    at this thread count? Asked once per class and process before oneDNN is chosen: under
    ``OMP_THREAD_LIMIT`` below torch's thread count, or ``OMP_DYNAMIC=true``, torch's oneDNN linear
    leaves rows unwritten (NaN, values off by tens: reliability #211)."""
    (x,) = fresh_inputs((k[5], k[3]))
    try:
        return _right(x, w.detach(), None if b is None else b.detach())
    except RuntimeError:
        return False


def _right(x, w, b) -> bool:
    """oneDNN's ``x w^T + b`` equals ``F.linear``'s, checked as :mod:`batchcraft.measure.poison` says
    (fresh inputs from the caller, a poisoned output block, the reference after the call)."""
    with torch.no_grad():
        got = poisoned_call(torch.empty(x.shape[0], w.shape[0]), lambda: _lp(x, w, b, "none", [], ""))
        return bool(torch.allclose(got, _LINEAR(x, w, b), rtol=1e-4, atol=1e-4))


def runtime_fingerprint() -> str | None:
    """What a oneDNN agreement check's answer depends on besides the shape, as one string: the
    CPU, the CPUs this process may run on, torch's version and intra-op threads, the thread limit
    and thread count that torch's OpenMP runtime itself holds (:func:`openmp.runtime_state`: it
    read its variables when it loaded, whatever ``os.environ`` says now), and every
    threading-runtime or math-library variable of the environment (:data:`_RUNTIME_ENV`).

    None where a stored pass must not be trusted: the runtime's state cannot be read, or a region
    would not get its full team (:func:`openmp.full_team`; under dynamic adjustment the team
    follows the machine's load, so a check passed while idle says nothing about a busy moment)."""
    state = _openmp.runtime_state()
    if state is None or not _openmp.full_team(state):
        return None
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count()
    env = ",".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(_RUNTIME_ENV))
    return (f"{cpu_model()}|cpus={cpus}|{torch.__version__}|t={torch.get_num_threads()}|"
            f"omp_limit={state[1]}|omp_threads={state[2]}|{env}")


def _bucket(m: int) -> int:
    b = 1
    while b < m:
        b *= 2
    return b


class _Store:
    """SQLite table of kernel choices (WAL, busy timeout; a file SQLite cannot read is rebuilt)."""

    def __init__(self, path):
        self.path = path
        self.lock = threading.Lock()
        self.db = None
        if path is None:
            return
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(str(path), timeout=10, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self._tables()
        except sqlite3.DatabaseError:
            try:
                os.replace(path, f"{path}.corrupt-{int(time.time())}")
                self.db = sqlite3.connect(str(path), timeout=10, check_same_thread=False)
                self._tables()
            except (OSError, sqlite3.DatabaseError):
                self.db = None
        except OSError:
            self.db = None

    def _tables(self) -> None:
        self.db.execute(f"CREATE TABLE IF NOT EXISTS {SCHEMA} (key TEXT PRIMARY KEY, choice TEXT, "
                        "default_us REAL, onednn_us REAL)")
        self.db.execute(f"CREATE TABLE IF NOT EXISTS {CHECKS} (key TEXT PRIMARY KEY)")

    def passed(self, key) -> bool:
        """Was the oneDNN check ``key`` passed and stored before?"""
        if self.db is None:
            return False
        with self.lock:
            try:
                return self.db.execute(f"SELECT 1 FROM {CHECKS} WHERE key=?", (key,)).fetchone() is not None
            except sqlite3.DatabaseError:
                return False

    def put_passed(self, key) -> None:
        """Store that the oneDNN check ``key`` passed (a failed check is never stored: it runs again)."""
        if self.db is None:
            return
        with self.lock:
            try:
                self.db.execute(f"INSERT OR REPLACE INTO {CHECKS} VALUES (?)", (key,))
                self.db.commit()
            except sqlite3.DatabaseError:
                pass

    def get(self, key):
        if self.db is None:
            return None
        with self.lock:
            try:
                row = self.db.execute(f"SELECT choice, default_us, onednn_us FROM {SCHEMA} WHERE key=?", (key,)).fetchone()
            except sqlite3.DatabaseError:
                return None
        return row

    def put(self, key, choice, t_default, t_onednn) -> None:
        if self.db is None:
            return
        with self.lock:
            try:
                self.db.execute(f"INSERT OR REPLACE INTO {SCHEMA} VALUES (?, ?, ?, ?)", (key, choice, t_default, t_onednn))
                self.db.commit()
            except sqlite3.DatabaseError:
                pass


def default_cache_path():
    if os.environ.get("BATCHCRAFT_KERNEL_CACHE", "1") == "0":
        return None
    return str(cache_dir() / "kernels.sqlite")


def race_us(fns, rounds: int = 7) -> list:
    """Best time in microseconds of each of ``fns``, measured in interleaved rounds.

    Each function runs once first (oneDNN builds a primitive per shape on its first call), then
    the functions take turns, the order rotating each round, so that a stretch of load from
    another process slows every candidate alike; the minimum per function is kept.
    """
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    perf = time.perf_counter
    for r in range(rounds):
        for q in range(len(fns)):
            j = (q + r) % len(fns)
            t0 = perf()
            fns[j]()
            best[j] = min(best[j], perf() - t0)
    return [b * 1e6 for b in best]


class Selector:
    """Chooses the kernel of each batched linear (see the module docstring).

    Args:
        mode (str): ``"auto"`` (measured), ``"default"`` (always ``F.linear``), ``"onednn"``.
        store: where choices persist (None: memory only).
        timer: ``[fn, ...] -> [microseconds, ...]`` (default :func:`race_us`; tests pass fakes).
    """

    def __init__(self, mode: str = "auto", store=None, timer=race_us):
        self.mode = mode
        self.name = mode
        self.store = store
        self.timer = timer
        self.choices: dict = {}
        self._by_shape: dict = {}  # inference calls: exact shapes -> choice (linear())
        self.measured: dict = {}
        self.n_measured = 0  # shape classes timed by this selector (not read from the store)
        self._onednn = None  # onednn_available(), asked only when a choice needs it (the first
        # oneDNN call costs a first auto-batched call 3-6 ms; a stored "default" choice does not)
        self.machine = cpu_model()

    @property
    def onednn(self) -> bool:
        """Does this torch build run oneDNN's linear here (checked once, when first needed)?"""
        if self._onednn is None:
            self._onednn = _onednn_built() and self._check("available", onednn_available)
        return self._onednn

    def _check(self, what: str, fn) -> bool:
        """``fn()``, a oneDNN agreement check, unless the store holds a pass of ``what`` under
        this :func:`runtime_fingerprint`; a pass is stored (never without a fingerprint)."""
        fingerprint = runtime_fingerprint() if self.store is not None else None
        if fingerprint is None:
            return fn()
        key = f"{fingerprint}|{what}"
        if self.store.passed(key):
            return True
        ok = fn()
        if ok:
            self.store.put_passed(key)
        return ok

    def _agrees(self, k, w, b) -> bool:
        """:func:`_agrees` for shape class ``k`` through :meth:`_check`."""
        return self._check(f"class={k[0]}|grad={k[1]}|bias={k[2]}|K={k[3]}|N={k[4]}|M<={k[5]}|t={k[6]}",
                           lambda: _agrees(k, w, b))

    def key(self, x, w, b) -> tuple:
        m = x.numel() // x.shape[-1] if x.dim() else 1
        grad = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)
        return (x.dtype, grad, b is not None, x.shape[-1], w.shape[0], _bucket(m), torch.get_num_threads())

    def choose(self, x, w, b) -> str:
        with torch._C.DisableTorchFunction():  # the selector's own metadata reads are not the user's
            return self._choose(x, w, b)

    def _choose(self, x, w, b) -> str:
        if (self.mode == "default" or x.device.type != "cpu" or x.dtype != torch.float32
                or x.dim() == 0 or torch.is_autocast_enabled("cpu") or w.dim() != 2
                or tangents_possible()):  # (tangents: see the module docstring)
            return "default"
        k = self.key(x, w, b)
        if self.mode == "onednn":  # (checked per shape class and thread count, as a measured choice)
            c = self.choices.get(k)
            if c is None:
                c = self.choices[k] = "onednn" if self.onednn and self._agrees(k, w, b) else "default"
            return c
        c = self.choices.get(k)
        if c is None:
            small = 2.0 * k[5] * k[3] * k[4] < MIN_MEASURED_FLOP
            c = self.choices[k] = "default" if small else self._decide(k, x, w, b)
        return c

    def _decide(self, k, x, w, b) -> str:
        # (runs inside choose()'s DisableTorchFunction: measurement calls are not the user's)
        skey = f"{self.machine}|{torch.__version__}|{k[0]}|grad={k[1]}|bias={k[2]}|K={k[3]}|N={k[4]}|M<={k[5]}|t={k[6]}"
        row = self.store.get(skey) if self.store is not None else None
        if row is not None:
            self.measured[k] = (row[1], row[2])
            if row[0] != "onednn":
                return row[0]
            # (a stored choice is this machine's, not this process's: its thread limits may differ)
            return "onednn" if self.onednn and self._agrees(k, w, b) else "default"
        if not self.onednn or not self._agrees(k, w, b):
            return "default"  # nothing to measure against (not stored: another build may have it)
        m = k[5]
        xs = torch.full((m, k[3]), 0.5)  # not randn: measuring must not move the caller's random state
        ws = w.detach()
        bs = None if b is None else b.detach()
        grad = k[1]

        def run(fn):
            def go():
                if grad:
                    xg = xs.requires_grad_(True)
                    fn(xg, ws.requires_grad_(True), bs).sum().backward()
                    xs.grad = None
                    ws.grad = None
                else:
                    with torch.no_grad():
                        fn(xs, ws, bs)
            return go

        t_d, t_o = self.timer([run(_LINEAR), run(onednn_linear)])
        ws.requires_grad_(False)
        choice = "onednn" if t_o * LEAD < t_d else "default"
        self.measured[k] = (t_d, t_o)
        self.n_measured += 1
        if self.store is not None:
            self.store.put(skey, choice, t_d, t_o)
        return choice

    def linear(self, x, w, b=None):
        """``F.linear`` with the kernel chosen for this shape class."""
        if type(x) is _T and not (_grad_on() or _tf_on() or _any_autocast() or tangents_possible()):
            # inference, no mode of the user's, no autocast: the choice by exact shapes, one dict
            # read (what choose() would decide from the same shapes, dtype, device and threads)
            key = (x.shape, w.shape, b is None, x.dtype, x.is_cpu, _threads())
            c = self._by_shape.get(key)
            if c is None:
                if len(self._by_shape) >= 4096:
                    self._by_shape.clear()
                c = self._by_shape[key] = self.choose(x, w, b)
        else:
            c = self.choose(x, w, b)
        if c == "onednn" and _openmp.team_ok():
            return onednn_linear(x, w, b)
        return _LINEAR(x, w, b)

    def linear_for(self, lw, shapes):
        """The function a lowered program calls for a batched ``F.linear``."""
        if self.mode == "default" or self._onednn is False:
            return _LINEAR
        return self.linear


_SELECTORS: dict = {}
_STORE = None


def selector(mode: str) -> Selector:
    """The process-wide selector for ``mode`` (``"auto"``, ``"default"`` or ``"onednn"``)."""
    global _STORE
    s = _SELECTORS.get(mode)
    if s is None:
        if mode == "auto" and _STORE is None:
            _STORE = _Store(default_cache_path())
        s = _SELECTORS[mode] = Selector(mode, _STORE if mode == "auto" else None)
    return s


__all__ = ["Selector", "selector", "onednn_linear", "onednn_available", "runtime_fingerprint"]
