"""The `model` section: built-in models, a custom flax module, a torch module."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import Field, field_validator, model_validator

from xlatrain.config.base import DropoutRate, NonNegativeInt, PathText, PositiveInt, Strict, expanded


class ModelBase(Strict):
    """The model trained: a built-in one, your own flax module or a PyTorch module (docs/models.md)."""

    loss: Literal["cross_entropy", "mse"] = "cross_entropy"
    """cross_entropy: integer targets, logits on the last axis. mse: targets shaped like the output."""

    def named(self) -> str:
        """How an error names this model: a user's by its model.target, a built-in one by its model.name."""
        target = getattr(self, "target", None)
        return f"model.target={target!r}" if target else f"model.name={self.name}"


class MLPConfig(ModelBase):
    name: Literal["mlp"]
    """A multilayer perceptron over the flattened input."""
    hidden: tuple[PositiveInt, ...] = (128, 128)
    """Widths of the hidden layers."""
    dropout: DropoutRate = 0.0
    """Dropout rate while training."""


class CNNConfig(ModelBase):
    name: Literal["cnn"]
    """A small convolutional network over [height, width, channels] inputs."""
    channels: tuple[PositiveInt, ...] = (16, 32)
    """Channels of each convolution; the first keeps the resolution, later ones stride 2."""
    hidden: PositiveInt = 64
    """Width of the dense layer after the convolutions."""


CPU_UNROLLED_LAYERS = 16
GPU_UNROLLED_LAYERS = 48
"""Unrolled, GPT-2 small's step compiled for an H100 launches 0.42x the kernels and moves 0.51x the bytes of the
scanned one (the scan copies each layer's saved activations out of their stack), in 0.58x the memory; at 48 blocks
0.38x, 0.45x and 0.53x, compiled in 40-45 s against 10-13 s (bench/results/gpu_kernels.json)."""
HUGGING_FACE_PREFIX = "hf:"
"""model.init_from=hf:DIR: a local Hugging Face checkpoint directory (config.json and *.safetensors)."""


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
"""The projections LoRA adapts, by their short names (PEFT's q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
down_proj)."""


