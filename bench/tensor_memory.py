"""What one device holds as the layers split over mesh.tensor: the parameters and the optimizer state (their
sharded shapes) and XLA's temporaries (memory analysis: the activations and the step's working buffers) of the
GPT's train step, one data replica on T devices against the same replica on one device, with and without
sequence parallelism, in one global program (parallel.mode=jit, XLA's partitioner) and in the per-device program
(parallel.mode=shard_map, the tensor group's collectives written out); and how far each falls short of 1/T: the
part that stays whole on every device, fitted from T=2 and T=4 (bytes = whole + split / T) and checked at T=8.
Memory, not speed: XLA:CPU devices share the cores. The collectives per mesh axis are the train step's optimised
HLO's.

    python3 -m bench.tensor_memory    # writes bench/results/tensor_memory.json
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
from xlatrain.lowering.inspect import collectives  # noqa: E402

from bench.common import write_results  # noqa: E402
from xlatrain.commands.lower import memory_split  # noqa: E402
from xlatrain.config import load_config  # noqa: E402
from xlatrain.program import build_program  # noqa: E402

MODEL = ["model.layers=4", "model.width=256", "model.heads=8", "data.seq_len=128", "batch.global_size=8",
         "mesh.data=1", "data.max_bytes=2000000", "data.glob='*.py'", "trainer.compile_cache=off"]
TENSOR_SIZES = (1, 2, 4, 8)
KEYS = ("params_bytes", "optimizer_bytes", "temp_bytes")


MODES = ("jit", "shard_map")


def measured(tensor: int, sequence_parallel: bool, mode: str = "jit") -> dict:
    config = load_config(None, [*MODEL, f"mesh.tensor={tensor}", f"parallel.sequence_parallel={sequence_parallel}",
                                f"parallel.mode={mode}"])
    program = build_program(config, jax.devices()[:tensor])
    compiled = program.train_step.first.compiled
    return {**memory_split(program, compiled), "collectives": collectives(compiled.as_text(), dict(program.mesh.shape))}


def whole_and_split(at2: int, at4: int) -> tuple[float, float]:
    """(bytes every device keeps whole, bytes split over T) from bytes = whole + split / T at T=2 and T=4."""
    split = 4 * (at2 - at4)
    return at2 - split / 2, split


def row_name(mode: str, tensor: int, sequence_parallel: bool) -> str:
    """t4-sp for parallel.mode=jit (as the results have always named them), shard_map-t4-sp for the other."""
    return f"{'' if mode == 'jit' else mode + '-'}t{tensor}{'-sp' if sequence_parallel else ''}"


def main() -> None:
    rows = {"t1": measured(1, False)}
    for mode in MODES:
        for sequence_parallel in (False, True):
            for tensor in TENSOR_SIZES[1:]:
                name = row_name(mode, tensor, sequence_parallel)
                rows[name] = measured(tensor, sequence_parallel, mode)
                print(f"{name}: " + ", ".join(f"{key} {rows[name][key] / 2**20:.2f} MiB" for key in KEYS), flush=True)
    one = rows["t1"]
    summary = {}
    for mode, suffix in ((mode, suffix) for mode in MODES for suffix in ("", "-sp")):
        for key in KEYS:
            at = {t: rows[row_name(mode, t, suffix == "-sp") if t > 1 else "t1"][key] for t in TENSOR_SIZES}
            whole, split = whole_and_split(at[2], at[4])
            summary[f"{'' if mode == 'jit' else mode + '-'}{key}{suffix}"] = {
                "ratio_to_one_device": {t: at[t] / one[key] for t in TENSOR_SIZES},
                "whole_bytes": whole, "whole_share_of_one_device": whole / one[key],
                "t8_predicted_by_whole_plus_split_over_t": whole + split / 8, "t8_measured": at[8]}
            print(f"{mode} {key}{suffix}: ratio " + ", ".join(f"t{t} {at[t] / one[key]:.3f}" for t in TENSOR_SIZES)
                  + f"; whole {whole / 2**20:.2f} MiB ({whole / one[key]:.1%} of one device's), t8 predicted "
                  f"{(whole + split / 8) / 2**20:.2f} vs measured {at[8] / 2**20:.2f} MiB")
    path = write_results("tensor_memory", "python3 -m bench.tensor_memory", {"model": MODEL, "rows": rows,
                                                                           "summary": summary})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
