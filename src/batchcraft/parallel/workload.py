"""What a tuning trial runs: a model, its input batches and how to call it.

A model can come from three places, described by a :class:`ModelSpec` that worker processes can
rebuild it from:

* a **registry** name (:mod:`batchcraft.models`): ``"resnet18"``;
* a **factory** ``"package.module:attribute"`` in any importable file (the working directory and
  the caller's ``sys.path`` are importable in the workers): the attribute is an ``nn.Module``, or
  a callable (a class, a function) that returns a model, or ``(model, example_input)``;
* a Python **object** given to :func:`~batchcraft.parallel.tune`: an ``nn.Module`` or a factory
  callable, saved with ``torch.save`` (pickled by reference: its class must be importable; a class
  defined in the main script is found by re-running that script as ``__mp_main__`` in the worker,
  as ``multiprocessing`` does, so the script must keep its work under
  ``if __name__ == "__main__":``).

Inputs: an ``example_input`` (a tensor, or a tuple / list / dict of tensors) whose first
dimension is the batch: a batch of size b repeats its rows cyclically; else ``input_shape``
(without the batch dimension: random float32); else the model's own ``example_input(batch_size)``
method; else a shape from its first convolution or linear layer. The auto-batched TreeLSTM is
special: a batch is a list of real UD English EWT sentences, run through
:func:`batchcraft.autobatch`; it cannot be traced, so it gets no inter-op pools and no backends.
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
import types
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from batchcraft.errors import ConfigurationError

__all__ = ["Workload", "ModelSpec", "model_spec", "build_workload", "build_model", "make_input", "tile", "invoke"]

_TREE_SENTENCES = 256  # sentences loaded for TreeLSTM batches (reused cyclically)


@dataclass
class ModelSpec:
    """Where a model comes from (JSON-able, for worker processes).

    Attributes:
        kind (str): "registry", "factory" or "file".
        name (str): registry name, "module:attribute", or a label for an object.
        path (str, optional): kind "file": the ``torch.save``'d object (and example input).
        kwargs (dict): keyword arguments for the registry entry or the factory.
        input_shape (list[int], optional): per-item input shape (no batch dimension).
        image_size (int, optional): H = W for image models without an example input.
        main_path (str, optional): the caller's main script, re-run as ``__mp_main__`` before
            unpickling (classes defined there).
    """

    kind: str
    name: str
    path: str | None = None
    kwargs: dict = field(default_factory=dict)
    input_shape: list | None = None
    image_size: int | None = None
    main_path: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelSpec":
        return cls(**d)


@dataclass
class Workload:
    """A model and how to feed it.

    Attributes:
        name (str): registry name, factory path or label.
        model (nn.Module): in eval mode.
        make_batch (callable): ``make_batch(batch_size) -> input`` (a tensor, a tuple / dict of
            tensors, or a list of instances).
        call (callable): ``call(input)``; the model called on it, or the auto-batched TreeLSTM.
        traceable (bool): the model may run in the inter-op executor and under other backends
            (its input is tensors and torch.fx can trace it).
    """

    name: str
    model: nn.Module
    make_batch: Callable
    call: Callable
    traceable: bool = True


def invoke(fn: Callable, x) -> Any:
    """``fn(x)``, ``fn(*x)`` for a tuple / list of inputs, ``fn(**x)`` for a dict."""
    if isinstance(x, (tuple, list)):
        return fn(*x)
    if isinstance(x, dict):
        return fn(**x)
    return fn(x)


def tile(example, batch_size: int):
    """A batch of ``batch_size`` rows made from ``example``'s rows (first dimension), cyclically.

    Tuples, lists and dicts are tiled leaf by leaf; a 0-dimensional tensor or a non-tensor leaf
    is passed as is.

    Raises:
        ConfigurationError: batch_size < 1, or an example tensor with no rows.
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ConfigurationError(f"make_input: batch_size must be an int >= 1, got {batch_size!r}")
    if isinstance(example, torch.Tensor):
        if example.dim() == 0:
            return example
        if example.shape[0] == 0:
            raise ConfigurationError("example_input: a tensor with no rows (first dimension 0) cannot make batches")
        idx = torch.arange(batch_size) % example.shape[0]
        return example.index_select(0, idx).contiguous()
    if isinstance(example, tuple):
        return tuple(tile(e, batch_size) for e in example)
    if isinstance(example, list):
        return [tile(e, batch_size) for e in example]
    if isinstance(example, dict):
        return {k: tile(v, batch_size) for k, v in example.items()}
    return example


