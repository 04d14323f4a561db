"""`xlatrain lower`: compile the train step, on this host's devices or for a GPU it need not have, and report what
XLA made of it: params, FLOPs, peak memory against a device's, collectives, the AMP order, a pipeline's layout."""

from __future__ import annotations

import contextlib
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterator

import jax

from xlatrain.compat.backends import compile_only_gpus, cudnn_missing
from xlatrain.compat.monitoring import cost_analysis
from xlatrain.config import Config, MuonConfig, load_config
from xlatrain.errors import UserError, first_line
from xlatrain.lowering import hlo_graph
from xlatrain.lowering.inspect import axes_spanned, collectives, dump, peak_memory_bytes
from xlatrain.lowering.kernels import kernel_split
from xlatrain.mesh import TENSOR
from xlatrain.models.attention import attention_paths
from xlatrain.muon import muon_labels
from xlatrain.program import Program, build_program
from xlatrain.runtime.gpu_targets import GpuTarget, resolve_target, target_devices
from xlatrain.state import with_shardings


def lower(config: Config, target: GpuTarget | None = None, devices: list | None = None, dump_to: Path | None = None,
          as_json: bool = False) -> None:
    """Prints the report (one JSON object with `as_json`); `devices`: the compile-only GPUs of `target`."""
    with _refused_by_target(target):
        program = build_program(config, devices)
        with attention_paths() as paths:  # the train step's, not those of the model traced to count its FLOPs
            step = program.train_step.first
        report = lower_report(program, step.compiled)
    report["attention"] = [asdict(path) for path in paths]
    if target is not None:
        report["target"] = {"asked": target.label, "device_kind": target.device_kind, "devices": len(devices),
                            "memory_bytes": target.memory_bytes, "cudnn_missing": cudnn_missing()}
    if dump_to:
        for path in dump(step.lowered, step.compiled, dump_to, "train_step"):
            print(f"wrote {path}", file=sys.stderr)
    print(json.dumps(report) if as_json else format_report(report, program.derived.devices))


def lower_report(program: Program, compiled: Any) -> dict[str, Any]:
    """What `xlatrain lower --json` prints of a compiled (first) train step."""
    available, where = program.device_memory
    analysis, hlo_text = cost_analysis(compiled), compiled.as_text()
    report = {"params": program.param_count,
              "flops": _flops_or_none(analysis),
              "bytes_accessed": analysis.get("bytes accessed"),
              "kernels": kernel_split(hlo_text),
              "peak_memory_bytes": peak_memory_bytes(compiled),
              "memory": memory_split(program, compiled),
              "collectives": collectives(hlo_text, dict(program.mesh.shape)),
              "device_memory": {"bytes": available, "of": where},
              "model_flops": program.measured.model_flops_per_step,
              "amp_order": amp_order_problems(program) if program.steps_per_sync == 1 else None,
              "loss_scaled": program.policy.dynamic_scale,
              "gradients_synchronised": program.gradients_synchronised}
    if program.pipeline is not None:
        report["pipeline"] = pipeline_report(program, compiled)
    if isinstance(program.config.optimizer, MuonConfig):
        report["muon"] = muon_report(program)
    return report


def muon_report(program: Program) -> dict[str, Any]:
    """What Muon's update moves per device (its collectives, the update compiled alone), against the bytes an
    all-gather of every hidden matrix would bring to each device (the matrices whole)."""
    state = with_shardings(program.abstract_state, program.specs, program.mesh)
    update = jax.jit(program.tx.update).lower(state.params, state.opt_state, state.params).compile()
    labels = jax.tree.leaves(muon_labels(program.abstract_state.params, program.model.frozen))
    matrices = [leaf for leaf, label in zip(jax.tree.leaves(program.abstract_state.params), labels, strict=True)
                if label == "muon"]
    return {"collectives": collectives(update.as_text(), dict(program.mesh.shape)),
            "all_gather_bytes": sum(leaf.size * leaf.dtype.itemsize for leaf in matrices)}


