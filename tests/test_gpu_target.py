"""`xlatrain lower --target`: a config's train step compiled for GPUs on a host without one.

The compiling tests need jax's CUDA plugin, which the main environment does not have (jax would look for CUDA in
every test): CI's gpu-target leg runs this file in an environment that adds it (.ci/run). The rest run everywhere.
"""

import itertools
import json
import shlex

import jax
import jax.numpy as jnp
import pytest
from conftest import REPO, TINY_GPT, run_cli

from xlatrain.compat.backends import cudnn_missing, installed_cuda_plugin
from xlatrain.errors import UserError
from xlatrain.models.attention import causal_attention
from xlatrain.observe.peaks import known_peak
from xlatrain.runtime.gpu_targets import (
    GPU_TARGETS,
    parse_target_config,
    resolve_target,
    resolved_memory,
    target_config_text,
    target_devices,
)
from xlatrain.runtime.platform import compiling_for, lowering_platform

HAS_CUDA_PLUGIN = installed_cuda_plugin() is not None
needs_cuda_plugin = pytest.mark.skipif(not HAS_CUDA_PLUGIN, reason="jax's CUDA plugin is not installed (CI's "
                                       "gpu-target leg in .ci/run installs it in its own environment)")
PIPELINE = ["parallel.mode=shard_map", "model.width=16", "data.seq_len=16", "batch.global_size=32"]
H100 = target_config_text(GPU_TARGETS["h100"])


def test_each_known_target_describes_its_device_and_mfu_knows_its_peak():
    for field in ('device_description_str: "NVIDIA H100 80GB HBM3"', "core_count: 132", "major: 9",
                  "device_memory_size: 85520809984", 'platform_name: "CUDA"'):
        assert field in H100
    for name, spec in GPU_TARGETS.items():
        assert known_peak(spec.name, "bfloat16") is not None, spec.name
        assert parse_target_config(target_config_text(spec))[1] == [], name
        assert resolve_target(name).memory_bytes == resolved_memory(spec.name) == spec.memory_bytes
    assert known_peak(GPU_TARGETS["h200"].name, "bfloat16") == known_peak("NVIDIA H200", "bfloat16")


def test_a_target_is_a_known_name_or_a_target_config_file(tmp_path):
    assert resolve_target("H100").device_kind == "NVIDIA H100 80GB HBM3"
    spec = tmp_path / "h100_pcie.txtpb"
    spec.write_text(H100.replace("core_count: 132", "core_count: 114")
                    .replace("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe"))
    from_file = resolve_target(str(spec))
    assert (from_file.device_kind, from_file.memory_bytes) == ("NVIDIA H100 PCIe", GPU_TARGETS["h100"].memory_bytes)
    assert resolved_memory("NVIDIA H100 PCIe") == GPU_TARGETS["h100"].memory_bytes  # for remat: auto, on its devices
    assert "core_count: 114" in from_file.config_text
    with pytest.raises(UserError, match=r"--target h900: neither a known GPU \(h100, h200, a100, l4\) nor a file"):
        resolve_target("h900")
    (tmp_path / "notes.txt").write_text("threads: 1024\n")
    with pytest.raises(UserError, match="not a GPU target config in text format: it needs gpu_device_info"):
        resolve_target(str(tmp_path / "notes.txt"))
    (tmp_path / "no_sms.txtpb").write_text(H100.replace("  core_count: 132\n", ""))
    with pytest.raises(UserError, match=r"no_sms.txtpb: gpu_device_info lacks a positive core_count \(0\); give a "
                                        "GPU target config in text format"):
        resolve_target(str(tmp_path / "no_sms.txtpb"))
    assert [target_devices(-1, 4, None), target_devices(2, 4, None), target_devices(-1, 1, 3)] == [4, 8, 3]
    with pytest.raises(UserError, match="--devices 0"):
        target_devices(1, 1, 0)



