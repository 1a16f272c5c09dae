"""torch.compile and torch.export of a planned ResNet-18 run and equal the original (slow: compiling takes tens of s)."""

import copy

import pytest
import torch

from batchcraft import models
from batchcraft.microbatching import microbatch

pytestmark = pytest.mark.slow

ALGOS = ("default", "im2col", "unfold_matmul")  # some layers leave PyTorch's own call
# 64x64, not smaller: in train mode the last BatchNorm normalises 2 samples x 2x2 pixels; at 1x1 it would turn
# rounding differences of 1e-7 into output differences of 1e-2 (ill-conditioned, for any two algorithms)


@pytest.fixture(scope="module")
def resnet_pair():
    torch.manual_seed(0)
    original = models.get("resnet18")
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    planned = microbatch(copy.deepcopy(original), x, "1MiB", cache=False, progress=False, repeats=1,
                         confirm=False, verify=False, algorithms=ALGOS)
    used = {c.algorithm for _, _, pp in planned.plan.pass_plans() for c in pp.choice.steps}
    assert used - {"default"}, "test setup: the plan should use other algorithms than the default"
    return original, planned, x


def _close(got, ref, what, rel=1e-4):
    # normwise: float32 sums of a train step differ by ~1e-6 of the tensor's scale between algorithms
    err, scale = float((got - ref).abs().max()), float(ref.abs().max())
    assert err <= rel * max(scale, 1e-6), f"{what}: max |diff| {err:.3g} vs scale {scale:.3g}"


def _grads(model, x, run=None):
    model.train()
    model.zero_grad()
    y = (model if run is None else run)(x)
    y.square().sum().backward()
    return y.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_torch_compile_of_a_planned_resnet18_equals_the_original(resnet_pair):
    # Inductor (the default backend) on the forward; a training step through AOTAutograd below. Inductor's
    # training step also passes (checked by hand: ~45 s of C++ compilation on 2 cores, too slow for the suite).
    original, planned, x = resnet_pair
    model = copy.deepcopy(planned).eval()
    with torch.no_grad():
        _close(torch.compile(model)(x), copy.deepcopy(original).eval()(x), "compiled eval output")


def test_torch_compile_training_step_equals_the_original(resnet_pair):
    # dynamo + AOTAutograd: traces the custom op's fake implementation and its registered autograd formula
    original, planned, x = resnet_pair
    ref_model, model = copy.deepcopy(original), copy.deepcopy(planned)
    compiled = torch.compile(model, backend="aot_eager")
    y_ref, g_ref = _grads(ref_model, x)
    y, g = _grads(model, x, compiled)
    _close(y, y_ref, "output")
    for k in g_ref:
        _close(g[k], g_ref[k], "d" + k)
    for k, v in ref_model.state_dict().items():  # BatchNorm running statistics updated alike
        _close(model.state_dict()[k].double(), v.double(), k)
    assert list(model.state_dict()) == list(original.state_dict())


def test_torch_export_of_a_planned_resnet18_equals_the_original(resnet_pair):
    original, planned, x = resnet_pair
    model = copy.deepcopy(planned).eval()
    ep = torch.export.export(model, (x,))
    ops = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert sum(str(t).startswith("batchcraft.planned_conv2d") for t in ops) == 20  # every convolution
    assert not any("aten.convolution" in str(t) for t in ops)
    with torch.no_grad():
        _close(ep.module()(x), copy.deepcopy(original).eval()(x), "exported output")
    assert set(ep.state_dict) <= set(original.state_dict())  # the original's parameter and buffer names


def test_export_of_an_unplanned_shape_says_what_to_do(resnet_pair):
    _, planned, _ = resnet_pair
    model = copy.deepcopy(planned).eval()
    with pytest.raises(Exception, match="no plan for input .* while exporting"):
        torch.export.export(model, (torch.randn(3, 3, 48, 48),))


def test_a_compiled_planned_model_plans_a_new_shape_on_first_sight():
    # the planning hook runs eagerly (a graph break): the new shape is planned, then compiled
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(4, 2, 3))
    ref = copy.deepcopy(net)
    planned = microbatch(net, torch.randn(4, 3, 10, 10), "1MiB", cache=False, progress=False, repeats=1,
                         verify=False, algorithms=("im2col", "unfold_matmul"))
    compiled = torch.compile(planned, backend="aot_eager")
    for shape in [(4, 3, 10, 10), (3, 3, 13, 11), (3, 3, 13, 11)]:
        x = torch.randn(shape)
        with torch.no_grad():
            _close(compiled(x), ref(x), f"compiled {shape}")
    assert [i.key.shape for i in planned.plan.inputs] == [(4, 3, 10, 10), (3, 3, 13, 11)]
