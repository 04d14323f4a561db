"""A built-in decoder's weights, with its resolved config and tokenizer: from a run directory's checkpoint (however
many devices and stages wrote it) or from a Hugging Face checkpoint directory, on one device (what `xlatrain sample`
and `xlatrain export --hf` read) or spread over several (what `xlatrain eval` reads)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import optax
from pydantic import TypeAdapter, ValidationError

from xlatrain.config import (
    DECODERS,
    HUGGING_FACE_PREFIX,
    Config,
    DecoderConfig,
    GPTConfig,
    ModelConfig,
    ScheduleFreeAdamWConfig,
    TorchModelConfig,
)
from xlatrain.config.base import expanded
from xlatrain.config.hugging_face import architecture, checkpoint_directory, read_config_json
from xlatrain.data.sources import open_dataset, run_tokenizer
from xlatrain.data.tokenizers import Tokenizer
from xlatrain.errors import UserError, first_line
from xlatrain.evaluation.decoder import decoder_definition, decoder_graphdef
from xlatrain.evaluation.devices import merged_variables, trained_split
from xlatrain.hf.names import naming_of, stacked_layers
from xlatrain.hf.tokenizer import checkpoint_tokenizer
from xlatrain.hf.weights import HuggingFaceWeights, placed_params
from xlatrain.optim import evaluated_params
from xlatrain.pipeline.layout import StageLayout
from xlatrain.pipeline.schedule import build
from xlatrain.run.checkpoints import in_current_layout, read_checkpoint
from xlatrain.run.directory import pinned_partition, read_run_config
from xlatrain.sharding import Rules

TORCH_REFUSED = ("trained a torch module (model.name=torch): its weights belong to your PyTorch code, which xlatrain "
                 "runs only as a whole forward, without a KV cache or a Hugging Face layout; export them with "
                 "`xlatrain export RUN_DIR --torch OUT.pt`")


@dataclass(frozen=True)
class TrainedDecoder:
    model: DecoderConfig
    """With vocab and max_len resolved."""
    params: Any
    """In the model's layout (blocks stacked [layers, ...]), where the reading placed them (one device unless
    asked otherwise)."""
    tokenizer: Tokenizer | None
    source: str
    """What the weights came from, for messages."""
    model_state: Any = None
    """The model's state beside its params (an MoE router's balancing bias), as the params are; None: none."""
    split: Rules | None = None
    """The logical rules that split its params over `data` in training (fsdp), or None."""

    def module(self) -> tuple[Any, Any]:
        """(nnx graph definition, its variables: the params with the model state among them): what
        xlatrain.models.sampling.generate runs."""
        return decoder_graphdef(self.model), merged_variables(self.params, self.model_state or {})


Placement = Callable[[tuple[int, ...]], jax.sharding.Sharding]
"""Where an array of a shape is read to."""


def on_one_device(_shape: tuple[int, ...]) -> jax.sharding.Sharding:
    """This process's first device."""
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def trained_decoder(source: str, step: int | None, command: str,
                    placement: Placement = on_one_device) -> TrainedDecoder:
    """A run directory's checkpoint (`step`, or the latest), or a Hugging Face directory (hf:DIR)."""
    if source.startswith(HUGGING_FACE_PREFIX):
        if step is not None:
            raise UserError(f"{command}: --step picks a run's checkpoint; a Hugging Face directory has one")
        return from_hugging_face(checkpoint_directory(source), command, placement)
    return from_run(Path(expanded(source)), step, command, placement)[0]


def from_run(run_dir: Path, step: int | None, command: str,
             placement: Placement = on_one_device) -> tuple[TrainedDecoder, Config, int]:
    """(the decoder, the run's config, the step of the checkpoint read: `step`, or the latest)."""
    config = read_run_config(run_dir)
    if isinstance(config.model, TorchModelConfig):
        raise UserError(f"{command}: {str(run_dir)!r} {TORCH_REFUSED}")
    if not isinstance(config.model, DECODERS):
        raise UserError(f"{command}: {str(run_dir)!r} trained {config.model.named()}, not a built-in decoder "
                        "(model.name=gpt or llama)")
    (params, model_state), step = _restored_params(run_dir, config, step, command, placement)
    model = config.model
    vocab = params["embed"]["embedding"].shape[0]
    if isinstance(model, GPTConfig):
        max_len = params["position"]["embedding"].shape[0]
    else:
        max_len = model.max_len or getattr(config.data, "seq_len", None) or \
            open_dataset(config.data, model.loss).spec.input_shape[0]
    resolved = model.model_copy(update={"vocab": vocab, "max_len": max_len})
    params = in_current_layout(params, _abstract_params(resolved))
    return TrainedDecoder(resolved, params, run_tokenizer(config.data, run_dir), f"{run_dir} step {step}",
                          model_state, trained_split(config)), config, step


def _abstract_params(model: DecoderConfig) -> Any:
    """The decoder's params as shapes, in the model's layout (blocks stacked [layers, ...])."""
    return jax.eval_shape(decoder_definition(model).init, jax.random.PRNGKey(0))[0]


def _restored_params(run_dir: Path, config: Config, step: int | None, command: str,
                     placement: Placement) -> tuple[tuple[Any, Any], int]:
    """((params, model state), step), each array read as `placement` says, the blocks in the model's layout; a
    schedule-free run's averaged params (optim.py: evaluated_params, from its optimizer state)."""
    schedule_free = isinstance(config.optimizer, ScheduleFreeAdamWConfig)
    read = ("params", "model_state", *(("opt_state",) if schedule_free else ()))
    fields, step = read_checkpoint(run_dir, config.trainer.keep_checkpoints, step, command, lambda checkpoints, step:
                                   checkpoints.restore_fields_on(step, placement, read))
    params = fields["params"]
    if schedule_free:  # read on its own, the optimizer's state is a dict of its named tuple's fields
        params = evaluated_params(optax.contrib.ScheduleFreeState(**fields["opt_state"]), params)
    if config.mesh.stage > 1:
        params = _stage_layout(run_dir, config).layer_params(params)
    return (params, fields["model_state"]), step


def _stage_layout(run_dir: Path, config: Config) -> StageLayout:
    """The layout a pipelined run's checkpoints hold their blocks in."""
    pipe, stages = config.parallel.pipeline, config.mesh.stage
    partition = tuple(pipe.partition) if pipe.partition != "auto" else pinned_partition(run_dir)
    if partition is None:
        raise UserError(f"{run_dir}: a pipelined run's config.yaml lacks derived.pipeline_partition; restore the "
                        "file from the run's first start")
    virtual = pipe.chunks_per_stage()
    placement = build(pipe.schedule, stages, pipe.microbatches_for(stages), virtual).placement
    return StageLayout(stages, virtual, partition, placement)


def from_hugging_face(directory: Path, command: str, placement: Placement = on_one_device) -> TrainedDecoder:
    named = f"{command}: hf:{directory}"
    keys = architecture(read_config_json(directory, named), named)
    try:
        model = TypeAdapter(ModelConfig).validate_python(keys)
    except ValidationError as err:
        raise UserError(f"{named}: config.json describes a model xlatrain refuses: {first_line(err)}") from None
    abstract = _abstract_params(model)
    weights = HuggingFaceWeights(directory, naming_of(model), named, stacked_layers(model))
    weights.check(abstract)
    params = placed_params(weights, abstract, jax.tree.map(lambda leaf: placement(tuple(leaf.shape)), abstract))
    return TrainedDecoder(model, params, checkpoint_tokenizer(directory), f"hf:{directory}")
