"""Time to build a pipelined step's program: tracing (JAX: the Python model run on abstract values, its VJP,
lowering to StableHLO) and XLA's compilation, of the gradients program of each schedule, against the same
model's unpipelined data-parallel gradients on the same 8 CPU devices, in one process. A pipelined step traces
each kind of chunk once (lowering/pipeline/chunks.py: `TracedChunk`) and its slots evaluate those programs.
Rounds alternate the cases' order; medians of ROUNDS. The persistent compilation cache is off (nothing loaded).

    python3 -m bench.pipeline_trace                 # writes bench/results/pipeline_trace.json
"""

from __future__ import annotations

import os
import statistics
import time

os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"])

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import write_results  # noqa: E402
from bench.pipeline import GPT  # noqa: E402
from xlatrain.compat.monitoring import backend_compile_listener  # noqa: E402
from xlatrain.config import load_config  # noqa: E402
from xlatrain.data.loader import make_global, split_microbatches  # noqa: E402
from xlatrain.mesh import train_batch_sharding  # noqa: E402
from xlatrain.program import build_program  # noqa: E402

ROUNDS = 3
SETTINGS = ["parallel.mode=shard_map", "trainer.compile_cache=off"]
PIPELINE = ["mesh.stage=4", "parallel.pipeline.microbatches=8"]
CASES = {"data parallel 8": [],
         **{f"{schedule} p=4 m=8 remat {remat}": [*PIPELINE, f"parallel.pipeline.schedule={schedule}",
                                                  f"parallel.pipeline.remat={remat}"]
            for schedule, remat in (("1f1b", "full"), ("1f1b", "none"), ("interleaved", "none"), ("zb1p", "none"),
                                    ("zbv", "none"))}}


def first_batch(program) -> dict:
    rows = [program.dataset.train[i] for i in range(program.derived.global_batch)]
    batch = {key: np.stack([r[key] for r in rows]) for key in ("inputs", "targets")}
    return make_global(split_microbatches(batch, program.derived.microbatches), train_batch_sharding(program.mesh),
                       1, 1)


def build_times(program, state, batch) -> dict[str, float]:
    """Seconds to trace and lower the gradients program, and to compile it (XLA)."""
    compiled: list[float] = []
    loaded: list[None] = []
    with backend_compile_listener(lambda name, seconds: compiled.append(seconds), lambda: loaded.append(None)):
        began = time.perf_counter()
        program.compiled_gradients(state, batch)
        total = time.perf_counter() - began
    assert not loaded, "an executable came from the persistent cache"
    return {"trace_s": total - sum(compiled), "compile_s": sum(compiled)}


def main() -> None:
    assert jax.device_count() == 8, "bench.pipeline_trace sets 8 CPU devices before JAX starts; unset JAX_PLATFORMS"
    inputs = {}
    for name, overrides in CASES.items():
        program = build_program(load_config(None, [*GPT, *SETTINGS, *overrides]))
        inputs[name] = (program, program.create_state(), first_batch(program))
    samples: dict[str, list[dict]] = {name: [] for name in CASES}
    names = list(CASES)
    for round_index in range(ROUNDS):
        for name in names if round_index % 2 == 0 else reversed(names):
            samples[name].append(build_times(*inputs[name]))
    parts = ("trace_s", "compile_s")
    medians = {name: {part: statistics.median(s[part] for s in runs) for part in parts}
               for name, runs in samples.items()}
    reference = medians["data parallel 8"]
    results = {name: {**median, "trace_ratio_to_data_parallel": median["trace_s"] / reference["trace_s"],
                      "compile_ratio_to_data_parallel": median["compile_s"] / reference["compile_s"],
                      "samples": samples[name]} for name, median in medians.items()}
    for name, median in medians.items():
        print(f"{name:<34} trace {median['trace_s']:6.2f} s (x{results[name]['trace_ratio_to_data_parallel']:.1f} "
              f"of data parallel)  compile {median['compile_s']:6.2f} s "
              f"(x{results[name]['compile_ratio_to_data_parallel']:.1f})")
    path = write_results("pipeline_trace", "python3 -m bench.pipeline_trace", {
        "model": "GPT 8 layers, width 128, 4 heads, seq 64, global batch 32, fp32 (bench.pipeline's)",
        "cases": results,
        "note": "The gradients program (the train step without the update), data 2 x stage 4 for the pipelines. "
                "trace_s: from calling compiled_gradients until XLA starts compiling (tracing, VJPs, lowering); "
                "compile_s: XLA's compilation. Medians of alternating rounds in one process."})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
