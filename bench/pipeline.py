"""Pipeline schedules: simulated step time and bubble from XLA's per-chunk costs, beside measured step
times on fake CPU devices.

1. Simulation. The costs of one microbatch through `before_blocks`, one block and `after_blocks` + loss
   come from XLA's cost analysis (lowering/pipeline/block_costs.py) for a GPT of LAYERS blocks; for each p, m, v
   the blocks are partitioned automatically and the schedule's table is replayed with each chunk's
   forward and backward FLOPs as durations (xlatrain.pipeline.schedule.simulate). The global batch is
   fixed, so a microbatch costs 1/m of the batch. Each schedule is replayed with remat: full (a backward
   recomputes its forward) and remat: none (it does not); zb1p and zbv, whose backward is B and W, with remat:
   none, their B and W costs measured separately (W: the weight-gradient part of the split backward). Reported
   per case: the simulated bubble beside theory's, and the efficiency: one device's sequential time (the
   model's work, without recomputation) / (p x the pipelined step time), 1.0 being a perfect p-fold speedup,
   both as the schedule runs asynchronously (each action as soon as its inputs are there) and in lockstep
   (each slot as long as its slowest action: how xlatrain's SPMD step runs a table).
2. Measurement. The compiled train step on 8 CPU devices, for each schedule (data 2 x stage 4, and data
   4 x stage 2), against plain data parallel over the same 8 devices, interleaved A/B rounds, medians.
   Fake CPU devices share this machine's cores, so these times show the pipeline's *overheads*
   (with remat: full the recomputed forwards; per-slot actions and ppermutes, smaller matmuls), never a
   speedup. Each pipelined case runs with remat: full and remat: none, and reports XLA's FLOPs of the
   step against the unpipelined model's (lowering/pipeline/work.py). The GPT is of width 128; the same three
   cases (data parallel, 1f1b p=4 m=8 with remat full and none) also run at width 64, where a pipeline
   microbatch (2 rows of 64 tokens) is so small that XLA:CPU's cost per kernel shows, and data parallel
   against 1f1b p=4 m=8 and m=4 remat none at width 512, where each kernel does 16x the work of width 128's.
   1f1b p=4 also runs with m=4 (= p, 1F1B's fewest): a microbatch of 4 rows, as many as a data-parallel
   device's batch, so its kernels are data parallel's size and there are 14 slots instead of 22; its bubble,
   which costs a real pipeline time, costs fake devices on shared cores almost nothing (an idle stage waits).
3. How the cores are shared. Data parallel and 1f1b p=4 m=8 and m=4 (width 128) once more in two child
   processes that set, before JAX starts its threads, what the threads inherit: confined to one core
   (`sched_setaffinity`), where a step's time is exactly its total work; and on both cores under the real-time
   round-robin scheduler (SCHED_RR, which needs root or CAP_SYS_NICE; without it the case is reported as not
   measured), which moves a runnable thread to an idle core at once where the default scheduler balances the
   cores by their number of threads. On two cores with the default scheduler a pipeline's time is also how
   well eight device threads of unequal work per slot are spread over them. Each child runs CHILD_RUNS times,
   in fresh processes, and the median over them is reported beside each process's ratio: on a shared host one
   process's ratio is not the host's (1.10-1.26x on one core, in one day's processes).

    python3 -m bench.pipeline                  # writes bench/results/pipeline.json
    python3 -m bench.pipeline --one-core       # one case of part 3, printed as JSON (what the full run calls)
    python3 -m bench.pipeline --realtime       # the other
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from xlatrain.runtime.malloc import tune_malloc

MALLOC = tune_malloc()  # as the xlatrain command runs; before JAX starts a thread
CORES_SHARED = {"--one-core": "one core", "--realtime": "two cores, real-time scheduler (SCHED_RR)"}
"""Part 3's child processes: the flag each runs with, and the group its results join."""
CHILD = sys.argv[1] if sys.argv[1:] and sys.argv[1] in CORES_SHARED else None
NOT_PERMITTED = None
try:  # before JAX starts a thread too: every thread it starts inherits these
    if CHILD == "--one-core":
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    elif CHILD == "--realtime":
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))
except PermissionError as error:
    NOT_PERMITTED = f"not measured: {error}"

os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"])

import jax  # noqa: E402

from bench.common import interleaved_medians, train_runner, write_results  # noqa: E402
from xlatrain.config import load_config  # noqa: E402
from xlatrain.pipeline.partition import action_flops, auto_partition  # noqa: E402
from xlatrain.pipeline.schedule import build, lockstep_time, simulate  # noqa: E402
from xlatrain.program import build_program  # noqa: E402

LAYERS = 8
SMALL_GPT = [f"model.layers={LAYERS}", "model.width=64", "model.heads=4", "data.seq_len=64",
             "data.max_bytes=400000", "batch.global_size=32", "trainer.progress=false"]
