"""What data a run was trained on (its example counts and a digest of sampled examples), saved with each
checkpoint, so that a resume on data that changed since says so: it cannot continue the run exactly."""

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


def identity_record(examples: tuple[int, int], digest: str) -> dict:
    """The JSON a checkpoint keeps of data_identity's values."""
    return {"examples": list(examples), "digest": digest}


def data_change(config: DataConfig, then: dict, now: dict) -> str | None:
    """How the data differs between two identity_records (from the checkpoint a run resumes, and of the data now), or
    None (also when `then` is none: {} from a checkpoint written before xlatrain kept its data's identity)."""
    examples = then.get("examples") if isinstance(then, dict) else None
    if then == now or not (isinstance(examples, list) and len(examples) == 2 and isinstance(then.get("digest"), str)):
        return None
    named = f"data.source={config.source}" + (f", data.path={config.path!r}" if getattr(config, "path", None) else "")
    (train, held_out), (train_now, held_out_now) = then["examples"], now["examples"]
    if (train, held_out) != (train_now, held_out_now):
        return f"{named}: {train} training and {held_out} held-out examples then, {train_now} and {held_out_now} now"
    return f"{named}: as many examples, but sampled ones differ (digest {then['digest']} then, {now['digest']} now)"
