"""Per-instance values that instance code left on modules: made concrete when the call ends.

Instance code may store a value on a module: ``self.last_h = h`` (keeping the last hidden state),
``self.ema = 0.9 * self.ema + 0.1 * h`` under ``no_grad`` (a buffer re-assigned each step). Inside
the call these are lazy values; left there, the module would be unusable afterwards (its
``state_dict()`` and every later use would meet a value of a finished call). When the call ends,
:func:`resolve_module_state` replaces every lazy value of the call found in the attributes,
buffers and parameters of the modules the function reaches (itself, a bound method's object, a
``functools.partial``'s arguments, closure cells, the module-level globals its code names, and
their submodules), and in the lists, dicts and plain objects those attributes hold
(``self.history.append(h)``; the last :data:`MAX_SCANNED` entries of a list, dicts of at most
that many), by its value.

Which value: the last assignment batchcraft executed. Instances run in fibers in instance order
and each runs until it waits for a value, so without value waits the assignments happen in eager's
order and the final values are eager's. With value waits, instances interleave: then the last
assignment may come from another instance than in eager, and the call warns (``RuntimeWarning``).
"""

from __future__ import annotations

import functools
import warnings

from torch import nn


def roots(fn) -> list:
    """Modules ``fn`` reaches directly: itself, a bound method's object, a partial's arguments,
    the cells of its closure, the globals its code names (and the functions of its module
    among them, followed the same way)."""
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
        code, glob = getattr(func, "__code__", None), getattr(func, "__globals__", None)
        if code is not None and glob is not None:  # globals the code names (m = Model() at module level)
            for name in code.co_names:
                v = glob.get(name)
                if isinstance(v, (nn.Module, functools.partial)) or (
                        callable(v) and hasattr(v, "__code__") and getattr(v, "__globals__", None) is glob):
                    todo.append(v)
    return out


#: attributes every ``nn.Module`` has (its tables and hooks): not where instance code stores values
_MODULE_INTERNALS = frozenset(nn.Module().__dict__)
_SCALARS = (int, float, bool, str, type(None))
#: entries of one list or dict attribute looked at after a call (a list: its last ones)
MAX_SCANNED = 1024
_PLAIN_MODULES = ("builtins", "torch")


def _take(rec, x, left: list | None, where: str):
    """``rec.resolve(x)``; with ``left`` (after batched work failed), a value whose work did not
    run stays as it is and ``where`` goes into ``left``."""
    if left is not None and not rec.computed(x):
        left.append(where)
        return x
    return rec.resolve(x)


#: containers inside containers looked into (a list of (h, c) tuples is two deep), and the most
#: entries looked at under one attribute in all (nested tables would otherwise multiply)
MAX_DEPTH = 4
MAX_VISITED = 8 * MAX_SCANNED


def _resolve_inside(m, name: str, v, rec, lazy_type, replaced: list, left: list | None = None) -> None:
    """The lazy values of ``rec`` in a list, dict (subclasses too), tuple, namedtuple or plain
    object held by attribute ``name`` of module ``m`` (``self.history.append(h)``,
    ``self.log.last = h``, ``self.state = (h, c)``, ``self.states.append((h, c))``), and in the
    containers inside those, down to :data:`MAX_DEPTH` levels."""
    new, changed = _inside(v, f"{type(m).__name__}.{name}", rec, lazy_type, replaced, left, 1, [MAX_VISITED])
    if changed:  # a tuple (a namedtuple) cannot change in place: the attribute gets a new one
        m.__dict__[name] = new


