"""`xlatrain lower`: the report's keys, the collectives data parallel and FSDP need, and HLO dumps."""

import json

import pytest
from conftest import DIGITS_MLP, TINY_GPT, run_cli
from xlatrain.lowering.inspect import collectives, shape_bytes
from xlatrain.lowering.kernels import kernel_split

from xlatrain.cli import main


def lower_json(capsys, *overrides):
    assert main(["lower", "--json", *overrides]) == 0
    return json.loads(capsys.readouterr().out)


def kinds(report):
    return {c["kind"]: c for c in report["collectives"]}


def test_data_parallel_step_all_reduces_gradients(capsys, devices):
    report = lower_json(capsys, *DIGITS_MLP)
    assert set(report) == {"params", "flops", "bytes_accessed", "kernels", "peak_memory_bytes", "memory",
                           "device_memory", "collectives", "model_flops", "amp_order", "loss_scaled",
                           "gradients_synchronised", "attention"}
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
    # 128 rows of 32768 tokens: the blockwise attention holds no [L, L] array (8 rows fit, 2.2 GiB a device), but
    # the activations of 16 rows a device do not
    assert main(["lower", "data.seq_len=32768", "batch.global_size=128"]) == 0
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


LOOPED_HLO = """HloModule m

%fused_update (p0: f32[12,4,8], p1: f32[1,4,8], p2: s32[]) -> f32[12,4,8] {
  %p0 = f32[12,4,8]{2,1,0} parameter(0)
  %p1 = f32[1,4,8]{2,1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %c = s32[] constant(0)
  ROOT %dus = f32[12,4,8]{2,1,0} dynamic-update-slice(%p0, %p1, %p2, %c, %c)
}

%fused_slice (q0: f32[12,4,8], q1: s32[]) -> f32[1,4,8] {
  %q0 = f32[12,4,8]{2,1,0} parameter(0)
  %q1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = f32[1,4,8]{2,1,0} dynamic-slice(%q0, %q1, %z, %z), dynamic_slice_sizes={1,4,8}
  ROOT %copy = f32[1,4,8]{2,1,0} copy(%ds)
}

%fused_dot (r0: bf16[4,8], r1: bf16[8,16]) -> bf16[4,16] {
  %r0 = bf16[4,8]{1,0} parameter(0)
  %r1 = bf16[8,16]{1,0} parameter(1)
  ROOT %dot = bf16[4,16]{1,0} dot(%r0, %r1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (b: (s32[], f32[12,4,8])) -> (s32[], f32[12,4,8]) {
  %b = (s32[], f32[12,4,8]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %stack = f32[12,4,8]{2,1,0} get-tuple-element(%b), index=1
  %slice = f32[1,4,8]{2,1,0} fusion(%stack, %i), kind=kLoop, calls=%fused_slice
  %updated = f32[12,4,8]{2,1,0} fusion(%stack, %slice, %i), kind=kLoop, calls=%fused_update
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[12,4,8]{2,1,0}) tuple(%next, %updated)
}

%cond (c: (s32[], f32[12,4,8])) -> pred[] {
  %c = (s32[], f32[12,4,8]{2,1,0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (a: f32[12,4,8], x: bf16[4,8], w: bf16[8,16]) -> bf16[4,16] {
  %a = f32[12,4,8]{2,1,0} parameter(0)
  %x = bf16[4,8]{1,0} parameter(1)
  %w = bf16[8,16]{1,0} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], f32[12,4,8]{2,1,0}) tuple(%zero, %a)
  %loop = (s32[], f32[12,4,8]{2,1,0}) while(%init), condition=%cond, body=%body, backend_config=TRIPS
  ROOT %mm = bf16[4,16]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot
}
""".replace("TRIPS", '{"known_trip_count":{"n":"12"}}')


def test_kernels_count_a_loops_trips_slices_by_their_slice_and_matmul_flops():
    split = kernel_split(LOOPED_HLO)
    row = 4 * 8 * 4  # one layer's slice; the index is 4 bytes
    assert split["by_class"] == {"matmul": {"kernels": 1, "bytes": 2 * (4 * 8 + 8 * 16 + 4 * 16)},
                                 "scan slices": {"kernels": 24, "bytes": 12 * ((row + 4 + row) + 2 * (row + 4))},
                                 "elementwise": {"kernels": 12, "bytes": 12 * 3 * 4}}
    assert split["kernels"] == 37 and split["matmul_flops"] == 2 * 4 * 16 * 8


def test_the_kernels_matmul_flops_are_the_models(capsys):
    """Counted two ways, on a device program's dots and on the jaxpr (all devices): the unrolled GPT's agree."""
    report = lower_json(capsys, *TINY_GPT, "model.scan_layers=false")
    assert 8 * report["kernels"]["matmul_flops"] == report["model_flops"]  # per device, and over the 8
    assert report["kernels"]["kernels"] == sum(c["kernels"] for c in report["kernels"]["by_class"].values())
    assert report["bytes_accessed"] > 0
