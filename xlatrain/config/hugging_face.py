"""A Hugging Face checkpoint's config.json as model keys, and model keys as a config.json: the architecture of
model.init_from=hf:DIR (read before the config is validated, so that every check sees it) and of
`xlatrain export --hf`.

Read: Llama, Mistral, Qwen2, Qwen3, Gemma 2 and Gemma 3 (text) into model.name=llama, their sliding windows as
transformers 5 applies them (Mistral's on every layer; Qwen's on the layers `layer_types` names, by default those
from max_window_layers on, when use_sliding_window is set; Gemma's on its local layers); GPT-2 into model.name=gpt.
RoPE's settings come as transformers 5 writes them (`rope_parameters`) or as earlier versions did (`rope_theta`,
`rope_scaling`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from xlatrain.config.base import expanded
from xlatrain.config.model import HUGGING_FACE_PREFIX, RopeScaling
from xlatrain.errors import UserError, first_line

MOE_ARCHITECTURES = {"mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3", "olmoe": "llama"}
"""The Mixture-of-Experts families: each is its dense sibling's attention with experts in the MLP's place."""
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama", "gemma2": "llama",
                 "gemma3_text": "llama", "gpt2": "gpt", **{family: "llama" for family in MOE_ARCHITECTURES}}
LATENT_ATTENTION = ("deepseek_v2", "deepseek_v3", "kimi_k2")
"""Families whose attention is DeepSeek's multi-head latent attention, which is not built."""
"""config.json's model_type -> the built-in model it loads into."""
ROPE_SCALINGS = ("linear", "llama3")
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
"""GPT-2's tanh-approximated GELU, which the built-in GPT computes (jax.nn.gelu's default)."""


def checkpoint_directory(init_from: str) -> Path:
    return Path(expanded(init_from[len(HUGGING_FACE_PREFIX):]))


def read_config_json(directory: Path, named: str, otherwise: str = "") -> dict:
    """`otherwise`: what else the user may do when there is no config.json, ending the message."""
    path = directory / "config.json"
    if not path.is_file():
        raise UserError(f"{named}: {str(directory)!r} holds no config.json; give the directory of a local Hugging "
                        f"Face checkpoint (config.json and *.safetensors){otherwise}")
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{named}: {str(path)!r} is not a JSON file ({first_line(err)})") from None
    if not isinstance(found, dict):
        raise UserError(f"{named}: {str(path)!r} is not a JSON object")
    return found


def architecture(hf: dict, named: str) -> dict[str, Any]:
    """The model keys (model.name among them) of a checkpoint's config.json."""
    model_type = hf.get("model_type")
    if model_type == "gemma3":
        raise UserError(f"{named}: config.json is Gemma3ForConditionalGeneration's (Gemma 3 4B and larger: a vision "
                        "tower beside the language model, whose weights sit under language_model), which xlatrain "
                        "does not load; it loads the text-only Gemma3ForCausalLM checkpoints (model_type "
                        "gemma3_text: Gemma 3 270M and 1B)")
    if model_type in LATENT_ATTENTION:
        raise UserError(f"{named}: config.json has model_type={model_type!r}, whose attention is DeepSeek's "
                        "multi-head latent attention (compressed keys and values), which xlatrain does not build; its "
                        "MoE layers are (model.moe with score=sigmoid and bias_rate)")
    if model_type not in ARCHITECTURES:
        raise UserError(f"{named}: config.json has model_type={model_type!r}, which xlatrain does not load; it loads "
                        f"{', '.join(ARCHITECTURES)}")
    try:
        if model_type in MOE_ARCHITECTURES:
            return _moe(hf, model_type, named)
        read = {"gpt2": _gpt2, "gemma2": _gemma2, "gemma3_text": _gemma3}.get(model_type)
        return read(hf, named) if read else _llama(hf, model_type, named)
    except KeyError as err:
        raise UserError(f"{named}: config.json lacks {err.args[0]!r}, which a {model_type} checkpoint has") from None


