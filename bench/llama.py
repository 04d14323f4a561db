"""The built-in Llama-style decoder (model.name=llama) against Hugging Face transformers' LlamaForCausalLM of the same
shape and the same weights, on CPU:

1. the train step: xlatrain's (one XLA:CPU device, as `xlatrain train` runs it by default; the layers scanned; and
   mesh.cpu_devices=per_core) vs the transformers model trained in eager PyTorch (the threads torch picks: 2 here,
   SDPA attention), the same batch, AdamW with clipping, one host read of the loss per step on every side;
2. sampling: tokens per second of xlatrain's compiled decode loop (what `xlatrain sample` runs) vs transformers'
   `generate`, both greedy with a KV cache, from the same prompts, whose tokens are compared too.

    python3 -m bench.llama    # writes bench/results/llama.json

xlatrain starts from the transformers model's weights (model.init_from=hf:DIR), so both sides train and decode the
same model; the first step's losses are reported side by side. Targets: train step <= 1.0x PyTorch eager's time;
sampling >= 1.0x transformers' tokens per second. The process keeps freed memory as the `xlatrain` command does
(xlatrain/runtime/malloc.py), for every side.
"""

from __future__ import annotations

from xlatrain.runtime.malloc import tune_malloc

MALLOC = tune_malloc()  # before JAX or torch start a thread

import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402

from bench.common import blas_programs, interleaved_medians, train_runner, write_results  # noqa: E402
from bench.common import eager_runner as common_eager_runner  # noqa: E402
from xlatrain.commands.trained import from_hugging_face  # noqa: E402
from xlatrain.config import load_config  # noqa: E402
from xlatrain.models.sampling import Sampling, generate  # noqa: E402
from xlatrain.program import apply_cpu_devices, build_program  # noqa: E402

TRAIN_SHAPES = {
    "Llama 4 x 128 (GQA 4/2 heads, SwiGLU 384), seq 64": dict(width=128, heads=4, kv_heads=2, mlp=384, seq_len=64),
    "Llama 4 x 256 (GQA 4/2 heads, SwiGLU 704), seq 128": dict(width=256, heads=4, kv_heads=2, mlp=704, seq_len=128),
}
"""Four layers each, batch 16, bytes (256 ids): the shapes of bench.cpu_speed's two GPTs, as Llamas."""
SAMPLING_SHAPE = dict(width=512, heads=8, kv_heads=2, mlp=1408, layers=8, vocab=2048, context=512)
"""A Llama of 24.7M parameters (8 x 512, a vocabulary of 2048) that decodes 256 tokens after a prompt of 16."""
PROMPT, NEW_TOKENS = 16, 256
COMMON = ["optimizer.name=adamw", "optimizer.weight_decay=0.01", "optimizer.clip_norm=1.0", "batch.global_size=16",
          "trainer.progress=false", "runtime.cpu_matmul=xla"]
ONE_DEVICE, PER_CORE = "mesh.data=1", "mesh.cpu_devices=per_core"


def hugging_face_llama(directory: Path, width: int, heads: int, kv_heads: int, mlp: int, layers: int = 4,
                       vocab: int = 256, context: int = 128) -> transformers.LlamaForCausalLM:
    """A transformers Llama with its initial weights, saved in `directory`."""
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=mlp,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, max_position_embeddings=context,
                                      tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(directory)
    return model


def cross_entropy(model: transformers.PreTrainedModel, inputs: torch.Tensor, targets: torch.Tensor) -> tuple:
    """An eager step's objective (bench.common.eager_runner): the cross entropy, and its value."""
    logits = model(input_ids=inputs).logits
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return loss, loss.item()


def eager_runner(model: transformers.LlamaForCausalLM, program) -> callable:
    """The transformers model trained in eager PyTorch on the program's first batch, with its optimizer."""
    return common_eager_runner(model, program, cross_entropy)


def llama_overrides(directory: Path, seq_len: int) -> list[str]:
    return [*COMMON, f"model.init_from=hf:{directory}", "model.name=llama", f"data.seq_len={seq_len}"]