def build_model(name: str, **model_kwargs) -> nn.Module:
    """Build registry model ``name`` in eval mode.

    Raises:
        ConfigurationError: unknown name (the message lists the known ones).
    """
    from batchcraft import models

    try:
        model = models.get(name, **model_kwargs)
    except KeyError as exc:
        raise ConfigurationError(str(exc.args[0])) from None
    return model.eval()


def make_input(model: nn.Module, batch_size: int, *, image_size: int | None = None, seed: int = 0):
    """An input batch for ``model``: its ``example_input`` if any, else shaped from its first layer.

    Args:
        model (nn.Module): the model.
        batch_size (int): leading dimension (>= 1).
        image_size (int, optional): height = width for image models without ``example_input``.
            Default: None (224).
        seed (int): random seed. Default: 0.
    Returns:
        Tensor: (batch_size, ...) input.
    Raises:
        ConfigurationError: batch_size < 1, or no input shape can be derived.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigurationError(f"make_input: batch_size must be an int >= 1, got {batch_size!r}")
    if hasattr(model, "example_input"):
        return model.example_input(batch_size, seed=seed)
    g = torch.Generator().manual_seed(seed)
    for mod in model.modules():
        if isinstance(mod, nn.Conv2d):
            size = image_size or 224
            return torch.randn(batch_size, mod.in_channels, size, size, generator=g)
        if isinstance(mod, nn.Linear):
            return torch.randn(batch_size, mod.in_features, generator=g)
    raise ConfigurationError(
        f"make_input: cannot derive an input shape for {type(model).__name__}",
        hint="give an example input (tune(..., example_input=x) or a factory returning (model, x)), "
             "--input-shape, or an example_input(batch_size, seed=0) method")


# -- where models come from -------------------------------------------------------------------
def _main_path() -> str | None:
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return os.path.abspath(path) if path and os.path.isfile(path) else None


def model_spec(model, *, example_input=None, input_shape=None, model_kwargs: dict | None = None,
               image_size: int | None = None, tmpdir: str | None = None) -> ModelSpec:
    """The :class:`ModelSpec` for a registry name, a ``"module:attribute"`` path or an object.

    An object (and ``example_input``) is saved with ``torch.save`` into ``tmpdir`` (default: a new
    temporary directory the caller removes).

    Raises:
        ConfigurationError: the object cannot be pickled (a class defined inside a function, a
            lambda), or a bad input shape.
    """
    shape = None if input_shape is None else [int(s) for s in input_shape]
    if shape is not None and (not shape or min(shape) < 1):
        raise ConfigurationError(f"input_shape must be positive sizes without the batch dimension, got {input_shape!r}")
    kwargs = dict(model_kwargs or {})
    if isinstance(model, str) and example_input is None:
        return ModelSpec("factory" if ":" in model else "registry", model, kwargs=kwargs,
                         input_shape=shape, image_size=image_size)
    obj = model
    label = model if isinstance(model, str) else type(model).__name__ if isinstance(model, nn.Module) \
        else getattr(model, "__qualname__", type(model).__name__)
    if isinstance(model, str):  # a path with an example input given here: save only the input
        obj = None
    tmpdir = tmpdir or tempfile.mkdtemp(prefix="batchcraft-model-")
    path = os.path.join(tmpdir, "model.pt")
    try:
        torch.save({"obj": obj, "example_input": example_input, "kwargs": kwargs}, path)
    except Exception as exc:  # pickling fails with AttributeError, PicklingError, TypeError, ...
        raise ConfigurationError(
            f"tune: cannot send {label!r} to the worker processes: {exc}",
            hint="define the model class (or factory) at module level of an importable file, or pass "
                 "'package.module:factory'") from None
    return ModelSpec("file", label, path=path, kwargs=kwargs if isinstance(model, str) else {},
                     input_shape=shape, image_size=image_size, main_path=_main_path())


def _import_attribute(path: str):
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise ConfigurationError(f"model {path!r}: expected 'package.module:attribute'")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = importlib.import_module(module)
    except ImportError as exc:
        raise ConfigurationError(f"model {path!r}: cannot import {module!r}: {exc}",
                                 hint="run from the directory that holds the package, or add it to PYTHONPATH") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigurationError(f"model {path!r}: {module!r} has no attribute {attr!r}") from None
    return obj


def _load_main(main_path: str) -> None:
    """Make the caller's main script importable as ``__main__`` here (as multiprocessing's spawn),
    unless it already is (the tuning process itself, or done before)."""
    main = sys.modules.get("__main__")
    here = getattr(main, "__file__", None)
    if (here and os.path.abspath(here) == main_path) or getattr(main, "__batchcraft_main__", None) == main_path:
        return
    import runpy

    mod = types.ModuleType("__mp_main__")
    mod.__dict__.update(runpy.run_path(main_path, run_name="__mp_main__"))
    mod.__file__, mod.__batchcraft_main__ = main_path, main_path
    sys.modules["__mp_main__"] = mod
    sys.modules["__main__"] = mod


def _from_factory(obj, kwargs: dict, label: str):
    """(model, example input or None) from a module, or a factory returning one (or a pair)."""
    if isinstance(obj, nn.Module):
        if kwargs:
            raise ConfigurationError(f"model {label!r} is a module instance: it takes no model kwargs")
        return obj, None
    if not callable(obj):
        raise ConfigurationError(f"model {label!r}: expected an nn.Module or a factory, got {type(obj).__name__}")
    out = obj(**kwargs)
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], nn.Module):
        return out
    if isinstance(out, nn.Module):
        return out, None
    raise ConfigurationError(f"model {label!r}: the factory returned {type(out).__name__}, expected an "
                             f"nn.Module or (model, example_input)")


def _treelstm(model_kwargs: dict, seed: int) -> Workload:
    from batchcraft import autobatch
    from batchcraft.data import load_sentences
    from batchcraft.models import suite

    sentences = load_sentences(limit=_TREE_SENTENCES)
    task = suite.build("treelstm", sentences, hidden=model_kwargs.get("hidden", 256), seed=seed)
    run = autobatch(task.fn)
    offset = (seed * 37) % len(task.instances)  # instances of different processes see different trees

    def make_batch(batch_size: int):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigurationError(f"make_input: batch_size must be an int >= 1, got {batch_size!r}")
        n = len(task.instances)
        return [task.instances[(offset + i) % n] for i in range(batch_size)]

    return Workload("treelstm", task.model.eval(), make_batch, run, traceable=False)


def build_workload(spec, *, model_kwargs: dict | None = None, image_size: int | None = None,
                   seed: int = 0) -> Workload:
    """The workload of ``spec`` (a :class:`ModelSpec`, its dict, or a registry name / path).

    Raises:
        ConfigurationError: unknown model, an import that fails, a factory that returns something
            else than a model, or no input can be derived for it.
    """
    if isinstance(spec, dict):
        spec = ModelSpec.from_dict(spec)
    if not isinstance(spec, ModelSpec):
        spec = model_spec(spec, model_kwargs=model_kwargs, image_size=image_size)
    elif model_kwargs:
        spec.kwargs = {**spec.kwargs, **model_kwargs}
    size = spec.image_size if image_size is None else image_size
    if spec.kind == "registry" and spec.name == "treelstm":
        return _treelstm(spec.kwargs, seed)
    example = None
    if spec.kind == "registry":
        model = build_model(spec.name, **spec.kwargs)
    elif spec.kind == "factory":
        model, example = _from_factory(_import_attribute(spec.name), spec.kwargs, spec.name)
    elif spec.kind == "file":
        if spec.main_path:
            _load_main(spec.main_path)
        saved = torch.load(spec.path, weights_only=False)
        example = saved["example_input"]
        if saved["obj"] is None:  # a registry name or factory path with the caller's example input
            if ":" in spec.name:
                model, own = _from_factory(_import_attribute(spec.name), saved["kwargs"], spec.name)
                example = own if example is None else example
            else:
                model = build_model(spec.name, **saved["kwargs"])
        else:
            model, own = _from_factory(saved["obj"], {}, spec.name)
            example = own if example is None else example
    else:
        raise ConfigurationError(f"ModelSpec: unknown kind {spec.kind!r}")
    model = model.eval()
    if example is not None:
        def make_batch(b):
            return tile(example, b)
    elif spec.input_shape is not None:
        shape = list(spec.input_shape)

        def make_batch(b):
            if not isinstance(b, int) or b < 1:
                raise ConfigurationError(f"make_input: batch_size must be an int >= 1, got {b!r}")
            return torch.randn(b, *shape, generator=torch.Generator().manual_seed(seed))
    else:
        def make_batch(b):
            return make_input(model, b, image_size=size, seed=seed)
    x = make_batch(1)  # fail early if no input can be made
    traceable = isinstance(x, torch.Tensor) or (isinstance(x, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in x))
    return Workload(spec.name, model, make_batch, lambda inp: invoke(model, inp), traceable=traceable)
