"""Muon (optimizer.name=muon) against AdamW on CPU:

1. the train step: Muon's over AdamW's on the default GPT, one XLA:CPU device (interleaved medians), and the same
   under fsdp over 8 fake CPU devices sharing the cores (reported, not a target: their times are overheads);
2. held-out loss against steps for AdamW and Muon, each at the best of 5 log-spaced learning rates, on the default
   GPT and the Llama of examples/configs/llama_stdlib.yaml (300 steps, the configs' cosine schedule): a result
   table, not a criterion.

    python3 -m bench.optimizers    # writes bench/results/optimizers.json
"""

from __future__ import annotations

from xlatrain.runtime.malloc import tune_malloc

MALLOC = tune_malloc()  # before JAX starts a thread

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

from bench.common import interleaved_medians, train_runner, write_results  # noqa: E402
from xlatrain.config import load_config  # noqa: E402
from xlatrain.program import build_program  # noqa: E402
from xlatrain.trainer import train  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MUON = ["optimizer.name=muon", "optimizer.lr=0.02", "optimizer.adam_lr=3e-3"]
RATES = {"adamw": [7.5e-4, 1.5e-3, 3e-3, 6e-3, 1.2e-2], "muon": [5e-3, 1e-2, 2e-2, 4e-2, 8e-2]}
"""Five log-spaced peak rates each (AdamW's around the configs' 3e-3; Muon's for the matrices, its AdamW group at
the configs' 3e-3)."""
MODELS = {"gpt": [], "llama": [str(REPO / "examples" / "configs" / "llama_stdlib.yaml")]}
QUIET = ["trainer.progress=false", "trainer.log_every=50", "trainer.eval_every=50", "trainer.loggers=[jsonl]"]


def step_times(overrides: list[str]) -> dict[str, float]:
    """Median seconds per train step of AdamW and Muon on this process's devices."""
    runners = {}
    for name, extra in (("adamw", []), ("muon", MUON)):
        config = load_config(None, [*overrides, *extra])
        runners[name] = train_runner(build_program(config, jax.devices()[:config.mesh.data]))
    return interleaved_medians(runners, rounds=5, steps_per_round=10, warmup=3)


def fsdp_step_times() -> dict[str, float]:
    """step_times under fsdp over 8 CPU devices, in a process of its own (the device count is fixed at start)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-m", "bench.optimizers", "--fsdp"], cwd=REPO, env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def held_out_losses(model: list[str], name: str, rate: float, scratch: Path) -> dict[int, float]:
    rates = [f"optimizer.lr={rate}"] if name == "adamw" else [*MUON, f"optimizer.lr={rate}"]
    run = scratch / f"{len(list(scratch.iterdir()))}"
    config = load_config(model[0] if model else None, [*rates, *QUIET, "mesh.data=1", f"trainer.run_dir={run}"])
    return train(config, devices=jax.devices()[:1], echo=lambda _: None).eval_losses


def loss_table(scratch: Path) -> dict:
    table = {}
    for model, config in MODELS.items():
        for name, rates in RATES.items():
            curves = {rate: held_out_losses(config, name, rate, scratch) for rate in rates}
            best = min(rates, key=lambda rate: curves[rate][max(curves[rate])])
            table[f"{model}/{name}"] = {"best_lr": best, "curve": curves[best],
                                        "final_by_lr": {rate: curves[rate][max(curves[rate])] for rate in rates}}
            print(f"{model} {name}: best lr {best}, held-out loss by step "
                  + ", ".join(f"{step}: {loss:.3f}" for step, loss in curves[best].items()))
    return table


def main() -> None:
    if sys.argv[1:] == ["--fsdp"]:
        print(json.dumps(step_times(["mesh.data=8", "parallel.strategy=fsdp"])))
        return
    one = step_times(["mesh.data=1"])
    fsdp = fsdp_step_times()
    print("default GPT step, one device: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in one.items())
          + f": muon / adamw {one['muon'] / one['adamw']:.2f}x")
    print("the same, fsdp over 8 fake CPU devices: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in fsdp.items())
          + f": {fsdp['muon'] / fsdp['adamw']:.2f}x")
    table = loss_table(Path(tempfile.mkdtemp(prefix="bench-optimizers-")))
    path = write_results("optimizers", "python3 -m bench.optimizers", {
        "targets": {"train_step": "reported: Muon's step over AdamW's on one device",
                    "held_out_loss": "a result table, not a criterion"},
        "malloc": MALLOC, "rates": RATES, "muon": MUON,
        "train_step": {"one_device": one, "one_device_muon_over_adamw": one["muon"] / one["adamw"],
                       "fsdp_8_fake_devices": fsdp, "fsdp_muon_over_adamw": fsdp["muon"] / fsdp["adamw"]},
        "held_out_loss": table})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
