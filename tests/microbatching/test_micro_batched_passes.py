"""A planned Conv2d equals nn.Conv2d: values, dX, dW, db, for random geometries, divisions and batches.
Micro-batched passes write disjoint slices and accumulate dW; the workspace audit sees real peaks."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from batchcraft.errors import WorkspaceError
from batchcraft.microbatching.algorithms import PASSES, ConvGeometry, algorithms_for
from batchcraft.microbatching.execute import WorkspaceAudit, execute_pass
from batchcraft.microbatching.layer import PlannedConv2d
from batchcraft.microbatching.types import InputKey


@st.composite
def planned_layers(draw):
    k = draw(st.sampled_from([1, 3, 5]))
    stride = draw(st.sampled_from([1, 1, 2]))
    pad = draw(st.integers(0, 2))
    dil = draw(st.sampled_from([1, 1, 2]))
    c, o = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    h = draw(st.integers(dil * (k - 1) + 1, 10))
    w = draw(st.integers(dil * (k - 1) + 1, 10))
    bias = draw(st.booleans())
    conv = nn.Conv2d(c, o, k, stride=stride, padding=pad, dilation=dil, bias=bias)
    geom = ConvGeometry.from_conv(conv, (h, w))
    batch = draw(st.integers(1, 9))
    steps = {}
    for p in PASSES:
        left, seq = batch, []
        while left:  # a random division with a random supported algorithm per micro-batch
            n = draw(st.integers(1, left))
            names = [a.name for a in algorithms_for(geom, p, n, torch.float32)]
            seq.append((draw(st.sampled_from(names)), n))
            left -= n
        steps[p] = seq
    run_batch = draw(st.sampled_from([batch, max(1, batch - 2), batch + 3]))
    return conv, geom, steps, run_batch


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(planned_layers(), st.integers(0, 2 ** 16))
def test_planned_layer_equals_conv2d(case, seed):
    conv, geom, steps, n = case
    torch.manual_seed(seed)
    # steps planned for `batch`, installed for a run of n samples: repeated cyclically, the last cut short
    key = InputKey(geom.input_shape(n), "float32", "cpu")
    planned = PlannedConv2d(conv, "layer", geom, steps, key=key)
    x = torch.randn(geom.input_shape(n))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = conv(x1)
    dy = torch.randn_like(y_ref)
    y_ref.backward(dy)
    ref_grads = [p.grad.clone() for p in conv.parameters()]
    conv.zero_grad()
    y = planned(x2)
    y.backward(dy)
    tol = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(x2.grad, x1.grad, **tol)
    for got, ref in zip([p.grad for p in conv.parameters()], ref_grads):
        torch.testing.assert_close(got, ref, **tol)


def test_backward_filter_accumulates_over_micro_batches():
    # the FIELD-FAULTS "last micro-batch wins" bug: dW must be the sum over all micro-batches
    torch.manual_seed(0)
    geom = ConvGeometry(3, 4, (3, 3), (1, 1), (1, 1), (1, 1), 1, 6, 6)
    x, dy = torch.randn(8, 3, 6, 6), torch.randn(8, 4, 6, 6)
    whole = execute_pass("backward_filter", [("default", 8)], dy, x, geom)
    for steps in ([("default", 1)] * 8, [("im2col", 4), ("fft", 2), ("unfold_matmul", 2)]):
        torch.testing.assert_close(execute_pass("backward_filter", steps, dy, x, geom), whole, rtol=1e-4, atol=1e-4)
    last_only = execute_step_last = execute_pass("backward_filter", [("default", 1)], dy[-1:], x[-1:], geom)
    assert not torch.allclose(last_only, whole)
    del execute_step_last


def test_forward_slices_are_disjoint_and_in_order():
    torch.manual_seed(0)
    geom = ConvGeometry(2, 3, (3, 3), (1, 1), (1, 1), (1, 1), 1, 5, 5)
    x, w = torch.randn(7, 2, 5, 5), torch.randn(3, 2, 3, 3)
    whole = execute_pass("forward", [("default", 7)], x, w, geom)
    # samples differ, so a wrong offset would show
    divided = execute_pass("forward", [("fft", 4), ("im2col", 2), ("default", 1)], x, w, geom)
    torch.testing.assert_close(divided, whole, rtol=1e-4, atol=1e-4)


def test_unplanned_pass_refuses_instead_of_running_unbudgeted():
    conv = nn.Conv2d(2, 2, 3, padding=1)
    planned = PlannedConv2d(conv, "features.0", ConvGeometry.from_conv(conv, (5, 5)), {"forward": [("default", 2)]})
    y = planned(torch.randn(2, 2, 5, 5, requires_grad=True))
    with pytest.raises(WorkspaceError, match="features.0.*backward_data"):
        y.sum().backward()


def test_an_input_without_plan_or_session_is_reported():
    conv = nn.Conv2d(2, 2, 3)
    planned = PlannedConv2d(conv, "c", ConvGeometry.from_conv(conv, (5, 5)), {"forward": [("default", 1)]})
    planned(torch.randn(1, 2, 5, 5))
    with pytest.raises(WorkspaceError, match=r"layer c: no plan for input \(1, 2, 6, 6\) float32"):
        planned(torch.randn(1, 2, 6, 6))
    with pytest.raises(WorkspaceError, match="expected input"):
        planned(torch.randn(1, 3, 5, 5))


def test_parameters_are_shared_not_copied():
    conv = nn.Conv2d(2, 2, 3)
    planned = PlannedConv2d(conv, "c", ConvGeometry.from_conv(conv, (5, 5)), {})
    assert planned.weight is conv.weight and planned.bias is conv.bias
    assert len(list(planned.parameters())) == 2


def test_audit_measures_divided_workspace_below_undivided():
    geom = ConvGeometry(8, 8, (3, 3), (1, 1), (1, 1), (1, 1), 1, 16, 16)
    conv = nn.Conv2d(8, 8, 3, padding=1, bias=False)
    x = torch.randn(16, 8, 16, 16)
    peaks = {}
    for steps in ([("im2col", 16)], [("im2col", 2)] * 8):
        planned = PlannedConv2d(conv, "c", geom, {"forward": steps})
        with WorkspaceAudit() as audit, torch.no_grad():
            planned(x)
        peaks[len(steps)] = audit.peak_bytes[("c", "forward")]
    # im2col columns: 16 samples x 72 rows x 256 columns x 4 bytes = 1.1 MiB undivided
    assert peaks[1] >= 16 * 72 * 256 * 4 * 0.9
    assert peaks[8] < peaks[1] / 3
