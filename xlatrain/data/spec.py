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
