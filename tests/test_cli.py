"""`xlatrain train` end to end in a real process: logs, TensorBoard files, saved config, resume."""

import json
import re
import subprocess
import sys

import pytest
import yaml
from conftest import run_cli

from xlatrain.cli import _parse_intermixed, _parser, main
from xlatrain.run.metrics import read_metrics


def test_train_writes_metrics_tensorboard_config_and_checkpoints(tmp_path):
    run_dir = tmp_path / "digits"
    args = ("train", "examples/configs/digits_mlp.yaml", "trainer.steps=30", "trainer.eval_every=15",
            "trainer.checkpoint_every=10", "trainer.log_every=5", f"trainer.run_dir={run_dir}")
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr
    assert "effective lr 0.003" in result.stdout and "finished at step 30" in result.stdout

    records = read_metrics(run_dir / "metrics.jsonl")
    train_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_records] == [5, 10, 15, 20, 25, 30]
    # stderr is not a terminal (trainer.progress: auto): a plain line per logged step, no progress-bar frames
    logged = [line.strip() for line in result.stdout.splitlines() if re.match(r"\s+step \d+/30: ", line)]
    assert [int(line.split("/")[0].split()[1]) for line in logged] == [5, 10, 15, 20, 25, 30]
    assert all(re.fullmatch(r"step \d+/30: loss \d+\.\d{4}, lr [\d.e-]+, [\d,]+ samples/s, [\d.]+% MFU, "
                            r"ETA \d+:\d\d:\d\d", line) for line in logged), logged
    assert logged[-1].startswith(f"step 30/30: loss {train_records[-1]['loss']:.4f}") and "\r" not in result.stderr
    eval_30 = [r for r in records if "eval_loss" in r][-1]["eval_loss"]
    assert result.stdout.splitlines()[-1] == (f"  finished at step 30; checkpoint and metrics in {run_dir}; train loss "
                                              f"{train_records[-1]['loss']:.4f}, eval loss {eval_30:.4f}")
    assert {"loss", "accuracy", "grad_norm", "lr", "samples_per_sec"} <= set(train_records[0])
    assert [r["step"] for r in records if "eval_loss" in r] == [15, 30]
    assert train_records[-1]["loss"] < train_records[0]["loss"]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == ["10", "20", "30"]

    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["model"]["hidden"] == [128, 128] and saved["trainer"]["steps"] == 30
    assert saved["derived"]["global_batch"] == 64 and saved["derived"]["data_parallel"] == 8

    again = run_cli(*args)
    assert again.returncode == 0 and "already at step 30" in again.stdout
    for log, torn in (("metrics.jsonl", '{"step": 31, "lo'), ("summary.jsonl", '{"executions": 4')):
        with open(run_dir / log, "a") as handle:  # as a run killed while writing them would leave them
            handle.write(torn)
    longer = run_cli(*args[:-2], "trainer.steps=35", f"trainer.run_dir={run_dir}")
    assert longer.returncode == 0 and "resuming from checkpoint at step 30" in longer.stdout, longer.stderr
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r][-2:] == [30, 35]
    report = run_cli("report", str(run_dir))
    assert report.returncode == 0 and report.stdout.count("\nsession ") == 1, report.stderr  # two sessions trained


