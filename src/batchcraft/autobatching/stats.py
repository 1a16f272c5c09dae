"""Statistics of the last ``autobatch`` call."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RunStats:
    """What one call of an auto-batched function did.

    Attributes:
        instances (int): instances run.
        core (str): the recording core that ran (``"c"`` or ``"python"``).
        fibers (bool): the instances ran as fibers (False: one after another; ``fibers="auto"``
            does so once a call of the function finished without a value wait).
        ops_recorded (int): per-instance operations recorded (static-block calls count once).
        batched_calls (int): batched executions of a (depth, signature) group; one per group.
        fallbacks (int): node-steps run one instance at a time because no batching rule applied.
        fallback_reasons (dict[str, int]): why, per operation, and how many node-steps; also notes
            that are not counted in ``fallbacks`` because the work still batches: a static block
            that runs unblocked, operation by operation (it writes shared state), and a program
            whose elementwise fusion is off.
        eager_ops (int): operations run on concrete values at record time (value-dependent shapes).
        eager_reasons (dict[str, int]): those operations by name.
        syncs (int): times pending work was executed because instance code needed a value.
        peak_pending (int): most nodes waiting at once (the recorded graph's size bound).
        groups_by_rule (dict[str, int]): batched calls per kind: ``block`` and ``ragged_block``
            (static blocks), the batching rule of a single operation (``rules.py``: ``weight`` for
            linear / embedding / layer norm, ``elementwise``, ``matmul``, ``gates`` (a recurrent
            cell's gates after its input projection), ``dim`` (softmax, argmax, index_select and
            other ops with a dimension argument), ``sum`` / ``max`` (reductions), ``seq`` (cat,
            stack), ``shape`` / ``squeeze`` / ``unsqueeze`` / ``getitem`` (views), ``unbind``...),
            ``hoisted`` (a signature's shared prefix run once for its groups, ``hoist.py``),
            ``fused_lstm`` etc. (a recurrent cell's chains as one layer call, ``chains.py``).
        groups_reordered (int): groups run in their largest input's source order (big rows:
            ``execute.ORDER_MIN_ROW_BYTES``).
        groups_consumer_ordered (int): groups whose rows were laid out in their readers' order
            (``order.consumer_order``), so that the readers took views instead of gathers.
        groups_deduplicated, rows_deduplicated (int): groups with integer inputs run once per
            distinct input (``dedup.py``), and the rows that were not computed.
        groups_looked_up (int): groups that only look rows up in embedding tables, placed at their
            ids' rows of the tables instead of run (``lookup.py``): no copy of the rows.
        fused_kernels, steps_fused (int): fused elementwise kernel calls (``fuse.py``) and the
            batched steps they ran instead of one torch call each; fused_declined: kernel calls
            that ran the steps' torch calls instead at run time (autograd needed, a forward-AD
            level, an operand on another device or layout). Steps of other dtypes, and programs
            traced under autocast, are never planned as kernels: not counted.
        rows_in_place (int): gathered inputs handed to fused kernels as rows of their buffers
            (``gather.Rows``), read through their row index instead of a gather's copy, or to
            batched matrix products as their rows' addresses (``gather.RowRefs``, ``rowmm.py``);
            where a kernel declined at run time (``fused_declined``), its unfused branch copied them.
        rows_dead (int): rows of a group's output that nothing read (no later operation, no live
            value: MV-RNN's ``P^T`` of a sentence's last composition), left uncomputed (NaN) by
            the products that make it (``execute.DEAD_ROWS``, ``lower._cut_output``).
        recurrences_unpacked (dict[str, int]): why the steps of a recurrent cell (``GRUCell``,
            ``LSTMCell``, ``RNNCell``, a static block around one) ran step by step rather than as
            one layer call (``chains.py``): a bare cell (wrap it in ``static_block``), value
            requests between the steps, an unpackable form; with the node-steps noted at each
            flush (a diagnostic count: flushes can split the steps differently between calls).
        recurrences_stepwise (int): fused recurrences (``fused_*`` groups) run in inference as one
            input product and per-step kernels instead of torch's layer call (``chains.stepwise``).
        groups_merged (int): groups that ran as part of another group of their signature because
            what they read became ready together once recurrences were fused (``chains.relevel``).
        shape_splits (dict[str, int]): operations whose nodes at one depth ran as several groups
            because the instances' inputs differ in shape (a whole sentence's embedding lookup,
            a stack of a per-instance number of tensors), with the most shapes met at one depth;
            only where there were at least ``schedule.SPLIT_MIN`` (depth scheduler).
        ragged_declined (dict[str, int]): static blocks whose list arguments could not run as
            ragged groups (their nodes then group by list length), with the operation or use that
            prevented it; noted when a block is traced for a new list pattern.
        record_s, schedule_s, gather_s, kernel_s (float): seconds spent recording instance code,
            ordering groups, gathering per-instance arguments, and in batched programs.
        kernels_measured (int): matrix-multiply shape classes whose kernel was measured during
            this call (``kernels="auto"``: once per machine, then cached; the time is in
            ``kernel_s``, so a first call on a new machine is slower).
        memory_retained (bool): the call ran with memory retention (``memory.py``: glibc, option
            ``retain_memory``).
        page_faults (int): minor page faults of the process during the call (fresh memory
            touched; each costs microseconds of kernel time).
    """

    instances: int = 0
    core: str = ""
    fibers: bool = True
    ops_recorded: int = 0
    batched_calls: int = 0
    fallbacks: int = 0
    fallback_reasons: dict = field(default_factory=dict)
    eager_ops: int = 0
    eager_reasons: dict = field(default_factory=dict)
    syncs: int = 0
    peak_pending: int = 0
    groups_by_rule: dict = field(default_factory=dict)
    groups_reordered: int = 0
    groups_consumer_ordered: int = 0
    groups_deduplicated: int = 0
    rows_deduplicated: int = 0
    groups_looked_up: int = 0
    recurrences_unpacked: dict = field(default_factory=dict)
    recurrences_stepwise: int = 0
    groups_merged: int = 0
    shape_splits: dict = field(default_factory=dict)
    fused_kernels: int = 0
    steps_fused: int = 0
    fused_declined: int = 0
    rows_in_place: int = 0
    rows_dead: int = 0
    ragged_declined: dict = field(default_factory=dict)
    record_s: float = 0.0
    schedule_s: float = 0.0
    gather_s: float = 0.0
    kernel_s: float = 0.0
    kernels_measured: int = 0
    memory_retained: bool = False
    page_faults: int = 0

    def note_fallback(self, reason: str, count: int = 1) -> None:
        self.fallback_reasons[reason] = self.fallback_reasons.get(reason, 0) + count

    def note_ragged_declined(self, reason: str) -> None:
        self.ragged_declined[reason] = self.ragged_declined.get(reason, 0) + 1

    def note_unpacked(self, reason: str, count: int) -> None:
        self.recurrences_unpacked[reason] = self.recurrences_unpacked.get(reason, 0) + count

    def note_shape_split(self, name: str, shapes: int) -> None:
        if shapes > self.shape_splits.get(name, 0):
            self.shape_splits[name] = shapes

    def note_eager(self, name: str) -> None:
        self.eager_reasons[name] = self.eager_reasons.get(name, 0) + 1

    @property
    def mean_batch(self) -> float:
        """Mean instances' operations per batched call (ops_recorded / batched_calls)."""
        return self.ops_recorded / self.batched_calls if self.batched_calls else 0.0

    @property
    def total_s(self) -> float:
        return self.record_s + self.schedule_s + self.gather_s + self.kernel_s

    def to_dict(self) -> dict:
        d = asdict(self)
        d["mean_batch"] = self.mean_batch
        return d

    def summary(self) -> str:
        text = (f"{self.instances} instances ({self.core or '?'} core{'' if self.fibers else ', in sequence'}): "
                f"{self.ops_recorded} ops recorded -> "
                f"{self.batched_calls} batched calls (mean {self.mean_batch:.1f} per call), {self.fallbacks} fallbacks, "
                f"{self.eager_ops} eager ops, {self.syncs} syncs; time: record {self.record_s * 1e3:.1f} ms, "
                f"schedule {self.schedule_s * 1e3:.1f} ms, gather {self.gather_s * 1e3:.1f} ms, "
                f"kernels {self.kernel_s * 1e3:.1f} ms")
        if self.kernels_measured:
            text += (f"; {self.kernels_measured} kernel shape classes measured in this call "
                     f"(once per machine, cached)")
        if self.page_faults >= 1000:  # fresh memory touched: each fault costs microseconds of kernel time
            text += (f"; {self.page_faults} page faults"
                     + ("" if self.memory_retained else " (memory retention off or unavailable: memory.py)"))
        if self.fused_kernels or self.fused_declined:
            text += (f"; {self.steps_fused} elementwise steps in {self.fused_kernels} fused kernels"
                     + (f" ({self.fused_declined} declined at run time: autograd on, forward AD, or an "
                        f"operand's device or layout)" if self.fused_declined else "")
                     + (f", {self.rows_in_place} gathered inputs passed as rows of their buffers" if self.rows_in_place else ""))
        if self.groups_deduplicated:
            text += (f"; {self.groups_deduplicated} groups run once per distinct input "
                     f"({self.rows_deduplicated} rows not computed)")
        if self.recurrences_stepwise or self.groups_merged:
            text += (f"; fused recurrences: {self.recurrences_stepwise} run step by step in C kernels, "
                     f"{self.groups_merged} groups of their readers merged")
        if self.groups_looked_up:
            text += f"; {self.groups_looked_up} embedding lookups read in place"
        if self.rows_dead:
            text += f"; {self.rows_dead} output rows nothing read left uncomputed"
        if self.groups_by_rule:
            text += "; groups: " + ", ".join(f"{k} {v}" for k, v in sorted(self.groups_by_rule.items()))
        if self.fallback_reasons:
            text += "; fallbacks: " + "; ".join(f"{k} (x{v})" for k, v in sorted(self.fallback_reasons.items()))
        if self.ragged_declined:
            text += "; list arguments grouped by length, not ragged: " + "; ".join(
                f"{k} (x{v})" for k, v in sorted(self.ragged_declined.items()))
        if self.shape_splits:
            text += ("; operations split into one group per input shape at one depth (instances' tensors "
                     "differ in size; per-element work, such as one lookup per token, or equal shapes "
                     "batch as one group): " + ", ".join(
                         f"{k} ({v} shapes)" for k, v in sorted(self.shape_splits.items())))
        if self.recurrences_unpacked:
            text += "; recurrences run step by step: " + "; ".join(
                f"{k} (x{v})" for k, v in sorted(self.recurrences_unpacked.items()))
        return text