def _llama(hf: dict, model_type: str, named: str) -> dict[str, Any]:
    if hf.get("mlp_bias"):
        raise UserError(f"{named}: config.json sets mlp_bias=true: the SwiGLU MLP here has no biases")
    if hf.get("hidden_act", "silu") != "silu":
        raise UserError(f"{named}: config.json sets hidden_act={hf['hidden_act']!r}; the Llama MLP here is SwiGLU "
                        "(silu)")
    attention_bias = bool(hf.get("attention_bias", False))
    keys = {**_llama_shape(hf, tied=False), "qkv_bias": (model_type == "qwen2" and hf.get("qkv_bias", True)) or
            attention_bias,
            "out_bias": attention_bias, "qk_norm": "head" if model_type == "qwen3" else None}
    return {**keys, **_rope(hf, named), **_windows(hf, model_type, named)}


MOE_TOP_K = {"mixtral": 2, "qwen2_moe": 4, "qwen3_moe": 8, "olmoe": 8}
"""num_experts_per_tok where a config.json leaves it out (transformers' defaults)."""


def _moe(hf: dict, model_type: str, named: str) -> dict[str, Any]:
    """Mixtral (Mistral's attention), Qwen2-MoE (Qwen2's, a gated shared expert), Qwen3-MoE (Qwen3's) and OLMoE
    (q/k norms over the projection, clip_qkv): routed experts in every layer's MLP, or (Qwen's mlp_only_layers and
    decoder_sparse_step) in every decoder_sparse_step-th after the first dense ones."""
    dense = list(hf.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))):
        raise UserError(f"{named}: config.json's mlp_only_layers={dense} are not the first layers; model.moe keeps "
                        "the MLP in the first model.moe.dense_layers_first layers and those model.moe.interleave "
                        "leaves")
    if hf.get("router_jitter_noise"):
        raise UserError(f"{named}: config.json sets router_jitter_noise={hf['router_jitter_noise']}, which the router "
                        "here does not draw; set it to 0 in config.json")
    experts = hf.get("num_local_experts") or hf.get("num_experts")
    if not experts:
        raise KeyError("num_experts")
    keys = _llama(hf, MOE_ARCHITECTURES[model_type], named)
    if model_type == "olmoe":
        keys.update(qk_norm="projection", clip_qkv=hf.get("clip_qkv"))
    shared = hf.get("shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0
    moe = {"experts": experts, "top_k": hf.get("num_experts_per_tok", MOE_TOP_K[model_type]),
           "expert_hidden": hf["intermediate_size"] if model_type in ("mixtral", "olmoe") else
           hf["moe_intermediate_size"], "shared_hidden": shared, "shared_gate": bool(shared),
           "normalise": True if model_type == "mixtral" else bool(hf.get("norm_topk_prob", False)),
           "aux_loss_weight": float(hf.get("router_aux_loss_coef", 0.01 if model_type == "olmoe" else 0.001)),
           "dense_layers_first": len(dense), "interleave": hf.get("decoder_sparse_step") or 1}
    return {**keys, "moe": moe}


def _llama_shape(hf: dict, tied: bool, head_dim: int | None = None) -> dict[str, Any]:
    """The keys every Llama-style config.json gives alike (`tied`, `head_dim`: the family's defaults)."""
    heads = hf["num_attention_heads"]
    return {"name": "llama", "layers": hf["num_hidden_layers"], "width": hf["hidden_size"], "heads": heads,
            "kv_heads": hf.get("num_key_value_heads") or heads,
            "head_dim": hf.get("head_dim") or head_dim or hf["hidden_size"] // heads,
            "mlp_hidden": hf["intermediate_size"], "vocab": hf["vocab_size"], "max_len": hf["max_position_embeddings"],
            "norm_eps": hf["rms_norm_eps"], "tie_embeddings": bool(hf.get("tie_word_embeddings", tied))}


HF_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}


def _check_layer_types(types: list, layers: int, named: str) -> None:
    unknown = sorted({str(kind) for kind in types if kind not in HF_LAYER_TYPES})
    if unknown or len(types) != layers:
        raise UserError(f"{named}: config.json's layer_types ({len(types)} of them) must name each of its {layers} "
                        "layers full_attention or sliding_attention" +
                        (f"; {', '.join(unknown)} is not built" if unknown else ""))


