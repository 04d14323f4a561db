"""What a data source tells the model builder: example shapes and the size of the output."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

DOCUMENT_KEYS = ("segment_ids", "positions")
"""The batch entries of packed documents: which document (1, 2, ...; 0 is padding) each position is in, and its
position within that document."""


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
    documents: bool = False
    """Packed documents: examples carry `segment_ids` and `positions` (DOCUMENT_KEYS) and a `mask`."""
    tokenizer: dict | None = None
    """The tokenizer's name, vocab_size, end_of_text and fingerprint (token data), for the run's records."""
    pairs: bool = False
    """Preference pairs: each example is two sequences (chosen, rejected) [2, ...] with a `mask`, and their
    `reference` log-probabilities [2]; the model sees each as one of its input_shape."""

    def abstract_batch(self, rows: tuple[int, ...], sharding=None) -> dict[str, jax.ShapeDtypeStruct]:
        """Abstract batch entries [*rows, *example shape] (with a `mask` when examples are padded)."""
        pair = (2,) if self.pairs else ()
        shapes = {"inputs": ((*pair, *self.input_shape), self.input_dtype),
                  "targets": ((*pair, *self.target_shape), self.target_dtype)}
        if self.buckets is not None or self.documents or self.pairs:
            shapes["mask"] = ((*pair, *self.target_shape), np.dtype(np.float32))
        if self.pairs:
            shapes["reference"] = (pair, np.dtype(np.float32))
        if self.documents:
            shapes.update({key: (self.input_shape, np.dtype(np.int32)) for key in DOCUMENT_KEYS})
        return {k: jax.ShapeDtypeStruct((*rows, *shape), dtype, sharding=sharding)
                for k, (shape, dtype) in shapes.items()}
