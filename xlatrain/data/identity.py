"""What a run's data was when the run was written (its example counts and a digest of sampled examples), saved in
config.yaml, so that a resume on data that changed since says so: it cannot continue the run exactly."""

from __future__ import annotations

import hashlib

import numpy as np

from xlatrain.config import DataConfig
from xlatrain.data.sources import Dataset

SAMPLED_EXAMPLES = 1024
"""Examples per split read for the digest, evenly spread: a bounded cost however large the data; an edit that
touches none of them goes unnoticed."""


def data_identity(dataset: Dataset) -> tuple[tuple[int, int], str]:
    """(training examples, held-out examples) and a sha256 of the sampled examples of both splits."""
    digest = hashlib.sha256()
    for source in (dataset.train, dataset.eval):
        for index in _sampled(len(source)):
            for key, value in sorted(source[int(index)].items()):
                value = np.ascontiguousarray(value)
                digest.update(f"{key}:{value.dtype.str}:{value.shape}".encode())
                digest.update(value.tobytes())
    return (len(dataset.train), len(dataset.eval)), digest.hexdigest()[:16]


def _sampled(count: int) -> np.ndarray:
    return np.unique(np.linspace(0, count - 1, min(count, SAMPLED_EXAMPLES)).round().astype(np.int64))


def data_change(config: DataConfig, saved: dict, examples: tuple[int, int], digest: str) -> str | None:
    """How the data differs from what config.yaml's `derived` recorded when the run was written, or None (also when
    it recorded nothing: a run written before xlatrain kept its data's identity)."""
    then, then_digest = saved.get("data_examples"), saved.get("data_digest")
    if not (isinstance(then, list) and len(then) == 2 and isinstance(then_digest, str)) \
            or (list(examples) == then and digest == then_digest):
        return None
    named = f"data.source={config.source}" + (f", data.path={config.path!r}" if getattr(config, "path", None) else "")
    if list(examples) != then:
        return (f"{named}: {then[0]} training and {then[1]} held-out examples then, {examples[0]} and "
                f"{examples[1]} now")
    return f"{named}: as many examples, but sampled ones differ (digest {then_digest} then, {digest} now)"
