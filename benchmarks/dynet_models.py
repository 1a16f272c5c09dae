"""DyNet versions of the auto-batching suite models, for benchmarks/vs_dynet.py (issue 7).

Same formulation, sizes and parameters as the PyTorch models in ``batchcraft.models``:
the parameters are exported from the torch model (``.npz``, torch's ``state_dict``
names) and loaded here, so outputs can be compared element-wise with torch eager.

This module imports only numpy and DyNet (no torch, no batchcraft), so a DyNet worker
process's resident memory is DyNet's own. DyNet's auto-batching strategy is chosen
before the first ``import dynet`` (:func:`import_dynet`); its codes, from DyNet 2.1.2
``dynet/exec.cc``: 0 off, 1 agenda-based (lowest average depth first), 2 depth-based,
3 agenda-based with per-depth signature counts.

Source: Neubig, Goldberg and Dyer, "On-the-fly Operation Batching in Dynamic
Computation Graphs", NeurIPS 2017 (arXiv 1705.07860), §3-4.
"""

from __future__ import annotations

#: DyNet autobatch codes -> names used in tables and JSON
AUTOBATCH_MODES = {0: "off", 1: "agenda", 2: "depth", 3: "agenda-depthcount"}

_dy = None


def import_dynet(autobatch: int, mem_mb: int | None = None, seed: int = 0):
    """Configure and import DyNet once per process; return the ``dynet`` module.

    ``mem_mb`` None keeps DyNet's default memory pools (512 MB, grown on demand).

    Raises:
        ImportError: DyNet is not installed (run benchmarks/setup_dynet.sh).
        RuntimeError: DyNet was already imported with another configuration.
    """
    global _dy
    if _dy is not None:
        if _dy.__batchcraft_autobatch__ != autobatch:
            raise RuntimeError("import_dynet: DyNet already configured with autobatch="
                               f"{_dy.__batchcraft_autobatch__}, asked for {autobatch}")
        return _dy
    import dynet_config

    if mem_mb is None:
        dynet_config.set(random_seed=seed, autobatch=autobatch)
    else:
        dynet_config.set(mem=str(mem_mb), random_seed=seed, autobatch=autobatch)
    import dynet as dy

    dy.__batchcraft_autobatch__ = autobatch
    _dy = dy
    return dy


def lstm_step(dy, H: int, cell, x, h, c):
    """One LSTM step (torch's gate order i, f, g, o) on DyNet expressions; returns (h, c)."""
    W_ih, W_hh, b = cell
    g = dy.affine_transform([b, W_ih, x, W_hh, h])
    i = dy.logistic(dy.pick_range(g, 0, H))
    f = dy.logistic(dy.pick_range(g, H, 2 * H))
    u = dy.tanh(dy.pick_range(g, 2 * H, 3 * H))
    o = dy.logistic(dy.pick_range(g, 3 * H, 4 * H))
    c = dy.cmult(f, c) + dy.cmult(i, u)
    return dy.cmult(o, dy.tanh(c)), c


