"""Hand-batched PyTorch references for the suite: what a person writes by hand.

These run the *same parameters* as the per-instance models, batched by hand,
so time and results can be compared with eager per-instance runs and with
:func:`batchcraft.autobatch`:

* :func:`birnn_padded`: :class:`~batchcraft.models.birnn.BiRNNTagger` as one packed
  bidirectional ``nn.LSTM`` call (cuDNN/oneDNN style padded batching).
* :func:`treelstm_levels`: :class:`~batchcraft.models.treelstm.TreeLSTM` level by level,
  all nodes of the same height across the batch at once (DGL's TreeLSTM example,
  Tai et al. 2015 batched as in the DGL ``tree_lstm`` example).

Each takes a list of sentences and returns a list with one result per sentence,
equal (within float32 rounding) to calling the model on each sentence.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence


def _shared_lstm(model) -> nn.LSTM:
    """A bidirectional ``nn.LSTM`` whose parameters *are* the tagger's two LSTM cells'."""
    lstm = getattr(model, "_handbatched_lstm", None)
    cells = [getattr(c, n) for c in (model.fwd, model.bwd) for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
    if lstm is None or any(a is not b for a, b in zip(lstm._flat_weights, cells)):  # new or replaced params
        lstm = nn.LSTM(model.fwd.input_size, model.hidden, batch_first=True, bidirectional=True)
        for suffix, cell in (("", model.fwd), ("_reverse", model.bwd)):
            for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                setattr(lstm, f"{name}_l0{suffix}", getattr(cell, name))  # same Parameter objects
        object.__setattr__(model, "_handbatched_lstm", lstm)  # not a submodule: no duplicate params
    return lstm


def birnn_padded(model, sentences) -> list[torch.Tensor]:
    """Run a :class:`~batchcraft.models.birnn.BiRNNTagger` over ``sentences`` as one packed batch.

    Args:
        model (BiRNNTagger): the tagger (its ``fwd``/``bwd`` cells and layers are used as they are).
        sentences (list[Sentence]): encoded sentences (``word_ids`` filled), any lengths >= 1.
    Returns:
        list[Tensor]: per sentence, UPOS logits of shape (len(sentence), n_tags).
    """
    if not sentences:
        return []
    dev = next(model.parameters()).device
    lengths = torch.tensor([len(s) for s in sentences], device="cpu")  # pack_padded_sequence wants them on the CPU
    ids = torch.zeros(len(sentences), int(lengths.max()), dtype=torch.long, device="cpu")
    for i, s in enumerate(sentences):
        ids[i, : len(s)] = torch.tensor(s.word_ids, device="cpu")
    ids = ids.to(dev)
    x = model.embed(ids)  # (B, T, word_dim); outside autobatch a static block is a plain call
    packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    out, _ = _shared_lstm(model)(packed)
    out, _ = pad_packed_sequence(out, batch_first=True)  # (B, T, 2 hidden)
    logits = model.out(out)
    return [logits[i, : len(s)] for i, s in enumerate(sentences)]


def treelstm_levels(model, sentences) -> list[torch.Tensor]:
    """Run a :class:`~batchcraft.models.treelstm.TreeLSTM` over ``sentences`` level by level.

    All words of all trees are numbered globally; the input projections run once for every
    word; then nodes are processed by height (leaves first), each height as one batched
    Child-Sum step, with children's states summed by ``index_add``.

    Args:
        model (TreeLSTM): the encoder (its ``inputs`` and ``cell`` parameters are used).
        sentences (list[Sentence]): encoded trees (``word_ids``, ``upos_ids`` filled).
    Returns:
        list[Tensor]: per sentence, the root's hidden state, shape (hidden,).
    """
    if not sentences:
        return []
    offsets, word_ids, upos_ids, parent, height = [], [], [], [], []
    for s in sentences:
        base = len(word_ids)
        offsets.append(base)
        word_ids += s.word_ids
        upos_ids += s.upos_ids
        parent += [base + h if h >= 0 else -1 for h in s.heads]
        hs = [0] * len(s)
        order = _post_order(s)
        for i in order:
            hs[i] = 1 + max((hs[c] for c in s.children[i]), default=-1)
        height += hs
    n = len(word_ids)
    iou_x, f_x = model.inputs(torch.tensor(word_ids), torch.tensor(upos_ids))  # (n, 3h), (n, h)
    hid = model.hidden
    cell = model.cell
    parent_t = torch.tensor(parent)
    height_t = torch.tensor(height)
    h_all = iou_x.new_zeros(n, hid)
    c_all = iou_x.new_zeros(n, hid)
    for level in range(int(height_t.max()) + 1):
        nodes = (height_t == level).nonzero().squeeze(1)
        iou = iou_x[nodes]
        kids = ((parent_t >= 0) & (height_t < level)).nonzero().squeeze(1)
        kids = kids[(height_t[parent_t[kids]] == level)]  # children of this level's nodes
        pos = torch.full((n,), -1, dtype=torch.long)
        pos[nodes] = torch.arange(len(nodes))
        kid_row = pos[parent_t[kids]]  # row of each child's parent in this level
        if len(kids):
            h_k, c_k = h_all[kids], c_all[kids]
            h_sum = iou.new_zeros(len(nodes), hid).index_add(0, kid_row, h_k)
            iou = iou + cell.U_iou(h_sum)
            f = torch.sigmoid(f_x[parent_t[kids]] + cell.U_f(h_k))
            fc = iou.new_zeros(len(nodes), hid).index_add(0, kid_row, f * c_k)
        i, o, u = iou.chunk(3, dim=-1)
        c = torch.sigmoid(i) * torch.tanh(u)
        if len(kids):
            c = c + fc
        h = torch.sigmoid(o) * torch.tanh(c)
        h_all = h_all.index_copy(0, nodes, h)  # out of place: earlier levels' values stay in the graph
        c_all = c_all.index_copy(0, nodes, c)
    return [h_all[off + s.root] for off, s in zip(offsets, sentences)]


def _post_order(s) -> list[int]:
    out, stack = [], [(s.root, False)]
    while stack:
        node, done = stack.pop()
        if done:
            out.append(node)
        else:
            stack.append((node, True))
            stack.extend((c, False) for c in s.children[node])
    return out
