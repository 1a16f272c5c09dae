"""FLOP-bound time for the auto-batching benchmarks: FLOPs counted per node, GEMM rate measured.

The FLOP-bound time of a batch is its FLOPs divided by the fp32 matrix-multiply rate of
this machine (best of a few representative shapes, so the bound is optimistic: no
system can beat it). FLOPs count a multiply-add as 2; the training step counts
3x the forward (backward = gradient w.r.t. inputs + w.r.t. weights, each a forward's
worth of GEMM FLOPs), the usual estimate (Kaplan et al. 2020, §2.1).
"""

from __future__ import annotations

import time

import torch

from batchcraft.autobatching.kernels import onednn_available, onednn_linear

#: the dense weight whose gradient the benchmark compares across systems, per model
GRAD_PARAM = {"treelstm": "inputs.W_iou.weight", "birnn": "fwd.weight_hh", "mvrnn": "compose.W.weight",
              "nestedrnn": "char_rnn.weight_hh"}


def treelstm_node_flops(k: int, hidden: int, in_dim: int) -> tuple[int, int]:
    """(GEMM FLOPs, elementwise FLOPs) of one Child-Sum TreeLSTM node with ``k`` children.

    Per node (batchcraft.models.treelstm): ``W_iou x + b`` and ``W_f x + b`` with
    x of size ``in_dim``; with children, ``U_iou`` on the sum of the children's h and
    ``U_f`` on each child's h, forget gates, the gated sum of child cells; then the
    i/o/u gates, c and h.
    """
    H = hidden
    gemm = 2 * in_dim * 4 * H
    elem = 4 * H  # biases
    if k:
        gemm += 2 * H * 3 * H + k * 2 * H * H
        elem += (k - 1) * H + 3 * H  # sum of child h, add to iou
        elem += k * H * 3 + (k - 1) * H + H  # f_x + U_f h_k, sigmoid, f*c_k, their sum, add to c
    elem += 6 * H  # sigmoid i, tanh u, i*u, sigmoid o, tanh c, o*tanh(c)
    return gemm, elem


def birnn_word_flops(hidden: int, in_dim: int, n_tags: int) -> tuple[int, int]:
    """(GEMM, elementwise) FLOPs per word of the BiLSTM tagger: two ``nn.LSTMCell`` steps
    (``W_ih x + W_hh h``, two biases, 3 sigmoids, 2 tanh, 3 products, 1 sum) and the output layer."""
    H = hidden
    gemm = 2 * (2 * (in_dim * 4 * H + H * 4 * H)) + 2 * 2 * H * n_tags
    elem = 2 * (2 * 4 * H + 9 * H) + n_tags
    return gemm, elem


def mvrnn_compose_flops(hidden: int) -> tuple[int, int]:
    """(GEMM, elementwise) FLOPs of one MV-RNN composition: ``B a``, ``A b``,
    ``W [.;.] + b`` (H x 2H), tanh, and ``W_M [A; B]`` ((H x 2H) @ (2H x H))."""
    H = hidden
    return 2 * H * H * 2 + 2 * 2 * H * H + 2 * H * 2 * H * H, 2 * H


def berxit_layer_flops(L: int, d: int, d_ff: int, n_heads: int, n_classes: int) -> tuple[int, int]:
    """(GEMM, elementwise) FLOPs of one Berxit encoder layer on ``L`` positions plus its exit
    head: ``qkv`` (L x d x 3d), scores and context (2 x L x L x d over the heads), ``proj``
    (L x d x d), the feed-forward pair (2 x L x d x d_ff), the head's pool (d x d) and classes;
    elementwise: scaling, mask and softmax (~5 per score), two residuals, two layer norms
    (~8 per element), GELU (~8 per element), tanh and the exit softmax."""
    gemm = 2 * L * d * 3 * d + 2 * 2 * L * L * d + 2 * L * d * d + 2 * 2 * L * d * d_ff + 2 * d * d + 2 * d * n_classes
    elem = 5 * n_heads * L * L + 2 * L * d + 2 * 8 * L * d + 8 * L * d_ff + d + 4 * n_classes
    return gemm, elem


