"""Module attribute reads through class-level ``ModuleAttr`` descriptors while the C core records
(autobatching/attrs.py).

Includes the cases a helper's hostile tests found against the earlier ``__dict__``-copy design:
``torch.func.functional_call``, ``del``/``None``/``add_module``/``_modules`` writes during the
call, and ``torch.save`` during the call; and, for the descriptors, subclasses with their own
``__getattr__``, class-level lookups, instance attributes that shadow a submodule, other threads
reading the same class during a call, and class attributes set by the user during a call.
"""

from __future__ import annotations

import io
import threading

import pytest
import torch
from torch import nn
from torch.func import functional_call

from batchcraft import autobatch
from batchcraft.autobatching import _native, attrs
from equivalence import CORES

ORIGINAL = nn.Module.__getattr__
needs_c = pytest.mark.skipif(not _native.available, reason="the C core was not built")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)
        self.w = nn.Parameter(torch.ones(2))
        self.seen = []

    def forward(self, x):
        self.seen.append(type(vars(Net).get("a")).__name__)
        return self.a(x) * self.w


@pytest.mark.parametrize("core", CORES)
def test_installed_only_while_the_c_core_records_and_restored_after_errors(core):
    torch.manual_seed(0)
    net = Net()
    xs = [torch.randn(2) for _ in range(3)]
    out = autobatch(net, core=core)(xs)
    for o, x in zip(out, xs):
        torch.testing.assert_close(o, net(x))
    assert set(net.seen[:3]) == ({"ModuleAttr"} if core == "c" else {"NoneType"})
    assert nn.Module.__getattr__ is ORIGINAL and "a" not in vars(net) and "a" not in vars(Net)
    assert not any(type(v).__name__ == "ModuleAttr" for v in vars(nn.Linear).values())

    def boom(x):
        net.a(x)
        raise ValueError("boom")

    with pytest.raises(Exception, match="boom"):
        autobatch(boom, core=core)(xs)
    assert nn.Module.__getattr__ is ORIGINAL and "a" not in vars(Net)
    net.seen.clear()
    autobatch(net, core=core, fast_attributes=False)(xs)
    assert set(net.seen) == {"NoneType"}