def memory_split(program: Program, compiled: Any) -> dict[str, int]:
    """Bytes per device: the parameters, their float32 gradients (of those that train: none of a frozen one,
    LoRA's base) and the optimizer state (their sharded shapes), beside XLA's arguments and temporaries (memory
    analysis: the activations and the step's working buffers)."""
    shardings = program.state_shardings
    stats = compiled.memory_analysis()
    params = program.abstract_state.params
    frozen = jax.tree.leaves(program.model.frozen) if program.model.frozen is not None else None
    return {"params_bytes": _bytes_per_device(params, shardings.params),
            "gradient_bytes": _bytes_per_device(params, shardings.params, itemsize=4,
                                                counted=None if frozen is None else [f is not True for f in frozen]),
            "optimizer_bytes": _bytes_per_device(program.abstract_state.opt_state, shardings.opt_state),
            "argument_bytes": int(stats.argument_size_in_bytes) if stats is not None else 0,
            "temp_bytes": int(stats.temp_size_in_bytes) if stats is not None else 0}


def _bytes_per_device(abstract: Any, shardings: Any, itemsize: int | None = None,
                      counted: list[bool] | None = None) -> int:
    """The largest shard of each leaf (what the most loaded device holds), summed; `itemsize`: each element's
    bytes (None: the leaf's dtype's); `counted`: which leaves count (None: all)."""
    leaves, placed = jax.tree.leaves(abstract), jax.tree.leaves(shardings)
    return sum(math.prod(sharding.shard_shape(leaf.shape)) * (itemsize or leaf.dtype.itemsize)
               for leaf, sharding, counts in zip(leaves, placed, counted or [True] * len(leaves), strict=True)
               if counts)


def amp_order_problems(program: Program) -> list[str]:
    """The AMP order checked on the compiled (single-step) train program; empty when it holds. Beside a tensor
    axis a reduction inside a tensor group alone does not count as the gradient sync."""
    leaves = jax.tree_util.tree_flatten_with_path(program.abstract_state)[0]
    params = [i for i, (path, _) in enumerate(leaves) if jax.tree_util.keystr(path).startswith(".params")]
    skips = program.policy.dynamic_scale or program.config.trainer.on_nonfinite == "skip"
    return hlo_graph.amp_order_problems(hlo_graph.parse_hlo(program.train_step.first.compiled.as_text()), params,
                                        sorted(program.train_batch_shapes()), skips_nonfinite=skips,
                                        clips=program.config.optimizer.clip_norm is not None,
                                        scales=program.policy.dynamic_scale,
                                        synchronised=program.gradients_synchronised,
                                        counted=_beyond_tensor(program.mesh))


def _beyond_tensor(mesh: jax.sharding.Mesh) -> Callable[[list[list[int]] | None], bool] | None:
    """The reductions that count as the sync: not those inside a tensor group alone. A pipeline's over `stage`
    count as without a tensor axis (XLA combines some with the gradient norm's into one all-reduce)."""
    if mesh.shape.get(TENSOR, 1) == 1:
        return None
    return lambda groups: groups is None or set(axes_spanned(groups, dict(mesh.shape))) != {TENSOR}


def pipeline_report(program: Program, compiled: Any) -> dict[str, Any]:
    """The pipeline of a compiled train step: schedule, partition, bubble, and the activations a stage holds,
    beside XLA's temporaries (memory analysis) that hold them."""
    plan, s, remat = program.pipeline, program.pipeline.schedule, program.remat
    memory = compiled.memory_analysis()
    return {"schedule": s.name, "stages": s.stages, "virtual_stages": s.virtual_stages,
            "microbatches": s.microbatches, "partition": list(plan.layout.partition),
            "partition_source": plan.partition_source, "compute_balance": plan.balance.compute_ratio,
            "memory_balance": plan.balance.memory_ratio,
            "bubble": s.bubble(), "theoretical_bubble": s.theoretical_bubble(),
            "activation_buffers": plan.slots.activation_buffers,
            "gpipe_activation_buffers": plan.gpipe_activation_buffers(),
            "activation_bytes_per_microbatch": plan.costs.boundary_bytes,
            "remat": remat.remat, "remat_reason": remat.reason,
            "residual_buffers": plan.slots.residual_buffers if remat.remat == "none" else 0,
            "stash_buffers": plan.slots.stash_buffers,
            "stash_bytes_per_microbatch": plan.count_stash_bytes() if plan.slots.splits_backward else 0,
            "residual_bytes_per_microbatch": plan.count_residual_bytes() if remat.remat == "none" else 0,
            "temp_bytes": int(memory.temp_size_in_bytes) if memory is not None else 0}


