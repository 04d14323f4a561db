"""Which Hugging Face tensor each parameter of the built-in decoders is, and whether it is stored transposed
(torch's nn.Linear keeps [out, in], where a flax kernel is [in, out]; GPT-2's Conv1D keeps [in, out] too)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from xlatrain.models.blocks import BLOCKS, DENSE_BLOCKS
from xlatrain.models.interleave import interleaving_of

LAYER = "{layer}"
"""Where a block's tensor names its layer."""
EXPERT = "{expert}"
"""Where an expert's tensor names its expert."""


@dataclass(frozen=True)
class Tensor:
    name: str
    """The checkpoint's name; a block's holds LAYER."""
    transposed: bool = False
    groups: int | None = None
    """The checkpoint keeps the parameter's last two dimensions [groups, n] as one [groups x n] (GPT-2's c_attn
    [width, 3 x width] for the GPT's qkv [width, 3, width])."""
    experts: bool = False
    """The parameter's first dimension (a layer's) is its experts, which the checkpoint keeps one tensor each (its
    name holds EXPERT)."""

    def stored_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The checkpoint's shape of a parameter of `shape` (one layer's; one expert's tensor of an experts one)."""
        shape = shape[1:] if self.experts else shape
        if self.groups is not None:
            return (*shape[:-2], shape[-2] * shape[-1])
        return shape[::-1] if self.transposed else shape

    def of_layer(self, layer: int) -> str:
        return self.name.replace(LAYER, str(layer))

    def of_expert(self, name: str, expert: int) -> str:
        """`name` (this tensor's, its layer filled in) for one expert."""
        return name.replace(EXPERT, str(expert))


def _linear(ours: str, theirs: str, bias: bool = True) -> dict[tuple[str, ...], Tensor]:
    found = {(ours, "kernel"): Tensor(f"{theirs}.weight", transposed=True)}
    return {**found, (ours, "bias"): Tensor(f"{theirs}.bias")} if bias else found


def _in_blocks(names: dict[tuple[str, ...], Tensor], prefix: str, stack: str = BLOCKS) -> dict[tuple[str, ...], Tensor]:
    return {(stack, *path): dataclasses.replace(t, name=f"{prefix}.{LAYER}.{t.name}") for path, t in names.items()}