@needs_c
def test_same_lookups_and_errors_as_torch():
    class Own(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(1, 1)
            self.register_buffer("buf", torch.zeros(1))

        def __getattr__(self, name):
            if name == "magic":
                return 42
            return super().__getattr__(name)

    m = Own()
    seen = {}

    def f(x):
        seen["magic"], seen["inner"], seen["buf"] = m.magic, m.inner is m._modules["inner"], m.buf is m._buffers["buf"]
        try:
            m.missing
        except AttributeError as exc:
            seen["error"] = str(exc)
        seen["getattr_default"] = getattr(m.inner, "nope", 7)
        return x

    autobatch(f, core="c")([torch.zeros(1)])
    assert seen == {"magic": 42, "inner": True, "buf": True, "error": "'Own' object has no attribute 'missing'",
                    "getattr_default": 7}


@pytest.mark.parametrize("core", CORES)
def test_functional_call_uses_the_parameters_passed_in(core):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    sets = [{k: torch.randn_like(v) for k, v in net.named_parameters()} for _ in range(2)]

    def f(inst):
        x, k = inst
        return functional_call(net, sets[k], (x,))

    xs = [(torch.randn(3), i % 2) for i in range(4)]
    for o, inst in zip(autobatch(f, core=core)(xs), xs):
        torch.testing.assert_close(o, f(inst))


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("change", ["none", "del", "add_module", "modules_dict", "register_parameter"])
def test_changes_to_a_module_during_the_call_are_seen_as_in_eager(core, change):
    def run(batched):
        torch.manual_seed(0)
        m = Net()

        def fn(x):
            if change == "none":
                m.b = None
            elif change == "del" and "b" in m._modules:
                del m.b
            elif change == "add_module":
                m.add_module("a", m.b)
            elif change == "modules_dict":
                m._modules["a"] = m.b
            elif change == "register_parameter":
                m.register_parameter("w", m.a.bias)
            return m(x), hasattr(m, "b") and m.b is not None, m.a is m._modules["a"]

        xs = [torch.randn(2) for _ in range(2)]
        return autobatch(fn, core=core)(xs) if batched else [fn(x) for x in xs]

    for got, ref in zip(run(True), run(False)):
        torch.testing.assert_close(got[0], ref[0])
        assert got[1:] == ref[1:]


@needs_c
def test_a_module_saved_during_the_call_is_saved_as_it_is():
    torch.manual_seed(0)
    m = Net()
    saved = []

    def fn(x):
        buf = io.BytesIO()
        torch.save(m, buf)
        saved.append(buf.getvalue())
        return m(x)

    autobatch(fn, core="c")([torch.randn(2)])
    loaded = torch.load(io.BytesIO(saved[0]), weights_only=False)
    assert "a" not in vars(loaded)
    loaded.a = None
    assert loaded.a is None


@needs_c
def test_concurrent_calls_share_one_installation():
    nets = [Net(), Net()]
    barrier = threading.Barrier(2)
    errors = []

    def worker(net):
        try:
            barrier.wait(10)
            for _ in range(15):
                autobatch(net, core="c")([torch.randn(2) for _ in range(3)])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    ts = [threading.Thread(target=worker, args=(n,)) for n in nets]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors and nn.Module.__getattr__ is ORIGINAL and "a" not in vars(Net)


class Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(2, 2)


class OwnGetattr(Base):
    def __getattr__(self, name):
        if name == "inner":
            return "own"
        return super().__getattr__(name)


@needs_c
def test_a_subclass_with_its_own_getattr_keeps_it():
    base, own = Base(), OwnGetattr()
    seen = {}

    def f(x):
        seen["patched"] = type(vars(Base).get("inner")).__name__
        seen["base"], seen["own"] = base.inner is base._modules["inner"], own.inner
        return base.inner(x)

    autobatch(f, core="c")([torch.zeros(2)])
    assert seen == {"patched": "ModuleAttr", "base": True, "own": "own"}
    assert "inner" not in vars(Base)


@needs_c
def test_class_lookups_and_shadowing_instance_attributes_are_as_in_eager():
    m = Base()
    seen = {}

    def f(x):
        seen["class_hasattr"] = hasattr(Base, "inner")
        try:
            Base.inner
        except AttributeError as exc:
            seen["class_error"] = "inner" in str(exc)
        object.__setattr__(m, "inner", "shadow")  # instance __dict__ comes before the class
        seen["shadow"] = m.inner
        del m.__dict__["inner"]
        seen["back"] = m.inner is m._modules["inner"]
        try:
            m.missing
        except AttributeError as exc:
            seen["missing"] = str(exc)
        return x

    autobatch(f, core="c")([torch.zeros(1)])
    assert seen == {"class_hasattr": False, "class_error": True, "shadow": "shadow", "back": True,
                    "missing": "'Base' object has no attribute 'missing'"}


@needs_c
def test_a_class_attribute_set_during_the_call_is_left_as_set():
    m = Base()

    def f(x):
        Base.inner = "mine"  # replaces the descriptor; in eager too the class attribute comes first
        return m.inner

    try:
        out = autobatch(f, core="c")([torch.zeros(1)])
        assert out == ["mine"] and vars(Base)["inner"] == "mine"
    finally:
        if "inner" in vars(Base):
            del Base.inner


@needs_c
def test_another_thread_reading_the_same_class_during_a_call_sees_eager_values():
    torch.manual_seed(0)
    nets = [Net(), Net()]
    stop = threading.Event()
    wrong = []

    def reader():
        other = nets[1]
        while not stop.is_set():
            if other.a is not other._modules["a"] or other.w is not other._parameters["w"]:
                wrong.append(1)
            try:
                other.nothing
            except AttributeError as exc:
                if str(exc) != "'Net' object has no attribute 'nothing'":
                    wrong.append(str(exc))

    t = threading.Thread(target=reader)
    t.start()
    try:
        for _ in range(20):
            autobatch(nets[0], core="c")([torch.randn(2) for _ in range(3)])
    finally:
        stop.set()
        t.join()
    assert not wrong and "a" not in vars(Net)


class Defaults:
    proj = None
    norm = None


class WithProj(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x) if self.proj is not None else x


class MixedIn(WithProj, Defaults):  # MRO: MixedIn, WithProj, Defaults, Module: Defaults.proj wins
    pass


@pytest.mark.parametrize("core", CORES)
def test_a_class_attribute_from_a_later_mixin_still_wins_as_in_eager(core):
    # hostile helper (stop 30, reliability #63): a descriptor on WithProj hid Defaults.proj from MixedIn
    torch.manual_seed(0)
    base, mixed = WithProj(), MixedIn()

    def fn(x):
        return base(x) + mixed(x), type(mixed).proj is None

    xs = [torch.randn(4) for _ in range(3)]
    for got, ref in zip(autobatch(fn, core=core)(xs), [fn(x) for x in xs]):
        torch.testing.assert_close(got[0], ref[0])
        assert got[1] is ref[1] is True
    assert "proj" not in vars(WithProj)


@needs_c
def test_a_subclass_made_during_the_call_sees_its_later_mixin():
    # checked at its first lookup (ModuleAttr.verified): the descriptor on WithProj is installed
    class Fresh(WithProj):  # no subclass with a later mixin exists yet: it gets the descriptor
        pass

    torch.manual_seed(1)
    base = Fresh()
    seen = {}

    def fn(x):
        cls = type("Late", (Fresh, Defaults), {})  # a new class during the call
        late = cls.__new__(cls)
        late.__dict__.update(base.__dict__)  # (modules cannot be built inside instance code)
        seen["installed"] = type(vars(Fresh).get("proj")).__name__
        seen["late"], seen["class"] = late.proj, type(late).proj
        return base(x)

    autobatch(fn, core="c")([torch.randn(4) for _ in range(2)])
    assert seen == {"installed": "ModuleAttr", "late": None, "class": None}


@pytest.mark.parametrize("core", CORES)
def test_a_bare_module_container_gets_no_descriptor(core):
    # hostile helper (stop 30, reliability #63): the descriptor went on nn.Module itself, which
    # every module class reaches before a mixin listed after nn.Module
    class Net(nn.Module, Defaults):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.extra = nn.Module()
            self.extra.add_module("norm", nn.LayerNorm(4))

        def forward(self, x):
            y = self.lin(x)
            y = self.norm(y) if self.norm is not None else y
            return self.extra.norm(y)

    torch.manual_seed(2)
    net = Net()
    xs = [torch.randn(4) for _ in range(3)]
    for got, ref in zip(autobatch(net, core=core)(xs), [net(x) for x in xs]):
        torch.testing.assert_close(got, ref)
    assert "norm" not in vars(nn.Module)


def _base_and_scaled_net():
    """A fresh (Base, Net(Base)) pair, Net holding a parameter ``scale``: each test may give
    Base attributes without touching other tests' classes."""
    class Base(nn.Module):
        pass

    class Net(Base):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(2.0))

    return Base, Net


