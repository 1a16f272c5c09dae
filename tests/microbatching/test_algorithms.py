"""Every registered algorithm equals PyTorch's convolution, on each pass it claims (differential)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchcraft.microbatching.algorithms import ALGORITHMS, PASSES, ConvGeometry, algorithms_for, get_algorithm


@st.composite
def geometries(draw):
    k = draw(st.sampled_from([1, 3, 5]))
    kw = draw(st.sampled_from([k, 3]))
    stride = draw(st.sampled_from([(1, 1), (1, 1), (2, 2), (2, 1)]))
    dil = draw(st.sampled_from([(1, 1), (1, 1), (2, 1)]))
    pad = (draw(st.integers(0, 2)), draw(st.integers(0, 2)))
    groups = draw(st.sampled_from([1, 1, 1, 2]))
    c, o = groups * draw(st.integers(1, 3)), groups * draw(st.integers(1, 3))
    h = draw(st.integers(dil[0] * (k - 1) + 1, 9))
    w = draw(st.integers(dil[1] * (kw - 1) + 1, 9))
    return ConvGeometry(c, o, (k, kw), stride, pad, dil, groups, h, w), draw(st.integers(1, 5))


def _reference(geom, n, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(geom.input_shape(n), generator=g).to(dtype).requires_grad_()
    w = torch.randn(geom.weight_shape(), generator=g).to(dtype).requires_grad_()
    y = F.conv2d(x, w, None, geom.stride, geom.padding, geom.dilation, geom.groups)
    dy = torch.randn(y.shape, generator=g).to(dtype)
    y.backward(dy)
    return x.detach(), w.detach(), y.detach(), dy, x.grad, w.grad


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(geometries(), st.integers(0, 2 ** 16))
def test_every_algorithm_matches_conv2d(case, seed):
    geom, n = case
    x, w, y, dy, dx, dw = _reference(geom, n, seed)
    assert geom.output_shape(n) == tuple(y.shape)
    for pass_, args, ref in [("forward", (x, w), y), ("backward_data", (dy, w), dx), ("backward_filter", (dy, x), dw)]:
        for algo in algorithms_for(geom, pass_, n, torch.float32):
            got = algo.run(pass_, *args, geom)
            assert got.shape == ref.shape, (algo.name, pass_)
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * max(1.0, ref.abs().max().item()),
                                       msg=lambda m: f"{algo.name} {pass_} {geom.key()} n={n}: {m}")


def test_grouped_convolutions_get_only_onednn_paths():
    # groups != 1: PyTorch's default (and oneDNN channels_last, which handles groups) only
    geom = ConvGeometry(4, 4, (3, 3), (1, 1), (1, 1), (1, 1), 2, 8, 8)
    for p in PASSES:
        names = [a.name for a in algorithms_for(geom, p, 2, torch.float32)]
        assert names[0] == "default" and set(names) <= {"default", "onednn_channels_last"}


def test_special_algorithms_are_offered_where_they_apply():
    geom = ConvGeometry(8, 8, (3, 3), (1, 1), (1, 1), (1, 1), 1, 12, 12)
    fwd = {a.name for a in algorithms_for(geom, "forward", 16, torch.float32)}
    assert {"default", "onednn_channels_last", "im2col", "unfold_matmul", "fft", "winograd_2x2_3x3"} <= fwd
    assert "winograd_2x2_3x3" not in {a.name for a in algorithms_for(geom, "backward_filter", 16, torch.float32)}
    strided = ConvGeometry(8, 8, (3, 3), (2, 2), (1, 1), (1, 1), 1, 12, 12)
    names = {a.name for a in algorithms_for(strided, "forward", 16, torch.float32)}
    assert "fft" not in names and "winograd_2x2_3x3" not in names


def test_stated_workspace_grows_with_micro_batch():
    geom = ConvGeometry(8, 8, (3, 3), (1, 1), (1, 1), (1, 1), 1, 12, 12)
    for name in ["im2col", "fft", "winograd_2x2_3x3", "onednn_channels_last"]:
        a = get_algorithm(name)
        assert a.workspace_bytes(geom, "forward", 8) > a.workspace_bytes(geom, "forward", 1) > 0


def test_unknown_algorithm_lists_known():
    with pytest.raises(KeyError, match="fft"):
        get_algorithm("magic")


def test_geometry_key_distinguishes_hyperparameters():
    a = ConvGeometry(8, 8, (3, 3), (1, 1), (1, 1), (1, 1), 1, 12, 12)
    b = ConvGeometry(8, 8, (3, 3), (1, 1), (1, 1), (2, 2), 1, 12, 12)
    assert a.key() != b.key() and len(set(ALGORITHMS)) == len(ALGORITHMS)


# normwise, vs float64 truth; float16: PyTorch's own default backward_filter reached 4.5e-3 on a
# 1x1 geometry (fp16 partial sums), so 4e-3 was tighter than the dtype allows
_DTYPE_TOL = {torch.float64: 1e-10, torch.bfloat16: 3e-2, torch.float16: 1e-2}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(geometries(), st.integers(0, 2 ** 16), st.sampled_from(sorted(_DTYPE_TOL, key=str)))
def test_every_algorithm_that_claims_a_dtype_computes_in_it(case, seed, dtype):
    geom, n = case
    x, w, y, dy, dx, dw = _reference(geom, n, seed, torch.float64)
    truth = {"forward": y, "backward_data": dx, "backward_filter": dw}
    args = {"forward": (x, w), "backward_data": (dy, w), "backward_filter": (dy, x)}
    for pass_ in PASSES:
        for algo in algorithms_for(geom, pass_, n, dtype):
            got = algo.run(pass_, *(t.detach().to(dtype) for t in args[pass_]), geom)
            assert got.dtype == dtype, (algo.name, pass_)
            ref = truth[pass_]
            err = float((got.double() - ref).abs().max())
            assert err <= _DTYPE_TOL[dtype] * max(1.0, float(ref.abs().max())), (algo.name, pass_, dtype, err)


def test_algorithms_that_cannot_run_a_dtype_say_why():
    from batchcraft.microbatching.algorithms import unsupported_algorithms

    f64 = unsupported_algorithms(PASSES, torch.float64)
    assert "cannot run forward in float64" in f64["nnpack forward"]  # found by trying the kernel
    assert "onednn_nchw forward" in f64 and "fft forward" not in f64
    bf16 = unsupported_algorithms(PASSES, torch.bfloat16)
    assert "Unsupported dtype BFloat16" in bf16["fft backward_filter"]
    assert "16 bits" in bf16["winograd_2x2_3x3 forward"]  # declared: numerically unsafe
    assert unsupported_algorithms(PASSES, torch.float32) == {}
    geom = ConvGeometry(8, 8, (3, 3), (1, 1), (1, 1), (1, 1), 1, 12, 12)
    names = {a.name for a in algorithms_for(geom, "forward", 4, torch.bfloat16)}
    assert "fft" not in names and "default" in names and "im2col" in names
