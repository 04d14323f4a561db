"""GPT-2 small (124M parameters: 12 layers, width 768, 12 heads, a 50,304-entry vocabulary, sequences of 1,024) on
one GPU in bf16: step time, tokens/s and MFU of `xlatrain train`, from the wall time of its logged intervals, with
the persistent compilation cache and a profiler trace of three steps; then a second start with the same cache,
timed to its first step. Then the parts of the step whose formulation xlatrain chooses on GPUs, alone.

    python3 -m bench.gpu                    # on a machine with a GPU; writes bench/results/gpu.json
    python3 -m bench.gpu --model llama-1b   # a 1.1B Llama-style model; writes bench/results/gpu_llama.json
    python3 -m bench.gpu --model moe        # a Mixture of Experts (8 experts, top-2); bench/results/gpu_moe.json
    python3 -m bench.gpu --smoke            # a tiny GPT on whatever device there is: checks the script, writes nothing

The data is the built-in text source (bytes, so only 256 of the vocabulary's ids occur; the embedding and the
head still have GPT-2's shape and cost). MFU is against the datasheet's dense bf16 peak of the device
(xlatrain/observe/peaks.py); the goal on an H100 is >= 45%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import yaml

from bench.common import time_to_first_step, write_results
from xlatrain.observe.peaks import peak_per_device
from xlatrain.observe.trace_kernels import trace_kernel_split

REPO = Path(__file__).resolve().parents[1]
MFU_GOAL = 0.45

GPT2_SMALL = ["model.name=gpt", "model.layers=12", "model.width=768", "model.heads=12", "model.vocab=50304",
              "data.source=text", "data.seq_len=1024", "batch.global_size=16", "precision.policy=bf16",
              "trainer.steps=60", "trainer.log_every=10", "trainer.profile_steps=[11,13]"]
LLAMA_1B = ["model.name=llama", "model.layers=22", "model.width=2048", "model.heads=32", "model.kv_heads=4",
            "model.mlp_hidden=5632", "model.vocab=32000", "data.source=text", "data.seq_len=1024",
            "batch.global_size=8", "precision.policy=bf16", "trainer.steps=40", "trainer.log_every=5",
            "trainer.profile_steps=[11,12]"]
"""A Llama-style decoder of 1.1B parameters (TinyLlama's shape: grouped-query attention, SwiGLU, RoPE)."""
MOE = ["model.name=llama", "model.layers=16", "model.width=1024", "model.heads=16", "model.kv_heads=4",
       "model.moe.experts=8", "model.moe.top_k=2", "model.moe.expert_hidden=2816", "model.vocab=32000",
       "data.source=text", "data.seq_len=1024", "batch.global_size=8", "precision.policy=bf16", "trainer.steps=40",
       "trainer.log_every=5", "trainer.profile_steps=[11,12]"]
"""A Mixtral-style decoder of 1.2B parameters, 0.4B of them active (16 layers of 8 experts, top-2; MFU counts the
active ones): the formulation model.moe.formulation=auto chooses, the router's metrics logged."""
SHAPES = {"gpt2-small": (GPT2_SMALL, "gpu"), "llama-1b": (LLAMA_1B, "gpu_llama"), "moe": (MOE, "gpu_moe")}
"""--model: (the shape, the results file bench/results/NAME.json)."""
SMOKE = ["model.name=gpt", "model.layers=2", "model.width=64", "model.heads=2", "data.source=text",
         "data.seq_len=64", "data.max_bytes=400000", "batch.global_size=8", "precision.policy=bf16",
         "trainer.steps=24", "trainer.log_every=4", "trainer.profile_steps=[5,6]"]
COMMON = ["trainer.progress=false", "trainer.eval_every=100000", "trainer.checkpoint_every=100000"]
MEASURED_FROM_STEP = {False: 20, True: 12}
"""Records from this step on: past the first steps and the profiled window."""


def steady_step_seconds(records: list[dict], measured_from: int) -> float:
    """Median wall seconds per step over the logged intervals that start at `measured_from` or later and hold no
    evaluation or checkpoint: in a steady run an interval lasts exactly its steps. (The rates the trainer logged
    before 2026-11-26 counted each window from its first step's dispatch, while the step before still ran on the
    device, and so read low: on the H200, 54.5 ms per step against 45.5 ms by the intervals.)"""
    intervals = [r for r in records if "interval_seconds" in r]
    return statistics.median(this["interval_seconds"] / (this["step"] - previous["step"])
                             for previous, this in zip(intervals, intervals[1:])
                             if previous["step"] >= measured_from and not this["time_eval"]
                             and not this["time_checkpoint"])


def measure(shape: list[str], work: Path, measured_from: int) -> dict:
    cache, run, again = work / "cache", work / "run", work / "second"
    first_step, summary = time_to_first_step(["train", *shape, *COMMON, f"trainer.run_dir={run}",
                                              f"trainer.compile_cache={cache}"], run, REPO)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "loss" in r and r["step"] >= measured_from]
    second_first_step, second = time_to_first_step(["train", *shape, *COMMON, "trainer.steps=1",
                                                    "trainer.profile_steps=null", f"trainer.run_dir={again}",
                                                    f"trainer.compile_cache={cache}"], again, REPO)
    config = yaml.safe_load((run / "config.yaml").read_text())
    flops, devices = config["derived"]["model_flops_per_step"], config["derived"]["devices"]
    tokens_per_step = config["derived"]["global_batch"] * config["data"]["seq_len"]
    step = steady_step_seconds(records, measured_from)
    peak, peak_source = peak_per_device(jax.devices(), "bfloat16")
    traces = sorted((run / "profile").rglob("*.xplane.pb"))
    first_traced, last_traced = config["trainer"]["profile_steps"]
    return {
        "model_flops_per_step": flops,
        "tokens_per_step": tokens_per_step,
        "step_ms": round(1e3 * step, 2),
        "tokens_per_sec": round(tokens_per_step / step, 1),
        "tflops_per_sec_per_device": round(flops / devices / step / 1e12, 2),
        "mfu": round(flops / devices / step / peak, 4) if peak else None,
        "peak": peak_source,
        "logged_tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in logged),
        "time_breakdown": summary["time_breakdown"],
        "bottlenecks": [f["rule"] for f in summary["findings"]],
        "time_to_first_step_s": {"first_start": round(first_step, 2), "second_start": round(second_first_step, 2)},
        "loaded_from_cache_at_second_start": second["compile_cache_hits"],
        "profile_trace": str(traces[0].relative_to(run)) if traces else None,
        "profile_trace_bytes": traces[0].stat().st_size if traces else 0,
        "kernels_from_trace": trace_kernel_split(traces[0], last_traced - first_traced + 1) if traces else None,
    }