GEMMA_DEFAULTS = {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096}
"""What Gemma2Config and Gemma3TextConfig take where a config.json leaves it out."""
GEMMA2_DEFAULTS = {**GEMMA_DEFAULTS, "sliding_window_pattern": 2, "rope_theta": 10_000.0,
                   "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
GEMMA3_DEFAULTS = {**GEMMA_DEFAULTS, "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
                   "rope_local_base_freq": 10_000.0, "attn_logit_softcapping": None, "final_logit_softcapping": None}


def _gemma(hf: dict, named: str, defaults: dict) -> dict[str, Any]:
    """What Gemma 2 and 3 share: the Llama layout with (1 + scale) RMSNorms before and after attention and the MLP,
    a GeGLU MLP, embeddings scaled by sqrt(width), scores scaled by query_pre_attn_scalar and soft-capped where the
    config says, and local sliding-window layers interleaved with global ones."""
    if hf.get("use_bidirectional_attention"):
        raise UserError(f"{named}: config.json sets use_bidirectional_attention=true: the decoders here are causal")
    if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise UserError(f"{named}: config.json sets hidden_activation={hf['hidden_activation']!r}; the Gemma MLP "
                        "here is GeGLU with the tanh GELU (gelu_pytorch_tanh)")
    layers = hf["num_hidden_layers"]
    pattern = hf.get("sliding_window_pattern") or defaults["sliding_window_pattern"]
    types = hf.get("layer_types") or ["sliding_attention" if (layer + 1) % pattern else "full_attention"
                                      for layer in range(layers)]
    _check_layer_types(types, layers, named)
    sliding = "sliding_attention" in types
    attention_bias = bool(hf.get("attention_bias", False))
    caps = {ours: hf.get(theirs, defaults[theirs]) for ours, theirs in (("attn_softcap", "attn_logit_softcapping"),
                                                                         ("logit_softcap", "final_logit_softcapping"))}
    return {**_llama_shape(hf, tied=True, head_dim=defaults["head_dim"]),
            "qkv_bias": attention_bias, "out_bias": attention_bias, "mlp_activation": "gelu_tanh",
            "norm_plus_one": True, "sandwich_norms": True, "embed_scale": True,
            "score_scale_dim": int(hf.get("query_pre_attn_scalar", defaults["query_pre_attn_scalar"])),
            "sliding_window": int(hf.get("sliding_window", defaults["sliding_window"])) if sliding else None,
            "layer_types": [HF_LAYER_TYPES[kind] for kind in types] if sliding else None,
            **{key: None if cap is None else float(cap) for key, cap in caps.items()}}


def _gemma2(hf: dict, named: str) -> dict[str, Any]:
    """Gemma 2: one RoPE for every layer, no q/k norms, a window on every other layer, soft-capping (50, 30)."""
    rope = _rope({"rope_parameters": hf.get("rope_parameters") or {
        **(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", GEMMA2_DEFAULTS["rope_theta"])}}, named)
    return {**_gemma(hf, named, GEMMA2_DEFAULTS), **rope, "qk_norm": None, "rope_theta_sliding": None}


def _gemma3(hf: dict, named: str) -> dict[str, Any]:
    """Gemma 3's text model: Gemma's layers with q/k norms per head, each kind of layer its RoPE (the global
    layers' base and scaling, the local layers' base), as transformers 5's rope_parameters[layer_type] or earlier
    versions' rope_theta, rope_scaling and rope_local_base_freq say."""
    by_kind = hf.get("rope_parameters") or {}
    if not isinstance(by_kind.get("full_attention"), dict):  # earlier versions' keys
        by_kind = {"full_attention": {**(hf.get("rope_scaling") or {}),
                                      "rope_theta": hf.get("rope_theta", GEMMA3_DEFAULTS["rope_theta"])},
                   "sliding_attention": {"rope_type": "default", "rope_theta": hf.get(
                       "rope_local_base_freq", GEMMA3_DEFAULTS["rope_local_base_freq"])}}
    local = by_kind.get("sliding_attention") or {}
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise UserError(f"{named}: config.json scales the sliding layers' RoPE ({local}); only the global layers' "
                        "RoPE scaling is built")
    keys = _gemma(hf, named, GEMMA3_DEFAULTS)
    return {**keys, **_rope({"rope_parameters": by_kind["full_attention"]}, named), "qk_norm": "head",
            "rope_theta_sliding": float(local.get("rope_theta", GEMMA3_DEFAULTS["rope_local_base_freq"]))
            if keys["sliding_window"] is not None else None}


def _windows(hf: dict, model_type: str, named: str) -> dict[str, Any]:
    """model.sliding_window and model.layer_types as transformers 5 reads a config.json: Mistral's window on every
    layer (layer_types are Ministral's, not Mistral's); Qwen's with use_sliding_window, on the layers layer_types
    names sliding_attention, or by default those from max_window_layers on."""
    layers = hf["num_hidden_layers"]
    window = hf.get("sliding_window") if model_type == "mistral" or hf.get("use_sliding_window") else None
    types = hf.get("layer_types") if model_type != "mistral" else None
    if types is not None:
        _check_layer_types(types, layers, named)
    if window is None:
        return {"sliding_window": None, "layer_types": None}
    if types is None:
        first = 0 if model_type == "mistral" else hf.get("max_window_layers", layers)
        types = ["sliding_attention" if layer >= first else "full_attention" for layer in range(layers)]
    ours = [HF_LAYER_TYPES[kind] for kind in types]
    return {"sliding_window": int(window), "layer_types": None if set(ours) == {"sliding"} else ours}


def _rope(hf: dict, named: str) -> dict[str, Any]:
    parameters = hf.get("rope_parameters") or {**(hf.get("rope_scaling") or {}),
                                                "rope_theta": hf.get("rope_theta", 10000.0)}
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    keys: dict[str, Any] = {"rope_theta": float(parameters.get("rope_theta", 10000.0)), "rope_scaling": None}
    if kind == "default":
        return keys
    if kind not in ROPE_SCALINGS:
        raise UserError(f"{named}: config.json's RoPE scaling {kind!r} is not built; xlatrain has "
                        f"{', '.join(ROPE_SCALINGS)}")
    scaling = {"type": kind, "factor": float(parameters["factor"])}
    if kind == "llama3":
        scaling.update(low_freq_factor=float(parameters["low_freq_factor"]),
                       high_freq_factor=float(parameters["high_freq_factor"]),
                       original_max_len=int(parameters["original_max_position_embeddings"]))
    return {**keys, "rope_scaling": scaling}


def _gpt2(hf: dict, named: str) -> dict[str, Any]:
    activation = hf.get("activation_function", "gelu_new")
    if activation not in GPT2_ACTIVATIONS:
        raise UserError(f"{named}: config.json sets activation_function={activation!r}; the GPT here computes "
                        f"{' / '.join(GPT2_ACTIVATIONS)}")
    for unbuilt in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if hf.get(unbuilt):
            raise UserError(f"{named}: config.json sets {unbuilt}=true, which the GPT here does not compute")
    if hf.get("scale_attn_weights") is False:
        raise UserError(f"{named}: config.json sets scale_attn_weights=false; the GPT here scales attention by "
                        "1/sqrt(head width)")
    width = hf["n_embd"]
    inner = hf.get("n_inner") or 4 * width
    if inner % width:
        raise UserError(f"{named}: config.json sets n_inner={inner}, not a multiple of n_embd={width} (model."
                        "mlp_ratio is a whole number)")
    return {"name": "gpt", "layers": hf["n_layer"], "width": width, "heads": hf["n_head"],
            "mlp_ratio": inner // width, "vocab": hf["vocab_size"], "max_len": hf["n_positions"],
            "norm_eps": hf.get("layer_norm_epsilon", 1e-5), "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
            "head_bias": False}


def with_checkpoint_architecture(model: dict) -> dict:
    """The model section of a config that names model.init_from=hf:DIR, completed from DIR's config.json; a key
    the config sets to another value than the checkpoint's is an error naming both."""
    init_from = model.get("init_from")
    if not (isinstance(init_from, str) and init_from.startswith(HUGGING_FACE_PREFIX)):
        return model
    named = f"model.init_from={init_from!r}"
    found = architecture(read_config_json(checkpoint_directory(init_from), named, otherwise=", or resume a run that "
                                          "started from one with model.init_from=null"), named)
    for key, value in _flat(found).items():
        given = _flat(model).get(key, value)
        if key not in TRAINING_DEFAULTS and _comparable(key, given) != _comparable(key, value):
            raise UserError(f"config: model.{key}={given!r} disagrees with {named} ({value!r} there); drop "
                            f"model.{key} or set it to {value!r}")
    moe = found.get("moe")
    given_moe = model.get("moe") if isinstance(model.get("moe"), dict) else {}
    return {**model, **found, **({"moe": {**moe, **given_moe}} if moe else {})}


TRAINING_DEFAULTS = ("moe.aux_loss_weight",)
"""What a checkpoint's config.json suggests for training (router_aux_loss_coef), which a config may set otherwise."""


def _flat(model: dict) -> dict[str, Any]:
    """The model keys with model.moe's as moe.KEY (a config may set some of them beside a checkpoint's)."""
    moe = model.get("moe")
    inner = {f"moe.{key}": value for key, value in moe.items()} if isinstance(moe, dict) else {}
    return {**{key: value for key, value in model.items() if key != "moe" or not inner}, **inner}


def _comparable(key: str, value: Any) -> Any:
    """A model key's value as the schema reads it: 8 is 8.0, and a RoPE scaling is compared with its defaults
    filled in (a run's saved config.yaml holds them all; a checkpoint's config.json only those of its kind)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if key == "rope_scaling" and isinstance(value, dict):
        try:
            return RopeScaling.model_validate(value).model_dump()
        except ValidationError:
            return value  # refused with the rest of the config
    return value


def hugging_face_config(model: Any, vocab: int, max_len: int) -> dict[str, Any]:
    """config.json of a trained gpt or llama model (its resolved vocabulary and context), for `export --hf`."""
    if model.name == "gpt":
        if model.head_bias:
            raise UserError("export --hf: this GPT's head has a bias (model.head_bias=true), which GPT-2's lm_head "
                            "has not; export runs trained with model.head_bias=false")
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": model.layers,
                "n_embd": model.width, "n_head": model.heads, "n_inner": model.mlp_ratio * model.width,
                "n_positions": max_len, "vocab_size": vocab, "layer_norm_epsilon": model.norm_eps,
                "activation_function": "gelu_new", "tie_word_embeddings": model.tie_embeddings,
                "resid_pdrop": model.dropout, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    if model.out_bias and not model.qkv_bias:
        raise UserError("export --hf: model.out_bias=true with model.qkv_bias=false has no Hugging Face "
                        "architecture (Llama's attention_bias sets both, Qwen2 biases q, k and v only)")
    if model.moe is not None:
        return _moe_config(model, vocab, max_len)
    if model.clip_qkv is not None:
        raise UserError("export --hf: model.clip_qkv is OLMoE's, a Mixture of Experts; no dense Hugging Face family "
                        "clips q, k and v")
    gemma_marks = {"model.norm_plus_one=true": model.norm_plus_one, "model.sandwich_norms=true": model.sandwich_norms,
                   "model.embed_scale=true": model.embed_scale,
                   "model.mlp_activation=gelu_tanh": model.mlp_activation == "gelu_tanh",
                   "model.qkv_bias=model.out_bias": model.qkv_bias == model.out_bias}
    if model.sandwich_norms or model.norm_plus_one or model.embed_scale or model.mlp_activation == "gelu_tanh":
        missing = [key for key, present in gemma_marks.items() if not present]
        if missing:
            raise UserError(f"export --hf: Gemma 2 and 3 are the Hugging Face families with Gemma's layers, and they "
                            f"have {', '.join(missing)} too; this model has not, so no family takes it")
        return _gemma_config(model, vocab, max_len)
    gemma_only = {"score_scale_dim": model.score_scale_dim, "rope_theta_sliding": model.rope_theta_sliding,
                  "attn_softcap": model.attn_softcap, "logit_softcap": model.logit_softcap}
    for key, value in gemma_only.items():
        if value is not None:
            raise UserError(f"export --hf: model.{key}={value} is Gemma's, whose other marks (model.sandwich_norms, "
                            "norm_plus_one, embed_scale, mlp_activation=gelu_tanh) this model lacks: no Hugging Face "
                            "family takes it")
    if model.qk_norm == "projection":
        raise UserError("export --hf: model.qk_norm=projection (queries and keys normalised over the whole projection) "
                        "has no dense Hugging Face architecture of this layout; model.qk_norm=head exports as Qwen3")
    if model.qk_norm == "head" and model.qkv_bias != model.out_bias:
        raise UserError("export --hf: model.qk_norm=head exports as Qwen3, whose attention_bias sets the q, k, v and "
                        "output biases together; set model.qkv_bias and model.out_bias alike")
    qwen2 = model.qkv_bias and not model.out_bias
    rope = _rope_parameters(model)
    found = {"model_type": "qwen2" if qwen2 else "llama",
             "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
             **_llama_shape_json(model, vocab, max_len), "hidden_act": "silu", "rope_parameters": rope,
             "rope_theta": model.rope_theta}
    if model.rope_scaling is not None:
        found["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    windows = model.layer_windows()
    if model.qk_norm == "head":
        return {**found, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
                "attention_bias": model.qkv_bias, **_qwen_windows(windows, model.sliding_window)}
    if qwen2:
        return {**found, **_qwen_windows(windows, model.sliding_window)}
    llama = {**found, "attention_bias": model.qkv_bias, "mlp_bias": False}
    if any(window is not None for window in windows):
        if None in windows or model.qkv_bias:
            raise UserError("export --hf: sliding-window layers in a model without Qwen's q, k and v biases or q/k "
                            "norms export as Mistral, which windows every layer with no biases; set every layer "
                            "sliding, or model.qkv_bias=true (Qwen2) or model.qk_norm=head (Qwen3)")
        return {**llama, "model_type": "mistral", "architectures": ["MistralForCausalLM"],
                "sliding_window": model.sliding_window}
    return llama


def _moe_config(model: Any, vocab: int, max_len: int) -> dict[str, Any]:
    """The family of an MoE model by its attention's marks: OLMoE (q/k norms over the projection), Qwen2-MoE (q, k, v
    biases and a gated shared expert), Qwen3-MoE (q/k norms per head), Mixtral (none of them)."""
    moe = model.moe
    unbuilt = {"model.moe.score=sigmoid": moe.score == "sigmoid", "model.moe.bias_rate": moe.bias_rate is not None,
               "Gemma's layers": model.sandwich_norms or model.norm_plus_one or model.embed_scale,
               "model.out_bias=true": model.out_bias}
    for what, present in unbuilt.items():
        if present:
            raise UserError(f"export --hf: {what} has no Hugging Face MoE family here (Mixtral, Qwen2-MoE, Qwen3-MoE, "
                            "OLMoE: softmax routers without a bias, Llama's layers)")
    family = ("olmoe" if model.qk_norm == "projection" else "qwen2_moe" if model.qkv_bias or moe.shared_hidden else
              "qwen3_moe" if model.qk_norm == "head" else "mixtral")
    wants = {"olmoe": {"no shared experts": not moe.shared_hidden, "no q, k, v biases": not model.qkv_bias},
             "qwen2_moe": {"q, k, v biases (model.qkv_bias)": model.qkv_bias, "no q/k norms": model.qk_norm is None,
                           "a gated shared expert (model.moe.shared_hidden, shared_gate)": moe.shared_gate},
             "qwen3_moe": {"no shared experts": not moe.shared_hidden},
             "mixtral": {"normalised top-k weights (model.moe.normalise)": moe.normalise}}[family]
    missing = [what for what, present in wants.items() if not present]
    if missing:
        raise UserError(f"export --hf: this MoE model exports as {family}, which has {', '.join(missing)}; this "
                        "model has not")
    if family in ("mixtral", "olmoe") and len(moe.layers_with_experts(model.layers)) < model.layers:
        raise UserError(f"export --hf: {family} has experts in every layer, and model.moe.dense_layers_first="
                        f"{moe.dense_layers_first}, interleave={moe.interleave} keep the MLP in some (Qwen's families "
                        "have such layers: model.qk_norm=head, or q, k, v biases)")
    if model.clip_qkv is not None and family != "olmoe":
        raise UserError("export --hf: model.clip_qkv is OLMoE's (q/k norms over the projection: model.qk_norm="
                        "projection)")
    found = {"model_type": family, "architectures": [MOE_CLASSES[family]],
             **_llama_shape_json(model, vocab, max_len), "hidden_act": "silu", "rope_parameters": _rope_parameters(
                 model), "rope_theta": model.rope_theta, "num_local_experts": moe.experts, "num_experts": moe.experts,
             "num_experts_per_tok": moe.top_k, "router_aux_loss_coef": moe.aux_loss_weight,
             "output_router_logits": False}
    windows = model.layer_windows()
    hidden = moe.hidden_of(model.mlp_width())
    if family == "mixtral":
        if any(window != windows[0] for window in windows):
            raise UserError("export --hf: Mixtral windows every layer or none; set model.layer_types to one type")
        return {**found, "intermediate_size": hidden, "sliding_window": windows[0]}
    if any(window is not None for window in windows) and family == "olmoe":
        raise UserError("export --hf: OLMoE has no sliding-window layers; drop model.sliding_window")
    found.update(norm_topk_prob=moe.normalise, moe_intermediate_size=hidden)
    if family == "olmoe":
        return {**found, "intermediate_size": hidden, "clip_qkv": model.clip_qkv, "attention_bias": False}
    found.update(decoder_sparse_step=moe.interleave, mlp_only_layers=list(range(moe.dense_layers_first)),
                 **_qwen_windows(windows, model.sliding_window))
    if family == "qwen3_moe":
        return {**found, "attention_bias": False}
    return {**found, "qkv_bias": True, "shared_expert_intermediate_size": moe.shared_hidden}


MOE_CLASSES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
               "olmoe": "OlmoeForCausalLM"}


def _rope_parameters(model: Any) -> dict[str, Any]:
    """model.rope_theta and model.rope_scaling as transformers 5's rope_parameters."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": model.rope_theta}
    if model.rope_scaling is not None:
        scaling = model.rope_scaling
        rope = {**rope, "rope_type": scaling.type, "factor": scaling.factor}
        if scaling.type == "llama3":
            rope.update(low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor,
                        original_max_position_embeddings=scaling.original_max_len)
    return rope


def _llama_shape_json(model: Any, vocab: int, max_len: int) -> dict[str, Any]:
    """The keys of _llama_shape, back as config.json has them."""
    return {"num_hidden_layers": model.layers, "hidden_size": model.width, "num_attention_heads": model.heads,
            "num_key_value_heads": model.kv_head_count(), "head_dim": model.head_width(),
            "intermediate_size": model.mlp_width(), "vocab_size": vocab, "max_position_embeddings": max_len,
            "rms_norm_eps": model.norm_eps, "tie_word_embeddings": model.tie_embeddings}


def _gemma_config(model: Any, vocab: int, max_len: int) -> dict[str, Any]:
    """Gemma3ForCausalLM's config.json (q/k norms), its RoPE per kind of layer in transformers 5's form, or
    Gemma2ForCausalLM's (none; one RoPE)."""
    types = ["full_attention" if window is None else "sliding_attention" for window in model.layer_windows()]
    shared = {**_llama_shape_json(model, vocab, max_len), "hidden_activation": "gelu_pytorch_tanh",
              "query_pre_attn_scalar": model.score_scale_dim or model.head_width(), "attention_bias": model.qkv_bias,
              "sliding_window": model.sliding_window, "layer_types": types,
              "attn_logit_softcapping": model.attn_softcap, "final_logit_softcapping": model.logit_softcap}
    if model.qk_norm is None:
        if model.rope_theta_sliding is not None:
            raise UserError("export --hf: Gemma 2 (Gemma's layers without q/k norms) has one RoPE for every layer; "
                            "drop model.rope_theta_sliding, or set model.qk_norm=head (Gemma 3)")
        return {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], **shared,
                "rope_parameters": _rope_parameters(model)}
    if model.qk_norm != "head":
        raise UserError("export --hf: Gemma 3 normalises queries and keys per head; set model.qk_norm=head")
    local = {"rope_type": "default", "rope_theta": model.rope_theta_sliding or model.rope_theta}
    if model.rope_theta_sliding is None and model.rope_scaling is not None and "sliding_attention" in types:
        raise UserError("export --hf: Gemma 3 scales only its global layers' RoPE, and this model scales its sliding "
                        "layers' too (model.rope_scaling without model.rope_theta_sliding)")
    return {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], **shared,
            "rope_parameters": {"full_attention": _rope_parameters(model), "sliding_attention": local}}


def _qwen_windows(windows: tuple[int | None, ...], window: int | None) -> dict[str, Any]:
    """Qwen2's and Qwen3's config keys for the layers' windows: layer_types, as transformers 5 writes them."""
    types = ["full_attention" if layer_window is None else "sliding_attention" for layer_window in windows]
    return {"use_sliding_window": "sliding_attention" in types, "sliding_window": window, "layer_types": types,
            "max_window_layers": types.index("sliding_attention") if "sliding_attention" in types else len(types)}