def test_a_target_file_is_checked_against_the_figures_xla_compiles_from():
    """XLA takes a target config without core_count, threads_per_warp, the shared-memory limits or the memory
    and then kills the process (SIGFPE, a failed check) or fits the step into 0 bytes: xlatrain refuses it first."""
    # The shape of XLA's own spec files: comments, fields xlatrain does not check (an enum, a map, strings).
    richer = "# proto-message: stream_executor.GpuTargetConfigProto\n" + H100.replace(
        "    minor: 0\n  }\n", "    feature_extension: ACCELERATED_FEATURES\n  }\n  matrix_unit_description {\n"
        "    rate_infos {\n      key: 2\n      value {\n        ops_per_clock: 1024\n      }\n    }\n  }\n"
        '  name: "NVIDIA H100 80GB HBM3"\n  ecc_enabled: true\n')
    config, problems = parse_target_config(richer)
    assert problems == [] and config.gpu_device_info.core_count == 132
    assert parse_target_config(H100.replace("core_count: 132", "core_count: 0")
                               .replace("  threads_per_warp: 32\n", "")
                               .replace("clock_rate_ghz: 1.98", "clock_rate_ghz: nan"))[1] == [
        "gpu_device_info lacks a positive threads_per_warp (0), core_count (0), clock_rate_ghz (nan)"]
    assert parse_target_config(H100.replace("device_memory_size", "device_memory_sizes"))[1] == [
        "gpu_device_info lacks a positive device_memory_size (0)"]
    rocm = H100.replace('platform_name: "CUDA"', 'platform_name: "ROCM"').replace("major: 9", "major: 0")
    assert parse_target_config(rocm)[1] == [
        "gpu_device_info.cuda_compute_capability.major is missing or 0: jax's CUDA plugin compiles for a CUDA "
        "compute capability", 'platform_name is "ROCM": jax\'s CUDA plugin compiles for "CUDA" only']
    for broken, where in ((H100.replace("core_count: 132", "core_count 132"), "8:14"),
                          (H100.replace("core_count: 132", 'core_count: "many"'), "8:15"),
                          (H100.replace("core_count: 132", "core_count: 99999999999"), "8:15"),
                          (H100[:-3], None)):
        [problem] = parse_target_config(broken)[1]
        assert problem.startswith("not a GPU target config in text format"), problem
        assert where is None or f"({where} :" in problem, problem


def test_lower_refuses_what_a_target_cannot_compile_in_one_line():
    cases = [(["--devices", "2"], "--devices counts the GPUs of --target"),
             (["collectives.impl=custom", "--target", "h100"], "collectives.impl=custom compiles against xlatrain's "
                                                                 "NCCL library"),
             (["--target", "h900"], "neither a known GPU")]
    if not HAS_CUDA_PLUGIN:
        cases.append((["--target", "h100"], "--target h100: compiling for a GPU needs jax's CUDA plugin (not the "
                                            "GPU): it is not installed; install it with pip install "
                                            f"jax-cuda13-plugin=={jax.__version__}"))
    for args, message in cases:
        result = run_cli("lower", *TINY_GPT, *args)  # overrides before the options: argparse takes them so
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr[-2000:])
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@needs_cuda_plugin
def test_a_target_config_xla_cannot_parse_or_compile_for_is_refused_naming_the_file(tmp_path):
    """xlatrain's check leaves the fields it does not know to XLA, and XLA:GPU may still refuse the step."""
    unknown_field = tmp_path / "unknown_field.txtpb"
    unknown_field.write_text(H100.replace("  core_count:", "  sm_count: 132\n  core_count:"))
    pascal = tmp_path / "p100.txtpb"  # compute capability 6.0: CUDA 13's ptxas no longer compiles for it
    pascal.write_text(H100.replace("major: 9", "major: 6").replace("NVIDIA H100 80GB HBM3", "Tesla P100"))
    for target, message in ((unknown_field, "XLA did not take the GPU target config"),
                            (pascal, "XLA:GPU cannot compile the train step for a Tesla P100")):
        result = run_cli("lower", *TINY_GPT, "--target", str(target))
        assert result.returncode == 2, result.stderr[-2000:]
        # XLA logs its own lines first (where its parser stopped, which ptxas it used); xlatrain's one line ends
        assert result.stderr.strip().splitlines()[-1].startswith(f"xlatrain: error: --target {target}: {message}"), \
            result.stderr


def test_attention_takes_the_formulation_of_the_platform_compiled_for():
    """On a CPU host, a causal attention traced for a GPU is XLA's one (or cuDNN's), not the CPU's query blocks."""
    q = jax.ShapeDtypeStruct((2, 128, 2, 16), jnp.float32)

    def dots(platform):
        with compiling_for(platform):
            assert lowering_platform() == platform
            # a function of its own each time: jax reuses a function's trace for the same shapes
            jaxpr = jax.make_jaxpr(lambda *qkv: causal_attention(*qkv))(q, q, q).jaxpr
            return sum(e.primitive.name == "dot_general" for e in jaxpr.eqns)

    assert (dots("cpu"), dots("gpu")) == (8, 2)  # 4 query blocks of 2 products each, against one of each
    assert lowering_platform() == jax.default_backend()


