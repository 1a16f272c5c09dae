"""Submodule and parameter reads without ``nn.Module.__getattr__`` while a call records.

``nn.Module`` keeps submodules and parameters in dicts that ordinary attribute lookup does not
search, so every ``self.cell`` in instance code runs ``Module.__getattr__`` in Python: 1.3-1.7 µs
on this machine, two per TreeLSTM node, about a fifth of its recording. For the duration of one
``autobatch`` call, :class:`FastAttributes` copies those entries into each module's instance
``__dict__`` (which lookup searches first) and removes them afterwards.

What stays as in eager: ``Module.__setattr__`` of a module or parameter removes the copy (it
clears the name from ``__dict__``), so a replacement made during the call is seen; a name the
class itself defines, modules whose class overrides ``__getattr__`` or ``__getattribute__``, and
names already in ``__dict__`` are left alone. Two calls on the same model in two threads share
the copies; the first to finish removes them and the other falls back to ``__getattr__``.
"""

from __future__ import annotations

import functools

from torch import nn

_GETATTR = nn.Module.__getattr__
_GETATTRIBUTE = nn.Module.__getattribute__


def _roots(fn) -> list:
    """The modules an auto-batched function reaches directly: itself, the object of a bound
    method, a partial's arguments and the cells of its closure."""
    out, seen, todo = [], set(), [fn]
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, nn.Module):
            out.append(x)
            continue
        if isinstance(x, functools.partial):
            todo += [x.func, *x.args, *x.keywords.values()]
            continue
        owner = getattr(x, "__self__", None)
        if owner is not None:
            todo.append(owner)
        func = getattr(x, "__func__", x)
        for cell in getattr(func, "__closure__", None) or ():
            try:
                todo.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
    return out


class FastAttributes:
    """Context manager: submodules and parameters of ``fn``'s modules readable from ``__dict__``."""

    __slots__ = ("roots", "added")

    def __init__(self, fn):
        self.roots = _roots(fn)
        self.added: list = []

    def __enter__(self) -> "FastAttributes":
        seen = set()
        for root in self.roots:
            for m in root.modules():
                if id(m) in seen:
                    continue
                seen.add(id(m))
                cls = type(m)
                if cls.__getattr__ is not _GETATTR or cls.__getattribute__ is not _GETATTRIBUTE:
                    continue
                d = m.__dict__
                for table in (m._modules, m._parameters):
                    for name, v in table.items():
                        if v is not None and name not in d and not hasattr(cls, name):
                            d[name] = v
                            self.added.append((d, name, v))
        return self

    def __exit__(self, *exc) -> bool:
        for d, name, v in self.added:
            if d.get(name) is v:
                del d[name]
        self.added.clear()
        return False


__all__ = ["FastAttributes"]
