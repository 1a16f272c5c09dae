"""Find a model's convolutions and the input each one sees, from one batch-1 run of an example.

The model runs once on ``example_input[:1]`` in eval mode (BatchNorm neither uses nor updates
batch statistics), under a forked random state, with every buffer copied before and written
back after, so probing never changes the model's values, buffers or the caller's random stream.
Planned layers (:class:`~batchcraft.microbatching.layer.PlannedConv2d`) seen during a probe run
their original ``Conv2d`` directly (they are being planned, not used).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from batchcraft.microbatching.algorithms import ConvGeometry
from batchcraft.microbatching.types import InputKey, dtype_name

__all__ = ["ConvCall", "find_convolutions", "probing", "preserved_state"]

_ACTIVE = [False]


def probing() -> bool:
    """True while a probe runs (planned layers then run their original convolution)."""
    return _ACTIVE[0]


@dataclass(frozen=True)
class ConvCall:
    """One convolution and one input it is called with.

    Attributes:
        name (str): qualified module name ("" for a model that is itself one convolution).
        module (nn.Module): the ``Conv2d`` or ``PlannedConv2d`` at ``name``.
        key (InputKey): the input it sees for the full example batch (N of the example).
        geometry (ConvGeometry): per-sample geometry of that call.
        input_requires_grad (bool): whether its input requires grad (then backward_data runs).
    """

    name: str
    module: nn.Module
    key: InputKey
    geometry: ConvGeometry
    input_requires_grad: bool


def _conv_of(mod: nn.Module) -> nn.Conv2d | None:
    if isinstance(mod, nn.Conv2d):
        return mod
    original = getattr(mod, "original", None)  # PlannedConv2d keeps its Conv2d in a list
    if isinstance(original, list) and original and isinstance(original[0], nn.Conv2d):
        return original[0]
    return None


@contextlib.contextmanager
def preserved_state(model: nn.Module, devices=()):
    """Restore buffers, train/eval flags and the random state of ``model`` (and CPU/``devices``) on exit."""
    modes = {m: m.training for m in model.modules()}
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.random.fork_rng(devices=list(devices)):
            yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for m, flag in modes.items():
            m.training = flag


def find_convolutions(model: nn.Module, example_input: torch.Tensor) -> tuple[list[ConvCall], dict[str, str]]:
    """Every ``Conv2d`` (or planned one) called by ``model(example_input)``, once per distinct input shape.

    Returns:
        (list[ConvCall], dict[str, str]): calls in call order, and {layer name: why it is not planned}
        (not called, padding mode other than zeros).
    """
    seen: dict[str, list] = {}
    hooks = []
    convs = {name: (mod, _conv_of(mod)) for name, mod in model.named_modules() if _conv_of(mod) is not None}
    for name, (mod, _) in convs.items():
        def hook(m, args, _name=name):
            x = args[0]
            seen.setdefault(_name, []).append((tuple(x.shape[1:]), dtype_name(x.dtype), str(x.device),
                                               x.requires_grad))
        hooks.append(mod.register_forward_pre_hook(hook))
    devices = [example_input.device] if example_input.device.type == "cuda" else []
    _ACTIVE[0] = True
    try:
        with preserved_state(model, devices):
            model.eval()
            with torch.enable_grad():
                model(example_input[:1])
    finally:
        _ACTIVE[0] = False
        for h in hooks:
            h.remove()
    n = int(example_input.shape[0])
    found, skipped = [], {}
    for name, (mod, conv) in convs.items():
        calls = seen.get(name)
        if not calls:
            skipped[name] = "not called by the example input"
        elif isinstance(conv.padding, str) or conv.padding_mode != "zeros":
            skipped[name] = (f"padding={conv.padding!r}, padding_mode={conv.padding_mode!r} "
                             "(only zero padding is planned)")
        else:
            shapes = {}
            for shape, dtype, device, grad in calls:
                k = InputKey((n, *shape), dtype, device)
                shapes[k] = shapes.get(k, False) or grad
            for k, grad in shapes.items():
                found.append(ConvCall(name, mod, k, ConvGeometry.from_conv(conv, k.shape[2:]), grad))
    return found, skipped