class DyTreeLSTM:
    """Child-Sum TreeLSTM (Tai et al. 2015, §3.1), the formulation of
    ``batchcraft.models.treelstm.TreeLSTM``: per node ``x = [E_word[w]; E_upos[t]]``,
    ``iou = W_iou x + b_iou + U_iou sum_k h_k``, ``f_k = sigmoid(W_f x + b_f + U_f h_k)``,
    ``c = sigmoid(i) * tanh(u) + sum_k f_k * c_k``, ``h = sigmoid(o) * tanh(c)``.

    Args:
        dy: the dynet module (from :func:`import_dynet`).
        params (dict[str, numpy.ndarray]): the torch model's ``state_dict`` as arrays.
    Instances are dicts with ``children`` (list of lists), ``root``, ``word_ids``, ``upos_ids``.
    """

    def __init__(self, dy, params):
        self.dy = dy
        self.pc = dy.ParameterCollection()
        pc = self.pc
        self.E_word = pc.lookup_parameters_from_numpy(params["inputs.word.weight"])
        self.E_tag = pc.lookup_parameters_from_numpy(params["inputs.tag.weight"])
        self.W_iou = pc.parameters_from_numpy(params["inputs.W_iou.weight"])
        self.b_iou = pc.parameters_from_numpy(params["inputs.W_iou.bias"])
        self.W_f = pc.parameters_from_numpy(params["inputs.W_f.weight"])
        self.b_f = pc.parameters_from_numpy(params["inputs.W_f.bias"])
        self.U_iou = pc.parameters_from_numpy(params["cell.U_iou.weight"])
        self.U_f = pc.parameters_from_numpy(params["cell.U_f.weight"])
        self.hidden = params["cell.U_f.weight"].shape[0]
        #: torch state_dict name -> DyNet parameter, for gradient cross-checks
        self.named = {"inputs.W_iou.weight": self.W_iou, "inputs.W_f.weight": self.W_f,
                      "cell.U_iou.weight": self.U_iou, "cell.U_f.weight": self.U_f}

    def _expressions(self):
        dy = self.dy
        return [dy.parameter(p) for p in (self.W_iou, self.b_iou, self.W_f, self.b_f, self.U_iou, self.U_f)]

    def tree(self, inst, ex):
        """Root hidden state expression (hidden,) of one tree; ``ex`` from ``_expressions()``."""
        dy, H = self.dy, self.hidden
        W_iou, b_iou, W_f, b_f, U_iou, U_f = ex
        kids, words, tags = inst["children"], inst["word_ids"], inst["upos_ids"]

        def node(i):
            states = [node(c) for c in kids[i]]
            x = dy.concatenate([dy.lookup(self.E_word, words[i]), dy.lookup(self.E_tag, tags[i])])
            iou = dy.affine_transform([b_iou, W_iou, x])
            f_x = dy.affine_transform([b_f, W_f, x])
            if states:
                iou = iou + U_iou * dy.esum([h for h, _ in states])
            i_g = dy.logistic(dy.pick_range(iou, 0, H))
            o_g = dy.logistic(dy.pick_range(iou, H, 2 * H))
            u = dy.tanh(dy.pick_range(iou, 2 * H, 3 * H))
            c = dy.cmult(i_g, u)
            if states:
                # f_x + U_f h, not affine_transform([f_x, U_f, h]): with autobatch on, DyNet 2.1.2's
                # backward of that form fails ("broadcasting over columns with mini-batched inputs").
                fc = [dy.cmult(dy.logistic(f_x + U_f * h), ck) for h, ck in states]
                c = c + dy.esum(fc)
            return dy.cmult(o_g, dy.tanh(c)), c

        return node(inst["root"])[0]

    def outputs(self, batch):
        """Build one fresh graph for ``batch``; return the root expressions, each (hidden,)."""
        self.dy.renew_cg()
        ex = self._expressions()
        return [self.tree(inst, ex) for inst in batch]

    @staticmethod
    def to_array(value):
        return value