def median_ms(fn, *args, calls: int = 20) -> float:
    """Median milliseconds of a jitted call (after two to compile and warm up)."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(calls):
        began = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - began)
    return round(1e3 * statistics.median(times), 3)


def parts(smoke: bool) -> dict:
    """Milliseconds of the two parts of the step whose formulation xlatrain chooses on GPUs, at the GPT's shapes:
    the token embedding's gradient (a scatter-add of bf16 rows, jnp.take's own gradient under the bf16 policy,
    against xlatrain's float32 sums, unsorted and sorted by token), for byte tokens and for tokens drawn
    uniformly from the vocabulary; and causal attention forward and backward, XLA's against cuDNN's."""
    from xlatrain.models.embedding import scatter_rows, sorted_rows

    batch, length, heads, head_dim, vocab = (8, 64, 2, 32, 512) if smoke else (16, 1024, 12, 64, 50304)
    width, tokens = heads * head_dim, batch * length
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    grads = jax.random.normal(keys[0], (tokens, width), jnp.bfloat16)
    embedding_gradients = {
        "bf16 scatter (jnp.take's gradient)": jax.jit(
            lambda g, i: jax.grad(lambda t: jnp.vdot(jnp.take(t, i, axis=0), g).astype(jnp.float32))(
                jnp.zeros((vocab, width), jnp.bfloat16))),
        "float32 scatter": jax.jit(partial(scatter_rows, rows=vocab)),
        "float32 sorted sum (xlatrain on GPUs)": jax.jit(partial(sorted_rows, rows=vocab))}
    result = {}
    for name, high in (("byte tokens", 256), ("uniform tokens", vocab)):
        ids = jax.random.randint(keys[1], (tokens,), 0, high)
        result[f"embedding gradient, {name}"] = {variant: median_ms(fn, grads, ids)
                                                 for variant, fn in embedding_gradients.items()}
    q, k, v = (jax.random.normal(key, (batch, length, heads, head_dim), jnp.bfloat16) for key in keys[2:])
    implementations = ("xla", "cudnn") if jax.default_backend() == "gpu" else ("xla",)
    result["causal attention forward and backward"] = {
        name: median_ms(jax.jit(jax.grad(lambda q, k, v, name=name: jnp.sum(jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation=name).astype(jnp.float32)), argnums=(0, 1, 2))), q, k, v)
        for name in implementations}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny GPT on any device; writes no results")
    parser.add_argument("--model", choices=SHAPES, default="gpt2-small",
                        help="the shape measured (default: %(default)s)")
    parser.add_argument("--out", type=Path, metavar="FILE", help="also write the measurement (JSON) to this file")
    parser.add_argument("--work", type=Path, metavar="DIR", help="keep the runs (metrics, profile trace) in this "
                        "new directory instead of a temporary one")
    args = parser.parse_args()
    if jax.default_backend() != "gpu" and not args.smoke:
        print(f"bench.gpu: no GPU here (jax's backend is {jax.default_backend()}); run it where there is one, or "
              "with --smoke to check the script", file=sys.stderr)
        return 2
    shape, results = SHAPES[args.model]
    shape = SMOKE if args.smoke else shape
    if args.work is not None:
        args.work.mkdir(parents=True)
        result = measure(shape, args.work, MEASURED_FROM_STEP[args.smoke])
    else:
        with tempfile.TemporaryDirectory() as work:
            result = measure(shape, Path(work), MEASURED_FROM_STEP[args.smoke])
    result["parts_ms"] = parts(args.smoke) if args.model == "gpt2-small" else {}
    device = jax.devices()[0].device_kind
    mfu = "unknown peak" if result["mfu"] is None else f"MFU {result['mfu']:.1%}"
    print(f"{device}: {'smoke GPT' if args.smoke else args.model} bf16 step {result['step_ms']:.1f} ms, "
          f"{result['tokens_per_sec']:,.0f} tokens/s, {result['tflops_per_sec_per_device']:.3g} TFLOP/s, {mfu}")
    print(f"time to first step: {result['time_to_first_step_s']['first_start']}s, a second start with the cache "
          f"{result['time_to_first_step_s']['second_start']}s ({result['loaded_from_cache_at_second_start']} "
          f"executables loaded); profile trace {result['profile_trace']} ({result['profile_trace_bytes']:,} bytes)")
    split = result["kernels_from_trace"]
    if split and split["by_class"]:
        print(f"kernels per step in the trace: {split['ms_per_step']:.2f} ms in {split['kernels_per_step']:g}: "
              + ", ".join(f"{kind} {c['ms']:.2f} ms ({c['kernels']:g})" for kind, c in split["by_class"].items()))
    for part, timings in result["parts_ms"].items():
        print(f"{part}: " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in timings.items()))
    print(json.dumps(result))
    if not args.smoke:
        met = result["mfu"] is not None and result["mfu"] >= MFU_GOAL
        result["mfu_goal"] = {"goal": MFU_GOAL, "met": met}
        path = write_results(results, f"python3 -m bench.gpu --model {args.model}", {"model": shape, **result})
        print(f"MFU goal {MFU_GOAL:.0%} {'met' if met else 'missed'}; wrote {path}")
    if args.out is not None:
        args.out.write_text(json.dumps({"device": device, "smoke": args.smoke, "model": shape, **result}, indent=2)
                            + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
