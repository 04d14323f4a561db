"""`xlatrain export RUN_DIR --torch OUT.pt`: a run's trained weights as the torch module's state_dict;
`xlatrain export RUN_DIR --hf OUT`: a built-in decoder's as a Hugging Face checkpoint directory (LoRA's adapters
merged into their weights); `xlatrain export RUN_DIR --peft OUT`: a LoRA run's adapters as a PEFT adapter."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from xlatrain.commands.trained import from_run
from xlatrain.config import HUGGING_FACE_PREFIX, TorchModelConfig
from xlatrain.config.hugging_face import hugging_face_config
from xlatrain.data.chat import TEMPLATE_FILES, template_files
from xlatrain.data.tokenizers import (
    TOKENIZER_FILE,
    Tokenizer,
    byte_tokenizer,
    bytes_as_hugging_face,
)
from xlatrain.errors import UserError, first_line
from xlatrain.hf.names import naming_of, stacked_layers
from xlatrain.hf.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_NAMING, adapter_config
from xlatrain.hf.writing import checkpoint_tensors, write_checkpoint
from xlatrain.models.lora import adapters_of, merged
from xlatrain.optim import evaluated_params
from xlatrain.program import apply_cpu_devices, build_program
from xlatrain.run.atomic import replace_file
from xlatrain.run.checkpoints import read_checkpoint
from xlatrain.run.directory import pinned_partition, read_run_config
from xlatrain.state import with_shardings


def export_torch_state_dict(run_dir: Path, out: Path, step: int | None = None) -> tuple[Path, int]:
    """Write the checkpoint at `step` (default: the latest) to `out`; returns (out, step). The file loads with
    `module.load_state_dict(torch.load(out), strict=True)`."""
    import torch

    config = read_run_config(run_dir)
    if not isinstance(config.model, TorchModelConfig):
        raise UserError(f"export --torch: {str(run_dir)!r} trained model.name={config.model.name}, not a torch module "
                        "(model.name=torch)")
    check_new_output(out, "export --torch", "path")
    # Restore onto the devices present, whatever data-parallel size the run trained with; on CPU, with the devices
    # its pipeline stages need (mesh.cpu_devices, as `xlatrain train` makes them).
    config = config.model_copy(update={"mesh": config.mesh.model_copy(update={"data": -1})})
    apply_cpu_devices(config)
    program = build_program(config, pinned_partition=pinned_partition(run_dir))
    abstract = with_shardings(program.abstract_state, program.specs, program.mesh)
    state, step = read_checkpoint(run_dir, config.trainer.keep_checkpoints, step, "export --torch",
                                  lambda checkpoints, step: checkpoints.restore(step, abstract).state)
    params = evaluated_params(state.opt_state, state.params)
    params = params if program.pipeline is None else program.pipeline.layout.layer_params(params)
    host = jax.tree.map(np.asarray, (params, state.model_state))
    state_dict = program.model.torch.state_dict(*host)
    replace_file(out, lambda partial: torch.save(state_dict, partial))
    return out, step


def check_new_output(out: Path, command: str, what: str) -> None:
    """An export writes a new file or directory, never over one."""
    if out.exists():
        raise UserError(f"{command}: {str(out)!r} exists; choose a new {what} (nothing is overwritten)")
    if not out.parent.is_dir():
        raise UserError(f"{command}: {str(out)!r} is in a directory that does not exist")


def export_hugging_face(run_dir: Path, out: Path, step: int | None = None) -> tuple[Path, int]:
    """Write the checkpoint at `step` (default: the latest) of a gpt or llama run as a Hugging Face checkpoint
    directory `out`: transformers.AutoModelForCausalLM.from_pretrained(out) loads it, and the run's tokenizer
    (AutoTokenizer) when it has one."""
    check_new_output(out, "export --hf", "directory")
    trained, _, step = from_run(run_dir, step, "export --hf")
    tokenizer = trained.tokenizer
    # transformers' configs default to their own families' special ids (Llama: 1 and 2, GPT-2: 50256), which
    # generate() would stop at: this model's end-of-text, where its vocabulary holds one (text read as bytes has
    # none), and no beginning-of-text token.
    end = tokenizer.end_of_text if tokenizer is not None and tokenizer.end_of_text < trained.model.vocab else None
    extra, end_of_turn = ({}, None) if tokenizer is None else _tokenizer_files(tokenizer, trained.model.max_len)
    ends = sorted({i for i in (end, end_of_turn) if i is not None and i < trained.model.vocab})
    config_json = {**hugging_face_config(trained.model, trained.model.vocab, trained.model.max_len),
                   "bos_token_id": None, "eos_token_id": ends[0] if len(ends) == 1 else (ends or None),
                   "dtype": "float32"}
    lora = getattr(trained.model, "lora", None)
    params = trained.params if lora is None else merged(jax.tree.map(np.asarray, trained.params),
                                                        lora.alpha / lora.rank)
    try:
        write_checkpoint(out, config_json, checkpoint_tensors(naming_of(trained.model), params,
                                                               stacked_layers(trained.model)), extra)
    except OSError as err:
        raise UserError(f"export --hf: {str(out)!r} cannot be written ({err.strerror or first_line(err)}); choose "
                        "a directory you can write to, with room for the weights") from None
    return out, step


def export_peft(run_dir: Path, out: Path, step: int | None = None) -> tuple[Path, int]:
    """Write the adapters of a run with model.lora at `step` (default: the latest) as a PEFT adapter directory
    `out`: peft.PeftModel.from_pretrained(base, out) loads them onto the run's base model."""
    check_new_output(out, "export --peft", "directory")
    trained, config, step = from_run(run_dir, step, "export --peft")
    lora = getattr(trained.model, "lora", None)
    if lora is None:
        raise UserError(f"export --peft: {str(run_dir)!r} trained without model.lora: it has no adapters; export "
                        "the whole model with --hf")
    base = trained.model.init_from[len(HUGGING_FACE_PREFIX):] if trained.model.init_from else None
    tensors = checkpoint_tensors(PEFT_NAMING, adapters_of(trained.params), stacked_layers(trained.model))
    try:
        write_checkpoint(out, adapter_config(lora, base), tensors, {}, config_file=ADAPTER_CONFIG,
                         weights_stem=ADAPTER_WEIGHTS)
    except OSError as err:
        raise UserError(f"export --peft: {str(out)!r} cannot be written ({err.strerror or first_line(err)}); choose "
                        "a directory you can write to") from None
    return out, step


