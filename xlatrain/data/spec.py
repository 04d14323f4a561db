"""What a data source tells the model builder: example shapes and the size of the output."""

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DataSpec:
    input_shape: tuple[int, ...]
    """One example, no batch axis."""
    input_dtype: np.dtype
    target_shape: tuple[int, ...]
    target_dtype: np.dtype
    num_outputs: int
    """Classes (or vocabulary) for cross-entropy; output features for mse."""
    origin: str = "the data"
    """Where the examples come from, for error messages (e.g. "data.path='x.npz'")."""
    buckets: tuple[int, ...] | None = None
    """Variable-length examples: batches are padded to one of these lengths (the last is input_shape[0])
    and carry a `mask` shaped like `targets`."""
