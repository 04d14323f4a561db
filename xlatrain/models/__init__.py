"""Flax models from config: the built-in MLP, CNN, GPT and Llama, or a user's own nnx.Module (a user's torch nn.Module
comes through xlatrain/torch_bridge/)."""

import inspect
from typing import Callable

import jax.numpy as jnp
from flax import nnx

from xlatrain.config import (
    DECODERS,
    CNNConfig,
    CustomModelConfig,
    DecoderConfig,
    GPTConfig,
    LlamaConfig,
    MLPConfig,
    ModelConfig,
)
from xlatrain.data.spec import DataSpec
from xlatrain.data.tokenizers import rounded_vocab
from xlatrain.errors import UserError, first_line
from xlatrain.models.blocks import BlockStack, stack_blocks
from xlatrain.models.cnn import CNN
from xlatrain.models.experts import MoEShape, RouterBalance
from xlatrain.models.flax_module import flax_model, takes_rngs
from xlatrain.models.gpt import GPT, GPTShape
from xlatrain.models.interface import ModelDef
from xlatrain.models.llama import Llama, LlamaShape
from xlatrain.models.lora import LoRAShape
from xlatrain.models.mlp import MLP
from xlatrain.models.targets import check_kwargs, import_target
from xlatrain.runtime.platform import lowering_platform

__all__ = ["BlockStack", "ModelDef", "flax_model", "model_factory", "stack_blocks", "takes_rngs"]


def model_factory(config: ModelConfig, spec: DataSpec, compute_dtype: jnp.dtype = jnp.float32,
                  scan_layers: bool | None = None, formulation: str | None = None) -> Callable[[nnx.Rngs], nnx.Module]:
    """A function rngs -> module, so the caller decides where (abstractly, or under jit) it runs.
    `scan_layers`: a decoder's model.scan_layers as resolved for the run's devices (None: for jax's default
    backend). `formulation`: the MoE experts' matmuls, in place of model.moe.formulation (a FLOP count traces
    `sorted`, which computes only the chosen experts)."""
    if isinstance(config, MLPConfig):
        features = 1
        for size in spec.input_shape:
            features *= size
        return lambda rngs: MLP(features, config.hidden, spec.num_outputs, config.dropout, rngs=rngs)
    if isinstance(config, CNNConfig):
        return lambda rngs: CNN(spec.input_shape, config.channels, config.hidden, spec.num_outputs, rngs=rngs)
    if isinstance(config, DECODERS):
        vocab, max_len = decoder_sizes(config, spec)
        scan = config.scans_layers(lowering_platform()) if scan_layers is None else scan_layers
        common = dict(layers=config.layers, width=config.width, heads=config.heads, vocab=vocab,
                      dropout=config.dropout, scan_layers=scan, dtype=jnp.dtype(compute_dtype),
                      tie_embeddings=config.tie_embeddings, norm_eps=config.norm_eps)
        if isinstance(config, GPTConfig):
            shape = GPTShape(**common, mlp_ratio=config.mlp_ratio, max_len=max_len, head_bias=config.head_bias)
            return lambda rngs: GPT(shape, rngs=rngs)
        scaling = None if config.rope_scaling is None else tuple(config.rope_scaling.model_dump().items())
        llama = LlamaShape(**common, kv_heads=config.kv_head_count(), head_dim=config.head_width(),
                           mlp_hidden=config.mlp_width(), rope_theta=config.rope_theta, rope_scaling=scaling,
                           qkv_bias=config.qkv_bias, out_bias=config.out_bias, qk_norm=config.qk_norm,
                           windows=config.layer_windows(), rope_theta_sliding=config.rope_theta_sliding,
                           mlp_activation=config.mlp_activation, norm_plus_one=config.norm_plus_one,
                           sandwich_norms=config.sandwich_norms, embed_scale=config.embed_scale,
                           score_scale_dim=config.score_scale_dim, attn_softcap=config.attn_softcap,
                           logit_softcap=config.logit_softcap, clip_qkv=config.clip_qkv,
                           moe=moe_shape(config, formulation),
                           moe_layers=() if config.moe is None else config.moe.layers_with_experts(config.layers),
                           lora=None if config.lora is None else LoRAShape(config.lora.rank, config.lora.alpha,
                                                                           config.lora.dropout, config.lora.targets))
        return lambda rngs: Llama(llama, rngs=rngs)
    if isinstance(config, CustomModelConfig):
        return _custom_factory(config)
    raise TypeError(f"model.name={config.name} is not a flax model")


