import torch

from batchcraft.microbatching.memory import peak_extra_bytes, peak_of_events


def test_peak_sees_temporaries_and_result():
    def fn():
        tmp = torch.ones(1 << 20)  # 4 MiB temporary, freed before returning
        out = torch.ones(1 << 18)  # 1 MiB result
        del tmp
        return out

    out, peak = peak_extra_bytes(fn)
    assert out.numel() == 1 << 18
    assert 5 * 2 ** 20 <= peak < 6 * 2 ** 20


def test_nothing_allocated_is_zero():
    x = torch.ones(10)
    _, peak = peak_extra_bytes(lambda: x)
    assert peak == 0


def test_frees_of_blocks_from_before_the_call_do_not_lower_the_workspace():
    held = []
    peak_extra_bytes(lambda: held.append(torch.ones(1 << 20)))  # allocated under an earlier profile

    def fn():
        held.pop()  # 4 MiB of the caller's freed inside the call: reported, but not the call's
        tmp = torch.ones(1 << 20)
        del tmp

    _, peak = peak_extra_bytes(fn)
    assert 4 * 2 ** 20 <= peak < 5 * 2 ** 20


def test_replay_pairs_frees_with_their_allocations():
    MiB = 2 ** 20
    # two micro-batches run one after the other: one workspace at a time
    assert peak_of_events([(0, 1, MiB), (1, 1, -MiB), (2, 2, MiB), (3, 2, -MiB)]) == MiB
    # a free of an address the call never allocated is ignored
    assert peak_of_events([(0, 9, -5 * MiB), (1, 1, MiB)]) == MiB
    # a free stamped before its allocation (core clocks apart) keeps the block live: safe side
    assert peak_of_events([(0, 1, -MiB), (1, 1, MiB), (2, 2, MiB)]) == 2 * MiB
    # an address allocated again without a free in between is counted once
    assert peak_of_events([(0, 1, MiB), (1, 1, MiB)]) == MiB
    assert peak_of_events([]) == 0
