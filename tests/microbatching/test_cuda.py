"""cuDNN frontend plans (GPU only): every plan of every pass equals PyTorch's convolution."""

import pytest
import torch
import torch.nn.functional as F

from batchcraft.microbatching.algorithms import ConvGeometry
from batchcraft.microbatching.cuda import available

pytestmark = pytest.mark.gpu


def test_available_explains_itself():
    ok, why = available()
    assert ok or why  # without a GPU or the package, a reason is given


@pytest.mark.skipif(not available()[0], reason=available()[1] or "cuda available")
@pytest.mark.parametrize("tf32", [False, True])
@pytest.mark.parametrize("pass_", ["forward", "backward_data", "backward_filter"])
def test_every_plan_matches_pytorch(pass_, tf32, monkeypatch):
    """float32 plans equal PyTorch's float32 convolution; with TF32 allowed (PyTorch's default for
    cuDNN convolutions) within TF32's rounding: 10-bit mantissas, an error of about 1e-3 of the
    result's scale (an H200 run had a wgrad plan 0.023 off on results of magnitude ~30)."""
    from batchcraft.microbatching.cuda import CudnnConvGraph

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", tf32)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)

    geom = ConvGeometry(8, 16, (3, 3), (1, 1), (1, 1), (1, 1), 1, 12, 12)
    dev = torch.device("cuda")
    x = torch.randn(geom.input_shape(4), device=dev, requires_grad=True)
    w = torch.randn(geom.weight_shape(), device=dev, requires_grad=True)
    y = F.conv2d(x, w, padding=1)
    dy = torch.randn_like(y)
    y.backward(dy)
    ref = {"forward": y, "backward_data": x.grad, "backward_filter": w.grad}[pass_].detach()
    cg = CudnnConvGraph(geom, pass_, 4)
    plans = cg.plans()
    assert plans
    for index, ws in plans:
        bufs = {"x": x.detach().clone(), "w": w.detach().clone(), "y": dy.clone()}
        bufs[cg.out_name] = torch.empty_like(bufs[cg.out_name])
        got = cg.run(index, bufs, torch.empty(max(ws, 1), device=dev, dtype=torch.uint8))
        scale = float(ref.abs().max())
        tol = dict(rtol=1e-2, atol=4e-3 * scale) if tf32 else dict(rtol=1e-4, atol=1e-5 * scale)
        torch.testing.assert_close(got, ref, **tol, msg=lambda m, i=index: f"plan {i}: {m}")