class LoRAConfig(Strict):
    """Low-rank adapters on the decoder's projections (PEFT's LoRA): each adapted projection W x becomes
    W x + (alpha / rank) B A dropout(x), W frozen and A, B trained (docs/finetuning.md)."""

    rank: PositiveInt = 8
    """The adapters' rank r (PEFT's r)."""
    alpha: float = Field(8.0, gt=0)
    """The adapters' scale is alpha / rank (PEFT's lora_alpha)."""
    dropout: DropoutRate = 0.0
    """Dropout on an adapter's input while training (PEFT's lora_dropout)."""
    targets: tuple[Literal["q", "k", "v", "o", "gate", "up", "down"], ...] = ("q", "v")
    """Which projections get adapters: q, k, v, o (attention's), gate, up, down (the MLP's). Default: PEFT's for
    Llama, q and v."""
    init_from: PathText | None = None
    """A PEFT adapter directory (adapter_config.json, adapter_model.safetensors) to start the adapters from; its
    rank and targets must be these. null: A drawn as PEFT draws it, B zero."""

    @field_validator("targets")
    @classmethod
    def _names_some(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError(f"names no projection; give some of {', '.join(LORA_TARGETS)}")
        if len(set(value)) < len(value):
            raise ValueError("names a projection twice")
        return value


class DPOConfig(Strict):
    """Direct preference optimisation (Rafailov et al.; TRL's DPOTrainer) on preference pairs (data prepare of
    preference records): the policy against a frozen reference, whose log-probabilities of every pair are computed
    once, at the run's start, from the weights it starts with (with model.lora: the base, its adapters off), as
    TRL's precompute_ref_log_probs (docs/finetuning.md)."""

    beta: float = Field(0.1, gt=0)
    """How far from the reference the policy may go (TRL's beta)."""
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: -log sigmoid(beta x the margin of log-ratios) (DPO); ipo: (the margin of the sequences' mean
    log-ratios - 1 / (2 beta))^2 (IPO, as TRL's loss_type=ipo)."""


class DecoderConfig(ModelBase):
    """What the built-in decoders (gpt, llama) share."""

    layers: PositiveInt = 4
    """Transformer blocks."""
    width: PositiveInt = 128
    """Model width."""
    heads: PositiveInt = 4
    """Attention (query) heads."""
    vocab: PositiveInt | None = None
    """Vocabulary size, at least the tokenizer's ids; null: the tokenizer's (256 for bytes) rounded up to
    model.vocab_multiple (with model.init_from=hf:DIR: the checkpoint's)."""
    vocab_multiple: PositiveInt = 64
    """With model.vocab null: the vocabulary is rounded up to a multiple of this (padding rows no id reads: a
    matmul-friendly size, and one that tensor-parallel splits divide)."""
    max_len: PositiveInt | None = None
    """Longest sequence (a GPT's positional table); null: data.seq_len (with model.init_from=hf:DIR: the
    checkpoint's max_position_embeddings / n_positions)."""
    dropout: DropoutRate = 0.0
    """Dropout rate while training (attention output, residual and MLP output dropout)."""
    tie_embeddings: bool = False
    """The output head reuses the token embedding table (transposed) instead of a matrix of its own."""
    norm_eps: float = Field(1e-6, gt=0)
    """Epsilon of the layer norms (GPT-2 checkpoints: 1e-5; RMSNorm of Llama checkpoints: 1e-5 or 1e-6)."""
    scan_layers: Literal["auto"] | bool = "auto"
    """`lax.scan` over the blocks (much faster compiles for deep models). auto: unroll up to 16 blocks on CPU, where
    the unrolled step runs faster, and up to 48 on GPUs, where it launches fewer kernels and moves about half the
    bytes (bench/README.md); scan beyond, and on other platforms. `xlatrain config` shows the choice as
    derived.scan_layers."""
    init_from: str | None = None
    """hf:DIR: start from a local Hugging Face checkpoint (config.json and *.safetensors, sharded or not): the
    architecture is read from its config.json; a model key set here that disagrees with it is an error."""
    lora: LoRAConfig | None = None
    """Low-rank adapters (LoRA) trained on a frozen model (model.name=llama); null: every parameter trains."""
    dpo: DPOConfig | None = None
    """Train on preference pairs with DPO's objective in place of the next-token loss; null: the next-token loss."""

    @field_validator("init_from", mode="before")
    @classmethod
    def _init_from_names_a_checkpoint_directory(cls, value: Any) -> Any:
        if value is None:
            return value
        if not (isinstance(value, str) and value.startswith(HUGGING_FACE_PREFIX)
                and len(value) > len(HUGGING_FACE_PREFIX)):
            raise ValueError(f"takes {HUGGING_FACE_PREFIX}DIR, a local Hugging Face checkpoint directory (config.json "
                             "and *.safetensors)")
        return HUGGING_FACE_PREFIX + expanded(value[len(HUGGING_FACE_PREFIX):])

    def scans_layers(self, platform: str) -> bool:
        """auto unrolls on CPU up to CPU_UNROLLED_LAYERS blocks, where XLA:CPU runs the unrolled step 1.06-1.27x
        faster (bench/results/cpu_speed.json) and deeper stacks compile slowly unrolled (about 0.4 s more per
        block); on GPUs up to GPU_UNROLLED_LAYERS (about 0.9 s more per block); it scans on other platforms."""
        if self.scan_layers != "auto":
            return self.scan_layers
        unrolled_at_most = {"cpu": CPU_UNROLLED_LAYERS, "gpu": GPU_UNROLLED_LAYERS}.get(platform, 0)
        return self.layers > unrolled_at_most


class GPTConfig(DecoderConfig):
    name: Literal["gpt"]
    """A GPT-2 style decoder: learned positions, LayerNorm, GELU MLP, causal multi-head attention."""
    mlp_ratio: PositiveInt = 4
    """MLP hidden width / model width."""
    head_bias: bool = True
    """A bias on the output head (GPT-2 checkpoints have none: false)."""

    @model_validator(mode="after")
    def _heads_divide_width(self) -> GPTConfig:
        if self.width % self.heads:
            raise ValueError(f"model.width={self.width} must be divisible by model.heads={self.heads}")
        if self.lora is not None:
            raise ValueError("model.lora adapts the separate q, k, v and MLP projections of model.name=llama (PEFT's "
                             "layout); the GPT's fused qkv has none: fine-tune a llama, or drop model.lora")
        return self


class RopeScaling(Strict):
    """How RoPE's frequencies are stretched for contexts longer than the trained one."""

    type: Literal["linear", "llama3"]
    """linear: every position divided by `factor`. llama3: Llama 3.1's, low frequencies divided by `factor`,
    high ones kept, a smooth ramp between."""
    factor: float = Field(gt=0)
    """How much longer the context becomes."""
    low_freq_factor: float = Field(1.0, gt=0)
    """llama3: wavelengths above original_max_len / low_freq_factor are scaled by the whole factor."""
    high_freq_factor: float = Field(4.0, gt=0)
    """llama3: wavelengths below original_max_len / high_freq_factor are kept."""
    original_max_len: PositiveInt = 8192
    """llama3: the context the model was first trained for."""


class MoEConfig(Strict):
    """Mixture-of-Experts feed-forward layers in place of the gated MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
    DeepSeek's routing), in every block or in those dense_layers_first and interleave leave: a router picks each
    token's model.moe.top_k experts (docs/models.md)."""

    experts: PositiveInt
    """Routed experts per layer."""
    top_k: PositiveInt = 2
    """Experts each token goes to."""
    expert_hidden: PositiveInt | None = None
    """Hidden width of each expert's SwiGLU MLP; null: model.mlp_hidden."""
    shared_hidden: NonNegativeInt = 0
    """Hidden width of the shared experts every token also goes through, as one SwiGLU MLP (DeepSeek's
    n_shared_experts x its expert width; Qwen2-MoE's shared_expert_intermediate_size); 0: none."""
    shared_gate: bool = False
    """The shared experts' output scaled by a sigmoid gate of the token (Qwen2-MoE); false: added as it is
    (DeepSeek)."""
    score: Literal["softmax", "sigmoid"] = "softmax"
    """The router's scores: a softmax over the experts (Mixtral, Qwen, OLMoE) or each expert's sigmoid
    (DeepSeek-V3)."""
    normalise: bool = True
    """The chosen experts' weights divided by their sum (Mixtral; Qwen's and OLMoE's norm_topk_prob); false: the
    router's scores as they are."""
    aux_loss_weight: float = Field(0.001, ge=0)
    """Weight of the load-balancing loss, transformers' load_balancing_loss_func over every layer's tokens of the
    global microbatch (router_aux_loss_coef); 0: none."""
    z_loss_weight: float = Field(0.0, ge=0)
    """Weight of ST-MoE's router z-loss (the mean of the router logits' logsumexp squared); 0: none."""
    bias_rate: float | None = Field(None, gt=0)
    """DeepSeek-V3's aux-loss-free balancing: each expert's bias on the router's choice (model state, outside
    the optimizer) moves by this much after every step, up for an expert with fewer choices than the mean over
    the step's global batch, down for one with more; null: no bias."""
    capacity_factor: float | None = Field(None, gt=0)
    """Each expert takes at most capacity_factor x tokens x top_k / experts choices of a microbatch's tokens on a
    replica, every token's first choice before any second; the rest are dropped (the token keeps its residual);
    null: dropless."""
    formulation: Literal["auto", "sorted", "dense", "padded", "blocked"] = "auto"
    """How the experts' matmuls run: sorted (grouped matmuls, jax.lax.ragged_dot), dense (every expert on every
    token, weighted by a [tokens, experts] matrix), padded (each expert's tokens gathered into a batch of the
    capacity), blocked (the choices sorted into blocks of 64 rows, each expert's padded to whole blocks, each
    block multiplied by its expert's weights). auto: by measurement, blocked on CPU (the fastest), dense on GPUs
    (the fewest bytes of an H100's compiled step; XLA:GPU expands ragged_dot into dense products) (bench/README.md,
    the MoE routing)."""

    dense_layers_first: NonNegativeInt = 0
    """The first this many layers keep the dense gated MLP of width model.mlp_hidden (DeepSeek's
    first_k_dense_replace; Qwen's mlp_only_layers [0, ..., n - 1])."""
    interleave: PositiveInt = 1
    """Of the other layers, every interleave-th has experts: layer i (from 0) when (i + 1) % interleave == 0
    (Qwen's decoder_sparse_step); the rest keep the dense MLP; 1: every one."""

    def hidden_of(self, mlp_hidden: int) -> int:
        return self.expert_hidden or mlp_hidden

    def layers_with_experts(self, layers: int) -> tuple[int, ...]:
        """The numbers of the layers whose MLP is the experts, in order."""
        return tuple(i for i in range(self.dense_layers_first, layers) if (i + 1) % self.interleave == 0)

    @model_validator(mode="after")
    def _top_k_fits(self) -> MoEConfig:
        if self.top_k > self.experts:
            raise ValueError(f"model.moe.top_k={self.top_k} is more than model.moe.experts={self.experts}: each "
                             "token chooses among the experts; lower top_k or add experts")
        if self.shared_gate and not self.shared_hidden:
            raise ValueError("model.moe.shared_gate=true gates the shared experts, and model.moe.shared_hidden=0 "
                             "has none: set their width, or drop shared_gate")
        return self


class LlamaConfig(DecoderConfig):
    name: Literal["llama"]
    """A Llama-style decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 2 and 3): RoPE, RMSNorm, a gated MLP,
    grouped-query attention."""
    kv_heads: PositiveInt | None = None
    """Key/value heads (grouped-query attention; 1: multi-query); must divide model.heads. null: model.heads."""
    head_dim: PositiveInt | None = None
    """Width of one head; null: model.width / model.heads."""
    mlp_hidden: PositiveInt | None = None
    """Hidden width of the SwiGLU MLP; null: 8/3 x model.width rounded up to a multiple of 64."""
    rope_theta: float = Field(10000.0, gt=0)
    """RoPE's base: wavelengths run from 2 pi to about 2 pi x rope_theta."""
    rope_scaling: RopeScaling | None = None
    """Stretching RoPE for longer contexts; null: none."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2 has them)."""
    out_bias: bool = False
    """A bias on the attention output projection (Llama checkpoints with attention_bias: true)."""
    qk_norm: Literal["head", "projection"] | None = None
    """RMSNorm of the queries and keys before RoPE. head: each head normalised on its own, one scale of
    model.head_dim shared by the heads (Qwen3). projection: over the whole query and key projections, a scale per
    feature (OLMoE). null: none."""
    clip_qkv: float | None = Field(None, gt=0)
    """The queries, keys and values clipped to [-c, c] after their projections (and q/k norms) (OLMoE's
    clip_qkv); null: not clipped."""
    sliding_window: PositiveInt | None = None
    """Sliding-window attention: a query at position i attends the keys j with i - W < j <= i (W keys, itself
    included), in the layers model.layer_types names sliding (every layer when it is null). A window at least as
    long as the sequence is full causal attention. null: every layer attends every earlier position."""
    layer_types: tuple[Literal["full", "sliding"], ...] | None = None
    """Each layer's attention, one entry per layer: full (every earlier position) or sliding (model.sliding_window);
    e.g. Qwen2's and Qwen3's windowed layers from max_window_layers on. null: every layer sliding where
    model.sliding_window is set, else full."""
    rope_theta_sliding: float | None = Field(None, gt=0)
    """RoPE's base on the sliding-window layers, which then take no RoPE scaling (Gemma 3's local layers: 10000,
    its global ones model.rope_theta 1e6 with model.rope_scaling); null: every layer's is model.rope_theta."""
    mlp_activation: Literal["silu", "gelu_tanh"] = "silu"
    """The gated MLP's activation: silu (SwiGLU: Llama, Mistral, Qwen) or gelu_tanh (GeGLU with the tanh GELU:
    Gemma)."""
    norm_plus_one: bool = False
    """The RMSNorms scale by (1 + their parameter), which starts at zero (Gemma), instead of by the parameter."""
    sandwich_norms: bool = False
    """RMSNorms after attention and after the MLP too, each before its output joins the residual (Gemma 2 and 3)."""
    embed_scale: bool = False
    """The token embeddings multiplied by sqrt(model.width) (Gemma)."""
    score_scale_dim: PositiveInt | None = None
    """Attention scores divided by the square root of this (Gemma's query_pre_attn_scalar); null: the head width."""
    attn_softcap: float | None = Field(None, gt=0)
    """Attention scores soft-capped to (-c, c) as tanh(s / c) c (Gemma 2: 50); null: none. XLA's attention then,
    not cuDNN's fused kernel, which has no soft cap."""
    logit_softcap: float | None = Field(None, gt=0)
    """The output logits soft-capped likewise (Gemma 2: 30); null: none."""
    norm_eps: float = Field(1e-5, gt=0)
    """Epsilon of the RMSNorms."""
    moe: MoEConfig | None = None
    """Mixture-of-Experts layers in place of the gated MLP; null: a dense model."""

    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's window (None: full causal attention)."""
        types = self.layer_types or ("sliding" if self.sliding_window else "full",) * self.layers
        return tuple(self.sliding_window if kind == "sliding" else None for kind in types)

    def kv_head_count(self) -> int:
        return self.kv_heads or self.heads

    def head_width(self) -> int:
        return self.head_dim or self.width // self.heads

    def mlp_width(self) -> int:
        return self.mlp_hidden or -(-8 * self.width // 3 // 64) * 64

    @model_validator(mode="after")
    def _heads_fit(self) -> LlamaConfig:
        if self.heads % self.kv_head_count():
            raise ValueError(f"model.kv_heads={self.kv_heads} must divide model.heads={self.heads} (each key/value "
                             "head serves a group of query heads)")
        if self.head_dim is None and self.width % self.heads:
            raise ValueError(f"model.width={self.width} must be divisible by model.heads={self.heads}, or set "
                             "model.head_dim")
        if self.head_width() % 2:
            raise ValueError(f"RoPE rotates pairs of dimensions: the head width {self.head_width()} must be even "
                             "(model.head_dim, or model.width / model.heads)")
        if self.layer_types is not None:
            if len(self.layer_types) != self.layers:
                raise ValueError(f"model.layer_types names {len(self.layer_types)} layers, and model.layers="
                                 f"{self.layers}: give one type (full or sliding) per layer")
            if "sliding" in self.layer_types and self.sliding_window is None:
                raise ValueError("model.layer_types has sliding layers, and model.sliding_window is null: set the "
                                 "window (in keys, each query's own included)")
        if self.rope_theta_sliding is not None and self.sliding_window is None:
            raise ValueError("model.rope_theta_sliding is the base of the sliding-window layers, and model."
                             "sliding_window is null: set the window, or drop model.rope_theta_sliding")
        if self.lora is not None and self.moe is not None and {"gate", "up", "down"} & set(self.lora.targets):
            raise ValueError(f"model.lora.targets={list(self.lora.targets)}: gate, up and down name no projection of a "
                             "model whose MLPs are experts (model.moe); adapt q, k, v and o")
        if self.moe is not None and not self.moe.layers_with_experts(self.layers):
            raise ValueError(f"model.moe.dense_layers_first={self.moe.dense_layers_first} and model.moe.interleave="
                             f"{self.moe.interleave} leave none of model.layers={self.layers} with experts: lower "
                             "them, or drop model.moe")
        return self


DECODERS = (GPTConfig, LlamaConfig)
"""The built-in decoders: token models with blocks that pipelines cut, KV-cache sampling and Hugging Face weights."""


class CustomModelConfig(ModelBase):
    name: Literal["custom"]
    """Your own flax.nnx.Module (docs/models.md)."""
    target: Annotated[str, Field(pattern=r"^[\w.]+:[\w.]+$")]
    """"package.module:ClassName" of a flax.nnx.Module subclass that takes a keyword argument `rngs`."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments of its constructor, checked against its signature."""


class TorchModelConfig(ModelBase):
    name: Literal["torch"]
    """A PyTorch nn.Module trained through the torch bridge (docs/models.md)."""
    target: Annotated[str, Field(pattern=r"^[\w.]+:[\w.]+$")]
    """"package.module:Name" of a torch.nn.Module subclass, or of a function returning a module."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments for it, checked against its signature."""
    init_from: PathText | None = None
    """A torch state_dict (.pt) to start from instead of the module's own initialisation."""
    shard_dims: dict[str, int | None] = {}
    """Parameter-name glob -> the dimension zero1/fsdp shard over `data` (null: keep it whole); the first
    matching pattern wins. Unmatched params: their largest dimension that the data axis divides."""
    tensor_dims: dict[str, Literal["column", "row"]] = {}
    """With mesh.tensor > 1 (parallel.mode=jit): parameter-name glob -> how it splits over `tensor`, the first
    matching pattern winning: column (an nn.Linear's output features: its weight's dimension 0 and its bias) or row
    (its input features: the weight's last dimension; a 1-D parameter, such as the bias after a row-parallel
    matmul, stays whole). Every pattern must match a parameter; XLA's partitioner inserts the collectives."""
    blocks: str = "blocks"
    """For pipelines: the nn.ModuleList attribute holding the repeated blocks (the module also defines
    before_blocks(inputs) and after_blocks(x))."""

    @model_validator(mode="after")
    def _init_file_exists(self) -> TorchModelConfig:
        if self.init_from is not None and not Path(self.init_from).is_file():
            raise ValueError(f"model.init_from={self.init_from!r} is not a file; give a torch state_dict saved "
                             "with torch.save(module.state_dict(), PATH)")
        return self


ModelConfig = Annotated[
    Union[MLPConfig, CNNConfig, GPTConfig, LlamaConfig, CustomModelConfig, TorchModelConfig],
    Field(discriminator="name"),
]
