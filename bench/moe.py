"""A Mixture-of-Experts train step on one CPU device (model.moe: 8 experts, top-2), against

1. the dense Llama with the same active parameters (its SwiGLU MLP top_k x the experts' width), xlatrain both;
2. transformers' MixtralForCausalLM of the same weights trained in eager PyTorch (the threads torch picks, SDPA
   attention), with its load-balancing loss (output_router_logits), as xlatrain trains with model.moe's;

each formulation of the experts' matmuls (model.moe.formulation; auto is blocked) beside the others, the same batch,
AdamW with clipping, one host read of the loss per step on every side.

    python3 -m bench.moe    # writes bench/results/moe.json

xlatrain starts from the transformers model's weights (model.init_from=hf:DIR); the first step's losses (cross
entropy, and the auxiliary loss) are reported side by side. Targets: the MoE step <= 1.3x the dense step's time,
and <= 1.0x transformers' Mixtral in eager PyTorch.
"""

from __future__ import annotations

from xlatrain.runtime.malloc import tune_malloc

MALLOC = tune_malloc()  # before JAX or torch start a thread

import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402

from bench.common import eager_runner as common_eager_runner  # noqa: E402
from bench.common import interleaved_medians, train_runner, write_results  # noqa: E402
from xlatrain.config import load_config  # noqa: E402
from xlatrain.program import build_program  # noqa: E402

EXPERTS, TOP_K = 8, 2
FORMULATIONS = ("blocked", "padded", "dense", "sorted")
"""model.moe.formulation=auto's choice (blocked) first."""
SHAPES = {
    "Mixtral 4 x 128 (GQA 4/2, 8 experts of 192, top-2), seq 64": dict(width=128, heads=4, kv_heads=2, hidden=192,
                                                                       seq_len=64),
    "Mixtral 4 x 256 (GQA 4/2, 8 experts of 352, top-2), seq 128": dict(width=256, heads=4, kv_heads=2, hidden=352,
                                                                        seq_len=128),
}
"""Four layers each, batch 16, bytes (256 ids): bench.llama's shapes, each MLP as 8 experts whose two chosen ones
are as wide as the dense MLP there."""
COMMON = ["optimizer.name=adamw", "optimizer.weight_decay=0.01", "optimizer.clip_norm=1.0", "batch.global_size=16",
          "trainer.progress=false", "mesh.data=1"]
AUX_LOSS_WEIGHT = 0.001
"""transformers' router_aux_loss_coef default, and model.moe.aux_loss_weight's."""


def hugging_face_mixtral(directory: Path, width: int, heads: int, kv_heads: int, hidden: int, seq_len: int,
                         ) -> transformers.MixtralForCausalLM:
    """A transformers Mixtral with its initial weights, saved in `directory`."""
    config = transformers.MixtralConfig(vocab_size=256, hidden_size=width, intermediate_size=hidden,
                                        num_hidden_layers=4, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                        max_position_embeddings=seq_len, num_local_experts=EXPERTS,
                                        num_experts_per_tok=TOP_K, router_aux_loss_coef=AUX_LOSS_WEIGHT,
                                        tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config)
    model.save_pretrained(directory)
    return model


def with_aux_loss(model: transformers.MixtralForCausalLM, inputs: torch.Tensor, targets: torch.Tensor) -> tuple:
    """An eager step's objective (bench.common.eager_runner): cross entropy plus the weighted load-balancing loss,
    and (cross entropy, auxiliary loss)."""
    out = model(input_ids=inputs, output_router_logits=True)
    cross_entropy = F.cross_entropy(out.logits.float().reshape(-1, out.logits.shape[-1]), targets.reshape(-1))
    return cross_entropy + AUX_LOSS_WEIGHT * out.aux_loss, (cross_entropy.item(), out.aux_loss.item())


def eager_runner(model: transformers.MixtralForCausalLM, program) -> callable:
    """The transformers model trained in eager PyTorch on the program's first batch, AdamW with clipping."""
    return common_eager_runner(model, program, with_aux_loss)


def one_shape(directory: Path, model: transformers.MixtralForCausalLM, width: int, heads: int, kv_heads: int,
              hidden: int, seq_len: int) -> dict:
    first = jax.devices()[:1]
    moe = [*COMMON, f"model.init_from=hf:{directory}", f"data.seq_len={seq_len}"]
    dense = [*COMMON, "model.name=llama", "model.layers=4", f"model.width={width}", f"model.heads={heads}",
             f"model.kv_heads={kv_heads}", f"model.mlp_hidden={TOP_K * hidden}", f"data.seq_len={seq_len}"]
    built = {**{f"moe_{f}": build_program(load_config(None, [*moe, f"model.moe.formulation={f}"]), first)
                for f in FORMULATIONS},
             "dense_same_active_params": build_program(load_config(None, dense), first)}
    runners = {name: train_runner(program) for name, program in built.items()}
    ours, theirs = runners["moe_blocked"](), eager_runner(model, built["moe_blocked"])()
    first_losses = {"xlatrain": {"cross_entropy": float(ours["loss"]), "aux_loss": float(ours["router_aux_loss"])},
                    "mixtral_eager": dict(zip(("cross_entropy", "aux_loss"), theirs, strict=True))}
    runners = {"mixtral_eager": eager_runner(model, built["moe_blocked"]), **runners}
    medians = interleaved_medians(runners, rounds=5, steps_per_round=4, warmup=2)
    auto = medians["moe_blocked"]
    return {"median_step_seconds": medians,
            "moe_over_dense_same_active_params": auto / medians["dense_same_active_params"],
            "moe_over_mixtral_eager": auto / medians["mixtral_eager"],
            "formulations_over_blocked": {f: medians[f"moe_{f}"] / auto for f in FORMULATIONS},
            "first_step_loss": first_losses, "params": built["moe_blocked"].param_count,
            "dense_params": built["dense_same_active_params"].param_count,
            "model_flops_per_step": {name: program.measured.model_flops_per_step
                                     for name, program in (("moe", built["moe_blocked"]),
                                                           ("dense", built["dense_same_active_params"]))}}


def main() -> None:
    scratch = Path(tempfile.mkdtemp(prefix="bench-moe-"))
    print(f"malloc: {MALLOC}; torch threads {torch.get_num_threads()}")
    results = {}
    for i, (label, shape) in enumerate(SHAPES.items()):
        directory = scratch / f"mixtral{i}"
        model = hugging_face_mixtral(directory, **shape)
        results[label] = found = one_shape(directory, model, **shape)
        for name, seconds in found["median_step_seconds"].items():
            print(f"{label:60s} {name:26s} {seconds * 1e3:8.2f} ms")
        print(f"{label:60s} MoE / dense (same active params) {found['moe_over_dense_same_active_params']:.2f}x, "
              f"MoE / Mixtral eager {found['moe_over_mixtral_eager']:.2f}x; first step {found['first_step_loss']}")
    path = write_results("moe", "python3 -m bench.moe", {
        "targets": {"moe_over_dense_same_active_params": "<= 1.3", "moe_over_mixtral_eager": "<= 1.0"},
        "torch_threads": torch.get_num_threads(), "malloc": MALLOC, "experts": EXPERTS, "top_k": TOP_K,
        "train_step": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
