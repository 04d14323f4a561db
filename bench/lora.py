"""LoRA (model.lora) against full fine-tuning and against peft + transformers, on CPU:

1. bytes: the gradients and the optimizer state of LoRA (rank 8, all seven projections) against full
   fine-tuning, per device, as `xlatrain lower` reports them (xlatrain/commands/lower.py: memory_split), on the
   Llama-3.2-1B shape, compiled only (nothing runs): target <= 5%;
2. the train step: a LoRA step of xlatrain (one XLA:CPU device) against peft + transformers in eager PyTorch on
   the same model, adapters and batch, AdamW with clipping: target <= 1.0x.

    python3 -m bench.lora    # writes bench/results/lora.json
"""

from __future__ import annotations

from xlatrain.runtime.malloc import tune_malloc

MALLOC = tune_malloc()  # before JAX or torch start a thread

import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import peft  # noqa: E402
import torch  # noqa: E402

from bench.common import (  # noqa: E402
    eager_runner,  # noqa: E402
    interleaved_medians,
    train_runner,
    write_results,
)
from bench.llama import COMMON, ONE_DEVICE, cross_entropy, hugging_face_llama, llama_overrides  # noqa: E402
from xlatrain.commands.lower import memory_split  # noqa: E402
from xlatrain.config import load_config  # noqa: E402
from xlatrain.program import build_program  # noqa: E402

TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = [f"model.lora.targets=[{','.join(TARGETS)}]", "model.lora.rank=8", "model.lora.alpha=16"]
LLAMA_1B = ["model.name=llama", "model.layers=16", "model.width=2048", "model.heads=32", "model.kv_heads=8",
            "model.mlp_hidden=8192", "model.vocab=128256", "model.tie_embeddings=true", "model.rope_theta=500000",
            "model.scan_layers=true", "model.max_len=2048", "batch.global_size=1", "precision.policy=bf16"]
"""Llama-3.2-1B's shape (1.24B parameters), one sequence of 2048 tokens, bf16 compute with float32 params."""
TRAIN_SHAPE = dict(width=256, heads=4, kv_heads=2, mlp=704, seq_len=128)
"""bench.llama's larger train shape: four layers, batch 16."""


def bytes_of(scratch: Path) -> dict:
    tokens = np.random.default_rng(0).integers(0, 128256, (4, 2049)).astype(np.int32)
    np.savez(scratch / "ids.npz", inputs=tokens[:, :-1], targets=tokens[:, 1:])
    data = ["data.source=arrays", f"data.path={scratch / 'ids.npz'}", "data.holdout=0.5"]
    found = {}
    for name, extra in (("full", []), ("lora", LORA)):
        program = build_program(load_config(None, [*LLAMA_1B, *data, *extra, ONE_DEVICE]), jax.devices()[:1])
        found[name] = {**memory_split(program, program.train_step.first.compiled), "params": program.param_count}
        print(f"{name:5s} " + ", ".join(f"{k} {v / 2**20:,.1f} MiB" for k, v in found[name].items() if "bytes" in k))
    ratios = {key: found["lora"][key] / found["full"][key] for key in ("gradient_bytes", "optimizer_bytes")}
    print("lora / full: " + ", ".join(f"{k} {v:.2%}" for k, v in ratios.items()))
    return {"shape": LLAMA_1B, "by_kind": found, "lora_over_full": ratios}


def step_against_peft(scratch: Path) -> dict:
    model = hugging_face_llama(scratch / "train", **{k: v for k, v in TRAIN_SHAPE.items() if k != "seq_len"})
    program = build_program(load_config(None, [*llama_overrides(scratch / "train", TRAIN_SHAPE["seq_len"]), *LORA,
                                               ONE_DEVICE]), jax.devices()[:1])
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=MODULES,
                                                         lora_dropout=0.0))
    runners = {"pytorch_peft_eager": eager_runner(adapted, program, cross_entropy),
               "xlatrain": train_runner(program)}
    medians = interleaved_medians(runners, rounds=5, steps_per_round=10, warmup=5)
    ratio = medians["xlatrain"] / medians["pytorch_peft_eager"]
    print("LoRA step, Llama 4 x 256, seq 128, batch 16: " + ", ".join(
        f"{k} {v * 1e3:.2f} ms" for k, v in medians.items()) + f": {ratio:.2f}x")
    return {"shape": TRAIN_SHAPE, "median_step_seconds": medians, "xlatrain_over_peft_eager": ratio}


def main() -> None:
    scratch = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    print(f"malloc: {MALLOC}; torch threads {torch.get_num_threads()}")
    step = step_against_peft(scratch)
    sizes = bytes_of(scratch)
    path = write_results("lora", "python3 -m bench.lora", {
        "targets": {"bytes": "LoRA's gradient and optimizer-state bytes / full fine-tuning's <= 0.05",
                    "train_step": "xlatrain / peft + transformers eager <= 1.0"},
        "common": COMMON, "torch_threads": torch.get_num_threads(), "malloc": MALLOC, "bytes": sizes,
        "train_step": step})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
