"""A Hugging Face checkpoint's tensors as the parameters of a built-in decoder: checked against the model's
shapes before anything is read, then read in the pieces each device holds (xlatrain/program.py places them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np

from xlatrain.errors import UserError
from xlatrain.hf.names import Tensor, checkpoint_layer, tensor_of
from xlatrain.hf.tensors import CheckpointTensors
from xlatrain.models.blocks import STACKS


def param_paths(params: Any) -> list[tuple[tuple[str, ...], Any]]:
    """(keys, leaf) of each parameter of a params dict."""
    return [(path_keys(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]]


def path_keys(path: tuple) -> tuple[str, ...]:
    """A params leaf's jax key path as its dict keys: ("blocks", "q", "kernel")."""
    return tuple(entry.key for entry in path)


class HuggingFaceWeights:
    def __init__(self, directory: Path, naming: str, named: str, layers: dict[str, tuple[int, ...]] | None = None):
        """`layers`: which of the checkpoint's layers each stack holds (hf/names.py: stacked_layers)."""
        self.tensors = CheckpointTensors(directory, named)
        self.naming, self.named, self.layers = naming, named, layers or {}

    def layer_name(self, tensor: Tensor, path: tuple[str, ...], index: int) -> str:
        """The name of `tensor` in the layer that its stack holds at `index`."""
        return tensor.of_layer(checkpoint_layer(self.layers, path[0], index))

    def tensor(self, path: tuple[str, ...]) -> Tensor:
        return self.tensors.resolve(tensor_of(self.naming, path))

    def check(self, abstract_params: Any) -> None:
        """Every parameter (in the model's layout: blocks stacked [layers, ...]) has its tensor, of its shape; an
        experts parameter one per expert, and no more experts than config.json says."""
        for path, leaf in param_paths(abstract_params):
            tensor = self.tensor(path)
            stacked = path[0] in STACKS
            shape = tuple(leaf.shape[1:] if stacked else leaf.shape)
            expected = tensor.stored_shape(shape)
            for layer in range(leaf.shape[0]) if stacked else (None,):
                name = tensor.name if layer is None else self.layer_name(tensor, path, layer)
                if tensor.experts:
                    self._check_expert_count(tensor.of_expert(name, shape[0]), shape[0], path)
                for each in [tensor.of_expert(name, e) for e in range(shape[0])] if tensor.experts else [name]:
                    self._check_tensor(each, expected, path)

    def _check_tensor(self, name: str, expected: tuple[int, ...], path: tuple[str, ...]) -> None:
        if name not in self.tensors.file_of:
            raise UserError(f"{self.named}: the checkpoint has no tensor {name!r} (model parameter "
                            f"{'.'.join(path)}); is it a complete {self.naming} checkpoint"
                            f"{' with as many experts as its config.json gives' if path[-2:-1] == ('moe',) else ''}?")
        found = self.tensors.shape(name)
        if found != expected:
            raise UserError(f"{self.named}: tensor {name!r} is {list(found)}, where model parameter "
                            f"{'.'.join(path)} needs {list(expected)}; the checkpoint disagrees with its "
                            "config.json")

    def _check_expert_count(self, past_last: str, experts: int, path: tuple[str, ...]) -> None:
        if past_last in self.tensors.file_of:
            raise UserError(f"{self.named}: the checkpoint has tensor {past_last!r}, an expert past the {experts} "
                            f"experts its config.json gives (model parameter {'.'.join(path)}); the checkpoint "
                            "disagrees with its config.json")

    def expert_count(self, tensor: Tensor, name: str) -> int:
        """How many experts the checkpoint holds a tensor of (`name`: the tensor's, its layer filled in)."""
        count = 0
        while tensor.of_expert(name, count) in self.tensors.file_of:
            count += 1
        return count

    def read(self, path: tuple[str, ...], layers: np.ndarray | None, index: tuple[slice, ...]) -> np.ndarray:
        """The parameter at `path`, [index] of one layer's (or a non-block parameter's) shape, for each layer in
        `layers` (any shape; -1: padding, zeros), stacked in front; `layers` None: a parameter outside the blocks."""
        tensor = self.tensor(path)

        def one(name: str) -> np.ndarray:
            if tensor.experts:  # one tensor per expert of index[0], each read at the rest of the index
                chosen = range(*index[0].indices(self.expert_count(tensor, name)))
                return np.stack([plain(tensor.of_expert(name, e), index[1:]) for e in chosen])
            return plain(name, index)

        def plain(name: str, index: tuple[slice, ...]) -> np.ndarray:
            if tensor.transposed:
                return self.tensors.read(name, index[::-1]).T
            if tensor.groups is not None:  # the merged last dimension read whole, then split and indexed
                merged = self.tensors.read(name, (*index[:-2], slice(None)))
                return merged.reshape(*merged.shape[:-1], tensor.groups, -1)[..., index[-2], index[-1]]
            return self.tensors.read(name, index)

        if layers is None:
            return one(tensor.name)
        parts = {int(layer): one(self.layer_name(tensor, path, int(layer)))
                 for layer in np.unique(layers) if layer >= 0}
        sample = next(iter(parts.values()))
        zeros = np.zeros_like(sample)
        return np.stack([parts.get(int(layer), zeros) for layer in layers.ravel()]).reshape(
            *layers.shape, *sample.shape)


def placed_params(weights: HuggingFaceWeights, abstract_params: Any, shardings: Any,
                  layers_at: Any = None) -> Any:
    """The parameters as global arrays in `shardings`, each device's piece read from the checkpoint alone.
    `layers_at(index)`: which layers the leading axes of a block parameter's piece hold, for a layout other than
    the model's [layers, ...] (a pipeline's stages: xlatrain/pipeline/layout.py); it returns (layers, the rest of
    the index)."""

    def place(path, abstract, sharding):
        keys = path_keys(path)

        def piece(index: tuple[slice, ...]) -> np.ndarray:
            if keys[0] not in STACKS:
                return weights.read(keys, None, index).astype(abstract.dtype)
            layers, rest = (np.arange(abstract.shape[0])[index[0]], index[1:]) if layers_at is None \
                else layers_at(index)
            return weights.read(keys, layers, rest).astype(abstract.dtype)

        return jax.make_array_from_callback(abstract.shape, sharding, piece)

    return jax.tree_util.tree_map_with_path(place, abstract_params, shardings)