class DyBiRNN:
    """BiLSTM UPOS tagger, the formulation of ``batchcraft.models.birnn.BiRNNTagger``:
    ``x_t = E[w_t]``; a forward and a backward LSTM (``nn.LSTMCell`` equations, gates i, f, g, o,
    ``W_ih x + b_ih + W_hh h + b_hh``) from zero states; logits ``W_out [h_fwd; h_bwd] + b_out``.

    Instances are dicts with ``word_ids``. Output per sentence: (n_tags, T) (``to_array`` -> (T, n_tags)).
    """

    def __init__(self, dy, params):
        self.dy = dy
        self.pc = pc = dy.ParameterCollection()
        self.E = pc.lookup_parameters_from_numpy(params["embed.weight"])
        self.cells = []
        for d in ("fwd", "bwd"):
            W_ih = pc.parameters_from_numpy(params[f"{d}.weight_ih"])
            W_hh = pc.parameters_from_numpy(params[f"{d}.weight_hh"])
            b = pc.parameters_from_numpy(params[f"{d}.bias_ih"] + params[f"{d}.bias_hh"])
            self.cells.append((W_ih, W_hh, b))
        self.W_out = pc.parameters_from_numpy(params["out.weight"])
        self.b_out = pc.parameters_from_numpy(params["out.bias"])
        self.hidden = params["fwd.weight_hh"].shape[1]
        self.named = {"fwd.weight_hh": self.cells[0][1], "fwd.weight_ih": self.cells[0][0],
                      "out.weight": self.W_out}

    def _lstm(self, xs, cell):
        dy, H = self.dy, self.hidden
        h = c = dy.zeros(H)
        hs = []
        for x in xs:
            h, c = lstm_step(dy, H, cell, x, h, c)
            hs.append(h)
        return hs

    def sentence(self, inst, ex):
        dy = self.dy
        W_out, b_out, cells = ex
        xs = [dy.lookup(self.E, w) for w in inst["word_ids"]]
        fw = self._lstm(xs, cells[0])
        bw = self._lstm(xs[::-1], cells[1])[::-1]
        return dy.concatenate_cols([dy.affine_transform([b_out, W_out, dy.concatenate([f, b])])
                                    for f, b in zip(fw, bw)])

    def outputs(self, batch):
        dy = self.dy
        dy.renew_cg()
        ex = (dy.parameter(self.W_out), dy.parameter(self.b_out),
              [tuple(dy.parameter(p) for p in cell) for cell in self.cells])
        return [self.sentence(inst, ex) for inst in batch]

    @staticmethod
    def to_array(value):
        return value.reshape(value.shape[0], -1).T


class DyMVRNN:
    """MV-RNN over dependency trees, the formulation of ``batchcraft.models.mvrnn.MVRNN``: a word
    is ``(a, A)``; a head absorbs its dependents in word order with ``p = tanh(W [B a; A b] + b_W)``,
    ``P = W_M [A; B]`` (Socher et al. 2012, eqs. 2-3).

    The torch model keeps each word matrix transposed (its embedding row viewed row-major is
    A^T); DyNet reshapes column-major, so the same row reshaped here is A itself. Instances are
    dicts with ``children``, ``root``, ``word_ids``.
    """

    def __init__(self, dy, params):
        self.dy = dy
        self.pc = pc = dy.ParameterCollection()
        H = params["leaf.vector.weight"].shape[1]
        self.E_vec = pc.lookup_parameters_from_numpy(params["leaf.vector.weight"])
        self.E_mat = pc.lookup_parameters_from_numpy(params["leaf.matrix.weight"])
        self.W = pc.parameters_from_numpy(params["compose.W.weight"])
        self.b = pc.parameters_from_numpy(params["compose.W.bias"])
        self.W_M = pc.parameters_from_numpy(params["compose.W_M"])
        self.hidden = H
        self.named = {"compose.W.weight": self.W, "compose.W_M": self.W_M}

    def tree(self, inst, ex):
        dy, H = self.dy, self.hidden
        W, b, W_M = ex
        kids, words = inst["children"], inst["word_ids"]

        def compose(a, A, bv, B):
            p = dy.tanh(dy.affine_transform([b, W, dy.concatenate([B * a, A * bv])]))
            return p, W_M * dy.concatenate([A, B])

        def node(i):
            v = dy.lookup(self.E_vec, words[i])
            M = dy.reshape(dy.lookup(self.E_mat, words[i]), (H, H))
            for c in kids[i]:
                cv, cM = node(c)
                v, M = compose(cv, cM, v, M) if c < i else compose(v, M, cv, cM)
            return v, M

        return node(inst["root"])[0]

    def outputs(self, batch):
        dy = self.dy
        dy.renew_cg()
        ex = (dy.parameter(self.W), dy.parameter(self.b), dy.parameter(self.W_M))
        return [self.tree(inst, ex) for inst in batch]

    @staticmethod
    def to_array(value):
        return value


