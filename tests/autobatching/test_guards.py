"""Guards a newcomer meets (issue 15 item 8)."""

from __future__ import annotations

import pytest
import torch

from batchcraft import RunStats, autobatch


def test_one_tensor_where_the_instances_belong_is_a_clear_error():
    f = autobatch(lambda x: x * 2)
    with pytest.raises(TypeError, match=r"sequence of instances.*one Tensor of shape \(4, 3\).*list\(x\)"):
        f(torch.randn(4, 3))
    out = f(list(torch.randn(4, 3)))  # the fix the message names works
    assert len(out) == 4 and out[0].shape == (3,)


def test_stats_are_an_empty_runstats_before_the_first_call():
    f = autobatch(lambda x: x * 2)
    assert isinstance(f.stats, RunStats)
    assert f.stats.instances == 0 and f.stats.batched_calls == 0 and f.stats.fallback_reasons == {}
    f([torch.ones(2)])
    assert f.stats.instances == 1 and f.stats.core in ("c", "python")


def test_bad_options_name_option_and_value():
    for kw, match in ((dict(scheduler="fifo"), "scheduler"), (dict(core="rust"), "core"),
                      (dict(max_pending=0), "max_pending"), (dict(kernels="mkl"), "kernels"),
                      (dict(ragged="yes"), "ragged")):
        with pytest.raises(ValueError, match=match):
            autobatch(lambda x: x, **kw)
