"""A built-in decoder's parameters as a Hugging Face checkpoint directory: config.json, safetensors (sharded past
MAX_SHARD_BYTES, with their index), and the tokenizer's files. Written into a temporary directory beside the
target (OUT.partial-*) and renamed to it when whole, so that a failed or killed export leaves no half checkpoint under
its name."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from xlatrain.hf.names import checkpoint_layer, tensor_of
from xlatrain.hf.tensors import INDEX_FILE
from xlatrain.hf.weights import param_paths
from xlatrain.models.blocks import STACKS

MAX_SHARD_BYTES = 5 * 2**30
"""transformers' own default shard size."""


def checkpoint_tensors(naming: str, params: Any, layers: dict[str, tuple[int, ...]] | None = None,
                       ) -> dict[str, np.ndarray]:
    """{checkpoint name: float32 array in its layout} of every parameter (blocks one tensor per layer). `layers`:
    which of the checkpoint's layers each stack holds (hf/names.py: stacked_layers)."""
    found, layers = {}, layers or {}
    for path, leaf in param_paths(params):
        tensor, value = tensor_of(naming, path), np.asarray(leaf, np.float32)
        for index, array in enumerate(value) if path[0] in STACKS else [(None, value)]:
            name = tensor.name if index is None else tensor.of_layer(checkpoint_layer(layers, path[0], index))
            pieces = [(tensor.of_expert(name, e), each) for e, each in enumerate(array)] if tensor.experts else \
                [(name, array)]
            for each_name, each in pieces:
                found[each_name] = np.ascontiguousarray(each.T if tensor.transposed else each).reshape(
                    tensor.stored_shape(array.shape))
    return found


def shards(tensors: dict[str, np.ndarray], max_bytes: int) -> list[dict[str, np.ndarray]]:
    """The tensors in order, cut into groups of at most `max_bytes` (a larger tensor alone in its group)."""
    groups: list[dict[str, np.ndarray]] = [{}]
    for name, array in tensors.items():
        if groups[-1] and sum(a.nbytes for a in groups[-1].values()) + array.nbytes > max_bytes:
            groups.append({})
        groups[-1][name] = array
    return groups


def write_checkpoint(out: Path, config_json: dict, tensors: dict[str, np.ndarray], extra_files: dict[str, str],
                     max_shard_bytes: int = MAX_SHARD_BYTES, config_file: str = "config.json",
                     weights_stem: str = "model") -> None:
    """`extra_files`: {name: text} written beside the weights (the tokenizer's). A failure (a full disk, a signal)
    removes what was written. `config_file` and `weights_stem`: the names (a PEFT adapter's differ)."""
    from safetensors.numpy import save_file

    partial = Path(tempfile.mkdtemp(prefix=f"{out.name}.partial-", dir=out.parent))
    try:
        groups = shards(tensors, max_shard_bytes)
        names = [f"{weights_stem}.safetensors"] if len(groups) == 1 else \
            [f"{weights_stem}-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
        for name, group in zip(names, groups, strict=True):
            save_file(group, str(partial / name), metadata={"format": "pt"})
        if len(groups) > 1:
            weight_map = {tensor: name for name, group in zip(names, groups, strict=True) for tensor in group}
            index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map}
            (partial / INDEX_FILE.replace("model", weights_stem, 1)).write_text(json.dumps(index, indent=2),
                                                                                encoding="utf-8")
        (partial / config_file).write_text(json.dumps(config_json, indent=2), encoding="utf-8")
        for name, text in extra_files.items():
            (partial / name).write_text(text, encoding="utf-8")
        # mkdtemp's directory and safetensors' files are the user's alone: a checkpoint is shared as other files are
        mask = _umask()
        partial.chmod(0o777 & ~mask)
        for path in partial.iterdir():
            path.chmod(0o666 & ~mask)
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