def test_a_start_writes_tensorboard_events_without_importing_torch(tmp_path):
    """tensorboardX imports torch where it is installed (1.5 s of every start here), only to accept its tensors;
    xlatrain logs numbers. torch stays importable for a model that needs it."""
    pytest.importorskip("torch")
    code = ("import sys; from pathlib import Path; import xlatrain.cli, xlatrain.trainer; "
            "from xlatrain.run.metrics import MetricsWriter; "
            f"w = MetricsWriter(Path({str(tmp_path)!r}), 0); w.write({{'step': 1, 'loss': 0.5}}); w.close(); "
            "assert 'torch' not in sys.modules, 'torch imported'; import torch; print(torch.ones(2).sum().item())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "2.0", result.stderr[-2000:]
    events, = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    assert b"loss" in events.read_bytes()


def test_lower_json_is_one_object():
    result = run_cli("lower", "--json", "examples/configs/digits_mlp.yaml")
    assert result.returncode == 0, result.stderr
    assert set(json.loads(result.stdout)) == {"params", "flops", "bytes_accessed", "kernels", "peak_memory_bytes",
                                             "memory", "device_memory", "collectives", "model_flops", "amp_order",
                                             "loss_scaled", "gradients_synchronised", "attention"}


def test_overrides_may_stand_between_a_commands_options():
    args = _parse_intermixed(_parser(), ["lower", "cfg.yaml", "model.layers=3", "--target", "h100", "mesh.stage=2",
                                         "--devices", "4", "model.width=64"])
    assert (args.args, args.target, args.devices) == (["cfg.yaml", "model.layers=3", "mesh.stage=2", "model.width=64"],
                                                      "h100", 4)
    for argv in (["lower", "model.layers=3", "--bogus"], ["report", "runs/a", "extra=1"]):
        result = run_cli(*argv)
        assert result.returncode == 2 and result.stderr.strip().splitlines() == [
            f"xlatrain: error: unrecognized arguments: {argv[-1]} (see xlatrain --help)"], result.stderr


def test_an_import_that_fails_as_train_starts_keeps_its_own_traceback(tmp_path, monkeypatch):
    """A broken install is xlatrain's to show as it is: its ImportError, not a NameError of the handler."""
    from xlatrain.cli import main

    monkeypatch.setitem(sys.modules, "xlatrain.trainer", None)
    with pytest.raises(ImportError, match="xlatrain.trainer"):
        main(["train", f"trainer.run_dir={tmp_path / 'run'}"])


def test_ctrl_c_in_a_command_that_trains_nothing_is_one_line_and_the_shells_status(monkeypatch, capsys):
    from xlatrain import config
    from xlatrain.cli import main

    def interrupted(*_args):
        raise KeyboardInterrupt

    monkeypatch.setattr(config, "load_config", interrupted)
    assert main(["config"]) == 130
    assert capsys.readouterr().err == "xlatrain: interrupted\n"


def test_version_names_xlatrain_and_the_jax_it_runs_on():
    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout.startswith("xlatrain 0.1.0 (jax "), result.stdout


@pytest.mark.parametrize("argv, flag, meant", [
    (["train", "--steps", "50"], "--steps", "trainer.steps=50"),
    (["train", "model.layers=2", "--steps=7"], "--steps=7", "trainer.steps=7"),
    (["lower", "--lr", "0.1"], "--lr", "optimizer.lr=0.1")])
def test_an_option_that_names_a_config_key_points_at_the_override(argv, flag, meant, capsys):
    from xlatrain.cli import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"xlatrain: error: unrecognized arguments: {flag}; did you mean {meant}? (see xlatrain --help)"]


def test_train_help_names_the_sections_and_how_to_list_every_key(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    from xlatrain.config import Config

    assert f"config sections: {', '.join(Config.model_fields)} (model.name" in shown  # the schema's, all of them
    assert "xlatrain config [CONFIG] [key=value ...] --keys [SECTION]" in shown


def test_config_keys_lists_the_keys_of_the_configs_own_kinds_with_values_and_meaning(capsys):
    assert main(["config", "model.name=llama", "model.kv_heads=2", "--keys", "model"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["model.name=llama", "A", "Llama-style", "decoder", "(Llama,", "Mistral,", "Qwen2,",
                                "Qwen3,", "Gemma", "2", "and", "3):", "RoPE,", "RMSNorm,", "a", "gated", "MLP,",
                                "grouped-query", "attention."]
    assert any(line.startswith("model.kv_heads=2 ") and "Key/value heads" in line for line in lines)
    assert not any(line.startswith(("model.mlp_ratio", "trainer.")) for line in lines)  # the GPT's; another section
    assert main(["config", "--keys", "trainer.steps"]) == 0
    assert capsys.readouterr().out.split() == ["trainer.steps=300", "Optimizer", "steps", "in", "total."]
    assert main(["config", "--keys", "trainr"]) == 2
    assert "no such key or section; the sections: batch, collectives, data" in capsys.readouterr().err


def test_progress_true_keeps_the_bar_where_stderr_is_not_a_terminal(tmp_path):
    result = run_cli("train", "examples/configs/digits_mlp.yaml", "trainer.steps=10", "trainer.log_every=5",
                     "trainer.progress=true", f"trainer.run_dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr
    assert "10/10" in result.stderr and "step/s" in result.stderr  # tqdm's frames
    assert not re.search(r"step \d+/10: loss", result.stdout)


def test_the_last_line_tells_a_stopped_run_from_a_finished_one_and_gives_the_final_losses(tmp_path):
    from xlatrain.trainer import TrainResult, final_line

    finished = TrainResult(tmp_path, 0, 300, losses={299: 2.5, 300: 2.31234}, eval_losses={100: 2.9, 300: 2.4})
    assert final_line(finished, tmp_path) == (f"finished at step 300; checkpoint and metrics in {tmp_path}; "
                                              "train loss 2.3123, eval loss 2.4000")
    stopped = TrainResult(tmp_path, 0, 120, losses={120: 2.7}, eval_losses={100: 2.9}, interrupted=True)
    assert final_line(stopped, tmp_path) == (f"stopped by signal at step 120; a checkpoint there resumes with the same "
                                             f"command; checkpoint and metrics in {tmp_path}; train loss 2.7000, "
                                             "eval loss 2.9000 (step 100)")


def test_the_time_left_is_the_pace_so_far_times_the_steps_left():
    from xlatrain.trainer import Eta

    now = [100.0]
    eta = Eta(start=50, steps=350, began=40.0, clock=lambda: now[0])
    assert eta.at(50) == "?" and eta.at(110) == "0:04:00"  # 60 s for 60 steps, 240 to go