@pytest.mark.parametrize("fast_modules", [True, False])
def test_a_base_class_property_set_during_the_call_is_read_as_eager(fast_modules):
    # reliability #139 (hostile find, stop 35): the lookup descriptor put on the leaf class was
    # found before a property given to a base class during the call
    Base, Net = _base_and_scaled_net()

    def run(net, x, flag):
        y = x * net.scale
        if bool(y.sum() > -1e9):  # a wait: other instances run meanwhile
            Base.scale = property(lambda self: torch.tensor(100.0))
        try:
            return y + net.scale
        finally:
            if flag:
                del Base.scale

    net = Net()
    xs = [torch.ones(2), torch.zeros(2)]
    ref = []
    for x in xs:
        ref.append(run(net, x, True))
    out = autobatch(lambda x: run(net, x, False), core="c", fast_modules=fast_modules)(xs) \
        if _native.available else None
    if hasattr(Base, "scale"):
        del Base.scale
    if out is None:
        pytest.skip("C core not built")
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)


@pytest.mark.parametrize("fast_modules", [True, False])
def test_class_attributes_set_and_removed_between_two_reads_are_seen(fast_modules):
    # the descriptor remembers "nothing later in the MRO" per type version (C core): setting or
    # deleting a base class's attribute gives the type a new version, so the next read walks again
    Base, Net = _base_and_scaled_net()

    def run(net, x):
        a = x * net.scale
        Base.scale = property(lambda self: torch.tensor(100.0))
        try:
            b = x * net.scale
        finally:
            del Base.scale
        return a, b, x * net.scale

    net = Net()
    xs = [torch.ones(2), torch.full((2,), 3.0)]
    ref = [run(net, x) for x in xs]
    for core in CORES:
        out = autobatch(lambda x: run(net, x), core=core, fast_modules=fast_modules)(xs)
        assert not hasattr(Base, "scale")
        for o, r in zip(out, ref):
            for a, b in zip(o, r):
                torch.testing.assert_close(a, b)


