"""`xlatrain parity`: identical computations agree, a changed hyperparameter is caught at its first step."""

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import DIGITS_MLP, REPO

from xlatrain.cli import main
from xlatrain.commands.parity import compare


def test_one_device_and_eight_devices_fsdp_agree(capsys, devices):
    code = main(["parity", "examples/configs/digits_mlp.yaml", "--a", "mesh.data=1", "--b",
                 "parallel.strategy=fsdp", "--steps", "10"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "no divergence over 10 steps" in out


def test_a_different_learning_rate_diverges_at_step_one_and_both_curves_are_drawn(capsys, tmp_path):
    chart = tmp_path / "parity.png"
    code = main(["parity", "--a", *DIGITS_MLP, "--b", *DIGITS_MLP, "optimizer.lr=0.01", "--steps", "5",
                 "--plot", str(chart)])
    out = capsys.readouterr().out
    assert code == 1
    assert "first divergence at step 1: param_norm" in out and f"wrote {chart}" in out
    from PIL import Image

    with Image.open(chart) as image:
        assert image.format == "PNG"


def test_compare_reports_the_first_step_beyond_tolerance():
    a = {s: {"loss": 1.0, "param_norm": 2.0} for s in (1, 2, 3)}
    b = {1: {"loss": 1.0, "param_norm": 2.0}, 2: {"loss": 1.00001, "param_norm": 2.0},
         3: {"loss": float("nan"), "param_norm": 2.0}}
    report = compare(a, b, 3, rtol=1e-4)
    assert report.first.step == 3 and report.first.metric == "loss"
    assert compare(a, a, 3, rtol=0.0).first is None


def test_too_many_configs_is_a_user_error(capsys):
    assert main(["parity", "a.yaml", "b.yaml", "c.yaml"]) == 2
    assert "at most two configs" in capsys.readouterr().err


def _parity_until(tmp_path, appears: str, sig: int):
    """`xlatrain parity` in a real process, sent `sig` once its scratch directory holds `appears`."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    process = subprocess.Popen(
        [sys.executable, "-m", "xlatrain.cli", "parity", "examples/configs/digits_mlp.yaml", "--a", "mesh.data=1",
         "--b", "mesh.data=2", "--steps", "5000"], cwd=REPO, env={**os.environ, "TMPDIR": str(scratch)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(scratch.glob(f"xlatrain-parity-*/{appears}")) and time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    process.send_signal(sig)
    out, err = process.communicate(timeout=120)
    return process.returncode, out, err, scratch


@pytest.mark.parametrize("appears, sig", [("A", "SIGTERM"), ("A/metrics.jsonl", "SIGINT")],
                         ids=["before-the-first-step", "while-a-side-trains"])
def test_a_stop_signal_ends_parity_with_no_verdict_and_no_traceback(tmp_path, appears, sig):
    code, out, err, scratch = _parity_until(tmp_path, appears, getattr(signal, sig))
    assert code == 128 + getattr(signal, sig), (code, err)
    assert err.strip().splitlines() == [f"xlatrain: {sig}: parity stopped before its comparison ended; nothing "
                                        "compared"], err
    assert "divergence" not in out and list(scratch.iterdir()) == []  # the scratch runs went with it
