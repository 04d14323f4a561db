"""The `model` section: built-in models, a custom flax module, a torch module."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import Field, model_validator

from xlatrain.config.base import DropoutRate, PositiveInt, Strict


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


class GPTConfig(ModelBase):
    name: Literal["gpt"]
    """A GPT-2 style decoder: learned positions, LayerNorm, GELU MLP, causal multi-head attention."""
    layers: PositiveInt = 4
    """Transformer blocks."""
    width: PositiveInt = 128
    """Model width."""
    heads: PositiveInt = 4
    """Attention heads; must divide model.width."""
    mlp_ratio: PositiveInt = 4
    """MLP hidden width / model width."""
    vocab: PositiveInt | None = None
    """Vocabulary size, at least the tokenizer's ids; null: the tokenizer's (256 for bytes) rounded up to
    model.vocab_multiple."""
    vocab_multiple: PositiveInt = 64
    """With model.vocab null: the vocabulary is rounded up to a multiple of this (padding rows no id reads: a
    matmul-friendly size, and one that tensor-parallel splits divide)."""
    max_len: PositiveInt | None = None
    """Positional table size; null: data.seq_len."""
    dropout: DropoutRate = 0.0
    """Dropout rate while training (attention, residual and embedding dropout)."""
    scan_layers: Literal["auto"] | bool = "auto"
    """`lax.scan` over the blocks (much faster compiles for deep models). auto: scan on GPUs; on CPU unroll up to
    16 blocks, where the unrolled step runs faster (bench/README.md). `xlatrain config` shows the choice as
    derived.scan_layers."""

    def scans_layers(self, platform: str) -> bool:
        """auto scans on accelerators and unrolls on CPU up to CPU_UNROLLED_LAYERS blocks, where XLA:CPU runs
        the unrolled step 1.06-1.27x faster (bench/results/cpu_speed.json) and deeper stacks compile slowly
        unrolled (about 0.4 s more per block)."""
        if self.scan_layers != "auto":
            return self.scan_layers
        return platform != "cpu" or self.layers > CPU_UNROLLED_LAYERS

    @model_validator(mode="after")
    def _heads_divide_width(self) -> GPTConfig:
        if self.width % self.heads:
            raise ValueError(f"model.width={self.width} must be divisible by model.heads={self.heads}")
        return self


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
    init_from: str | None = None
    """A torch state_dict (.pt) to start from instead of the module's own initialisation."""
    shard_dims: dict[str, int | None] = {}
    """Parameter-name glob -> the dimension zero1/fsdp shard over `data` (null: keep it whole); the first
    matching pattern wins. Unmatched params: their largest dimension that the data axis divides."""
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
    Union[MLPConfig, CNNConfig, GPTConfig, CustomModelConfig, TorchModelConfig], Field(discriminator="name")
]
