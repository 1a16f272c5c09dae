"""Math-library knobs: the profiler shows the kernel that ran; values equal PyTorch's default to
float32 rounding; training (gradients needed) keeps the default kernel; weights are packed once
and repacked when they change."""

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from batchcraft.errors import ConfigurationError
from batchcraft.parallel import InterOpExecutor, analyze, backends
from batchcraft.parallel.analysis import trace

KERNELS = {"default": "aten::addmm", "mkl-packed": "mkl::_mkl_linear", "onednn": "mkldnn::_linear_pointwise"}
CONV_KERNELS = {"default": "aten::mkldnn_convolution", "channels-last": "aten::mkldnn_convolution",
                "native": "aten::_slow_conv2d_forward"}


def ops_run(fn):
    with profile(activities=[ProfilerActivity.CPU]) as p:
        fn()
    return {e.key for e in p.key_averages()}


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 6 * 6, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.c2(torch.relu(self.c1(x)))).flatten(1))


@pytest.mark.parametrize("matmul", backends.available_matmul())
def test_each_matmul_backend_runs_its_kernel_and_equals_the_default(matmul):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 7)).eval()
    x = torch.randn(5, 64)
    with torch.inference_mode():
        ref = model(x)
        fast = backends.convert(model, matmul=matmul)
        out = fast(x)
        seen = ops_run(lambda: fast(x))
    assert KERNELS[matmul] in seen
    assert all(k not in seen for m, k in KERNELS.items() if m != matmul)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert fast[0].weight is model[0].weight  # weights shared, not copied


@pytest.mark.parametrize("conv", backends.CONV_BACKENDS)
def test_each_conv_backend_runs_its_kernel_and_equals_the_default(conv):
    torch.manual_seed(0)
    model, x = ConvNet().eval(), torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        ref = model(x)
        fast = backends.convert(model, conv=conv)
        out = fast(x)
        seen = ops_run(lambda: fast(x))
    assert CONV_KERNELS[conv] in seen
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if conv == "channels-last":
        assert fast.c1.weight.is_contiguous(memory_format=torch.channels_last)
        assert not model.c1.weight.is_contiguous(memory_format=torch.channels_last)  # the original is untouched
        assert fast.fc.weight is model.fc.weight
    assert torch._C._get_mkldnn_enabled()  # "native" switches oneDNN off only during its call


def test_training_keeps_the_default_kernel_and_gradients_equal_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    fast = backends.convert(model, matmul="onednn")
    x = torch.randn(4, 8)
    seen = ops_run(lambda: fast(x).sum().backward())
    assert "aten::addmm" in seen and "mkldnn::_linear_pointwise" not in seen
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    for g, p in zip(grads, model.parameters()):  # shared parameters: same gradients
        torch.testing.assert_close(g, p.grad)


def test_packs_are_made_once_per_batch_size_and_remade_when_the_weight_changes():
    lin = nn.Linear(16, 4)
    fast = backends.convert(nn.Sequential(lin), matmul="mkl-packed")[0]
    with torch.no_grad():
        for rows in (1, 3, 3, 5):
            fast(torch.randn(rows, 16))
        assert sorted(fast.__dict__["_batchcraft_packs"]["by_rows"]) == [1, 3, 5]
        fast(torch.randn(7, 16))  # more batch sizes than MAX_PACKS: the default kernel, no new pack
        assert len(fast.__dict__["_batchcraft_packs"]["by_rows"]) == backends.MAX_PACKS
        lin.weight.mul_(2)  # changed in place: the packs are stale
        x = torch.randn(3, 16)
        torch.testing.assert_close(fast(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
        assert sorted(fast.__dict__["_batchcraft_packs"]["by_rows"]) == [3]
        x3 = torch.randn(2, 3, 16)  # leading dimensions are flattened and restored
        torch.testing.assert_close(fast(x3), torch.nn.functional.linear(x3, lin.weight, lin.bias))


def test_install_switches_every_layer_of_the_process_and_uninstall_restores():
    model = nn.Sequential(nn.Linear(8, 8)).eval()
    x = torch.randn(2, 8)
    try:
        backends.install(matmul="onednn")
        with torch.no_grad():
            assert "mkldnn::_linear_pointwise" in ops_run(lambda: model(x))
            assert "mkldnn::_linear_pointwise" in ops_run(lambda: nn.Linear(8, 3)(x))  # built after, too
    finally:
        backends.uninstall()
    assert nn.Linear.forward is backends._ORIGINAL["linear"]
    with torch.no_grad():
        assert "aten::addmm" in ops_run(lambda: model(x))


def test_converted_graph_modules_run_in_the_inter_op_executor():
    torch.manual_seed(0)
    model = ConvNet().eval()
    x = torch.randn(3, 3, 6, 6)
    gm = backends.convert(trace(model), matmul="onednn", conv="channels-last")
    with torch.inference_mode(), InterOpExecutor(gm, inter_op_threads=2, intra_op_threads=1) as run:
        torch.testing.assert_close(run(x), model(x), rtol=1e-5, atol=1e-5)
        assert "mkldnn::_linear_pointwise" in ops_run(lambda: gm(x))  # (the profiler sees the calling thread)


def test_knobs_are_tried_only_for_layer_kinds_with_a_real_share_of_the_work():
    convs = analyze(ConvNet(), torch.randn(1, 3, 6, 6))
    rel = backends.relevant_knobs(convs)
    assert rel["conv"] == ("default", "channels-last") and rel["matmul"] == ("default",)  # fc: <1% of FLOPs
    assert backends.relevant_knobs(convs, min_fraction=0.0)["matmul"] == backends.available_matmul()
    assert backends.relevant_knobs(None) == {"matmul": ("default",), "conv": ("default",)}


def test_bad_backends():
    with pytest.raises(ConfigurationError, match="matmul backend must be one of"):
        backends.convert(nn.Linear(2, 2), matmul="blas")
    with pytest.raises(ConfigurationError, match="conv backend must be one of"):
        backends.install(conv="winograd")


@pytest.mark.parametrize("matmul", ["onednn", "mkl-packed"])
@pytest.mark.parametrize("how", ["jvp", "dual_level"])
def test_forward_mode_derivatives_keep_the_default_kernel(matmul, how):
    # reliability #206 (stop 41): the packed kernels have no forward derivative; under no_grad
    # they ran inside torch.func.jvp and dual levels and the tangents came back zero
    import torch.autograd.forward_ad as fwAD

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    fast = backends.convert(model, matmul=matmul)
    x, tx = torch.randn(5, 16), torch.randn(5, 16)
    with torch.no_grad():
        if how == "jvp":
            got = torch.func.jvp(fast, (x,), (tx,))[1]
            ref = torch.func.jvp(model, (x,), (tx,))[1]
        else:
            with fwAD.dual_level():
                got = fwAD.unpack_dual(fast(fwAD.make_dual(x, tx))).tangent
                ref = fwAD.unpack_dual(model(fwAD.make_dual(x, tx))).tangent
    assert ref.abs().max() > 0.01
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