class DyNestedRNN:
    """NestedRNN, the formulation of ``batchcraft.models.nestedrnn.NestedRNN``: per word, a GRU
    (``nn.GRUCell`` equations, gates r, z, n) over its character embeddings from a zero state; an
    LSTM (``nn.LSTMCell``) over the words' final GRU states; output: the last LSTM h (hidden,).

    Instances are dicts with ``char_ids`` (per word, the character ids of the torch model).
    """

    def __init__(self, dy, params):
        self.dy = dy
        self.pc = pc = dy.ParameterCollection()
        self.E = pc.lookup_parameters_from_numpy(params["char_embed.weight"])
        self.gru = [pc.parameters_from_numpy(params[f"char_rnn.{n}"])
                    for n in ("weight_ih", "bias_ih", "weight_hh", "bias_hh")]
        self.lstm = [pc.parameters_from_numpy(params["word_rnn.weight_ih"]),
                     pc.parameters_from_numpy(params["word_rnn.weight_hh"]),
                     pc.parameters_from_numpy(params["word_rnn.bias_ih"] + params["word_rnn.bias_hh"])]
        self.hidden = params["word_rnn.weight_hh"].shape[1]
        self.named = {"char_rnn.weight_hh": self.gru[2], "word_rnn.weight_hh": self.lstm[1]}

    def word(self, chars, gru):
        dy, H = self.dy, self.hidden
        W_ih, b_ih, W_hh, b_hh = gru
        h = dy.zeros(H)
        for ch in chars:
            gi = dy.affine_transform([b_ih, W_ih, dy.lookup(self.E, ch)])
            gh = dy.affine_transform([b_hh, W_hh, h])
            r = dy.logistic(dy.pick_range(gi, 0, H) + dy.pick_range(gh, 0, H))
            z = dy.logistic(dy.pick_range(gi, H, 2 * H) + dy.pick_range(gh, H, 2 * H))
            n = dy.tanh(dy.pick_range(gi, 2 * H, 3 * H) + dy.cmult(r, dy.pick_range(gh, 2 * H, 3 * H)))
            h = dy.cmult(1.0 - z, n) + dy.cmult(z, h)
        return h

    def sentence(self, inst, gru, lstm):
        dy, H = self.dy, self.hidden
        h = c = dy.zeros(H)
        for chars in inst["char_ids"]:
            h, c = lstm_step(dy, H, lstm, self.word(chars, gru), h, c)
        return h

    def outputs(self, batch):
        dy = self.dy
        dy.renew_cg()
        gru = [dy.parameter(p) for p in self.gru]
        lstm = [dy.parameter(p) for p in self.lstm]
        return [self.sentence(inst, gru, lstm) for inst in batch]

    @staticmethod
    def to_array(value):
        return value


#: model name -> DyNet class; the torch side names the same models in batchcraft.models.suite
MODELS = {"treelstm": DyTreeLSTM, "birnn": DyBiRNN, "mvrnn": DyMVRNN, "nestedrnn": DyNestedRNN}


def run_inference(model, batch) -> list:
    """Forward over ``batch``: one graph, one evaluation call up to the last output (DyNet
    batches everything pending in that call); returns one array per instance, torch's layout."""
    outs = model.outputs(batch)
    model.dy.forward(outs)
    return [model.to_array(o.npvalue()) for o in outs]


def run_train_step(model, batch) -> float:
    """Forward and backward of ``loss = sum of all outputs`` (no parameter update)."""
    dy = model.dy
    loss = dy.esum([dy.sum_elems(o) for o in model.outputs(batch)])
    value = loss.value()
    loss.backward()
    return value