class _Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.sub = nn.Linear(2, 2)
        self.other = nn.Linear(2, 2)
        # made outside the call (instance code may not make parameters or modules)
        self.__dict__["spares"] = dict(param=nn.Parameter(torch.ones(2)), buffer=torch.full((2,), 3.0),
                                       modules=[nn.Linear(2, 2) for _ in range(4)])


def _spare_module(p):
    return p.spares["modules"].pop()


# each step changes what ``pair.sub`` reads, in one of the ways a read remembered by the C
# descriptor (Python 3.11: the dicts' version tags) must notice; the read after each is compared
MUTATIONS = {
    "parameter_shadows": lambda p: p._parameters.__setitem__("sub", p.spares["param"]),
    "parameter_removed": lambda p: p._parameters.pop("sub", None),
    "buffer_shadows": lambda p: p._buffers.__setitem__("sub", p.spares["buffer"]),
    "buffer_removed": lambda p: p._buffers.pop("sub", None),
    "module_replaced": lambda p: p._modules.__setitem__("sub", p.other),
    "modules_table_replaced": lambda p: p.__dict__.__setitem__("_modules", {"sub": _spare_module(p),
                                                                            "other": p.other}),
    "instance_dict_shadows": lambda p: p.__dict__.__setitem__("sub", "in __dict__"),
    "instance_dict_cleared": lambda p: p.__dict__.pop("sub", None),
    "setattr_module": lambda p: setattr(p, "sub", _spare_module(p)),
    "unrelated_write": lambda p: setattr(p, "flag", True),
    "deleted": lambda p: p._modules.pop("sub", None),
}


def _reads(pairs, order):
    """What ``pair.sub`` reads (by kind and identity) after each mutation, alternating instances."""
    out = []
    for name in order:
        for p in pairs:
            MUTATIONS[name](p)
            try:
                v = p.sub
            except AttributeError as e:
                out.append(("error", str(e)))
                continue
            out.append((type(v).__name__, id(v)))
    return out


@pytest.mark.parametrize("core", CORES)
def test_repeated_reads_see_every_change_between_them(core):
    order = list(MUTATIONS) + ["setattr_module", "module_replaced", "parameter_shadows", "buffer_shadows",
                               "parameter_removed", "buffer_removed", "deleted", "setattr_module"]
    assert order.count("setattr_module") + order.count("modules_table_replaced") <= 4  # (spare modules)

    def run(batched):
        torch.manual_seed(0)
        a, b = _Pair(), _Pair()
        pairs = [a, b]
        seen = []

        def fn(x):  # (a and b in its closure: their class gets the descriptors)
            seen.append(_reads([a, b], order))
            seen.append(type(vars(_Pair).get("sub")).__name__)
            return x * 2

        xs = [torch.ones(1)]
        if batched:
            autobatch(fn, core=core)(xs)
        else:
            fn(xs[0])
        # ids are compared through the objects still held (each run builds its own)
        return [[(kind, ident if kind == "error" else _index_of(ident, pairs)) for kind, ident in seen[0]],
                seen[1]]

    got, ref = run(True), run(False)
    assert got[0] == ref[0]
    assert got[1] == ("ModuleAttr" if core == "c" and _native.available else "NoneType")


def _index_of(ident, pairs):
    """A stable name for an object read: which pair's table holds it now, or 'gone'."""
    for i, p in enumerate(pairs):
        for table in ("_parameters", "_buffers", "_modules"):
            for k, v in vars(p)[table].items():  # (a table made by "modules_table_replaced" too)
                if id(v) == ident:
                    return (i, table, k)
        if vars(p).get("sub") is not None and id(vars(p)["sub"]) == ident:
            return (i, "__dict__", "sub")
    return "gone"