GPT = [*SMALL_GPT, "model.width=128"]
LARGE_GPT = [*SMALL_GPT, "model.width=512"]
BATCH_ROWS = 64
SPLIT = ("zb1p", "zbv")
"""The schedules whose backward runs as B and W (remat: none only)."""
SIMULATED = [(name, p, m, v, remat) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p, 8 * p)
             for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb1p", 1), ("zbv", 2)) if p * v <= LAYERS
             for remat in ("full", "none") if name not in SPLIT or remat == "none"]
PIPELINES = {
    "gpipe p=4 m=8 (x2 data)": ["mesh.stage=4", "parallel.pipeline.schedule=gpipe", "parallel.pipeline.microbatches=8"],
    "1f1b p=4 m=8 (x2 data)": ["mesh.stage=4", "parallel.pipeline.schedule=1f1b", "parallel.pipeline.microbatches=8"],
    "1f1b p=4 m=4 (x2 data)": ["mesh.stage=4", "parallel.pipeline.schedule=1f1b", "parallel.pipeline.microbatches=4"],
    "interleaved p=4 v=2 m=8 (x2 data)": ["mesh.stage=4", "parallel.pipeline.schedule=interleaved",
                                          "parallel.pipeline.microbatches=8"],
    "1f1b p=2 m=4 (x4 data)": ["mesh.stage=2", "parallel.pipeline.microbatches=4"],
}
ZERO_BUBBLE = {f"{name} p={p} m={m}{data}": [f"mesh.stage={p}", f"parallel.pipeline.schedule={name}",
                                             f"parallel.pipeline.microbatches={m}", "parallel.pipeline.remat=none"]
               for p, m, data in ((2, 4, " (x4 data)"), (4, 8, " (x2 data)"), (4, 16, " (x2 data)"), (8, 8, ""))
               for name in ("1f1b", *SPLIT) if 2 * p <= LAYERS or name != "zbv"}
MEASURED = {"data parallel 8": ["parallel.mode=shard_map"],
            **{f"{name} remat {remat}": [*overrides, f"parallel.pipeline.remat={remat}"]
               for name, overrides in PIPELINES.items() for remat in ("full", "none")},
            **{f"{name} remat none": overrides for name, overrides in ZERO_BUBBLE.items() if name not in PIPELINES}}


def simulated_cases() -> list[dict]:
    """Costs measured for a microbatch of one row (8 rows per replica in 8 microbatches); a replica's
    batch of BATCH_ROWS rows in m microbatches makes each microbatch cost BATCH_ROWS / m times that."""
    program = build_program(load_config(None, [*GPT, "parallel.mode=shard_map", "mesh.stage=2",
                                               "parallel.pipeline.microbatches=8", "parallel.pipeline.schedule=zb1p",
                                               "parallel.pipeline.remat=none"]))
    assert program.derived.pipeline_microbatch_size == 1
    costs = program.pipeline.costs
    cases = []
    for name, p, m, v, remat in SIMULATED:
        partition = auto_partition(costs, p * v)
        scale = BATCH_ROWS / m
        chunks = costs.chunks(partition)
        schedule = build(name, p, m, v)
        durations = [[flops * scale for flops in kind]
                     for kind in action_flops(chunks, recompute=remat == "full", split=schedule.splits_backward)]
        timeline = simulate(schedule, *durations)
        sequential = sum(c.backward_flops for c in chunks) * scale * m  # a forward and a backward, no recompute
        cases.append({"schedule": name, "stages": p, "microbatches": m, "virtual_stages": v, "remat": remat,
                      "partition": list(partition), "simulated_bubble": timeline.bubble(),
                      "theoretical_bubble": schedule.theoretical_bubble(),
                      "efficiency": sequential / (p * timeline.step_time),
                      "lockstep_efficiency": sequential / (p * lockstep_time(schedule, *durations))})
    return cases


SMALL_MEASURED = {name: MEASURED[name] for name in ("data parallel 8", "1f1b p=4 m=8 (x2 data) remat full",
                                                    "1f1b p=4 m=8 (x2 data) remat none")}
CORES_SHARED_MEASURED = {name: MEASURED[name] for name in ("data parallel 8", "1f1b p=4 m=8 (x2 data) remat none",
                                                           "1f1b p=4 m=4 (x2 data) remat none")}
CHILD_RUNS = 3
"""Part 3's processes per case."""


def measured_in_child(flag: str) -> dict[str, dict] | str:
    """CORES_SHARED_MEASURED in a child process that runs, with all the threads it starts, as `flag` says."""
    child = subprocess.run([sys.executable, "-m", "bench.pipeline", flag], capture_output=True, text=True,
                           check=True)
    return json.loads(child.stdout.splitlines()[-1])