def gpu_target(config_path: str | None, overrides: list[str], asked: str, count: int | None,
               ) -> tuple[Config, GpuTarget, list]:
    """(config, GpuTarget, compile-only GPUs) for `lower --target`, before jax starts its backends. The persistent
    compilation cache stays off: a later run on the GPU itself must never load an executable compiled without it."""
    target = resolve_target(asked)
    config = load_config(config_path, [*overrides, "trainer.compile_cache=off"])
    if config.collectives.impl == "custom":
        raise UserError("lower --target: collectives.impl=custom compiles against xlatrain's NCCL library, which "
                        "needs the GPUs themselves; compile with collectives.impl=xla")
    devices = target_devices(config.mesh.data, config.mesh.per_replica(), count)
    return config, target, compile_only_gpus(target.config_text, devices, target.label)


@contextlib.contextmanager
def _refused_by_target(target: GpuTarget | None) -> Iterator[None]:
    """XLA:GPU refusing the step for a --target (a compute capability its ptxas has dropped, a limit of the
    device the step exceeds) as one line. For the host's own devices an XLA error is xlatrain's to fix: it
    keeps its traceback."""
    try:
        yield
    except jax.errors.JaxRuntimeError as error:
        if target is None:
            raise
        raise UserError(f"--target {target.label}: XLA:GPU cannot compile the train step for a {target.device_kind}: "
                        f"{first_line(error)}") from None


def _flops_or_none(analysis: dict[str, float]) -> float | None:
    """XLA's FLOP count; None where the backend gives no cost analysis (a compile-only GPU)."""
    return float(analysis["flops"]) if "flops" in analysis else None


def _fits(peak: int, memory: dict) -> str:
    """Against one device's memory, as `xlatrain train` holds the step before running it."""
    if not memory["bytes"]:
        return ""
    verdict = "fits" if peak <= memory["bytes"] else "does NOT fit (`xlatrain train` refuses it)"
    return f", {peak / memory['bytes']:.1%} of {memory['of']}: {verdict}"


def format_report(report: dict, devices: int) -> str:
    target = report.get("target")
    lines = [f"target             {target['devices']} x {target['device_kind']} (--target {target['asked']}), "
             "compiled only: nothing ran"] if target else []
    lines += [f"params             {report['params']:,}",
              "FLOPs per step     " + (f"{report['flops']:.4g}, {report['bytes_accessed'] / 1e9:.4g} GB accessed (XLA "
                                       "cost analysis, per device program: a loop's body counted once)"
                                       if report["flops"] is not None else "not given (XLA gave no cost analysis)"),
              "model FLOPs        " + (f"{report['model_flops']:.4g} per step, all devices (matmuls of the forward "
                                       "and backward over the global batch, counted on the jaxpr with every loop's "
                                       "trip count)" if report["model_flops"] else "not counted (a while loop)"),
              f"peak memory        {report['peak_memory_bytes'] / 2**20:.2f} MiB per device ({devices} devices)"
              + _fits(report["peak_memory_bytes"], report["device_memory"]),
              _memory_line(report["memory"]),
              _kernels_line(report["kernels"]),
              *_attention_lines(report["attention"] if target else []),
              "collectives        " + ("none" if not report["collectives"] else
                                       "(in the optimised HLO: a loop's body, e.g. a layer scan's, counted once)")]
    lines += [f"  {c['kind'] + (' over ' + c['over'] if c.get('over') else ''):<34} x{c['count']:<4} "
              f"{c['bytes'] / 2**20:.3f} MiB" for c in report["collectives"]]
    if "pipeline" in report:
        lines += _pipeline_lines(report["pipeline"])
    if "muon" in report:
        moved = sum(c["bytes"] for c in report["muon"]["collectives"])
        kinds = ", ".join(f"{c['kind']} x{c['count']}" for c in report["muon"]["collectives"]) or "no collectives"
        lines.append(f"muon update        {moved / 2**20:.3f} MiB per device ({kinds}); an all-gather of every "
                     f"hidden matrix: {report['muon']['all_gather_bytes'] / 2**20:.3f} MiB")
    lines.append(_amp_order_line(report))
    return "\n".join(lines)


