"""What data a run was trained on (its example counts and a digest of sampled examples), saved with each
checkpoint, so that a resume on data that changed since says so: it cannot continue the run exactly."""

from __future__ import annotations

import hashlib

import numpy as np

from xlatrain.config import DataConfig
from xlatrain.data.sources import Dataset
from xlatrain.errors import UserError
from xlatrain.runtime.distributed import everyones, host_name

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


def identity_record(examples: tuple[int, int], digest: str, tokenizer: dict | None = None) -> dict:
    """The JSON a checkpoint keeps of data_identity's values, and of token data the fingerprints of its tokenizer
    and of its shards' manifest (DataSpec.tokenizer)."""
    record = {"examples": list(examples), "digest": digest}
    if tokenizer is not None:
        record["tokenizer"] = tokenizer["fingerprint"]
        if "shards" in tokenizer:
            record["shards"] = tokenizer["shards"]
    return record


def check_same_tokenizer(config: DataConfig, then: dict, now: dict, step: int) -> None:
    """A checkpoint's ids mean the text of the tokenizer it was trained with: resuming on ids of another is
    refused (a checkpoint without the record, from bytes or before xlatrain kept it, is not checked)."""
    before = then.get("tokenizer") if isinstance(then, dict) else None
    if before is not None and before != now.get("tokenizer"):
        raise UserError(f"{_named(config)}: checkpoint {step} was trained on ids of tokenizer {before}, but this data "
                        f"is tokenized by {now.get('tokenizer', 'bytes')}: its ids would mean other text; resume on "
                        "the data (or shards) the run was trained on, or start a new run")


def data_change(config: DataConfig, then: dict, now: dict) -> str | None:
    """How the data differs between two identity_records (from the checkpoint a run resumes, and of the data now), or
    None (also when `then` is none: {} from a checkpoint written before xlatrain kept its data's identity)."""
    examples = then.get("examples") if isinstance(then, dict) else None
    if then == now or not (isinstance(examples, list) and len(examples) == 2 and isinstance(then.get("digest"), str)):
        return None
    (train, held_out), (train_now, held_out_now) = then["examples"], now["examples"]
    if (train, held_out) != (train_now, held_out_now):
        return (f"{_named(config)}: {train} training and {held_out} held-out examples then, {train_now} and "
                f"{held_out_now} now")
    if then["digest"] != now["digest"]:
        return (f"{_named(config)}: as many examples, but sampled ones differ (digest {then['digest']} then, "
                f"{now['digest']} now)")
    if then.get("shards", now.get("shards")) != now.get("shards"):
        return (f"{_named(config)}: the shards' manifest changed (fingerprint {then['shards']} then, "
                f"{now['shards']} now)")
    return None


def check_every_process_reads_the_same(config: DataConfig, record: dict) -> None:
    """Every process reads its rows of one shuffled order from its own copy of the data: copies that differ (a
    host with a stale or partial one) would train on rows that no one dataset holds. One error on every process,
    naming the ranks whose identity_record differs from process 0's."""
    records = everyones("data_identity", [record, host_name()])
    (reference, first_host), differing = records[0], []
    for rank, (theirs, host) in enumerate(records[1:], start=1):
        if theirs == reference:
            continue
        if theirs["examples"] != reference["examples"]:
            (train, held_out), (train_0, held_out_0) = theirs["examples"], reference["examples"]
            differing.append(f"rank {rank} (host {host}) has {train} training and {held_out} held-out examples, "
                             f"rank 0 (host {first_host}) {train_0} and {held_out_0}")
        else:
            differing.append(f"rank {rank} (host {host}) has as many examples as rank 0 (host {first_host}), but "
                             f"sampled ones differ (digest {theirs['digest']} against {reference['digest']})")
    if differing:
        raise UserError(f"{_named(config)}: the processes read different data: {'; '.join(differing[:3])}; each "
                        "process reads its rows from its own copy, so give every host the same files")


def _named(config: DataConfig) -> str:
    return f"data.source={config.source}" + (f", data.path={config.path!r}" if getattr(config, "path", None) else "")