def _tokenizer_files(tokenizer: Tokenizer, max_len: int) -> tuple[dict[str, str], int | None]:
    """(tokenizer.json and a tokenizer_config.json that transformers' AutoTokenizer reads, with the chat template
    beside the run's tokenizer where it has one; the id of that template's eos_token, which ends a turn). None for
    a sentencepiece model, which has no tokenizer.json (and whose .model transformers reads with Llama's
    conventions, which change its ids)."""
    from tokenizers import Tokenizer as HFTokenizer

    serialized = tokenizer.serialized
    if serialized is None and tokenizer.fingerprint == byte_tokenizer().fingerprint:
        serialized = bytes_as_hugging_face()
    if serialized is None:
        return {}, None
    loaded = HFTokenizer.from_str(serialized)
    end = loaded.id_to_token(tokenizer.end_of_text)
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
                **({"eos_token": end} if end is not None else {})}
    files = template_files(tokenizer.name)
    given = json.loads(files.pop(TEMPLATE_FILES[0], "{}"))
    settings |= {k: given[k] for k in ("chat_template", "bos_token", "eos_token") if isinstance(given.get(k), str)}
    end_of_turn = loaded.token_to_id(settings["eos_token"]) if "eos_token" in settings else None
    return {TOKENIZER_FILE: serialized, TEMPLATE_FILES[0]: json.dumps(settings, indent=2), **files}, end_of_turn
