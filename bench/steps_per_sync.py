"""Step boundaries: 1 optimizer step per executable vs 10 fused with lax.scan (trainer.steps_per_sync),
on a dispatch-bound tiny MLP, one CPU device.

Two measurements, both as seconds per optimizer step, interleaved in one run:
- executable: dispatch the compiled step and fetch that boundary's metrics to the host (the trainer's
  per-boundary work, without data loading);
- trainer: the whole `xlatrain.train` loop (loader, closures, logging) over 300 steps, from its summary.

    python3 -m bench.steps_per_sync            # writes bench/results/steps_per_sync.json
"""

from __future__ import annotations

import statistics
import tempfile

import jax

from bench.common import interleaved_medians, train_runner, write_results
from xlatrain.config import load_config
from xlatrain.program import build_program
from xlatrain.trainer import train

FUSED = 10
TINY_MLP = ["model.name=mlp", "data.source=digits", "model.hidden=[32]", "batch.global_size=32", "mesh.data=1",
            "trainer.progress=false", "trainer.log_every=1", "trainer.eval_every=100000",
            "trainer.checkpoint_every=100000"]


def executable_runner(k: int):
    config = load_config(None, [*TINY_MLP, f"trainer.steps_per_sync={k}", f"trainer.steps={k}"])
    return train_runner(build_program(config, jax.devices()[:1]))


def trainer_seconds_per_step(k: int, steps: int) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        config = load_config(None, [*TINY_MLP, f"trainer.steps_per_sync={k}", f"trainer.steps={steps}",
                                    f"trainer.run_dir={run_dir}/run"])
        result = train(config, devices=jax.devices()[:1], echo=lambda _: None)
    return result.summary.wall_seconds / steps


def main() -> None:
    per_call = interleaved_medians({"k1": executable_runner(1), f"k{FUSED}": executable_runner(FUSED)},
                                   rounds=6, steps_per_round=20, warmup=5)
    executable = {"k1": per_call["k1"], f"k{FUSED}": per_call[f"k{FUSED}"] / FUSED}
    loop: dict[str, list[float]] = {"k1": [], f"k{FUSED}": []}
    for round_index in range(3):
        for k in (1, FUSED) if round_index % 2 == 0 else (FUSED, 1):
            loop[f"k{k}"].append(trainer_seconds_per_step(k, steps=300))
    trainer = {name: statistics.median(values) for name, values in loop.items()}
    results = {}
    for name, medians in (("executable", executable), ("trainer", trainer)):
        speedup = medians["k1"] / medians[f"k{FUSED}"]
        results[name] = {"median_seconds_per_step": medians, f"speedup_k{FUSED}_over_k1": speedup}
        print(f"{name}: k=1 {medians['k1'] * 1e3:.3f} ms/step, k={FUSED} {medians[f'k{FUSED}'] * 1e3:.3f} ms/step, "
              f"speedup {speedup:.2f}x")
    path = write_results("steps_per_sync", "python3 -m bench.steps_per_sync",
                         {"model": "MLP 64-32-10, batch 32, adamw, one CPU device", "cases": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
