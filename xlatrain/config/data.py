"""The `data` section: where examples come from."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import Field, field_validator, model_validator

from xlatrain.config.base import Fraction, PositiveInt, Strict


class DataBase(Strict):
    shuffle: bool = True
    prefetch: PositiveInt = 2
    """Batches kept in flight on the devices by the device loader."""


class DigitsData(DataBase):
    source: Literal["digits"]
    holdout: Fraction = 0.2


class TextData(DataBase):
    source: Literal["text"]
    path: str | None = None
    """Directory of text files; default: this Python's standard-library sources."""
    glob: str = "**/*.py"
    seq_len: PositiveInt = 64
    max_bytes: PositiveInt = 8_000_000
    holdout: Fraction = 0.05
    buckets: tuple[PositiveInt, ...] | None = None
    """Variable-length examples (one paragraph each, up to seq_len bytes), every batch padded to the
    shortest of these lengths (or seq_len) that fits it, with padding masked out of the loss.
    Default: fixed windows of seq_len."""

    @field_validator("glob")
    @classmethod
    def _relative_pattern(cls, pattern: str) -> str:
        if not pattern or Path(pattern).is_absolute():
            raise ValueError(f"data.glob={pattern!r} must be a non-empty pattern relative to data.path, e.g. "
                             "'**/*.txt'")
        return pattern

    @model_validator(mode="after")
    def _path_exists(self) -> TextData:
        if self.path is not None and not Path(self.path).is_dir():
            raise ValueError(f"data.path={self.path!r} is not a directory; point it at a folder of text files")
        if self.buckets is not None:
            if not self.buckets or list(self.buckets) != sorted(set(self.buckets)) or self.buckets[-1] > self.seq_len:
                raise ValueError(f"data.buckets={list(self.buckets)} must be strictly increasing lengths "
                                 f"no longer than data.seq_len={self.seq_len}")
        return self


class ArrayData(DataBase):
    source: Literal["arrays"]
    path: str
    """A directory holding inputs.npy and targets.npy (memory-mapped), or an .npz file with those keys."""
    holdout: Fraction = 0.1

    @model_validator(mode="after")
    def _path_exists(self) -> ArrayData:
        if not Path(self.path).exists():
            raise ValueError(
                f"data.path={self.path!r} does not exist; give a directory with inputs.npy and "
                "targets.npy, or an .npz file"
            )
        return self


DataConfig = Annotated[Union[DigitsData, TextData, ArrayData], Field(discriminator="source")]