def measured_in_children(flag: str) -> dict[str, dict] | str:
    """`measured_in_child` CHILD_RUNS times: per case the medians over the processes of its seconds per step and
    of its ratio to data parallel, and each process's ratio."""
    runs = [measured_in_child(flag) for _ in range(CHILD_RUNS)]
    if isinstance(runs[0], str):
        return runs[0]

    def median(name: str, key: str) -> float:
        return statistics.median(run[name][key] for run in runs)

    return {name: {**first, "median_seconds_per_step": median(name, "median_seconds_per_step"),
                   "ratio_to_data_parallel": median(name, "ratio_to_data_parallel"),
                   "ratios_by_process": [run[name]["ratio_to_data_parallel"] for run in runs]}
            for name, first in runs[0].items()}


def measured_cases(model: list[str], cases: dict[str, list[str]]) -> dict[str, dict]:
    """Per case: median seconds per step, its ratio to data parallel's and, for a pipeline, XLA's FLOPs of the
    pipelined step / the unpipelined model's."""
    runners, work = {}, {}
    for name, overrides in cases.items():
        program = build_program(load_config(None, [*model, "parallel.mode=shard_map", *overrides]))
        runners[name] = train_runner(program)
        if program.pipeline is not None:
            work[name] = program.pipeline.count_work(program.remat.remat).ratio
    medians = interleaved_medians(runners, rounds=4, steps_per_round=5, warmup=2)
    reference = medians["data parallel 8"]
    return {name: {"median_seconds_per_step": seconds, "ratio_to_data_parallel": seconds / reference,
                   **({"xla_flops_ratio_to_unpipelined": work[name]} if name in work else {})}
            for name, seconds in medians.items()}


def main() -> None:
    assert jax.device_count() == 8, "bench.pipeline sets 8 CPU devices before JAX starts; unset JAX_PLATFORMS"
    cases = simulated_cases()
    for c in cases:
        print(f"simulated {c['schedule']:<11} p={c['stages']} m={c['microbatches']:<2} v={c['virtual_stages']} "
              f"remat {c['remat']:<4}: "
              f"bubble {c['simulated_bubble']:.1%} (theory {c['theoretical_bubble']:.1%}), "
              f"efficiency {c['efficiency']:.2f} (lockstep {c['lockstep_efficiency']:.2f}), "
              f"partition {c['partition']}")
    print(f"malloc: {MALLOC}")
    measured = {"width 64": measured_cases(SMALL_GPT, SMALL_MEASURED), "width 128": measured_cases(GPT, MEASURED),
                "width 512": measured_cases(LARGE_GPT, CORES_SHARED_MEASURED),
                **{f"width 128, {group}": measured_in_children(flag) for flag, group in CORES_SHARED.items()}}
    for model, group in measured.items():
        if isinstance(group, str):
            print(f"measured {model}: {group}")
            continue
        for name, values in group.items():
            flops = (f", XLA FLOPs x{values['xla_flops_ratio_to_unpipelined']:.2f} of the unpipelined model's"
                     if "xla_flops_ratio_to_unpipelined" in values else "")
            processes = (" (processes: " + ", ".join(f"x{r:.2f}" for r in values["ratios_by_process"]) + ")"
                         if "ratios_by_process" in values else "")
            print(f"measured {model}: {name:<40} {values['median_seconds_per_step'] * 1e3:8.1f} ms/step  "
                  f"x{values['ratio_to_data_parallel']:.2f} of data parallel{processes}{flops}")
    path = write_results("pipeline", "python3 -m bench.pipeline", {
        "model": f"GPT {LAYERS} layers, width 128 (measured also at widths 64 and 512), 4 heads, seq 64, "
                 "global batch 32, fp32, adamw",
        "simulated": cases, "measured_on_fake_cpu_devices": measured, "malloc": MALLOC,
        "note": "Simulated: XLA FLOPs per chunk replayed through each schedule's table (fixed global batch). "
                "Measured: 8 fake CPU devices on 2 shared cores; the ratios show pipeline overheads (remat full: "
                "recomputed forwards; per-slot actions and ppermutes, smaller matmuls; on two cores also the time "
                "a core idles while the other finishes a slot), not speedups. 'one core': the same devices confined "
                "to one core, where a step's time is exactly its total work. 'real-time scheduler': both cores, "
                "SCHED_RR, which moves a runnable thread to an idle core at once. Both: medians over "
                f"{CHILD_RUNS} processes, each one's ratio in ratios_by_process."})
    print(f"wrote {path}")


if __name__ == "__main__":
    if CHILD:
        print(json.dumps(NOT_PERMITTED or measured_cases(GPT, CORES_SHARED_MEASURED)))
    else:
        main()