LLAMA_LAYER = {("attn_norm", "scale"): Tensor("input_layernorm.weight"),
               **{k: v for ours, theirs in [("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("attn_out", "o_proj")]
                  for k, v in _linear(ours, f"self_attn.{theirs}").items()},
               ("q_norm", "scale"): Tensor("self_attn.q_norm.weight"),
               ("k_norm", "scale"): Tensor("self_attn.k_norm.weight"),
               ("mlp_norm", "scale"): Tensor("post_attention_layernorm.weight"),
               **{k: v for ours, theirs in [("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")]
                  for k, v in _linear(ours, f"mlp.{theirs}").items()}}
LLAMA = {("embed", "embedding"): Tensor("model.embed_tokens.weight"), ("norm", "scale"): Tensor("model.norm.weight"),
         ("head", "kernel"): Tensor("lm_head.weight", transposed=True), **_in_blocks(LLAMA_LAYER, "model.layers")}

GPT2_LAYER = {("ln_attn", "scale"): Tensor("ln_1.weight"), ("ln_attn", "bias"): Tensor("ln_1.bias"),
              ("qkv", "kernel"): Tensor("attn.c_attn.weight", groups=3),
              ("qkv", "bias"): Tensor("attn.c_attn.bias", groups=3),
              ("attn_out", "kernel"): Tensor("attn.c_proj.weight"), ("attn_out", "bias"): Tensor("attn.c_proj.bias"),
              ("ln_mlp", "scale"): Tensor("ln_2.weight"), ("ln_mlp", "bias"): Tensor("ln_2.bias"),
              ("mlp_in", "kernel"): Tensor("mlp.c_fc.weight"), ("mlp_in", "bias"): Tensor("mlp.c_fc.bias"),
              ("mlp_out", "kernel"): Tensor("mlp.c_proj.weight"), ("mlp_out", "bias"): Tensor("mlp.c_proj.bias")}
GPT2_PREFIX = "transformer."
"""GPT2LMHeadModel's tensors sit under it; a bare GPT2Model's have none."""
GPT2 = {("embed", "embedding"): Tensor(f"{GPT2_PREFIX}wte.weight"),
        ("position", "embedding"): Tensor(f"{GPT2_PREFIX}wpe.weight"),
        ("ln_final", "scale"): Tensor(f"{GPT2_PREFIX}ln_f.weight"),
        ("ln_final", "bias"): Tensor(f"{GPT2_PREFIX}ln_f.bias"),
        ("head", "kernel"): Tensor("lm_head.weight", transposed=True), **_in_blocks(GPT2_LAYER, f"{GPT2_PREFIX}h")}

GEMMA_LAYER = {**LLAMA_LAYER, ("post_attn_norm", "scale"): Tensor("post_attention_layernorm.weight"),
               ("mlp_norm", "scale"): Tensor("pre_feedforward_layernorm.weight"),
               ("post_mlp_norm", "scale"): Tensor("post_feedforward_layernorm.weight")}
"""Gemma's sandwich: its post_attention_layernorm follows attention (Llama's precedes the MLP)."""
GEMMA = {**{path: tensor for path, tensor in LLAMA.items() if path[0] != BLOCKS},
         **_in_blocks(GEMMA_LAYER, "model.layers")}



def _experts_layer(prefix: str, gate: str, up: str, down: str) -> dict[tuple[str, ...], Tensor]:
    """An MoE block's MLP (xlatrain/models/experts.py) under `prefix`: the router, one tensor per expert and
    weight, the shared experts and their gate."""
    def expert(theirs: str) -> Tensor:
        return Tensor(f"{prefix}.experts.{EXPERT}.{theirs}.weight", transposed=True, experts=True)

    return {("moe", "router", "kernel"): Tensor(f"{prefix}.gate.weight", transposed=True),
            ("moe", "gate"): expert(gate), ("moe", "up"): expert(up), ("moe", "down"): expert(down),
            **{("moe", "shared", ours, "kernel"): Tensor(f"{prefix}.shared_expert.{ours}_proj.weight", transposed=True)
               for ours in ("gate", "up", "down")},
            ("moe", "shared_gate", "kernel"): Tensor(f"{prefix}.shared_expert_gate.weight", transposed=True)}


LLAMA_ATTENTION = {path: tensor for path, tensor in LLAMA_LAYER.items() if path[0] not in ("gate", "up", "down")}
MIXTRAL = {**{path: tensor for path, tensor in LLAMA.items() if path[0] != BLOCKS},
           **_in_blocks({**LLAMA_ATTENTION, **_experts_layer("block_sparse_moe", "w1", "w3", "w2")}, "model.layers")}
QWEN_MOE = {**{path: tensor for path, tensor in LLAMA.items() if path[0] != BLOCKS},
            **_in_blocks({**LLAMA_ATTENTION, **_experts_layer("mlp", "gate_proj", "up_proj", "down_proj")},
                         "model.layers"),
            **_in_blocks(LLAMA_LAYER, "model.layers", DENSE_BLOCKS)}
"""Qwen2-MoE's, Qwen3-MoE's and OLMoE's names (Qwen's dense layers among the expert ones as Llama's)."""

PROJECTIONS = {"q": ("q", "self_attn.q_proj"), "k": ("k", "self_attn.k_proj"), "v": ("v", "self_attn.v_proj"),
               "o": ("attn_out", "self_attn.o_proj"), "gate": ("gate", "mlp.gate_proj"),
               "up": ("up", "mlp.up_proj"), "down": ("down", "mlp.down_proj")}
"""model.lora.targets' names: (the Llama block's module, its module in transformers' Llama layers)."""
PEFT_PREFIX = "base_model.model.model.layers"
"""Where a PEFT adapter of a causal LM keeps its layers' modules."""
PEFT = {(stack, ours, adapter): Tensor(f"{PEFT_PREFIX}.{LAYER}.{theirs}.lora_{which}.weight", transposed=True)
        for stack in (BLOCKS, DENSE_BLOCKS) for ours, theirs in PROJECTIONS.values()
        for adapter, which in (("lora_a", "A"), ("lora_b", "B"))}
"""LoRA's adapters in PEFT's names: lora_A [rank, in] and lora_B [out, rank], where ours are [in, rank] and
[rank, out]."""

BY_NAMING = {"llama": LLAMA, "gemma": GEMMA, "gpt": GPT2, "mixtral": MIXTRAL, "qwen_moe": QWEN_MOE, "peft": PEFT}


def naming_of(model) -> str:
    """Which names a built-in decoder's checkpoint uses: GPT-2's, Llama's, Gemma's where it has sandwich norms; with
    experts Mixtral's, or where it has Qwen's or OLMoE's marks (q/k norms, q/k/v biases, shared experts) theirs."""
    if getattr(model, "moe", None) is not None:
        return "qwen_moe" if model.qk_norm or model.qkv_bias or model.moe.shared_hidden else "mixtral"
    return "gemma" if getattr(model, "sandwich_norms", False) else model.name


def stacked_layers(model) -> dict[str, tuple[int, ...]]:
    """Which of the checkpoint's layers each stack holds, in order, where a decoder keeps its dense layers apart from
    its expert layers (model.moe.dense_layers_first, interleave); {}: one stack, every layer in order."""
    moe = getattr(model, "moe", None)
    order = None if moe is None else interleaving_of(model.layers, moe.layers_with_experts(model.layers))
    return {} if order is None else {BLOCKS: order.second, DENSE_BLOCKS: order.first}


def checkpoint_layer(layers: dict[str, tuple[int, ...]], stack: str, index: int) -> int:
    """The checkpoint's number of the layer at `index` of `stack` (stacked_layers' `layers`)."""
    return layers[stack][index] if stack in layers else index


def tensor_of(naming: str, path: tuple[str, ...]) -> Tensor:
    """The checkpoint tensor of the parameter at `path` (its keys in the params dict), in `naming`'s names."""
    return BY_NAMING[naming][path]
