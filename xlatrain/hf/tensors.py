"""A checkpoint directory's safetensors files, read slice by slice: each process reads only the parts of each
tensor that its devices hold. bfloat16 tensors, which numpy cannot name, are mapped from the file as ml_dtypes'
bfloat16; every other dtype is read through safetensors."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from xlatrain.errors import UserError, first_line
from xlatrain.hf.names import GPT2_PREFIX, Tensor

INDEX_FILE = "model.safetensors.index.json"
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
"""Buffers some checkpoints store beside their weights (GPT-2's causal mask, a rotary table): not parameters."""


class CheckpointTensors:
    """The tensors of a Hugging Face checkpoint directory (one model.safetensors, or shards and their index)."""

    def __init__(self, directory: Path, named: str):
        from safetensors import safe_open

        self.directory, self.named = directory, named
        files = self._files()
        self._open: dict[Path, Any] = {}
        self.file_of: dict[str, Path] = {}
        for path in files:
            try:
                self._open[path] = safe_open(str(path), framework="numpy")
            except Exception as err:  # safetensors raises its own error types on a damaged file
                raise UserError(f"{named}: {str(path)!r} is not a safetensors file ({first_line(err)[:120]})") from None
            self.file_of.update({name: path for name in self._open[path].keys()})

    def _files(self) -> list[Path]:
        index = self.directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
                raise UserError(f"{self.named}: {str(index)!r} is not a safetensors index ({first_line(err)})") \
                    from None
            files = sorted({self.directory / name for name in weight_map.values()})
            missing = [p for p in files if not p.is_file()]
            if missing:
                raise UserError(f"{self.named}: {INDEX_FILE} names {missing[0].name}, which is not in "
                                f"{str(self.directory)!r}; copy the whole checkpoint")
            return files
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise UserError(f"{self.named}: {str(self.directory)!r} holds no *.safetensors; convert a .bin checkpoint "
                            "with transformers (model.save_pretrained(DIR, safe_serialization=True))")
        return files

    def resolve(self, tensor: Tensor) -> Tensor:
        """GPT-2's tensors as this checkpoint names them (with or without GPT2LMHeadModel's prefix)."""
        if tensor.name.startswith(GPT2_PREFIX) and tensor.of_layer(0) not in self.file_of:
            return dataclasses.replace(tensor, name=tensor.name[len(GPT2_PREFIX):])
        return tensor

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open[self.file_of[name]].get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """tensor[index], reading no more of the file than that."""
        part = self._open[self.file_of[name]].get_slice(name)
        if part.get_dtype() == "BF16":
            return _bfloat16_view(self.file_of[name], name, tuple(part.get_shape()))[index]
        return np.asarray(part[index])


def _bfloat16_view(path: Path, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A read-only map of one bfloat16 tensor of a safetensors file (an 8-byte header size, a JSON header with each
    tensor's byte range, then the data)."""
    with path.open("rb") as file:
        (header_size,) = struct.unpack("<Q", file.read(8))
        begin, _ = json.loads(file.read(header_size))[name]["data_offsets"]
    return np.memmap(path, dtype=ml_dtypes.bfloat16, mode="r", offset=8 + header_size + begin, shape=shape)
