import torch

from batchcraft.microbatching.memory import peak_extra_bytes


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
