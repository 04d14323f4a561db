"""Step time of the precision policies (fp32, bf16, fp16) on the default GPT, one device, interleaved.

On CPU this is informational: XLA:CPU widens most 16-bit arithmetic to float32 and converts back, so
bf16/fp16 cost extra conversions instead of saving time. The same command on a GPU measures the real
effect (tensor cores, half the activation bytes).

    python3 -m bench.precision                 # writes bench/results/precision.json
"""

from __future__ import annotations

import jax

from bench.common import interleaved_medians, train_runner, write_results
from xlatrain.config import load_config
from xlatrain.program import build_program

POLICIES = ("fp32", "bf16", "fp16")


def runner(policy: str):
    program = build_program(load_config(None, ["mesh.data=1", f"precision.policy={policy}"]), jax.devices()[:1])
    return train_runner(program), program


def main() -> None:
    runners = {policy: runner(policy) for policy in POLICIES}
    medians = interleaved_medians({p: r for p, (r, _) in runners.items()}, rounds=4, steps_per_round=5, warmup=2)
    program = runners["fp32"][1]
    results = {p: {"median_step_seconds": medians[p], "ratio_over_fp32": medians[p] / medians["fp32"]}
               for p in POLICIES}
    for policy, row in results.items():
        print(f"{policy}: {row['median_step_seconds'] * 1e3:.1f} ms/step, {row['ratio_over_fp32']:.2f}x fp32")
    path = write_results("precision", "python3 -m bench.precision", {
        "model": f"default GPT ({program.param_count:,} params), batch {program.derived.global_batch}, "
                 f"seq {program.dataset.spec.input_shape[0]}", "device": jax.devices()[0].device_kind,
        "note": "CPU: informational only; 16-bit compute is emulated through float32 on XLA:CPU",
        "cases": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