def against_pytorch(directory: Path, model: transformers.LlamaForCausalLM, seq_len: int) -> dict:
    first, overrides = jax.devices()[:1], llama_overrides(directory, seq_len)
    built = {"unrolled": build_program(load_config(None, [*overrides, ONE_DEVICE]), first),
             "scanned": build_program(load_config(None, [*overrides, ONE_DEVICE, "model.scan_layers=true"]), first),
             "per_core": build_program(load_config(None, [*overrides, PER_CORE])),
             **blas_programs(None, [*overrides, ONE_DEVICE], first)}
    runners = {f"xlatrain_{name}": train_runner(program) for name, program in built.items()}
    first_losses = {"xlatrain": float(runners["xlatrain_unrolled"]()["loss"]),
                    "pytorch_eager": eager_runner(model, built["unrolled"])()}
    runners = {"pytorch_eager": eager_runner(model, built["unrolled"]), **runners}
    medians = interleaved_medians(runners, rounds=10, steps_per_round=10, warmup=5)
    eager = medians["pytorch_eager"]
    return {"median_step_seconds": medians, "over_pytorch_eager": {k: v / eager for k, v in medians.items()},
            "first_step_loss": first_losses, "params": built["unrolled"].param_count,
            "per_core_devices": built["per_core"].derived.devices}


def sampling_against_transformers(directory: Path, model: transformers.LlamaForCausalLM, rows: int) -> dict:
    """Greedy decoding of NEW_TOKENS after PROMPT tokens for `rows` prompts, timed whole (the prompt's pass
    included), after a first call that compiles (xlatrain) or warms up (transformers)."""
    model.eval()
    trained = from_hugging_face(directory, "bench")
    graphdef, params = trained.module()
    prompts = np.random.default_rng(0).integers(0, SAMPLING_SHAPE["vocab"], (rows, PROMPT))
    sampling = Sampling(NEW_TOKENS, temperature=0.0)

    def ours():
        tokens, _ = generate(graphdef, params, jnp.asarray(prompts, jnp.int32), jax.random.PRNGKey(0), sampling)
        return np.asarray(tokens)

    def theirs():
        with torch.no_grad():
            out = model.generate(torch.from_numpy(prompts), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[:, PROMPT:].numpy()

    same = float(np.mean(ours() == theirs()))
    medians = interleaved_medians({"xlatrain": ours, "transformers": theirs}, rounds=4, steps_per_round=2, warmup=1)
    per_second = {name: rows * NEW_TOKENS / seconds for name, seconds in medians.items()}
    return {"median_seconds": medians, "tokens_per_second": per_second,
            "xlatrain_over_transformers": per_second["xlatrain"] / per_second["transformers"],
            "greedy_tokens_equal_fraction": same}


def main() -> None:
    scratch = Path(tempfile.mkdtemp(prefix="bench-llama-"))
    checkpoints = {label: scratch / f"train{i}" for i, label in enumerate(TRAIN_SHAPES)}
    models = {label: hugging_face_llama(checkpoints[label], **{k: v for k, v in shape.items() if k != "seq_len"})
              for label, shape in TRAIN_SHAPES.items()}
    plan = apply_cpu_devices(*(load_config(None, [*llama_overrides(checkpoints[label], shape["seq_len"]), PER_CORE])
                               for label, shape in TRAIN_SHAPES.items()))
    print(f"malloc: {MALLOC}; torch threads {torch.get_num_threads()}; CPU devices with {PER_CORE}: "
          f"{plan.describe()}")
    training = {}
    for label, shape in TRAIN_SHAPES.items():
        training[label] = against_pytorch(checkpoints[label], models[label], shape["seq_len"])
        for name, ratio in training[label]["over_pytorch_eager"].items():
            ms = training[label]["median_step_seconds"][name] * 1e3
            print(f"{label:52s} {name:18s} {ms:8.2f} ms  {ratio:.2f}x PyTorch eager")
        print(f"{label:52s} first step's loss {training[label]['first_step_loss']}")
    sampler = hugging_face_llama(scratch / "sampling", **SAMPLING_SHAPE)
    sampling = {}
    for rows in (1, 8):
        sampling[f"{rows} prompt(s)"] = found = sampling_against_transformers(scratch / "sampling", sampler, rows)
        print(f"sampling, {rows} prompt(s) of {PROMPT} + {NEW_TOKENS} tokens: "
              + ", ".join(f"{name} {rate:,.0f} tokens/s" for name, rate in found["tokens_per_second"].items())
              + f": {found['xlatrain_over_transformers']:.2f}x, greedy tokens equal "
              f"{found['greedy_tokens_equal_fraction']:.3f}")
    path = write_results("llama", "python3 -m bench.llama", {
        "targets": {"train_step": "xlatrain / PyTorch eager <= 1.0",
                    "sampling": "xlatrain / transformers tokens per second >= 1.0"},
        "torch_threads": torch.get_num_threads(), "malloc": MALLOC, "per_core_cpu_devices": plan.describe(),
        "train_step": training,
        "sampling": {"shape": SAMPLING_SHAPE, "prompt_tokens": PROMPT, "new_tokens": NEW_TOKENS,
                     "params": sum(p.numel() for p in sampler.parameters()), "by_batch": sampling}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