def instance_flops(model: str, task, inst) -> tuple[int, int]:
    """(GEMM, elementwise) forward FLOPs of one instance of suite model ``model``."""
    m = task.model
    if model == "treelstm":
        in_dim = m.inputs.word.embedding_dim + m.inputs.tag.embedding_dim
        g = e = 0
        for kids in inst.children:
            a, b = treelstm_node_flops(len(kids), task.hidden, in_dim)
            g, e = g + a, e + b
        return g, e
    if model == "birnn":
        g, e = birnn_word_flops(task.hidden, m.fwd.input_size, m.out.out_features)
        return len(inst) * g, len(inst) * e
    if model == "mvrnn":
        g, e = mvrnn_compose_flops(task.hidden)
        return (len(inst) - 1) * g, (len(inst) - 1) * e
    if model == "nestedrnn":
        H, C = task.hidden, m.char_rnn.input_size
        chars = sum(len(w) for w in inst.words)
        # per character a GRU step (2 GEMVs, 2 biases, 2 sigmoids, tanh, 3 adds, 3 products);
        # per word an LSTM step
        g = chars * 2 * (C * 3 * H + H * 3 * H) + len(inst) * 2 * (H * 4 * H + H * 4 * H)
        e = chars * (6 * H + 9 * H) + len(inst) * (2 * 4 * H + 9 * H)
        return g, e
    if model == "berxit":
        # the layers an instance runs depend on its exit: read from the eager model's own output
        with torch.no_grad():
            exit_layer = task.fn(inst)[1]
        L = -(-(len(inst.word_ids) + 1) // m.pad_to) * m.pad_to
        layer = m.layers[0]
        g, e = berxit_layer_flops(L, layer.qkv.in_features, layer.ff1.out_features, layer.n_heads,
                                  m.exits[0].out.out_features)
        emb = 2 * 8 * L * layer.qkv.in_features  # token + position sum, layer norm
        return exit_layer * g, exit_layer * e + emb
    raise KeyError(f"_flops: no FLOP count for {model!r}")


def per_batch(model: str, task, batch_size: int) -> dict:
    """Mean forward/training FLOPs per batch of ``batch_size`` over ``task.instances``."""
    per = [instance_flops(model, task, s) for s in task.instances]
    nb = -(-len(per) // batch_size)
    gemm = sum(g for g, _ in per) / nb
    elem = sum(e for _, e in per) / nb
    return {"forward_flops": gemm + elem, "forward_gemm_flops": gemm, "train_flops": 3 * (gemm + elem),
            "nodes_per_batch": sum(len(s) for s in task.instances) / nb}


def measure_gemm_rate(hiddens: list[int], threads: int = 2, seconds: float = 0.25) -> dict:
    """Best measured fp32 matrix-multiply rate (FLOP/s) over shapes the models use.

    Shapes (M, K, N): (512, 512, 2048), and per hidden size H a level of 64 cells (64, H, 3H)
    and all nodes' input projection (1024, H + 32, 4H). Fastest of 5 timed rounds per shape (the CPU is
    shared, and the bound is what the machine allows, not what a busy moment gives), of the
    default library's ``torch.mm`` (MKL) and oneDNN's inner product where torch ships it (issue 14:
    the bound uses the best GEMM rate on the machine, not the default library's).
    """
    torch.set_num_threads(threads)
    shapes = [(512, 512, 2048)]  # a large GEMM: the machine's rate even for small models
    for h in hiddens:
        shapes += [(64, h, 3 * h), (1024, h + 32, 4 * h)]
    rates = {}
    for (m, k, n) in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        bt = b.t().contiguous()
        kernels = {"mkl": lambda: torch.mm(a, b)}
        if onednn_available():
            kernels["onednn"] = lambda: onednn_linear(a, bt)
        for lib, fn in kernels.items():
            fn()
            t0, reps = time.perf_counter(), 0
            while time.perf_counter() - t0 < 0.05:
                fn()
                reps += 1
            reps = max(1, int(reps * seconds / 0.05 / 5))
            rounds = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                rounds.append((time.perf_counter() - t0) / reps)
            # fastest round: the rate the machine allows
            rates[f"{m}x{k}x{n}" + ("" if lib == "mkl" else f" {lib}")] = 2 * m * k * n / min(rounds)
    best = max(rates, key=rates.get)
    return {"rate_flop_per_s": rates[best], "best_shape": best, "rates_flop_per_s": rates, "threads": threads}