class _Getattr(nn.Linear):
    pass


@needs_c
def test_the_plan_kept_between_calls_follows_every_change_to_the_module_tree():
    # AutoBatched keeps the last plan (attrs.PlanCache) while the walked modules' token is equal
    # (Python 3.11: the dicts' version tags); after each change a call must use what a fresh walk gives
    net = Net()
    spare = nn.Linear(2, 2)
    fn = autobatch(lambda x: net(x))
    changes = [
        lambda: None,
        lambda: net.add_module("c", nn.Linear(2, 2)),  # a new submodule: its class and names
        lambda: setattr(net.a, "extra", nn.Parameter(torch.ones(1))),  # a new parameter name
        lambda: net.b.register_buffer("running", torch.zeros(1)),
        lambda: delattr(net, "c"),
        lambda: setattr(net.a, "__class__", _Getattr),  # a module's class changed
        lambda: setattr(_Getattr, "__getattr__", lambda self, name: nn.Module.__getattr__(self, name)),
        lambda: delattr(_Getattr, "__getattr__"),
        lambda: net._modules.__setitem__("b", spare),  # same names, another module
        lambda: spare.register_parameter("bias", None),
    ]
    xs = [torch.randn(2) for _ in range(2)]
    for change in changes:
        change()
        fn(xs)
        assert fn._plans.pairs == attrs.plan(lambda x: net(x)), change
    # a function reaching other modules: other roots
    other = Net()
    fn2 = autobatch(lambda x: other(x) + net(x))
    fn2(xs)
    assert {c for c, _ in fn2._plans.pairs} >= {Net, nn.Linear}


@pytest.mark.parametrize("how", ["module.compile", "torch.compile"])
def test_a_compiled_model_gets_no_descriptors_and_matches_eager(how):
    # dynamo reads class attributes statically and cannot call a ModuleAttr: before the fix a
    # compiled model under autobatch failed with "'ModuleAttr' object is not callable"
    torch.manual_seed(0)
    net = Net()
    model = torch.compile(net, backend="eager") if how == "torch.compile" else net
    if how == "module.compile":
        net.compile(backend="eager")
    xs = [torch.randn(2) for _ in range(3)]
    ref = [model(x) for x in xs]
    f = autobatch(model)
    for _ in range(2):
        for o, r in zip(f(xs), ref):
            torch.testing.assert_close(o, r)
    assert not f._plans.pairs or not _native.available
    assert not any(type(v).__name__ == "ModuleAttr" for v in vars(Net).values())


class _CollidingKey(str):
    """A table key whose hash equals "w"'s: its __eq__ runs inside the lookup of "w"."""

    armed: list = []

    def __hash__(self):
        return hash("w")

    def __eq__(self, other):
        if _CollidingKey.armed:
            m, p = _CollidingKey.armed.pop()
            m._parameters["w"] = p  # a table already read changes during the lookup
        return False


class _WithColliding(nn.Module):
    def __init__(self):
        super().__init__()
        self._buffers[_CollidingKey("zz")] = torch.zeros(1)
        self._buffers["w"] = torch.full((1,), 1.0)


@pytest.mark.parametrize("core", CORES)
def test_a_lookup_that_changes_a_table_already_read_is_not_remembered(core):
    # hostile helper, stop 51: the C descriptor remembered the hit with the tags after the
    # lookups, so the second read returned the buffer eager no longer finds first
    def run(batched):
        m, spare = _WithColliding(), nn.Parameter(torch.full((1,), 7.0))

        def fn(x):
            _CollidingKey.armed.append((m, spare))
            a = m.w  # the buffer (1.0); its lookup registers the parameter "w" (7.0)
            b = m.w  # eager: the parameter
            return x + 10 * a + b

        xs = [torch.ones(1)]
        return [o.item() for o in (autobatch(fn, core=core)(xs) if batched else map(fn, xs))]

    assert run(True) == run(False) == [18.0]


