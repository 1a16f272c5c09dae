"""Helpers shared by the suite model tests (real UD sentences from the ``ud_sentences`` fixture)."""

from __future__ import annotations

import torch

from batchcraft import autobatch


def vocab_size(sentences) -> int:
    """Word vocabulary size that covers the fixture's encoding (ids are not re-encoded)."""
    return max(max(s.word_ids) for s in sentences) + 1


def shortest(sentences, k: int) -> list:
    """The ``k`` shortest sentences, in their original order (keeps batch-64 tests quick)."""
    keep = set(sorted(range(len(sentences)), key=lambda i: (len(sentences[i]), i))[:k])
    return [s for i, s in enumerate(sentences) if i in keep]


def forward_batched_and_eager(model, instances, scheduler: str = "depth"):
    """(auto-batched outputs, eager outputs, the AutoBatched callable), without autograd."""
    f = autobatch(model, scheduler=scheduler)
    with torch.no_grad():
        out = f(instances)
        ref = [model(x) for x in instances]
    return out, ref, f
