"""The planned convolution as torch.library custom operators: opcheck, fake shapes, encoding, state_dict."""

import pytest
import torch
from torch import nn

from batchcraft.microbatching import microbatch
from batchcraft.microbatching.op import decode_steps, encode_steps, planned_conv2d, planned_conv2d_backward

STEPS = {
    "divided": {"forward": [("im2col", 3), ("unfold_matmul", 2)], "backward_data": [("fft", 4), ("default", 1)],
                "backward_filter": [("unfold_matmul", 2), ("im2col", 2), ("default", 1)]},
    "default": {"forward": [("default", 5)], "backward_data": [("default", 5)], "backward_filter": [("default", 5)]},
}


def _args(bias: bool, steps: str, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4, 7, 6, generator=g).to(dtype).requires_grad_()
    w = torch.randn(3, 4, 3, 3, generator=g).to(dtype).requires_grad_()
    b = torch.randn(3, generator=g).to(dtype).requires_grad_() if bias else None
    return (x, w, b, [1, 1], [1, 1], [1, 1], 1, "layer1.conv", encode_steps(STEPS[steps]))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("steps", ["divided", "default"])
def test_opcheck_forward_and_autograd(bias, steps):
    # schema, fake (meta) implementation, autograd registration, AOT dispatch (static and dynamic)
    torch.library.opcheck(planned_conv2d, _args(bias, steps))


@pytest.mark.parametrize("mask", [[True, True, True], [True, False, False], [False, True, False]])
def test_opcheck_backward(mask):
    x, w, _, *rest = _args(True, "divided")
    dy = torch.randn(5, 3, 7, 6)
    torch.library.opcheck(planned_conv2d_backward, (dy, x.detach(), w.detach(), *rest, mask))


@pytest.mark.parametrize("steps", ["divided", "default"])
def test_op_equals_conv2d_with_gradients(steps):
    x, w, b, *rest = _args(True, steps, torch.float64)
    y = planned_conv2d(x, w, b, *rest)
    y.square().sum().backward()
    got = (y.detach(), x.grad, w.grad, b.grad)
    x2, w2, b2 = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y2 = torch.nn.functional.conv2d(x2, w2, b2, padding=1)
    y2.square().sum().backward()
    for a, e in zip(got, (y2.detach(), x2.grad, w2.grad, b2.grad)):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


def test_fake_implementation_gives_shapes_without_computing():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, w = torch.empty(6, 4, 9, 11), torch.empty(8, 4, 3, 5)
        y = planned_conv2d(x, w, None, [2, 1], [1, 2], [1, 1], 1, "c", encode_steps({"forward": [("fft", 6)]}))
        assert tuple(y.shape) == (6, 8, 5, 11)
        dx, dw, db = planned_conv2d_backward(torch.empty(6, 8, 5, 11), x, w, [2, 1], [1, 2], [1, 1], 1, "c", "",
                                             [True, True, False])
        assert tuple(dx.shape) == (6, 4, 9, 11) and tuple(dw.shape) == (8, 4, 3, 5) and db.numel() == 0


def test_steps_round_trip_through_their_text():
    for steps in STEPS.values():
        assert decode_steps(encode_steps(steps)) == {p: tuple(s) for p, s in steps.items()}
    assert decode_steps(encode_steps({"forward": [("winograd_2x2_3x3", 16)]})) == {"forward": (("winograd_2x2_3x3", 16),)}


def test_state_dict_keys_and_parameters_stay_the_original_models(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1))
    keys = list(model.state_dict())
    params = [id(p) for p in model.parameters()]
    planned = microbatch(model, torch.randn(4, 3, 8, 8), "1MiB", cache=False, progress=False, repeats=1,
                         verify=False, algorithms=("default", "im2col"))
    assert list(planned.state_dict()) == keys
    assert [id(p) for p in planned.parameters()] == params
    fresh = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1))
    fresh.load_state_dict(planned.state_dict())  # loads into the plain model, and back
    planned.load_state_dict(fresh.state_dict())


@pytest.mark.parametrize("algorithm", ["default", "im2col", "unfold_matmul", "fft", "winograd_2x2_3x3",
                                       "onednn_channels_last"])
def test_outputs_are_not_views_so_in_place_layers_may_follow(algorithm):
    # unfold_matmul's result is a .view() of its matmul: returned as is, relu_ after it raised
    # "Output 0 of GeneratedBackwardFor_batchcraft_planned_conv2d_default is a view and is being modified inplace"
    steps = {p: [(algorithm, 4)] for p in ("forward", "backward_data")}
    steps["backward_filter"] = [("unfold_matmul" if algorithm == "winograd_2x2_3x3" else algorithm, 4)]
    x = torch.randn(4, 3, 8, 8, requires_grad=True)
    w = torch.randn(5, 3, 3, 3, requires_grad=True)
    y = planned_conv2d(x, w, None, [1, 1], [1, 1], [1, 1], 1, "c", encode_steps(steps))
    assert y._base is None
    torch.relu_(y).sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.relu_(torch.nn.functional.conv2d(x2, w2, padding=1)).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-4, atol=1e-4)
