"""cuDNN execution plans as micro-batching algorithms on CUDA (optional ``nvidia-cudnn-frontend``).

On a GPU the algorithms are cuDNN's execution plans. For one (geometry, pass, micro-batch) we
build a cuDNN frontend graph (``conv_fprop``, ``conv_dgrad`` or ``conv_wgrad``), let the
heuristics rank its execution plans, build all of them, and read each plan's workspace
(``get_workspace_size_plan_at_index``); a plan is run with ``execute_plan_at_index`` on torch
tensors. :func:`measure_configs` times every plan with CUDA events and returns
:class:`~batchcraft.microbatching.types.Config` rows (algorithm ``"cudnn:<index>"``), the
same tables the CPU planner feeds to the WR / WD optimisers.

Nothing here is imported unless CUDA is used; without a GPU or without the package,
:func:`available` says why and callers skip. Checked on an H200 (frontend 1.32.0, cuDNN 9.19,
torch 2.11): every plan of every pass matches PyTorch (``tests/microbatching/test_cuda.py``);
``benchmarks/gpu_microbatch.py`` times the divisions (docs/benchmarks.md, GPU section).

Source: μ-cuDNN (arXiv 1804.04806) §II-III; NVIDIA cuDNN frontend documentation (graph API).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchcraft.microbatching.algorithms import ConvGeometry
from batchcraft.microbatching.types import Config

__all__ = ["available", "CudnnConvGraph", "measure_configs"]


def available() -> tuple[bool, str]:
    """(True, "") if CUDA and the cuDNN frontend can be used, else (False, why)."""
    if not torch.cuda.is_available():
        return False, "no CUDA device (torch.cuda.is_available() is False)"
    try:
        import cudnn  # noqa: F401  (package nvidia-cudnn-frontend)
    except ImportError as exc:
        return False, f"nvidia-cudnn-frontend is not installed ({exc}); pip install 'batchcraft[cuda]'"
    return True, ""


def _contiguous_stride(shape) -> list[int]:
    stride, acc = [], 1
    for d in reversed(list(shape)):
        stride.append(acc)
        acc *= int(d)
    return stride[::-1]


def _dtype(cudnn, dtype: torch.dtype):
    return {torch.float32: cudnn.data_type.FLOAT, torch.float16: cudnn.data_type.HALF,
            torch.bfloat16: cudnn.data_type.BFLOAT16}[dtype]


@dataclass
class CudnnConvGraph:
    """One built cuDNN graph for (geometry, pass, micro-batch n) with all its execution plans.

    Tensors are NCHW-contiguous torch CUDA tensors: forward (x, w) -> y,
    backward_data (dy, w) -> dx, backward_filter (x, dy) -> dw.
    """

    geom: ConvGeometry
    pass_: str
    n: int
    dtype: torch.dtype = torch.float32

    def __post_init__(self):
        import cudnn

        g, n = self.geom, self.n
        conv = dict(padding=list(g.padding), stride=list(g.stride), dilation=list(g.dilation))
        self.handle = cudnn.create_handle()
        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        dt = _dtype(cudnn, self.dtype)
        graph = cudnn.pygraph(io_data_type=dt, intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT, handle=self.handle)
        shapes = {"x": g.input_shape(n), "w": g.weight_shape(), "y": g.output_shape(n)}
        self._shapes = shapes

        def tensor(name):
            shape = list(shapes[name])
            return graph.tensor(name=name, dim=shape, stride=_contiguous_stride(shape), data_type=dt)

        if self.pass_ == "forward":
            self.inputs = {"x": tensor("x"), "w": tensor("w")}
            out = graph.conv_fprop(image=self.inputs["x"], weight=self.inputs["w"], **conv)
            self.out_name = "y"
        elif self.pass_ == "backward_data":
            self.inputs = {"y": tensor("y"), "w": tensor("w")}
            out = graph.conv_dgrad(loss=self.inputs["y"], filter=self.inputs["w"], **conv)
            self.out_name = "x"
        else:
            self.inputs = {"x": tensor("x"), "y": tensor("y")}
            out = graph.conv_wgrad(image=self.inputs["x"], loss=self.inputs["y"], **conv)
            self.out_name = "w"
        shape = list(shapes[self.out_name])
        out.set_output(True).set_data_type(dt).set_dim(shape).set_stride(_contiguous_stride(shape))
        self.output = out
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        if self.dtype == torch.float32 and not torch.backends.cudnn.allow_tf32:
            # PyTorch's float32 convolutions then stay off TF32 tensor cores: so do the plans (an H200
            # run had wgrad plans 3.7% off float32 on a few elements)
            notes = cudnn.numerical_note
            graph.deselect_numeric_notes([notes.TENSOR_CORE, notes.DOWN_CONVERT_INPUTS,
                                          notes.REDUCED_PRECISION_REDUCTION])
        graph.check_support()
        graph.build_plans(cudnn.build_plan_policy.ALL)
        self.graph = graph

    def plans(self) -> list[tuple[int, int]]:
        """[(plan index, workspace bytes)] of the plans that built."""
        out = []
        barred = getattr(self.graph, "_barred_indices", None)  # plans a note filter excluded (frontend 1.3x)
        barred = set(barred()) if callable(barred) else set()
        for i in range(self.graph.get_execution_plan_count()):
            if i in barred:
                continue
            try:
                out.append((i, int(self.graph.get_workspace_size_plan_at_index(i))))
            except Exception:  # a plan that declined to build has no workspace; skip it
                continue
        return out

    def run(self, index: int, tensors: dict[str, torch.Tensor], workspace: torch.Tensor) -> torch.Tensor:
        """Execute plan ``index``; ``tensors`` maps "x"/"w"/"y" to inputs and the output buffer."""
        pack = {t: tensors[k] for k, t in self.inputs.items()}
        pack[self.output] = tensors[self.out_name]
        self.graph.execute_plan_at_index(pack, workspace, index, handle=self.handle)
        return tensors[self.out_name]


def measure_configs(geom: ConvGeometry, pass_: str, n: int, *, dtype: torch.dtype = torch.float32,
                    limit_bytes: int | None = None, repeats: int = 5) -> tuple[list[Config], CudnnConvGraph]:
    """Time every cuDNN plan of (geom, pass, n) that fits ``limit_bytes``; Config per plan.

    Workspace is cuDNN's stated workspace for the plan (the buffer we allocate and pass), which
    on a GPU *is* the extra memory of the call. Time: median of ``repeats`` CUDA-event timings.
    """
    cg = CudnnConvGraph(geom, pass_, n, dtype)
    dev = torch.device("cuda")
    t = {k: torch.randn(s, device=dev, dtype=dtype) for k, s in cg._shapes.items()}
    configs = []
    for index, ws in cg.plans():
        if limit_bytes is not None and ws > limit_bytes:
            continue
        workspace = torch.empty(max(ws, 1), device=dev, dtype=torch.uint8)
        try:
            cg.run(index, t, workspace)  # warm-up; a plan may still fail at run time
        except Exception:
            continue
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            cg.run(index, t, workspace)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        configs.append(Config(f"cudnn:{index}", n, sorted(times)[len(times) // 2], ws))
    return configs, cg