def test_the_kept_plan_does_not_keep_dropped_modules_alive():
    # hostile helper, stop 51: the plan kept between calls held the last call's modules strongly
    import gc
    import weakref

    holder = {"model": nn.Sequential(nn.Linear(4, 4), nn.Tanh())}
    model = holder["model"]
    f = autobatch(lambda x: model(x))
    f([torch.randn(4)])
    old_sub = weakref.ref(model[0])
    model[0] = nn.Linear(4, 4)  # a submodule replaced between calls
    gc.collect()
    assert old_sub() is None
    f([torch.randn(4)])  # the next call walks again and still matches eager
    x = torch.randn(4)
    torch.testing.assert_close(f([x])[0], model(x))
    old_model = weakref.ref(model)
    model = nn.Sequential(nn.Linear(4, 4))  # the closure's model replaced
    del holder
    gc.collect()
    assert old_model() is None
    torch.testing.assert_close(f([x])[0], model(x))


class _RefusingMeta(type):
    def __setattr__(cls, name, value):
        if name == "b":
            raise RuntimeError("class attribute b is read-only")
        super().__setattr__(name, value)


class _Refusing(nn.Module, metaclass=_RefusingMeta):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.ones(2))
        self.b = nn.Parameter(torch.full((2,), 2.0))

    def forward(self, x):
        return x * self.a + self.b


@pytest.mark.parametrize("core", CORES)
def test_a_class_that_refuses_a_descriptor_keeps_eager_reads_and_nothing_stays(core):
    # hostile helper, stop 51 (present before): only TypeError/AttributeError were caught, so the
    # call raised and the descriptors set before stayed on the class
    m = _Refusing()
    xs = [torch.ones(2), torch.zeros(2)]
    out = autobatch(lambda x: m(x), core=core)(xs)
    for o, x in zip(out, xs):
        torch.testing.assert_close(o, m(x))
    assert not [k for k, v in vars(_Refusing).items() if type(v).__name__ == "ModuleAttr"]


class _DefaultingLinear(nn.Linear):
    def __getattribute__(self, name):
        try:
            return object.__getattribute__(self, name)
        except AttributeError:
            if name != "scale":
                raise
            return torch.full((2,), 5.0)  # never reaches nn.Module.__getattr__


@pytest.mark.parametrize("core", CORES)
def test_a_class_with_its_own_getattribute_gets_no_descriptor(core):
    # hostile helper, stop 51 (present before): object.__getattribute__ found the descriptor, so
    # a registered parameter was read where eager's lookup raised and the class's default answered
    lin = _DefaultingLinear(2, 2)
    lin._parameters["scale"] = nn.Parameter(torch.ones(2))
    assert lin.scale.sum().item() == 10.0  # eager: the class's default, not the parameter

    def fn(x):
        return lin(x) * lin.scale.sum()

    xs = [torch.ones(2), torch.zeros(2)]
    for o, x in zip(autobatch(fn, core=core)(xs), xs):
        torch.testing.assert_close(o, fn(x))


class _ScaledNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(3))

    def forward(self, x):
        return x * self.scale


class _ScaledSub(_ScaledNet):
    def __getattribute__(self, n):
        try:
            return object.__getattribute__(self, n)
        except AttributeError:
            if n == "scale" and object.__getattribute__(self, "__dict__").get("ready"):
                return torch.full((3,), 5.0)
            raise


@pytest.mark.parametrize("core", CORES)
def test_a_subclass_with_its_own_getattribute_misses_its_bases_descriptor(core):
    # hostile helper, stop 51: the base class got the descriptor; the subclass inherited it
    m, s = _ScaledNet(), _ScaledSub()
    s.ready = True
    fn = lambda x: m(x) + s.scale  # noqa: E731
    xs = [torch.zeros(3), torch.ones(3)]
    for o, x in zip(autobatch(fn, core=core)(xs), xs):
        torch.testing.assert_close(o, fn(x))


class _RefuseDel(type(nn.Module)):
    def __delattr__(cls, n):
        raise TypeError("no deletes")


class _DelNet(nn.Module, metaclass=_RefuseDel):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x)


@pytest.mark.parametrize("core", CORES)
def test_a_metaclass_refusing_deletes_still_loses_the_descriptor(core):
    m = _DelNet()
    xs = [torch.randn(3) for _ in range(2)]
    for o, x in zip(autobatch(lambda x: m(x), core=core)(xs), xs):
        torch.testing.assert_close(o, m(x))
    assert "lin" not in vars(_DelNet)