MOE_FORMULATIONS = {"cpu": "blocked", "gpu": "dense"}
"""model.moe.formulation=auto per platform. CPU: the fastest of the four (bench/results/moe_routing.json: 0.21-0.26x
the sorted formulation's time at 8 experts, top-2, where padded takes 0.52-0.60x; 0.08x at 32, top-4), about the
chosen experts' FLOPs. GPUs, from the step compiled for an H100 (bench/results/moe_gpu_target.json): XLA:GPU
expands ragged_dot into dense products (sorted 5.3x the model's FLOPs), blocked's loop over the blocks launches
39,511 kernels moving 359 GB, and dense moves the fewest bytes of the rest (60 GB, 2.85x the FLOPs); other
platforms as GPUs."""


def moe_shape(config: LlamaConfig, formulation: str | None = None) -> MoEShape | None:
    moe = config.moe
    if moe is None:
        return None
    auto = MOE_FORMULATIONS.get(lowering_platform(), MOE_FORMULATIONS["gpu"])
    chosen = formulation or (auto if moe.formulation == "auto" else moe.formulation)
    return MoEShape(experts=moe.experts, top_k=moe.top_k, hidden=moe.hidden_of(config.mlp_width()),
                    shared_hidden=moe.shared_hidden, shared_gate=moe.shared_gate, score=moe.score,
                    normalise=moe.normalise, capacity_factor=moe.capacity_factor, formulation=chosen,
                    balancing_bias=moe.bias_rate is not None)


def router_balance(config: ModelConfig) -> RouterBalance | None:
    """What the step makes of an MoE model's router statistics (None for other models)."""
    moe = getattr(config, "moe", None)
    if moe is None:
        return None
    return RouterBalance(moe.aux_loss_weight, moe.z_loss_weight, moe.bias_rate, moe.layers_with_experts(config.layers))


def decoder_sizes(config: DecoderConfig, spec: DataSpec) -> tuple[int, int]:
    """(vocabulary, longest sequence) of a built-in decoder on this data."""
    vocab = config.vocab or rounded_vocab(spec.num_outputs, config.vocab_multiple)
    if spec.num_outputs > vocab:
        raise UserError(f"config: model.vocab={config.vocab} is smaller than the tokenizer's {spec.num_outputs} "
                        f"ids ({spec.origin}); raise model.vocab to at least {spec.num_outputs}, or leave it null")
    max_len = config.max_len or spec.input_shape[0]
    if spec.input_shape[0] > max_len:
        raise UserError(f"config: {spec.origin} has sequences of {spec.input_shape[0]} tokens, longer than "
                        f"model.max_len={max_len}; raise model.max_len or shorten the sequences")
    return vocab, max_len


def _custom_factory(config: CustomModelConfig) -> Callable[[nnx.Rngs], nnx.Module]:
    target = import_target(config.target)
    if not (isinstance(target, type) and issubclass(target, nnx.Module)):
        raise UserError(f"config: model.target={config.target!r} is not a flax.nnx.Module subclass")
    if "rngs" not in inspect.signature(target.__init__).parameters:
        raise UserError(f"config: model.target={config.target!r} must accept a keyword argument `rngs`")
    check_kwargs(config.target, config.kwargs, target.__init__, skip_self=True, supplied=("rngs",))

    def build(rngs: nnx.Rngs) -> nnx.Module:
        try:
            return target(**config.kwargs, rngs=rngs)
        except Exception as err:  # the user's constructor: a wrong kwarg value, a bug
            raise UserError(f"config: model.target={config.target!r} raised {type(err).__name__} when built with "
                            f"model.kwargs={config.kwargs}: {first_line(err)}") from None

    return build
