"""Thread state: inter-op threads set at most once (checked first, never aborting), restoration."""

import os
import subprocess
import sys
import textwrap

import torch

from batchcraft.parallel import preserved_thread_state


def test_inter_op_threads_settable_once_and_refused_cleanly_after(tmp_path):
    # A fresh interpreter: the test process's own inter-op pool must not be touched.
    code = textwrap.dedent("""
        import torch
        from batchcraft.errors import ConfigurationError
        from batchcraft.parallel import set_inter_op_threads
        assert set_inter_op_threads(1) is True
        assert set_inter_op_threads(1) is False      # same value: checked, not set again
        torch.jit.wait(torch.jit.fork(torch.add, torch.ones(2), 1))  # inter-op work started
        try:
            set_inter_op_threads(2)
        except ConfigurationError as exc:
            assert "fresh process" in str(exc), exc
            print("refused")
        assert torch.get_num_interop_threads() == 1
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "refused"


def test_preserved_thread_state_restores_threads_and_env(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    with preserved_thread_state():
        torch.set_num_threads(1 if before != 1 else 2)
        os.environ["OMP_NUM_THREADS"] = "1"
        os.environ["MKL_NUM_THREADS"] = "1"
    assert torch.get_num_threads() == before
    assert os.environ["OMP_NUM_THREADS"] == "7" and "MKL_NUM_THREADS" not in os.environ
