"""Inter-op executor: run independent branches of a traced model concurrently.

Eager PyTorch runs one operator after another; only TorchScript's ``torch.jit.fork`` has inter-op
parallelism. This executor traces the model with torch.fx, cuts the graph into *tasks* (maximal
chains of nodes where each node feeds only the next), and runs ready tasks on a pool of Python
threads. PyTorch operators release the GIL, so two convolutions of different branches really run
at the same time, each with its own OpenMP team of ``intra_op_threads`` threads (Wang et al., arXiv 1908.04705:
inter-op pools x intra-op threads per pool).

Scheduling: a thread that finishes a task decrements its dependents' counters; it runs the first
dependent that becomes ready itself (no hand-off for a chain) and queues the others.
"""

from __future__ import annotations

import operator
import queue
import threading

import torch
import torch.fx
from torch.fx.node import map_arg

from batchcraft.errors import ConfigurationError
from batchcraft.parallel.analysis import trace
from batchcraft.parallel.thread_state import ThreadState

__all__ = ["InterOpExecutor"]


class _Task:
    __slots__ = ("index", "nodes", "dependents", "n_deps")

    def __init__(self, index: int):
        self.index = index
        self.nodes: list[torch.fx.Node] = []
        self.dependents: list[_Task] = []
        self.n_deps = 0


_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
                      operator.ilshift, operator.irshift, operator.imatmul, operator.setitem}


def _mutated_input(gm: torch.fx.GraphModule, node: torch.fx.Node) -> torch.fx.Node | None:
    """The node whose value ``node`` modifies in place (first argument), or None."""
    first = node.args[0] if node.args else None
    if not isinstance(first, torch.fx.Node):
        return None
    if node.op == "call_module":
        return first if getattr(gm.get_submodule(node.target), "inplace", False) else None
    if node.op == "call_method":
        name = node.target
        return first if name.endswith("_") and not name.startswith("__") else None
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        if node.target in _INPLACE_OPERATORS or node.kwargs.get("inplace") is True:
            return first
        return first if name.endswith("_") and not name.startswith("_") else None
    return None