def _kernels_line(kernels: dict) -> str:
    split = ", ".join(f"{kind} {c['kernels']} ({c['bytes'] / 1e9:.3g} GB)" for kind, c in kernels["by_class"].items())
    return (f"kernels            {kernels['kernels']} per step (a loop's body once per trip), moving "
            f"{kernels['bytes'] / 1e9:.4g} GB, matmuls {kernels['matmul_flops']:.4g} FLOPs: {split}")


def _attention_lines(paths: list[dict]) -> list[str]:
    """On a GPU target: which kernel each kind of layer's attention runs, and why where it is not cuDNN's."""
    lines = []
    for path in paths:
        layers = "full-attention layers" if path["window"] is None else f"sliding-window layers ({path['window']})"
        capped = "" if path["softcap"] is None else f", scores soft-capped at {path['softcap']:g}"
        lines.append(f"  attention        {layers}{capped}: {path['kernel']}" + (f" ({path['why']})" if path["why"]
                                                                                 else ""))
    return lines


def _memory_line(memory: dict) -> str:
    mib = {key: value / 2**20 for key, value in memory.items()}
    return (f"  per device       params {mib['params_bytes']:.2f} MiB, gradients {mib['gradient_bytes']:.2f} MiB, "
            f"optimizer state {mib['optimizer_bytes']:.2f} MiB (their sharded shapes); XLA: arguments "
            f"{mib['argument_bytes']:.2f} MiB, temporaries {mib['temp_bytes']:.2f} MiB (activations and working "
            "buffers)")


def _pipeline_lines(p: dict) -> list[str]:
    return [f"pipeline           {p['schedule']}: {p['stages']} stages x {p['virtual_stages']} chunk(s), "
            f"{p['microbatches']} microbatches, bubble {p['bubble']:.1%}",
            f"  partition        {p['partition_source']} {p['partition']}: max/mean per stage compute "
            f"{p['compute_balance']:.2f}, memory {p['memory_balance']:.2f}",
            f"  activations      {p['activation_buffers']} microbatch(es) x "
            f"{p['activation_bytes_per_microbatch'] / 2**10:.1f} KiB held per stage (gpipe holds "
            f"{p['gpipe_activation_buffers']}); XLA temporaries {p['temp_bytes'] / 2**20:.2f} MiB per device",
            f"  remat            {p['remat']}: " + (
                f"{p['residual_buffers']} microbatch(es) x {p['residual_bytes_per_microbatch'] / 2**10:.1f} KiB "
                "of residuals held per stage, no forward recomputed" if p["remat"] == "none"
                else "each chunk's backward recomputes its forward") + f"; {p['remat_reason']}",
            "  FLOPs            of one time slot: XLA counts the body of the slot loop once"]


def _amp_order_line(report: dict) -> str:
    order = report["amp_order"]
    scaled = ("scaled gradients", "unscale, ") if report["loss_scaled"] else ("gradients (no loss scale)", "")
    if order is None:
        return "AMP order          not checked (trainer.steps_per_sync > 1 compiles the steps into a loop)"
    if order in ([hlo_graph.SINGLE_DEVICE], [hlo_graph.ONE_DATA_REPLICA]):
        where = "single device" if order == [hlo_graph.SINGLE_DEVICE] else "one data replica"
        return f"AMP order          {where}: {scaled[0]} -> {scaled[1]}finite check, clip -> update"
    if order:
        return "AMP order          VIOLATED: " + "; ".join(order)
    if not report["gradients_synchronised"]:
        return (f"AMP order          holds in the optimised HLO: each stage's {scaled[0]} -> {scaled[1]}"
                "norm summed over the stages (all-reduce) -> finite check, clip -> update (one data replica)")
    return (f"AMP order          holds in the optimised HLO: {scaled[0]} -> all-reduce -> "
            f"{scaled[1]}finite check, clip -> update")
