"""The plan's vocabulary: a measured configuration, a step, a layer-pass's division, keys of what is planned.

* :class:`Config`: one measured way to run one micro-batch (algorithm, size, time, workspace).
* ``Step`` = ``(algorithm, micro_batch)``: what a planned layer runs for one slice of the batch.
* :class:`PassChoice`: a division of one layer-pass, i.e. the configurations run in order; its
  time is the sum, its workspace the max (one buffer reused by every micro-batch).
* :class:`InputKey`: what a plan is made for: the input's shape, dtype and device. A planned
  layer looks its steps up by the :class:`InputKey` of *its own* input.

Every other module (optimisers, policies, the plan, execution) speaks in these types.

Source: μ-cuDNN (Oyama et al., arXiv 1804.04806) §III (configurations and divisions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

__all__ = ["Config", "Step", "Steps", "PassChoice", "InputKey", "dtype_name", "parse_dtype"]

Step = tuple[str, int]  # (algorithm name, micro-batch size)
Steps = Mapping[str, Sequence[Step]]  # pass -> steps


@dataclass(frozen=True)
class Config:
    """One measured way to run one micro-batch.

    Attributes:
        algorithm (str): registry name (:data:`~batchcraft.microbatching.algorithms.ALGORITHMS`).
        micro_batch (int): samples in the call.
        time_ms (float): measured time of one call, ms (``inf``: not timed, over the budget).
        workspace_bytes (int): measured peak extra bytes of one call.
        spread (float): relative spread of the timed calls behind ``time_ms``
            ((median - min) / min); large values mean the machine was busy while measuring.
    """

    algorithm: str
    micro_batch: int
    time_ms: float
    workspace_bytes: int
    spread: float = 0.0

    @property
    def step(self) -> Step:
        return (self.algorithm, self.micro_batch)


@dataclass(frozen=True)
class PassChoice:
    """A division of one layer-pass: steps run in order; time adds, workspace is the max."""

    steps: tuple[Config, ...]

    @property
    def time_ms(self) -> float:
        return sum(c.time_ms for c in self.steps)

    @property
    def workspace_bytes(self) -> int:
        return max((c.workspace_bytes for c in self.steps), default=0)

    @property
    def micro_batches(self) -> tuple[int, ...]:
        return tuple(c.micro_batch for c in self.steps)

    def step_list(self) -> list[Step]:
        return [c.step for c in self.steps]

    def describe(self) -> str:
        """Compact division, e.g. ``"fft 32x2"`` or ``"default 64 + im2col 16"`` (algorithm size x count)."""
        groups: list[list] = []
        for c in self.steps:
            if groups and groups[-1][0] == c.algorithm and groups[-1][1] == c.micro_batch:
                groups[-1][2] += 1
            else:
                groups.append([c.algorithm, c.micro_batch, 1])
        return " + ".join(f"{a} {n}" + (f"x{k}" if k > 1 else "") for a, n, k in groups)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the spelling used in cache keys and plan files)."""
    return str(dtype).replace("torch.", "")


def parse_dtype(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; ValueError for anything that is not a floating torch dtype."""
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"not a floating torch dtype: {name!r}")
    return dtype


@dataclass(frozen=True)
class InputKey:
    """Shape (N, C, H, W), dtype and device of a tensor a plan is made for (hashable, JSON-friendly).

    ``device`` is ``str(tensor.device)`` (``"cpu"``, ``"cuda:0"``).
    """

    shape: tuple[int, ...]
    dtype: str
    device: str

    @classmethod
    def of(cls, x: torch.Tensor) -> "InputKey":
        return cls(tuple(int(s) for s in x.shape), dtype_name(x.dtype), str(x.device))

    @property
    def batch_size(self) -> int:
        return self.shape[0]

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    def describe(self) -> str:
        return f"({', '.join(map(str, self.shape))}) {self.dtype} on {self.device}"

    def to_dict(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype, "device": self.device}

    @classmethod
    def from_dict(cls, d: Mapping) -> "InputKey":
        return cls(tuple(int(s) for s in d["shape"]), str(d["dtype"]), str(d["device"]))
