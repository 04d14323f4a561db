"""`xlatrain lower`: the report's keys, the collectives data parallel and FSDP need, and HLO dumps."""

import json

import pytest
from conftest import DIGITS_MLP, TINY_GPT, run_cli
from xlatrain.lowering.inspect import collectives, shape_bytes

from xlatrain.cli import main


def lower_json(capsys, *overrides):
    assert main(["lower", "--json", *overrides]) == 0
    return json.loads(capsys.readouterr().out)


def kinds(report):
    return {c["kind"]: c for c in report["collectives"]}


def test_data_parallel_step_all_reduces_gradients(capsys, devices):
    report = lower_json(capsys, *DIGITS_MLP)
    assert set(report) == {"params", "flops", "peak_memory_bytes", "memory", "device_memory", "collectives",
                           "model_flops", "amp_order", "loss_scaled", "gradients_synchronised"}
    assert report["device_memory"]["bytes"] > report["peak_memory_bytes"]
    assert report["device_memory"]["of"].startswith("a CPU device's share of the host's")
    assert report["amp_order"] == []
    assert report["params"] == 64 * 32 + 32 + 32 * 10 + 10
    # the first layer's input gradient is not needed: forward + both gradients of the second layer, one of the first
    assert report["model_flops"] == 2 * 32 * (3 * 32 * 10 + 2 * 64 * 32)
    assert report["flops"] > 0 and report["peak_memory_bytes"] > 0
    reduce = kinds(report)["all-reduce"]
    assert reduce["count"] >= 1 and reduce["bytes"] >= 4 * report["params"]
    assert "all-gather" not in kinds(report)


def test_fsdp_step_all_gathers_parameters(capsys, devices):
    replicated = lower_json(capsys, *TINY_GPT)
    fsdp = lower_json(capsys, *TINY_GPT, "parallel.strategy=fsdp")
    assert "all-gather" in kinds(fsdp) and kinds(fsdp)["all-gather"]["bytes"] > 0
    assert fsdp["peak_memory_bytes"] < replicated["peak_memory_bytes"]


def test_single_device_step_has_no_collectives(capsys, devices, monkeypatch):
    monkeypatch.setattr("jax.devices", lambda *a: devices[:1])
    assert lower_json(capsys, *DIGITS_MLP, "mesh.data=1")["collectives"] == []


def test_the_report_says_whether_the_step_fits_a_device_as_train_would_hold_it(capsys, devices):
    assert main(["lower", *DIGITS_MLP]) == 0
    assert "of a CPU device's share of the host's" in capsys.readouterr().out.split("peak memory")[1].split("\n")[0]
    assert main(["lower", "data.seq_len=32768", "batch.global_size=8"]) == 0
    peak = capsys.readouterr().out.split("peak memory")[1].split("\n")[0]
    assert peak.endswith(": does NOT fit (`xlatrain train` refuses it)"), peak


def test_dump_writes_stablehlo_and_optimised_hlo(tmp_path):
    result = run_cli("lower", *DIGITS_MLP, "--dump", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "collectives" in result.stdout and "all-reduce" in result.stdout
    assert "stablehlo" in (tmp_path / "train_step.stablehlo.mlir").read_text()
    assert "all-reduce" in (tmp_path / "train_step.optimized.hlo.txt").read_text()


def test_a_dump_directory_that_cannot_be_made_is_one_line_before_anything_compiles(tmp_path):
    taken = tmp_path / "a-file"
    taken.write_text("kept")
    result = run_cli("lower", *DIGITS_MLP, "--dump", str(taken / "hlo"))
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"xlatrain: error: lower: --dump: cannot create {taken / 'hlo'} (Not a directory); name a directory you can "
        "write"]
    assert taken.read_text() == "kept"


@pytest.mark.parametrize("text, expected", [
    ("%a = f32[256,128]{1,0} all-reduce(f32[256,128]{1,0} %x), replica_groups={}", [("all-reduce", 1, 131072)]),
    # XLA:GPU's asynchronous starts: (operands, results) but all-reduce's, which holds its results only
    ("%b = ((f32[2]{0}, bf16[1,2]{1,0}), /*index=1*/(f32[4]{0}, bf16[2,2]{1,0})) all-gather-start(%x, %y)",
     [("all-gather", 1, 24)]),
    ("%b = ((f32[272512]{0}), f32[136256]{0}) reduce-scatter-start(%x), dimensions={0}",
     [("reduce-scatter", 1, 136256 * 4)]),
    ("%b = (bf16[1,64,128]{2,1,0}, bf16[1,64,128]{2,1,0}, u32[], u32[]) collective-permute-start(%y)",
     [("collective-permute", 1, 64 * 128 * 2)]),
    ("%b = (f32[4]{0}, f32[8]{0}) all-reduce-start(%x, %y), to_apply=%sum", [("all-reduce", 1, 48)]),
    ("%c = f32[] add(f32[] %x, f32[] %y)", []),
])
def test_collective_parsing(text, expected):
    assert [(c["kind"], c["count"], c["bytes"]) for c in collectives(text)] == expected


def test_shape_bytes():
    assert shape_bytes("(f32[2,3]{1,0}, s8[5]{0}, pred[])") == 24 + 5 + 1
