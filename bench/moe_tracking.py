"""Expert parallelism over 20 steps: the losses of the built-in Llama with Mixture-of-Experts layers (8 experts,
top-2) trained with its experts split over mesh.expert, and resumed halfway with another split, against the same
run on one device, step by step; and the router's choices: a token whose top-2 is a near tie can go to another
expert after another order of roundings (a flip), which changes its layer's loads, so each step's per-layer loads
(the busiest expert's choices, and the loads' coefficient of variation, from metrics.jsonl) are compared with one
device's and the steps where any differ are counted. The tests check one batch's gradients and a few steps
(tests/test_moe_models.py); this follows the runs long enough for rounding to show if it drifts. 8 host CPU
devices; speed is not measured.

    python3 -m bench.moe_tracking                # writes bench/results/moe_tracking.json
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import write_results  # noqa: E402
from xlatrain.config import load_config  # noqa: E402
from xlatrain.trainer import train  # noqa: E402

STEPS, EXPERTS, TOP_K, ROWS, SEQ = 20, 8, 2, 8, 128
MOE = ["model.name=llama", "model.layers=2", "model.width=64", "model.heads=4", "model.kv_heads=2",
       f"model.moe.experts={EXPERTS}", f"model.moe.top_k={TOP_K}", "model.moe.expert_hidden=64",
       f"data.seq_len={SEQ}", "data.glob='*.py'", "data.max_bytes=2000000", f"batch.global_size={ROWS}",
       f"optimizer.decay_steps={STEPS}", "trainer.progress=false", "trainer.log_every=1", "trainer.eval_every=100000",
       "trainer.compile_cache=off"]
CASES = {
    "expert 2 x data 2": ["mesh.expert=2", "mesh.data=2"],
    "expert 4": ["mesh.expert=4", "mesh.data=1"],
    "expert 2 x data 2, fsdp": ["mesh.expert=2", "mesh.data=2", "parallel.strategy=fsdp"],
    "expert 2 x tensor 2": ["mesh.expert=2", "mesh.tensor=2", "mesh.data=1"],
    "expert 4, shard_map, xlatrain's all_to_all": ["mesh.expert=4", "mesh.data=1", "parallel.mode=shard_map",
                                                   "collectives.impl=custom"],
}
RESUMED = (["mesh.expert=2", "mesh.data=2"], ["mesh.expert=4", "mesh.data=1"])
"""The first half with one split, the second resumed from its checkpoint with the other (every run decays its
learning rate over the 20 steps: optimizer.decay_steps)."""


def run(run_dir: Path, overrides: list[str], steps: int) -> None:
    devices = int(np.prod([int(o.split("=")[1]) for o in overrides if o.startswith("mesh.")]))
    config = load_config(None, [*MOE, *overrides, f"trainer.steps={steps}", f"trainer.checkpoint_every={STEPS // 2}",
                                f"trainer.run_dir={run_dir}"])
    train(config, devices=jax.devices()[:devices], echo=lambda _: None)


def records(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "loss" in r}


def loads(record: dict) -> list[tuple[int, float]]:
    """Per layer: the busiest expert's choices (a whole number) and the loads' coefficient of variation."""
    mean = ROWS * SEQ * TOP_K / EXPERTS
    return [(round(record[f"router_max_over_mean_layer{layer}"] * mean), record[f"router_cv_layer{layer}"])
            for layer in range(2)]


def compared(found: dict[int, dict], reference: dict[int, dict]) -> dict:
    ours = [found[s]["loss"] for s in range(1, STEPS + 1)]
    theirs = [reference[s]["loss"] for s in range(1, STEPS + 1)]
    flips = [s for s in range(1, STEPS + 1) if any(
        a[0] != b[0] or abs(a[1] - b[1]) > 1e-5 for a, b in zip(loads(found[s]), loads(reference[s]), strict=True))]
    return {"losses": ours, "worst_relative_difference": float(np.max(np.abs(np.subtract(ours, theirs)) /
                                                                      np.abs(theirs))),
            "steps_whose_loads_differ": flips}


def main() -> None:
    scratch = Path(tempfile.mkdtemp(prefix="bench-moe-tracking-"))
    run(scratch / "one", ["mesh.data=1"], STEPS)
    reference = records(scratch / "one")
    rows = []
    for i, (name, overrides) in enumerate(CASES.items()):
        run(scratch / f"case{i}", overrides, STEPS)
        rows.append({"case": name, "overrides": overrides, **compared(records(scratch / f"case{i}"), reference)})
    first, second = RESUMED
    run(scratch / "resumed", first, STEPS // 2)
    run(scratch / "resumed", second, STEPS)
    rows.append({"case": "expert 2 x data 2, resumed at step 10 with expert 4", "overrides": [first, second],
                 **compared(records(scratch / "resumed"), reference)})
    for row in rows:
        print(f"{row['case']}: the 20 steps' losses within {row['worst_relative_difference']:.1e} of one device's; "
              f"steps whose router loads differ: {row['steps_whose_loads_differ'] or 'none'}", flush=True)
    path = write_results("moe_tracking", "python3 -m bench.moe_tracking",
                         {"model": MOE, "one_device_losses": [reference[s]["loss"] for s in range(1, STEPS + 1)],
                          "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