def _inside(v, where: str, rec, lazy_type, replaced: list, left, depth: int, budget: list):
    """``(value, changed)``: ``v`` with the lazy values of ``rec`` in it resolved. Lists, dicts and
    plain objects are changed in place (``changed`` False); a tuple holding one comes back as a
    new tuple of the same type (``changed`` True), which the caller stores where ``v`` was."""
    t = type(v)
    if t is lazy_type:
        if v.rec is not rec:
            return v, False
        replaced.append(where)
        return _take(rec, v, left, where), True
    if t in _SCALARS or depth > MAX_DEPTH or budget[0] <= 0:
        return v, False
    budget[0] -= 1
    if isinstance(v, list):  # (subclasses too: their items are set in place)
        # appends land at the end: a long list (a vocabulary) is looked at in its last entries
        for k in range(max(0, len(v) - MAX_SCANNED), len(v)):
            new, changed = _inside(v[k], f"{where}[{k}]", rec, lazy_type, replaced, left, depth + 1, budget)
            if changed:
                v[k] = new
        return v, False
    if (t is tuple or hasattr(t, "_make")) and isinstance(v, tuple):
        if len(v) > MAX_SCANNED:
            return v, False
        vals = list(tuple.__iter__(v))
        any_changed = False
        for k, x in enumerate(vals):
            new, changed = _inside(x, f"{where}[{k}]", rec, lazy_type, replaced, left, depth + 1, budget)
            if changed:
                vals[k], any_changed = new, True
        if not any_changed:
            return v, False
        return (tuple(vals) if t is tuple else t._make(vals)), True
    if isinstance(v, dict):  # (OrderedDict, defaultdict)
        table = v
    elif t.__module__ not in _PLAIN_MODULES and not isinstance(v, (nn.Module, type)) \
            and isinstance(getattr(v, "__dict__", None), dict):
        table = vars(v)
    else:
        return v, False
    if len(table) > MAX_SCANNED:
        return v, False
    for k, x in list(table.items()):
        new, changed = _inside(x, f"{where}[{k!r}]", rec, lazy_type, replaced, left, depth + 1, budget)
        if changed:
            table[k] = new
    return v, False


def _dict_or_empty(table) -> dict:
    return table if isinstance(table, dict) else {}


def resolve_module_state(fn, rec, lazy_type, interleaved: bool, nested=(), left: list | None = None) -> list[str]:
    """Replace the lazy values of recorder ``rec`` on ``fn``'s modules by ``rec.resolve(value)``;
    return what was replaced (``"Type.name"``). ``interleaved``: the call had value waits.
    ``nested``: functions of ``autobatch`` calls that instance code made (they ran inline, and
    what they stored is ``rec``'s too), whose modules are looked at as well. ``left`` (a list):
    batched work failed, values whose work did not run stay lazy and are named in ``left``."""
    replaced, seen = [], set()
    for root in [r for start in (fn, *nested) for r in roots(start)]:
        for m in root.modules():
            if id(m) in seen:
                continue
            seen.add(id(m))
            d = m.__dict__
            # (a scripted module's tables are wrappers that iterate by index: not searched)
            for table in (d, _dict_or_empty(d.get("_buffers")), _dict_or_empty(d.get("_parameters"))):
                # (a module's own tables and hooks are most of its __dict__: left out by a set
                # difference, not one test per entry)
                for name in (table.keys() - _MODULE_INTERNALS if table is d else list(table)):
                    v = table.get(name)
                    t = type(v)
                    if t is lazy_type:
                        if v.rec is rec:
                            table[name] = _take(rec, v, left, f"{type(m).__name__}.{name}")
                            replaced.append(f"{type(m).__name__}.{name}")
                    elif table is d and t not in _SCALARS:
                        _resolve_inside(m, name, v, rec, lazy_type, replaced, left)
    if replaced and interleaved:
        warnings.warn(f"batchcraft.autobatch: instance code stored per-instance values on modules "
                      f"({', '.join(sorted(set(replaced)))}) in a call whose instances waited for values: "
                      f"the value kept is the last assignment in batchcraft's fiber order, which can differ "
                      f"from eager's instance order", RuntimeWarning, stacklevel=4)
    return replaced


__all__ = ["resolve_module_state", "roots"]
