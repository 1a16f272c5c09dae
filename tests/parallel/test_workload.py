"""Workloads: inputs for tensor models and for the auto-batched TreeLSTM."""

import pytest
import torch
from torch import nn

from batchcraft.errors import ConfigurationError
from batchcraft.parallel.workload import build_workload, make_input


def test_tensor_models_get_inputs_from_example_input_or_first_layer():
    w = build_workload("recommender", model_kwargs={"vocab": 20})
    x = w.make_batch(5)
    assert x.shape == (5, 8) and x.dtype == torch.int64 and w.traceable
    assert w.call(x).shape == (5,)
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    assert make_input(conv, 2, image_size=9).shape == (2, 3, 9, 9)
    assert make_input(nn.Sequential(nn.Linear(6, 2)), 3).shape == (3, 6)
    with pytest.raises(ConfigurationError, match="cannot derive an input shape"):
        make_input(nn.Sequential(nn.ReLU()), 1)
    with pytest.raises(ConfigurationError, match="batch_size must be an int >= 1"):
        make_input(conv, 0)


def test_unknown_model():
    with pytest.raises(ConfigurationError, match="unknown model 'nope'"):
        build_workload("nope")


def test_treelstm_batches_are_real_sentences_run_auto_batched():
    w = build_workload("treelstm", model_kwargs={"hidden": 16})
    assert not w.traceable
    batch = w.make_batch(3)
    assert len(batch) == 3 and all(hasattr(s, "word_ids") for s in batch)
    with torch.no_grad():
        out = w.call(batch)
        ref = [w.model(s) for s in batch]  # per-instance eager
    for got, want in zip(out, ref):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert len(w.make_batch(300)) == 300  # more than loaded: reused cyclically


# -- the user's own model ---------------------------------------------------------------------

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

from batchcraft.parallel.workload import ModelSpec, model_spec, tile  # noqa: E402

USER_MODELS = textwrap.dedent("""
    import torch
    from torch import nn

    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 4), nn.Embedding(10, 4)

        def forward(self, x, ids):
            return self.a(x) + self.b(ids)

    def pair():
        return TwoInputs(), (torch.randn(2, 3), torch.tensor([1, 7]))

    def not_a_model():
        return 42

    plain = nn.Linear(5, 2)
""")


def test_tile_repeats_rows_cyclically_leaf_by_leaf():
    x = torch.arange(6).reshape(3, 2)
    assert tile(x, 5)[:, 0].tolist() == [0, 2, 4, 0, 2]
    out = tile({"a": x, "n": 3, "s": torch.tensor(1.0)}, 4)
    assert out["a"].shape == (4, 2) and out["n"] == 3 and out["s"].dim() == 0
    assert [t.shape[0] for t in tile((x, [x]), 2)[:1]] == [2]
    with pytest.raises(ConfigurationError, match="no rows"):
        tile(torch.zeros(0, 3), 2)


def test_factories_from_any_importable_file(tmp_path, monkeypatch):
    (tmp_path / "usermodels.py").write_text(USER_MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    w = build_workload("usermodels:pair")
    x = w.make_batch(5)
    assert isinstance(x, tuple) and x[0].shape == (5, 3) and x[1].tolist() == [1, 7, 1, 7, 1]
    assert w.call(x).shape == (5, 4) and w.traceable
    w = build_workload(model_spec("usermodels:plain", input_shape=[5]))
    assert w.call(w.make_batch(3)).shape == (3, 2)
    with pytest.raises(ConfigurationError, match="returned int"):
        build_workload("usermodels:not_a_model")
    with pytest.raises(ConfigurationError, match="has no attribute 'missing'"):
        build_workload("usermodels:missing")
    with pytest.raises(ConfigurationError, match="cannot import 'nowhere_xyz'"):
        build_workload("nowhere_xyz:f")


def test_model_objects_and_example_inputs_are_saved_for_the_workers(tmp_path):
    model = nn.Sequential(nn.Linear(4, 3))
    spec = model_spec(model, example_input=torch.randn(2, 4), tmpdir=str(tmp_path))
    assert spec.kind == "file" and (tmp_path / "model.pt").exists()
    w = build_workload(ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict()))))  # as a worker gets it
    assert w.make_batch(3).shape == (3, 4)
    torch.testing.assert_close(w.call(w.make_batch(2)), model(w.make_batch(2)))

    class Local(nn.Module):  # defined in a function: cannot be pickled by reference
        def forward(self, x):
            return x

    with pytest.raises(ConfigurationError, match="cannot send .* to the worker processes"):
        model_spec(Local(), example_input=torch.randn(1, 2), tmpdir=str(tmp_path))
    with pytest.raises(ConfigurationError, match="input_shape must be positive"):
        model_spec("mlp_fc512", input_shape=[0])


MAIN_SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    from torch import nn
    from batchcraft.parallel import tune

    class Net(nn.Module):  # defined in the main script, as users do
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 2)

        def forward(self, x):
            return self.lin(x)

    if __name__ == "__main__":
        res = tune(Net(), example_input=torch.randn(1, 6), batch_sizes=[2], budget_s=float(sys.argv[1]),
                   knobs=(), repeats=1, final_repeats=1, max_trial_s=0.05)
        print("RESULT", json.dumps({"best": res.best.to_dict(), "per_batch": len(res.per_batch),
                                    "model": res.model}))
''')


@pytest.mark.slow
def test_tune_a_model_class_defined_in_the_users_main_script(tmp_path):
    script = tmp_path / "mine.py"
    script.write_text(MAIN_SCRIPT)
    out = subprocess.run([sys.executable, str(script), "30"], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))
    res = json.loads(line[len("RESULT "):])
    assert res["model"] == "Net" and res["per_batch"] == 1 and res["best"]["batch_size"] == 2
