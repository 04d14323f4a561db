"""How an unrolled BlockStack takes layer i out of its stacked params, and what that does to the backward:

- split (xlatrain/models/blocks.py `unstack_layers`, how it runs now): `lax.split` into one piece per layer, whose
  gradient is one concatenate of the layers' gradients;
- indexed (how it ran before): `params[i]` per layer, whose gradient is, per layer, a stacked-size array holding
  that layer's gradient padded with zeros, and their sum.

XLA's memory and cost analysis of the train step (temporary bytes, bytes accessed) and its step time, interleaved,
on one XLA:CPU device: AdamW, batch 16, sequences of 64, width 128, at 4 and 12 unrolled layers.

    python3 -m bench.unrolled_layers          # writes bench/results/unrolled_layers.json
"""

from __future__ import annotations

from contextlib import nullcontext
from unittest import mock

from xlatrain.runtime.malloc import tune_malloc

MALLOC = tune_malloc()  # as the `xlatrain` command does, before JAX starts a thread

import jax  # noqa: E402

from bench.common import interleaved_medians, train_runner, write_results  # noqa: E402
from xlatrain.compat.monitoring import cost_analysis  # noqa: E402
from xlatrain.config import load_config  # noqa: E402
from xlatrain.models import blocks  # noqa: E402
from xlatrain.program import build_program  # noqa: E402

LAYERS = (4, 12)


def indexed_layers(params_Lx, layers: int) -> list:
    return [jax.tree.map(lambda p, i=index: p[i], params_Lx) for index in range(layers)]


def build(layers: int, variant: int, indexed: bool):
    # A distinct weight decay per variant keeps jax from handing two builds one cached executable.
    config = load_config(None, ["optimizer.name=adamw", f"optimizer.weight_decay=0.01{variant}", "mesh.data=1",
                                "batch.global_size=16", "data.seq_len=64", "model.width=128", "model.heads=4",
                                f"model.layers={layers}", "model.scan_layers=false", "trainer.compile_cache=off"])
    with mock.patch.object(blocks, "unstack_layers", indexed_layers) if indexed else nullcontext():
        program = build_program(config, jax.devices()[:1])
        compiled = program.train_step.first.compiled
    return program, {"temporary_bytes": compiled.memory_analysis().temp_size_in_bytes,
                     "bytes_accessed": cost_analysis(compiled)["bytes accessed"]}


def compare(layers: int) -> dict:
    # Two executables of each, built alternately, so that neither way gains from being compiled first.
    built = {f"{name}_{copy}": build(layers, 2 * copy + (name == "indexed"), name == "indexed")
             for copy in (1, 2) for name in ("split", "indexed")}
    medians = interleaved_medians({name: train_runner(program) for name, (program, _) in built.items()},
                                  rounds=6, steps_per_round=10, warmup=3)
    split, indexed = built["split_1"][1], built["indexed_1"][1]
    return {"split": split, "indexed": indexed,
            "split_over_indexed": {key: split[key] / indexed[key] for key in split},
            "median_step_seconds": medians,
            "step_time_split_over_indexed": (medians["split_1"] + medians["split_2"])
            / (medians["indexed_1"] + medians["indexed_2"])}


def main() -> None:
    results = {}
    for layers in LAYERS:
        results[f"{layers} layers"] = result = compare(layers)
        ratios = result["split_over_indexed"]
        print(f"{layers:2d} layers, split over indexed: temporary bytes {ratios['temporary_bytes']:.2f}x, bytes "
              f"accessed {ratios['bytes_accessed']:.2f}x, step time {result['step_time_split_over_indexed']:.3f}x")
    path = write_results("unrolled_layers", "python3 -m bench.unrolled_layers",
                         {"malloc": MALLOC, "shapes": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
