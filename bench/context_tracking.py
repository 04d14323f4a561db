"""Context parallelism over 20 steps: the losses of the built-in Llama (GQA 4/2, a sliding-window layer and a
full one) trained with the sequence split over mesh.context, against the same run on one device, step by step.
The tests check one batch's gradients and a few steps (tests/test_context.py); this follows the runs long enough
for rounding to show if it drifts. 8 host CPU devices; speed is not measured.

    python3 -m bench.context_tracking                # writes bench/results/context_tracking.json
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import tempfile  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import write_results  # noqa: E402
from xlatrain.config import load_config  # noqa: E402
from xlatrain.trainer import train  # noqa: E402

STEPS = 20
LLAMA = ["model.name=llama", "model.layers=2", "model.width=64", "model.heads=4", "model.kv_heads=2",
         "model.sliding_window=48", "model.layer_types=[sliding,full]", "data.seq_len=256", "data.glob='*.py'",
         "data.max_bytes=2000000", "batch.global_size=8", f"trainer.steps={STEPS}", "trainer.progress=false",
         "trainer.log_every=1", "trainer.eval_every=100000", "trainer.checkpoint_every=100000",
         "trainer.compile_cache=off"]
CASES = {
    "ring, C=2 x data 2": ["mesh.context=2", "mesh.data=2"],
    "all_gather, C=2 x data 2": ["mesh.context=2", "mesh.data=2", "parallel.context_attention=all_gather"],
    "ring, C=4 x data 2, fsdp": ["mesh.context=4", "mesh.data=2", "parallel.strategy=fsdp"],
    "ring, C=4, shard_map, xlatrain's ppermute": ["mesh.context=4", "mesh.data=1", "parallel.mode=shard_map",
                                                  "collectives.impl=custom"],
    "ring, C=2 x 2 pipeline stages, xlatrain's ppermute": ["mesh.context=2", "mesh.stage=2", "mesh.data=1",
                                                           "collectives.impl=custom"],
}


def losses(overrides: list[str], devices: int) -> list[float]:
    with tempfile.TemporaryDirectory() as run_dir:
        config = load_config(None, [*LLAMA, *overrides, f"trainer.run_dir={run_dir}/run"])
        result = train(config, devices=jax.devices()[:devices], echo=lambda _: None)
    return [result.losses[step] for step in range(1, STEPS + 1)]


def main() -> None:
    reference = losses(["mesh.data=1"], 1)
    rows = []
    for name, overrides in CASES.items():
        devices = int(np.prod([int(o.split("=")[1]) for o in overrides if o.startswith("mesh.")]))
        ours = losses(overrides, devices)
        worst = float(np.max(np.abs(np.subtract(ours, reference)) / np.abs(reference)))
        rows.append({"case": name, "overrides": overrides, "losses": ours, "worst_relative_difference": worst})
        print(f"{name}: the 20 steps' losses within {worst:.1e} of one device's "
              f"(last {ours[-1]:.6f} vs {reference[-1]:.6f})", flush=True)
    path = write_results("context_tracking", "python3 -m bench.context_tracking",
                         {"model": LLAMA, "one_device_losses": reference, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
