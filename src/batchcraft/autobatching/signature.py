"""Signatures: what makes two recorded operations batchable together.

A signature is ``(op, argument structure, leaf descriptors)``:

* the operation (a torch function, a Tensor method, or a static block);
* the structure of its arguments, with every non-tensor argument **by type and
  value** (``add(x, 1)`` and ``add(x, 2)`` never share a signature; DyNet #555),
  and slices, lists and dicts spelled out;
* for each per-instance (lazy) tensor its own shape, dtype and device (keying on
  inputs, not outputs; DyNet #622), and for each shared tensor (parameters,
  tensors captured from outside the instance) its identity, shape and dtype, so
  that it is passed once to the batched call and never gathered.

Source: DyNet auto-batching (Neubig et al. 2017, §3.1, "signatures");
ACRoBat (Fegade et al. 2023, §4: parameter reuse).
"""

from __future__ import annotations

import torch

from batchcraft.autobatching.lazy import LazyTensor, desc_id

LEAF = "\x00leaf"  # marks a tensor position in a structure; the tensor is in the leaf list

_SCALARS = frozenset({int, float, bool, complex, str, type(None), type(Ellipsis), torch.dtype,
                      torch.device, torch.layout, torch.memory_format})
_Tensor = torch.Tensor
_Size = torch.Size


class Opaque:
    """An argument of unknown type, compared by identity (kept alive by the graph)."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self):
        return id(self.obj)

    def __eq__(self, other):
        return type(other) is Opaque and other.obj is self.obj

    def __repr__(self):
        return f"Opaque({type(self.obj).__name__})"


def flatten(obj, leaves: list):
    """Return a hashable structure for ``obj``; append its tensors (lazy or real) to ``leaves``."""
    t = type(obj)
    if t is LazyTensor:
        leaves.append(obj)
        return LEAF
    if t is tuple or t is list:
        return (t, tuple([flatten(o, leaves) for o in obj]))
    if t is float:  # by bit pattern: -0.0 differs from 0.0, and nan equals nan (bugs #9, #12)
        return (float, obj.hex())
    if t in _SCALARS:
        return (t, obj)
    if t is slice:
        return (slice, flatten(obj.start, leaves), flatten(obj.stop, leaves), flatten(obj.step, leaves))
    if isinstance(obj, _Tensor):
        leaves.append(obj)
        return LEAF
    if t is _Size:
        return (tuple, tuple([(int, d) for d in obj]))
    if t is dict:
        return (dict, tuple(obj.keys()), tuple([flatten(v, leaves) for v in obj.values()]))
    if isinstance(obj, tuple):  # namedtuple, torch.return_types (structseq)
        return (t, tuple([flatten(o, leaves) for o in obj]))
    return (Opaque, Opaque(obj))


def flatten_args(args: tuple, leaves: list):
    """:func:`flatten` for a top-level argument tuple, inlined for the common cases (hot path)."""
    items = []
    for a in args:
        t = type(a)
        if t is LazyTensor:
            leaves.append(a)
            items.append(LEAF)
        elif t in _SCALARS and t is not float:
            items.append((t, a))
        else:
            items.append(flatten(a, leaves))
    return (tuple, tuple(items))


class SigInfo:
    """What is known about one signature: a small id, output structure and descriptors.

    Attributes:
        sid (int): interned id, cheap to hash (buckets are keyed by it).
        out_struct: structure of the outputs (``LEAF`` for a single tensor).
        out_descs (tuple): (shape, dtype, device) of each output tensor, per instance.
        program: the traced program, for static blocks.
    """

    __slots__ = ("sid", "key", "out_struct", "out_descs", "out_dids", "single", "flat_tuple", "program",
                 "const_grad", "struct", "out_specs")
    _next = 0

    def __init__(self, key, out_struct, out_descs, program=None):
        SigInfo._next += 1
        self.sid = SigInfo._next
        self.key = key
        self.out_struct = out_struct
        self.out_descs = out_descs
        self.out_dids = tuple(desc_id(d) for d in out_descs)
        self.out_specs = tuple((i, d, di) for i, (d, di) in enumerate(zip(out_descs, self.out_dids)))
        self.struct = key[1] if key is not None else None
        self.single = out_struct is LEAF
        # outputs that are a plain tuple of tensors (e.g. (h, c)) are built without rebuild()
        self.flat_tuple = (type(out_struct) is tuple and out_struct[0] is tuple
                           and all(s is LEAF for s in out_struct[1]))
        self.program = program
        # a static block whose body uses tensors that require grad (its parameters)
        self.const_grad = program is not None and any(
            r[0] == "const" and getattr(r[1], "requires_grad", False)
            for st in program.steps for r in st.refs) or (program is not None and any(
                st.info is not None and st.info.const_grad for st in program.steps
                if st.info is not None and st.info.program is not None))


def rebuild(struct, it):
    """Inverse of :func:`flatten`: rebuild the structure taking tensors from iterator ``it``."""
    if struct is LEAF:
        return next(it)
    tag = struct[0]
    if tag is tuple:
        return tuple([rebuild(s, it) for s in struct[1]])
    if tag is list:
        return [rebuild(s, it) for s in struct[1]]
    if tag is slice:
        return slice(rebuild(struct[1], it), rebuild(struct[2], it), rebuild(struct[3], it))
    if tag is dict:
        return {k: rebuild(s, it) for k, s in zip(struct[1], struct[2])}
    if tag is Opaque:
        return struct[1].obj
    if tag is float:
        return float.fromhex(struct[1])
    if isinstance(tag, type) and issubclass(tag, tuple):
        items = [rebuild(s, it) for s in struct[1]]
        return tag(*items) if hasattr(tag, "_fields") else tag(items)  # namedtuple / structseq
    return struct[1]


def leaf_descriptor(x):
    """Per-instance leaves are described by (shape, dtype, device); shared ones by identity too."""
    if type(x) is LazyTensor:
        return x.desc
    return ("shared", id(x), x.shape, x.dtype, x.device)


def describe_tensor(t: torch.Tensor) -> tuple:
    """Descriptor of a per-instance value: (shape, dtype, device)."""
    return (tuple(t.shape), t.dtype, t.device)
