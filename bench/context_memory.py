"""Context parallelism's memory: XLA's temporaries per device (memory analysis: the activations and the step's
working buffers) of the built-in Llama's train step (examples/configs/llama_stdlib.yaml's shape, one row) at 4k,
16k and 32k tokens over mesh.context = 1, 2, 4, 8, by ring and by all-gather; for the ring, each against one
device's step at L / C tokens (target <= 1.15x: a device of the group holds what one device running its share of
the row would). Compiled for the CPU (8 host devices) or, with --target, for GPUs this host need not have
(`xlatrain lower --target h100`, jax's CUDA plugin in an environment of its own, docs/performance.md); there also
the longest row a Llama-3.2-1B-shaped model fits on 8 H100s, bf16, fsdp x context 8. Memory, not speed: nothing
runs.

    python3 -m bench.context_memory                  # writes bench/results/context_memory_cpu.json
    python3 -m bench.context_memory --target h100    # writes bench/results/context_memory_h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this process only writes the results; `lower` compiles
from bench.common import write_results  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LLAMA = ["model.name=llama", "model.layers=4", "model.width=128", "model.heads=4", "model.kv_heads=2",
         "batch.global_size=1", "mesh.data=1", "data.glob='*.py'", "data.max_bytes=4000000",
         "trainer.compile_cache=off"]
LLAMA_3_2_1B = ["model.name=llama", "model.layers=16", "model.width=2048", "model.heads=32", "model.kv_heads=8",
                "model.mlp_hidden=8192", "model.vocab=128256", "model.rope_theta=500000", "model.tie_embeddings=true",
                "precision.policy=bf16", "parallel.strategy=fsdp", "batch.global_size=1", "mesh.data=1",
                "data.glob='*.py'", "data.max_bytes=4000000", "trainer.compile_cache=off"]
LENGTHS, SIZES = (4096, 16384, 32768), (1, 2, 4, 8)
RING_TARGET = 1.15
LONGEST_TRIED = (131072, 196608, 262144, 393216, 524288)
"""Rows of the 1B model on 8 H100s, tried in order until one does not fit."""


def lower(overrides: list[str], devices: int, target: str | None) -> dict:
    flags = ["--target", target, "--devices", str(devices)] if target else []
    env = {**os.environ,
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"}
    result = subprocess.run([sys.executable, "-m", "xlatrain.cli", "lower", *overrides, "--json", *flags], cwd=REPO,
                            capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"xlatrain lower {' '.join(overrides)} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout)


def temporaries(length: int, size: int, kind: str, target: str | None) -> int:
    report = lower([*LLAMA, f"data.seq_len={length}", f"mesh.context={size}",
                    f"parallel.context_attention={kind}"], size, target)
    return report["memory"]["temp_bytes"]


def longest_row(target: str) -> list[dict]:
    tried = []
    for length in LONGEST_TRIED:
        report = lower([*LLAMA_3_2_1B, f"data.seq_len={length}", "mesh.context=8"], 8, target)
        fits = report["peak_memory_bytes"] <= report["device_memory"]["bytes"]
        tried.append({"seq_len": length, "peak_memory_bytes": report["peak_memory_bytes"], "fits": fits,
                      "memory": report["memory"], "device_memory": report["device_memory"]})
        print(f"Llama-3.2-1B shape, {length} tokens on 8 x {target}: {report['peak_memory_bytes'] / 2**30:.1f} GiB "
              f"per device of {report['device_memory']['bytes'] / 2**30:.1f}: {'fits' if fits else 'does not fit'}",
              flush=True)
        if not fits:
            break
    return tried


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", help="a GPU to compile for (xlatrain lower --target), else this host's CPU")
    target = parser.parse_args().target
    longest = longest_row(target) if target else None
    one_device = {length: temporaries(length, 1, "ring", target)
                  for length in sorted({length // size for length in LENGTHS for size in SIZES})}
    rows = []
    for length in LENGTHS:
        for size in SIZES[1:]:
            for kind in ("ring", "all_gather"):
                temp = temporaries(length, size, kind, target)
                share = one_device[length // size]
                rows.append({"seq_len": length, "context": size, "attention": kind, "temp_bytes": temp,
                             "one_device_at_share_bytes": share, "ratio": round(temp / share, 3)})
                print(f"{length:>6} tokens, C={size} {kind:>10}: {temp / 2**20:8.1f} MiB per device, "
                      f"{temp / share:.2f}x one device at {length // size} tokens", flush=True)
    ring = [r["ratio"] for r in rows if r["attention"] == "ring"]
    payload = {"target": target or "cpu", "model": LLAMA, "one_device_temp_bytes": one_device, "rows": rows,
               "ring_worst_ratio": max(ring), "ring_target": RING_TARGET, "ring_met": max(ring) <= RING_TARGET,
               "note": "compiled only: XLA's memory analysis of the train step, nothing run"}
    if longest is not None:
        payload["longest_row_llama_3_2_1b"] = longest
    name = f"context_memory_{target or 'cpu'}"
    path = write_results(name, "python3 -m bench.context_memory" + (f" --target {target}" if target else ""),
                         payload)
    print(f"ring's worst ratio {max(ring):.2f} (target <= {RING_TARGET}); wrote {path}")


if __name__ == "__main__":
    main()