def _ordering_edges(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """Extra (before, after) edges so an in-place update keeps eager order with the other readers.

    Eager runs readers of a tensor before or after an in-place update of it in program order; a
    concurrent schedule must too. Only direct readers are ordered (not readers through views).
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    edges = []
    for node in gm.graph.nodes:
        target = _mutated_input(gm, node)
        if target is None:
            continue
        for user in target.users:
            if user is not node:
                edges.append((user, node) if order[user] < order[node] else (node, user))
    return edges


def _split_tasks(gm: torch.fx.GraphModule) -> tuple[list[_Task], _Task]:
    """Cut the graph into chains; return the tasks (topological order) and the output's task."""
    task_of: dict[torch.fx.Node, _Task] = {}
    tasks: list[_Task] = []
    out_task = None
    for node in gm.graph.nodes:
        inputs = node.all_input_nodes
        # A node joins its only producer's chain when it is that producer's only user.
        if (len(inputs) == 1 and len(inputs[0].users) == 1 and inputs[0].op != "placeholder"
                and task_of[inputs[0]].nodes[-1] is inputs[0]):
            task = task_of[inputs[0]]
        else:
            task = _Task(len(tasks))
            tasks.append(task)
        task.nodes.append(node)
        task_of[node] = task
        if node.op == "output":
            out_task = task
    extra: dict[_Task, set[_Task]] = {}
    for before, after in _ordering_edges(gm):
        extra.setdefault(task_of[after], set()).add(task_of[before])
    for task in tasks:
        deps = ({task_of[i] for n in task.nodes for i in n.all_input_nodes} | extra.get(task, set())) - {task}
        task.n_deps = len(deps)
        for d in sorted(deps, key=lambda t: t.index):
            d.dependents.append(task)
    # Every task must become ready (no cycle), or a call would wait forever.
    pending = {t.index: t.n_deps for t in tasks}
    ready = [t for t in tasks if t.n_deps == 0]
    seen = 0
    while ready:
        t = ready.pop()
        seen += 1
        for d in t.dependents:
            pending[d.index] -= 1
            if pending[d.index] == 0:
                ready.append(d)
    if seen != len(tasks):
        raise RuntimeError(f"InterOpExecutor: task graph has a cycle ({len(tasks) - seen} tasks never ready)")
    return tasks, out_task


class _Run:
    """State of one call: values, remaining dependency counts, completion."""

    def __init__(self, inputs, tasks, state: ThreadState):
        self.inputs = list(inputs)
        self.env: dict[torch.fx.Node, object] = {}
        self.remaining = {t.index: t.n_deps for t in tasks}
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.result = None
        self.state = state  # the caller's thread-local torch state, applied in every pool thread


class InterOpExecutor:
    """Callable that runs a model's independent branches on ``inter_op_threads`` Python threads.

    The result equals the eager model's (same operators, same order within each branch); autograd
    works through it, and the caller's thread-local state (grad and inference mode, autocast per
    device type, torch-function modes, context variables: :mod:`batchcraft.parallel.thread_state`)
    holds in the pool threads.
    Gains need branches whose operators are large enough to hide a thread hand-off (~10-30 us).
    An in-place update (``relu(inplace=True)``, ``x.add_()``, ``x += y``) is ordered against the
    other direct readers of its tensor as in eager; updates through views (aliases) are not
    tracked, so models that mutate a view of a tensor other branches read are not supported.

    Args:
        model (nn.Module or torch.fx.GraphModule): must be traceable by torch.fx.
        inter_op_threads (int): pool threads running tasks concurrently (>= 1).
        intra_op_threads (int, optional): OpenMP threads of each pool thread (>= 1). Default: None
            (the process's current ``torch.get_num_threads()``).
    Raises:
        ConfigurationError: a thread count below 1, or an untraceable model.
    Source:
        Wang et al., arXiv 1908.04705 (inter-op pools run independent operators).
    Example:
        >>> with InterOpExecutor(model, inter_op_threads=2, intra_op_threads=1) as run:
        ...     y = run(x)  # equal to model(x)
    """

    def __init__(self, model, inter_op_threads: int = 2, intra_op_threads: int | None = None):
        if not isinstance(inter_op_threads, int) or inter_op_threads < 1:
            raise ConfigurationError(
                f"InterOpExecutor: inter_op_threads must be an int >= 1, got {inter_op_threads!r}")
        if intra_op_threads is not None and (not isinstance(intra_op_threads, int) or intra_op_threads < 1):
            raise ConfigurationError(
                f"InterOpExecutor: intra_op_threads must be an int >= 1 or None, got {intra_op_threads!r}")
        self.gm = trace(model)
        self.inter_op_threads = inter_op_threads
        self.intra_op_threads = intra_op_threads
        self.tasks, self._out_task = _split_tasks(self.gm)
        self._roots = [t for t in self.tasks if t.n_deps == 0]
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._closed = False
        # torch.set_num_threads sets the calling thread's OpenMP team size but also a process-wide
        # default read by threads created later: start the pool, then restore the default.
        saved = torch.get_num_threads()
        started = threading.Barrier(inter_op_threads + 1)
        for i in range(inter_op_threads):
            t = threading.Thread(target=self._worker, args=(started,), name=f"batchcraft-interop-{i}",
                                 daemon=True)
            t.start()
            self._threads.append(t)
        started.wait()
        if torch.get_num_threads() != saved:
            torch.set_num_threads(saved)

    @property
    def n_tasks(self) -> int:
        """Number of tasks (chains of nodes) the graph was cut into."""
        return len(self.tasks)

    # -- pool -------------------------------------------------------------------------------
    def _worker(self, started: threading.Barrier):
        if self.intra_op_threads is not None:
            torch.set_num_threads(self.intra_op_threads)
        started.wait()
        while True:
            item = self._queue.get()
            if item is None:
                return
            run, task = item
            run.state.run(self._drive, run, task)

    def _drive(self, run: _Run, task: _Task):
        while task is not None:
            if run.error is not None:
                return
            try:
                for node in task.nodes:
                    run.env[node] = self._run_node(run, node)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                with run.lock:
                    if run.error is None:
                        exc.add_note(f"InterOpExecutor: while running node {node.name!r}: {node.format_node()}")
                        trace_text = node.meta.get("stack_trace")
                        if trace_text:
                            exc.add_note(f"original source:\n{trace_text}")
                        run.error = exc
                run.done.set()
                return
            if task is self._out_task:
                run.done.set()
                return
            ready = []
            with run.lock:
                for dep in task.dependents:
                    run.remaining[dep.index] -= 1
                    if run.remaining[dep.index] == 0:
                        ready.append(dep)
            for other in ready[1:]:
                self._queue.put((run, other))
            task = ready[0] if ready else None

    def _run_node(self, run: _Run, node: torch.fx.Node):
        env = run.env
        if node.op == "placeholder":
            if run.inputs:
                return run.inputs.pop(0)
            if node.args:  # default value of an optional forward argument
                return node.args[0]
            raise TypeError(f"InterOpExecutor: missing input for {node.target!r}")
        if node.op == "get_attr":
            obj = self.gm
            for part in node.target.split("."):
                obj = getattr(obj, part)
            return obj
        args = map_arg(node.args, env.__getitem__)
        kwargs = map_arg(node.kwargs, env.__getitem__)
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            self_obj, *rest = args
            return getattr(self_obj, node.target)(*rest, **kwargs)
        if node.op == "call_module":
            return self.gm.get_submodule(node.target)(*args, **kwargs)
        if node.op == "output":
            run.result = args[0]
            return args[0]
        raise RuntimeError(f"InterOpExecutor: unknown fx node kind {node.op!r}")

    # -- public -----------------------------------------------------------------------------
    def __call__(self, *inputs):
        """Run the model on ``inputs`` (positional, as for ``model(*inputs)``); return its output."""
        if self._closed:
            raise RuntimeError("InterOpExecutor: called after close()")
        n_placeholders = sum(1 for n in self.gm.graph.nodes if n.op == "placeholder")
        if len(inputs) > n_placeholders:
            raise TypeError(f"InterOpExecutor: model takes {n_placeholders} inputs, got {len(inputs)}")
        run = _Run(inputs, self.tasks, ThreadState.capture())
        # Placeholders are consumed in graph order, so keep their tasks in order on one thread.
        placeholder_roots = [t for t in self._roots if t.nodes[0].op == "placeholder"]
        for t in self._roots:
            if t.nodes[0].op != "placeholder":
                self._queue.put((run, t))
        for t in placeholder_roots:  # in the caller's thread, under its own state
            for node in t.nodes:  # placeholders are single-node tasks (never chained)
                run.env[node] = self._run_node(run, node)
            ready = []
            for dep in t.dependents:
                with run.lock:
                    run.remaining[dep.index] -= 1
                    if run.remaining[dep.index] == 0:
                        ready.append(dep)
            for dep in ready:
                self._queue.put((run, dep))
        run.done.wait()
        if run.error is not None:
            raise run.error
        return run.result

    def close(self):
        """Stop the pool threads (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass
