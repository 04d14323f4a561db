"""GPT-2 small (124M parameters: 12 layers, width 768, 12 heads, a 50,304-entry vocabulary, sequences of 1,024) on
one GPU in bf16: step time, tokens/s and MFU as `xlatrain train` reports them, with the persistent compilation
cache and a profiler trace of three steps; then a second start with the same cache, timed to its first step.

    python3 -m bench.gpu              # on a machine with a GPU; writes bench/results/gpu.json
    python3 -m bench.gpu --smoke      # a tiny GPT on whatever device there is: checks the script, writes nothing

The data is the built-in text source (bytes, so only 256 of the vocabulary's ids occur; the embedding and the
head still have GPT-2's shape and cost). MFU is against the datasheet's dense bf16 peak of the device
(xlatrain/peaks.py); the goal on an H100 is >= 45%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import jax
import yaml

from bench.common import time_to_first_step, write_results

REPO = Path(__file__).resolve().parents[1]
MFU_GOAL = 0.45

GPT2_SMALL = ["model.name=gpt", "model.layers=12", "model.width=768", "model.heads=12", "model.vocab=50304",
              "data.source=text", "data.seq_len=1024", "batch.global_size=16", "precision.policy=bf16",
              "trainer.steps=60", "trainer.log_every=10", "trainer.profile_steps=[11,13]"]
SMOKE = ["model.name=gpt", "model.layers=2", "model.width=64", "model.heads=2", "data.source=text",
         "data.seq_len=64", "data.max_bytes=400000", "batch.global_size=8", "precision.policy=bf16",
         "trainer.steps=24", "trainer.log_every=4", "trainer.profile_steps=[5,6]"]
COMMON = ["trainer.progress=false", "trainer.eval_every=100000", "trainer.checkpoint_every=100000"]
MEASURED_FROM_STEP = {False: 20, True: 12}
"""Records from this step on: past the first steps and the profiled window."""


def measure(shape: list[str], work: Path, measured_from: int) -> dict:
    cache, run, again = work / "cache", work / "run", work / "second"
    first_step, summary = time_to_first_step(["train", *shape, *COMMON, f"trainer.run_dir={run}",
                                              f"trainer.compile_cache={cache}"], run, REPO)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if "loss" in r and r["step"] >= measured_from]
    second_first_step, second = time_to_first_step(["train", *shape, *COMMON, "trainer.steps=1",
                                                    "trainer.profile_steps=null", f"trainer.run_dir={again}",
                                                    f"trainer.compile_cache={cache}"], again, REPO)
    config = yaml.safe_load((run / "config.yaml").read_text())
    flops, tokens_per_sec = config["derived"]["model_flops_per_step"], statistics.median(
        r["tokens_per_sec"] for r in steady)
    tokens_per_step = config["derived"]["global_batch"] * config["data"]["seq_len"]
    traces = sorted((run / "profile").rglob("*.xplane.pb"))
    return {
        "model_flops_per_step": flops,
        "tokens_per_step": tokens_per_step,
        "step_ms": round(1e3 * tokens_per_step / tokens_per_sec, 2),
        "tokens_per_sec": round(tokens_per_sec, 1),
        "tflops_per_sec_per_device": statistics.median(r["tflops_per_sec_per_device"] for r in steady),
        "mfu": statistics.median(r["mfu"] for r in steady) if all("mfu" in r for r in steady) else None,
        "time_breakdown": summary["time_breakdown"],
        "bottlenecks": [f["rule"] for f in summary["findings"]],
        "time_to_first_step_s": {"first_start": round(first_step, 2), "second_start": round(second_first_step, 2)},
        "loaded_from_cache_at_second_start": second["compile_cache_hits"],
        "profile_trace": str(traces[0].relative_to(run)) if traces else None,
        "profile_trace_bytes": traces[0].stat().st_size if traces else 0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny GPT on any device; writes no results")
    args = parser.parse_args()
    if jax.default_backend() != "gpu" and not args.smoke:
        print(f"bench.gpu: no GPU here (jax's backend is {jax.default_backend()}); run it where there is one, or "
              "with --smoke to check the script", file=sys.stderr)
        return 2
    shape = SMOKE if args.smoke else GPT2_SMALL
    with tempfile.TemporaryDirectory() as work:
        result = measure(shape, Path(work), MEASURED_FROM_STEP[args.smoke])
    device = jax.devices()[0].device_kind
    mfu = "unknown peak" if result["mfu"] is None else f"MFU {result['mfu']:.1%}"
    print(f"{device}: {'smoke GPT' if args.smoke else 'GPT-2 small'} bf16 step {result['step_ms']:.1f} ms, "
          f"{result['tokens_per_sec']:,.0f} tokens/s, {result['tflops_per_sec_per_device']:.3g} TFLOP/s, {mfu}")
    print(f"time to first step: {result['time_to_first_step_s']['first_start']}s, a second start with the cache "
          f"{result['time_to_first_step_s']['second_start']}s ({result['loaded_from_cache_at_second_start']} "
          f"executables loaded); profile trace {result['profile_trace']} ({result['profile_trace_bytes']:,} bytes)")
    print(json.dumps(result))
    if not args.smoke:
        met = result["mfu"] is not None and result["mfu"] >= MFU_GOAL
        result["mfu_goal"] = {"goal": MFU_GOAL, "met": met}
        path = write_results("gpu", "python3 -m bench.gpu", result)
        print(f"MFU goal {MFU_GOAL:.0%} {'met' if met else 'missed'}; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
