"""The modules a static block's traces may read, found by a bounded walk from its callable.

A trace holds the parameters and buffers it read as constants, so a block must be traced again
when a module it uses changes (a replaced parameter, ``train()``/``eval()``): ``blocks.py`` puts
the state of the modules found here into the block's fingerprint (reliability #94, #100).

The walk starts at the block's function (or, for a module block, its class's ``forward``) and
follows what Python code can reach without running it: a bound method's object, a
``functools.partial``'s function and arguments, closure cells, the globals its code names
(names in nested code objects too: comprehensions, inner functions), attributes of a Python
module it names (``helper.apply``), other Python functions (with their own globals), the members
of lists, tuples, sets and dicts, and the attributes of plain objects. It stops at modules (their
submodules are walked by the fingerprint) and at tensors (a captured ``W``: its identity,
shape, dtype and ``requires_grad`` are part of the fingerprint too), at :data:`MAX_DEPTH` steps
from the start, after :data:`MAX_ITEMS` members of one container and after :data:`MAX_VISITS`
objects. What it does not see: modules reached only through values computed at run time
(``getattr(self, name)`` with a computed ``name``, a registry looked up by key; the README says
so). Libraries (:data:`_LIBRARIES`: ``torch``, ``math``...) are not walked.
"""

from __future__ import annotations

import functools
import types

import torch
from torch import nn

#: steps from the block's callable (function -> global -> container -> object -> module)
MAX_DEPTH = 6
#: members of one list, tuple, set or dict looked at
MAX_ITEMS = 256
#: objects looked at in one walk (a block's fingerprint is taken once per call)
MAX_VISITS = 4096

_SCALARS = (int, float, complex, str, bytes, bool, type(None))
_LIBRARIES = frozenset({"torch", "batchcraft", "math", "numpy", "functools", "itertools", "operator",
                        "collections", "typing", "builtins"})


def _code_names(code, out: set) -> set:
    """Global and attribute names of ``code`` and of the code objects nested in it."""
    out.update(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _code_names(c, out)
    return out


def reachable_modules(start) -> list:
    """``nn.Module`` objects reachable from ``start`` (see the module docstring), in walk order."""
    return reach(start)[0]


def reach(start) -> tuple[list, list]:
    """``(modules, tensors)`` reachable from ``start``: ``nn.Module`` objects, and tensors held
    outside any module (a captured ``W``), in walk order."""
    found, tensors, seen = [], [], set()
    todo = [(start, 0)]
    while todo and len(seen) < MAX_VISITS:
        x, depth = todo.pop()
        if id(x) in seen or isinstance(x, _SCALARS):
            continue
        seen.add(id(x))
        if isinstance(x, nn.Module):
            found.append(x)
            continue
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            continue
        if depth >= MAX_DEPTH or isinstance(x, type):
            continue
        nxt = depth + 1
        if isinstance(x, functools.partial):
            todo += [(a, nxt) for a in (x.func, *x.args, *x.keywords.values())]
        elif isinstance(x, (list, tuple, set, frozenset)):
            todo += [(a, nxt) for i, a in zip(range(MAX_ITEMS), x)]
        elif isinstance(x, dict):
            todo += [(a, nxt) for i, a in zip(range(MAX_ITEMS), x.values())]
        elif isinstance(x, (types.FunctionType, types.MethodType)):
            owner = getattr(x, "__self__", None)
            if owner is not None and not isinstance(owner, types.ModuleType):
                todo.append((owner, nxt))
            func = getattr(x, "__func__", x)
            names = _code_names(func.__code__, set())
            values = []
            for cell in func.__closure__ or ():
                try:
                    values.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    pass
            glob = func.__globals__
            values += [glob[name] for name in names if name in glob]
            for v in values:
                if isinstance(v, types.ModuleType):
                    # a Python module it names: the attributes its code reads (``helper.apply``);
                    # libraries hold no user modules (``torch.tanh``, ``math.sqrt``)
                    if v.__name__.partition(".")[0] not in _LIBRARIES:
                        todo += [(getattr(v, n), nxt) for n in names if n in vars(v)]
                else:
                    todo.append((v, nxt))
        elif not isinstance(x, types.ModuleType) and hasattr(x, "__dict__") \
                and type(x).__module__ not in ("builtins", "torch", "functools"):
            todo += [(a, nxt) for i, a in zip(range(MAX_ITEMS), vars(x).values())]
    return found, tensors


__all__ = ["reach", "reachable_modules", "MAX_DEPTH", "MAX_ITEMS", "MAX_VISITS"]
