"""`xlatrain parity --against torch_xla`: the torch GPT trained by xlatrain and by torch_xla (lazy tensors,
one torch_xla.sync() per step) in a virtual environment of its own (.ci/run makes one)."""

import os

import pytest
from conftest import REPO, run_cli

from xlatrain.commands.torch_parity import TORCH_XLA_PYTHON

pytestmark = pytest.mark.skipif(not os.environ.get(TORCH_XLA_PYTHON), reason=(
    f"set {TORCH_XLA_PYTHON} to the Python of a virtual environment with the [torch-xla] extra (.ci/run does)"))


def test_torch_gpt_tracks_torch_xla():
    done = run_cli("parity", "examples/configs/torch_gpt.yaml", "--against", "torch_xla", "--steps", "10", "--a",
                   "model.kwargs.width=32", "model.kwargs.layers=2", "model.kwargs.heads=2", "model.kwargs.max_len=32",
                   "data.seq_len=32", "data.max_bytes=400000",
                   env={"PYTHONPATH": str(REPO / "examples" / "torch_model")}, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no divergence over 10 steps" in done.stdout, done.stdout
