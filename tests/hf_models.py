"""Tiny Hugging Face causal language models that `transformers` creates here (no hub), saved as local checkpoint
directories: the references of tests/test_llama.py and tests/test_hugging_face.py."""

from pathlib import Path

import numpy as np

VOCAB = 320
"""More than the bytes' 256, so that a checkpoint's vocabulary is never the data's by accident."""

ARCHITECTURES = {
    # grouped-query attention, untied head, a RoPE base of its own
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, rope_theta=500.0)),
    # multi-query attention with q/k/v biases, tied embeddings
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=None)),
    # sliding windows shorter than the sequence: Mistral's on every layer, Qwen's on the layers from
    # max_window_layers on (here the second of two), Qwen3's with its q/k norms
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=4)),
    "qwen2-window": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=1, use_sliding_window=True,
                                                            sliding_window=4, max_window_layers=1)),
    "qwen3-window": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=32, attention_bias=True,
                                                            use_sliding_window=True, sliding_window=5,
                                                            max_window_layers=1)),
    # queries and keys normalised per head before RoPE, heads wider than hidden_size / heads, an untied head
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)),
    # Llama 3's frequency-dependent RoPE scaling, with biases on every attention projection
    # Gemma 3's text model: a local layer (window 4, RoPE base 10000) then a global one (base 1e6, linearly
    # scaled), scores scaled by query_pre_attn_scalar (not the head width), attention biases, a tied head
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=4, attention_bias=True,
        layer_types=["sliding_attention", "full_attention"], rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})),
    # Gemma 2: every other layer local (window 4), one RoPE, soft caps small enough to bend these scores and logits
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=4, attn_logit_softcapping=0.5,
        final_logit_softcapping=0.5)),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, attention_bias=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32})),
    "linear-rope": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=4, rope_scaling={
        "rope_type": "linear", "factor": 2.0})),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4, n_positions=128)),
    # Mixture-of-Experts families, 4 experts each: Mixtral (top-2, normalised), Qwen3-MoE (q/k norms per head,
    # top-2 of narrower experts, normalised), OLMoE (q/k norms over the projection, clip_qkv low enough to clip,
    # top-2 unnormalised), Qwen2-MoE (q/k/v biases, a gated shared expert, top-3 unnormalised)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_key_value_heads=2, num_local_experts=4,
                                                            num_experts_per_tok=2, sliding_window=None)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
                                                      clip_qkv=0.5, pad_token_id=0, eos_token_id=1, bos_token_id=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=3, moe_intermediate_size=48,
        shared_expert_intermediate_size=80)),
}


def hugging_face_model(kind: str, seed: int = 0, **overrides):
    """A transformers model of `kind` (ARCHITECTURES) in eval mode, with weights perturbed away from their
    initialisation (zero biases, unit norms) so that every tensor's place in the layout matters."""
    import torch
    import transformers

    config_class, model_class, settings = ARCHITECTURES[kind]
    shape = {} if kind == "gpt2" else dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                           num_attention_heads=4, max_position_embeddings=128)
    config = getattr(transformers, config_class)(**{"vocab_size": VOCAB, **shape, **settings, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    return model.eval()


def made_once(tmp_path_factory):
    """kind -> (the transformers model, its checkpoint directory), each made once: a module's `checkpoints`."""
    made = {}

    def checkpoint(kind: str):
        if kind not in made:
            model = hugging_face_model(kind)
            made[kind] = model, saved(model, tmp_path_factory.mktemp(kind))
        return made[kind]

    return checkpoint


def saved(model, directory: Path, **save_options) -> Path:
    model.save_pretrained(directory, **save_options)
    return directory


def logits_of(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()