def lower_for_gpus(*overrides: str, target: str = "h100", env: dict | None = None) -> dict:
    result = run_cli("lower", *TINY_GPT, *overrides, "--json", "--target", target, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


@needs_cuda_plugin
def test_the_gpt_compiles_for_an_h100_and_its_memory_is_xlas(tmp_path):
    report = lower_for_gpus("precision.policy=bf16", env={"XDG_CACHE_HOME": str(tmp_path)})
    assert not list(tmp_path.rglob("*")), "a compile-only executable went into the persistent cache"
    assert report["target"] == {"asked": "h100", "device_kind": "NVIDIA H100 80GB HBM3", "devices": 1,
                                "memory_bytes": GPU_TARGETS["h100"].memory_bytes, "cudnn_missing": cudnn_missing()}
    assert report["flops"] > 0 and report["bytes_accessed"] > 0  # XLA's analysis of the H100 module, on the CPU
    assert report["kernels"]["matmul_flops"] == report["model_flops"]  # the unrolled layers' dots, all counted
    assert ("attention" in report["kernels"]["by_class"]) == (cudnn_missing() is None)
    assert 0 < report["peak_memory_bytes"] < GPU_TARGETS["h100"].memory_bytes
    assert report["amp_order"] == ["no cross-replica reduction of the gradients (single device: nothing to order)"]


@needs_cuda_plugin
def test_lower_names_the_kernel_of_sliding_window_and_soft_capped_layers():
    """Sliding windows run in cuDNN's fused kernel (local_window_size) where it is installed; soft-capped scores,
    which it cannot cap, in XLA's ops, and the report says so."""
    gemma = ["model.name=llama", "model.kv_heads=1", "precision.policy=bf16", "model.sliding_window=8",
             "model.layer_types=[sliding,full]"]
    windowed = lower_for_gpus(*gemma)["attention"]
    fused = "cuDNN's fused kernel" if cudnn_missing() is None else "XLA's"
    assert {(p["window"], p["softcap"], p["kernel"]) for p in windowed} == {(8, None, fused), (None, None, fused)}
    result = run_cli("lower", *TINY_GPT, *gemma, "model.attn_softcap=50", "--target", "h100", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("  attention        sliding-window layers (8), scores soft-capped at 50: XLA's (cuDNN's fused kernel has "
            "no soft-capping: the scores are capped in XLA's ops)") in result.stdout.splitlines()


@needs_cuda_plugin
def test_on_a_gpu_unrolled_layers_launch_fewer_kernels_than_the_scan_and_move_fewer_bytes():
    """model.scan_layers=auto unrolls on GPUs: the scan copies each layer's saved activations out of their stack."""
    unrolled, scanned = (lower_for_gpus("model.layers=4", "precision.policy=bf16", *scan)
                         for scan in ([], ["model.scan_layers=true"]))
    assert "scan slices" not in unrolled["kernels"]["by_class"] and scanned["kernels"]["by_class"]["scan slices"]
    assert unrolled["kernels"]["kernels"] < scanned["kernels"]["kernels"]
    assert unrolled["kernels"]["bytes"] < scanned["kernels"]["bytes"]
    assert unrolled["kernels"]["matmul_flops"] == scanned["kernels"]["matmul_flops"] == unrolled["model_flops"]


@needs_cuda_plugin
def test_the_llama_compiles_for_two_h100s_with_the_amp_order_intact():
    report = lower_for_gpus("model.name=llama", "model.kv_heads=1", "precision.policy=bf16", "mesh.data=2",
                            "parallel.strategy=fsdp")
    assert report["target"]["devices"] == 2 and report["model_flops"] > 0
    assert 0 < report["peak_memory_bytes"] < GPU_TARGETS["h100"].memory_bytes
    assert report["amp_order"] == [], report["amp_order"]


@needs_cuda_plugin
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb1p", "zbv"])
def test_every_schedule_compiles_for_gpus_with_the_amp_order_intact(schedule):
    """2 stages x 2 data replicas of H100s: XLA:GPU runs the gradient sync as asynchronous -start/-done pairs,
    which the AMP-order check must see as the cross-replica reductions they are."""
    layers = 4 if schedule in ("interleaved", "zbv") else 2
    report = lower_for_gpus(*PIPELINE, "mesh.stage=2", "mesh.data=2", f"model.layers={layers}",
                            f"parallel.pipeline.schedule={schedule}", "parallel.pipeline.remat=none",
                            "parallel.pipeline.microbatches=4", "precision.policy=bf16")
    assert report["target"]["devices"] == 4 and report["pipeline"]["schedule"] == schedule
    assert report["amp_order"] == [], report["amp_order"]
    assert {"all-reduce", "collective-permute"} <= {c["kind"] for c in report["collectives"]}


@needs_cuda_plugin
def test_on_an_h100_1f1b_holds_p_microbatches_where_gpipe_holds_m():
    """XLA:GPU's memory analysis: with m=8 and p=2, GPipe's temporaries exceed 1F1B's by the 6 more microbatches
    of activations (and residuals, with remat: none) it holds, give or take XLA's buffer assignment, which shares
    other temporaries differently between the two programs. Measured, in microbatches' worth: jax 0.10.2 6.0
    (full) and 7.02 (none), jax 0.12 5.0 and 6.46; activations of 128 KiB and residuals of 2.1 MiB per
    microbatch keep that sharing (about 100 KB) small beside them."""
    common = [*PIPELINE, "mesh.stage=2", "mesh.data=1", "model.layers=2", "parallel.pipeline.microbatches=8",
              "model.width=64", "data.seq_len=128"]
    lowered = {(schedule, remat): lower_for_gpus(*common, f"parallel.pipeline.schedule={schedule}",
                                                 f"parallel.pipeline.remat={remat}")
               for schedule, remat in itertools.product(("gpipe", "1f1b"), ("full", "none"))}
    assert all(report["amp_order"] == [] for report in lowered.values())
    reports = {case: report["pipeline"] for case, report in lowered.items()}
    activations = reports["1f1b", "full"]["activation_bytes_per_microbatch"]
    residuals = reports["1f1b", "none"]["residual_bytes_per_microbatch"]
    assert (activations, residuals) == (4 * 128 * 64 * 4, 2162688)  # rows x length x width x float32
    for remat, per_microbatch in (("full", activations), ("none", activations + residuals)):
        saved = reports["gpipe", remat]["temp_bytes"] - reports["1f1b", remat]["temp_bytes"]
        assert abs(saved / per_microbatch - (8 - 2)) <= 1.25, (remat, saved / per_microbatch)


@needs_cuda_plugin
def test_the_docs_target_commands_run_as_written():
    performance = (REPO / "docs" / "performance.md").read_text()
    section = performance[performance.index("## Compile for a GPU you do not have"):]
    block = section[section.index("```bash\n") + 8:section.index("```", section.index("```bash\n") + 8)]
    commands = [shlex.split(line.split("#")[0]) for line in block.splitlines() if line.startswith("xlatrain lower")]
    assert len(commands) == 2
    for command in commands:
        result = run_cli(*command[1:], timeout=600)
        assert result.returncode == 0, (command, result.stderr[-3000:])
        assert "compiled only" in result.stdout and ": fits" in result.stdout, result.stdout


@needs_cuda_plugin
def test_a_tensor_parallel_gpt_compiles_for_four_h100s_with_reduce_scatters_under_sequence_parallelism():
    """XLA:GPU turns the row-parallel outputs' sum into reduce-scatters over `tensor` (XLA:CPU keeps an all-reduce
    and a slice); the parameters per GPU are a quarter of the whole's, beyond the norms and positions."""
    shape = ["model.width=64", "model.heads=4", "precision.policy=bf16", "mesh.data=1", "mesh.tensor=4"]
    plain = lower_for_gpus(*shape)
    sequence_parallel = lower_for_gpus(*shape, "parallel.sequence_parallel=true")
    assert plain["target"]["devices"] == 4
    kinds = {(c["kind"], c["over"]) for c in sequence_parallel["collectives"]}
    assert ("reduce-scatter", "tensor") in kinds and ("all-gather", "tensor") in kinds
    assert ("reduce-scatter", "tensor") not in {(c["kind"], c["over"]) for c in plain["collectives"]}
    assert sequence_parallel["memory"]["temp_bytes"] < plain["memory"]["temp_bytes"]
    assert plain["amp_order"] == ["no cross-replica reduction of the gradients (one data replica: nothing to order)"]
