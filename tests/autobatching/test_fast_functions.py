"""The C core's direct paths for common calls while a call records: ``torch.<function>`` on lazy
values (``_core.FastFn``, read through ccore.FAST_FACTORIES's descriptors) and the ``__call__`` of
``nn.Linear`` / ``nn.Embedding`` / the cell modules (``_core.FastCall``, modcalls.FAST_CALLS).
Both must record exactly what torch's dispatch to the recording mode would: the same values and
gradients as eager and as the Python core, and the original objects for every other reader."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchcraft import autobatch
from batchcraft.autobatching import _native

from equivalence import NameLog

pytestmark = pytest.mark.skipif(not _native.available, reason="the C core was not built")
if _native.available:  # (ccore needs the C core at import)
    from batchcraft.autobatching.ccore import FAST_TORCH_FUNCTIONS
else:
    FAST_TORCH_FUNCTIONS = ()

# one expression per function of FAST_TORCH_FUNCTIONS, with positional and keyword spellings
EXPRESSIONS = {
    "sigmoid": lambda x, y: torch.sigmoid(x), "tanh": lambda x, y: torch.tanh(x),
    "relu": lambda x, y: torch.relu(x), "exp": lambda x, y: torch.exp(x),
    "log": lambda x, y: torch.log(x.abs() + 1), "abs": lambda x, y: torch.abs(x),
    "sqrt": lambda x, y: torch.sqrt(x * x + 1), "neg": lambda x, y: torch.neg(x),
    "clamp": lambda x, y: torch.clamp(x, min=-0.5, max=0.5), "add": lambda x, y: torch.add(x, y, alpha=2),
    "sub": lambda x, y: torch.sub(x, 1.5), "mul": lambda x, y: torch.mul(x, y),
    "div": lambda x, y: torch.div(x, y.abs() + 1, rounding_mode=None), "matmul": lambda x, y: torch.matmul(x, y.t()),
    "mm": lambda x, y: torch.mm(x, y.t()), "bmm": lambda x, y: torch.bmm(x.unsqueeze(0), y.t().unsqueeze(0)),
    "dot": lambda x, y: torch.dot(x[0], y[0]), "sum": lambda x, y: torch.sum(x, dim=1, keepdim=True),
    "mean": lambda x, y: torch.mean(x, 0), "amax": lambda x, y: torch.amax(x, dim=-1),
    "amin": lambda x, y: torch.amin(x, -1), "max": lambda x, y: torch.max(x, dim=1).values,
    "min": lambda x, y: torch.min(x, y), "argmax": lambda x, y: torch.argmax(x, dim=1).float(),
    "softmax": lambda x, y: torch.softmax(x, dim=-1), "log_softmax": lambda x, y: torch.log_softmax(x, 1),
    "cat": lambda x, y: torch.cat([x, y], dim=0), "stack": lambda x, y: torch.stack((x, y), 1),
    "squeeze": lambda x, y: torch.squeeze(x[:1], 0), "unsqueeze": lambda x, y: torch.unsqueeze(x, dim=1),
    "flatten": lambda x, y: torch.flatten(x), "reshape": lambda x, y: torch.reshape(x, (-1,)),
    "transpose": lambda x, y: torch.transpose(x, 0, 1), "where": lambda x, y: torch.where(x > 0, x, y),
    "maximum": lambda x, y: torch.maximum(x, y), "minimum": lambda x, y: torch.minimum(x, y),
}


def test_every_fast_function_has_an_expression():
    assert set(EXPRESSIONS) == set(FAST_TORCH_FUNCTIONS)


@pytest.mark.parametrize("name", sorted(EXPRESSIONS))
def test_fast_functions_match_eager_and_the_python_core(name):
    expr = EXPRESSIONS[name]
    w = torch.randn(3, 4, requires_grad=True)
    seen = []

    def f(x):
        seen.append(type(getattr(torch, name)).__name__)
        return expr(x * w, torch.cos(x) + w)  # lazy first arguments (and torch.cos: the mode's path)

    xs = [torch.randn(3, 4) for _ in range(3)]
    ref = [f(x) for x in xs]
    (gref,) = torch.autograd.grad(sum(r.sum() for r in ref) + w.sum(), w, allow_unused=True, materialize_grads=True)
    for core in ("c", "python"):
        seen.clear()
        out = autobatch(f, core=core)(xs)
        for o, r in zip(out, ref):
            torch.testing.assert_close(o, r)
        (g,) = torch.autograd.grad(sum(o.sum() for o in out) + w.sum(), w, allow_unused=True, materialize_grads=True)
        torch.testing.assert_close(g, gref)
        assert seen == (["FastFn"] * 3 if core == "c" else ["builtin_function_or_method"] * 3)


def test_concrete_first_arguments_and_other_readers_get_the_original():
    originals = {n: getattr(torch, n) for n in FAST_TORCH_FUNCTIONS}
    seen = {}

    def f(x):
        fn = torch.sigmoid
        seen.update(name=fn.__name__, repr=repr(fn), wrapped=fn.__wrapped__ is originals["sigmoid"])
        a = torch.add(torch.ones(2), x)  # concrete first argument: torch's dispatch to the mode
        return fn(a) + torch.stack([torch.zeros(2), x]).sum(0)

    xs = [torch.randn(2) for _ in range(2)]
    out = autobatch(f, core="c")(xs)
    for o, x in zip(out, xs):
        torch.testing.assert_close(o, torch.sigmoid(1 + x) + x)
    assert seen == {"name": "sigmoid", "repr": repr(originals["sigmoid"]), "wrapped": True}
    assert all(getattr(torch, n) is fn for n, fn in originals.items())
    assert all(vars(torch)[n] is fn for n, fn in originals.items())


def test_a_mode_of_the_user_sees_the_original_function():
    funcs = []

    def f(x):
        y = x * 2
        with NameLog(funcs):
            z = torch.tanh(y)  # read with the user's mode innermost: the original, which the mode sees
        return torch.sigmoid(z)

    xs = [torch.randn(3) for _ in range(2)]
    out = autobatch(f, core="c")(xs)
    for o, x in zip(out, xs):
        torch.testing.assert_close(o, torch.sigmoid(torch.tanh(x * 2)))
    assert torch.tanh in funcs and all(type(fn).__name__ != "FastFn" for fn in funcs)


def test_bad_arguments_raise_as_through_the_mode():
    def f(x):
        return torch.sum(x, dim=3)  # no dimension 3

    errors = []
    for fast in (True, False):
        with pytest.raises(Exception) as info:
            autobatch(f, core="c", fast_factories=fast)([torch.ones(2, 2)])
        errors.append((type(info.value), "dim" in str(info.value).lower() or "range" in str(info.value).lower()))
    assert errors[0] == errors[1]


def test_module_calls_go_through_the_c_call_and_fall_back_for_keywords():
    lin, emb, cell = nn.Linear(4, 3), nn.Embedding(10, 4), nn.GRUCell(4, 3)
    kinds = []

    def f(i):
        kinds.append((type(nn.Linear.__call__).__name__, type(nn.GRUCell.__call__).__name__))
        x = emb(torch.tensor(i))
        h = cell(x, lin(x))
        h = cell(input=x, hx=h)  # keywords: the Python path (Module.__call__), same values
        return lin(input=x) + h

    ids = [1, 7, 3]
    out = autobatch(f, core="c")(ids)
    for o, i in zip(out, ids):
        torch.testing.assert_close(o, f(i))
    assert kinds[0] == ("FastCall", "FastCall")
    assert type(nn.Linear.__call__).__name__ == "function"  # restored after the call


def test_fast_functions_compare_hash_pickle_and_copy_as_the_original():
    import copy
    import pickle

    original = torch.relu
    got = {}

    def f(x):
        fn = torch.relu
        got.update(eq=fn == original, ne=fn != original, within=fn in (torch.tanh, original),
                   key={original: 1}.get(fn), pickled=pickle.loads(pickle.dumps(fn)) is original,
                   copied=copy.deepcopy(fn) == original)
        return fn(x)

    autobatch(f, core="c")([torch.randn(2)])
    assert got == {"eq": True, "ne": False, "within": True, "key": 1, "pickled": True, "copied": True}


def test_a_fast_function_written_back_leaves_torch_its_own():
    original = torch.tanh

    def f(x):
        saved = torch.tanh  # the fast function, read in instance code
        torch.tanh = lambda t: saved(t) * 2
        try:
            y = torch.tanh(x)
        finally:
            torch.tanh = saved  # written back: torch must keep its own function
        return y

    xs = [torch.randn(3) for _ in range(2)]
    for o, x in zip(autobatch(f, core="c")(xs), xs):
        torch.testing.assert_close(o, 2 * original(x))
    assert torch.tanh is original and vars(torch)["tanh"] is original


def test_both_cores_agree_under_disable_torch_function_subclass():
    def f(x):
        y = x * 2
        with torch._C.DisableTorchFunctionSubclass():
            return torch.tanh(y)

    errors = []
    for core in ("c", "python"):
        with pytest.raises(Exception) as info:
            autobatch(f, core=core)([torch.ones(2)])
        errors.append(type(info.value))
    assert errors[0] is errors[1]


def test_fast_objects_read_as_the_originals():
    docs = {}

    def f(x):
        docs.update(fn=torch.sigmoid.__doc__, call=nn.Linear.__call__.__name__)
        return x * 1

    autobatch(f, core="c")([torch.ones(1)])
    assert docs["fn"] == torch.sigmoid.__doc__ and docs["call"]
