"""Examples from prepared token shards: windows of seq_len + 1 tokens, or whole documents packed into rows.

Both are random-access sources that grain shuffles, so a checkpoint's grain state says exactly where the data was.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xlatrain.data.shards import Shard


@dataclass(frozen=True)
class ShardWindows:
    """Windows of seq_len + 1 tokens at stride seq_len within each shard (crossing documents, which the
    end-of-text token separates), as next-token (inputs, targets) records."""

    shards: tuple[Shard, ...]
    seq_len: int

    def __post_init__(self):
        counts = [max(0, (len(s.tokens) - 1) // self.seq_len) for s in self.shards]
        object.__setattr__(self, "_first", np.cumsum([0, *counts]))

    def __len__(self) -> int:
        return int(self._first[-1])

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        shard = int(np.searchsorted(self._first, index, side="right")) - 1
        start = (index - int(self._first[shard])) * self.seq_len
        window = np.asarray(self.shards[shard].tokens[start:start + self.seq_len + 1], np.int32)
        return {"inputs": window[:-1], "targets": window[1:]}


@dataclass(frozen=True)
class PackedRows:
    """Whole documents packed in order into rows of seq_len positions, a document longer than a row split into
    pieces of seq_len + 1 tokens that overlap by one (every next-token pair is in one piece). Each record carries
    `segment_ids` (1, 2, ... per piece of the row, 0 on padding), `positions` (restarting at 0 in each piece) and
    `mask` (1 on the pieces' targets), so that attention and the loss stay inside a document.

    Shards with loss weights hold examples (a conversation, a prompt and its completion): each is one piece,
    never split (a later piece would lose the prompt), truncated to its first seq_len + 1 tokens (TRL's
    `keep_start`); the mask is its targets' weights, and an example left with no weighted target is skipped
    (`skipped` counts them, `truncated` those cut)."""

    shards: tuple[Shard, ...]
    seq_len: int

    def __post_init__(self):
        whole = [_whole_examples(s.bounds, s.weights, self.seq_len) for s in self.shards if s.weights is not None]
        object.__setattr__(self, "skipped", sum(skipped for _, skipped, _ in whole))
        object.__setattr__(self, "truncated", sum(truncated for _, _, truncated in whole))
        pieces = ([kept for kept, _, _ in whole] if whole else [_pieces(s.bounds, self.seq_len) for s in self.shards])
        shard_of = np.concatenate([np.full(len(p), i, np.int32) for i, p in enumerate(pieces)] or [np.zeros(0)])
        starts = np.concatenate([p[:, 0] for p in pieces] or [np.zeros(0, np.int64)])
        lengths = np.concatenate([p[:, 1] for p in pieces] or [np.zeros(0, np.int64)])
        object.__setattr__(self, "_shard", shard_of)
        object.__setattr__(self, "_start", starts)
        object.__setattr__(self, "_length", lengths)
        object.__setattr__(self, "_row_first", _next_fit(lengths - 1, self.seq_len))

    def __len__(self) -> int:
        return len(self._row_first) - 1

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        row = {k: np.zeros(self.seq_len, np.int32) for k in ("inputs", "targets", "segment_ids", "positions")}
        mask = np.zeros(self.seq_len, np.float32)
        at = 0
        for segment, piece in enumerate(range(self._row_first[index], self._row_first[index + 1]), start=1):
            start, length = int(self._start[piece]), int(self._length[piece])
            tokens = np.asarray(self.shards[self._shard[piece]].tokens[start:start + length], np.int32)
            span = slice(at, at + length - 1)
            row["inputs"][span], row["targets"][span] = tokens[:-1], tokens[1:]
            row["segment_ids"][span] = segment
            row["positions"][span] = np.arange(length - 1)
            weights = self.shards[self._shard[piece]].weights
            mask[span] = 1.0 if weights is None else weights[start + 1:start + length]
            at += length - 1
        return {**row, "mask": mask}


@dataclass(frozen=True)
class PreferencePairs:
    """The preference pairs of shards prepared from preference records (each pair two documents side by side: the
    prompt with the chosen answer, then with the rejected one), one record per pair, so that a batch, and every
    replica's and microbatch's share of it, holds whole pairs: `inputs`, `targets` and `mask` [2, seq_len], the
    chosen row first, each row one sequence from position 0, cut to its first seq_len + 1 tokens and padded (the
    mask, its targets' weights, is 0 on padding). A pair either of whose rows has no weighted target left is
    skipped. `reference`: each pair's two reference log-probabilities [pairs, 2], once they are computed
    (model.dpo), added to its record."""

    shards: tuple[Shard, ...]
    seq_len: int
    reference: np.ndarray | None = None

    def __post_init__(self):
        found = [(index, _whole_examples(s.bounds, s.weights, self.seq_len)) for index, s in enumerate(self.shards)]
        shard_of, starts, lengths, skipped, truncated = [], [], [], 0, 0
        for index, (pieces, _, cut) in found:
            bounds = np.asarray(self.shards[index].bounds[:-1], np.int64)
            kept = dict(zip(pieces[:, 0].tolist(), pieces[:, 1].tolist()))
            for chosen, rejected in zip(bounds[0::2].tolist(), bounds[1::2].tolist()):
                if chosen in kept and rejected in kept:
                    shard_of.append(index)
                    starts.append((chosen, rejected))
                    lengths.append((kept[chosen], kept[rejected]))
                else:
                    skipped += 1
            truncated += cut
        object.__setattr__(self, "_shard", np.asarray(shard_of, np.int32))
        object.__setattr__(self, "_start", np.asarray(starts, np.int64).reshape(-1, 2))
        object.__setattr__(self, "_length", np.asarray(lengths, np.int64).reshape(-1, 2))
        object.__setattr__(self, "skipped", skipped)
        object.__setattr__(self, "truncated", truncated)

    def use_reference(self, values: np.ndarray) -> None:
        """The pairs' reference log-probabilities [pairs, 2], computed once the model exists (set once, before the
        loader reads a record)."""
        object.__setattr__(self, "reference", values)

    def __len__(self) -> int:
        return len(self._shard)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        shard = self.shards[self._shard[index]]
        record = {k: np.zeros((2, self.seq_len), np.int32) for k in ("inputs", "targets")}
        record["mask"] = np.zeros((2, self.seq_len), np.float32)
        for row, (start, length) in enumerate(zip(self._start[index].tolist(), self._length[index].tolist())):
            tokens = np.asarray(shard.tokens[start:start + length], np.int32)
            record["inputs"][row, :length - 1], record["targets"][row, :length - 1] = tokens[:-1], tokens[1:]
            record["mask"][row, :length - 1] = shard.weights[start + 1:start + length]
        if self.reference is not None:
            record["reference"] = self.reference[index].astype(np.float32)
        return record


def _pieces(bounds: np.ndarray, seq_len: int) -> np.ndarray:
    """[n, 2] (start, length) of each document's pieces of at most seq_len + 1 tokens, overlapping by one;
    documents of one token (an empty text's end-of-text) have no next-token pair and give none."""
    starts, stops = np.asarray(bounds[:-1], np.int64), np.asarray(bounds[1:], np.int64)
    pairs = stops - starts - 1
    per_document = np.maximum(0, -(-pairs // seq_len))
    document = np.repeat(np.arange(len(starts)), per_document)
    first_piece = np.cumsum(per_document) - per_document
    offset = (np.arange(len(document)) - first_piece[document]) * seq_len
    piece_start = starts[document] + offset
    piece_length = np.minimum(seq_len + 1, stops[document] - piece_start)
    return np.stack([piece_start, piece_length], axis=1)


def _whole_examples(bounds: np.ndarray, weights: np.ndarray, seq_len: int) -> tuple[np.ndarray, int, int]:
    """([n, 2] (start, length) of each example cut to its first seq_len + 1 tokens, those with no weighted target
    in it left out; how many were left out; how many of those kept were cut)."""
    starts, stops = np.asarray(bounds[:-1], np.int64), np.asarray(bounds[1:], np.int64)
    lengths = np.minimum(stops - starts, seq_len + 1)
    weighted = np.zeros(len(starts), np.int64)
    pairs = np.flatnonzero(lengths > 1)
    if len(pairs):  # the targets' weights summed per example: [start + 1, start + length), one pass over the file
        edges = np.stack([starts[pairs] + 1, starts[pairs] + lengths[pairs]], axis=1).reshape(-1)
        edges = edges[:-1] if edges[-1] == len(weights) else edges  # the last sum runs to the end anyway
        weighted[pairs] = np.add.reduceat(np.asarray(weights), edges, dtype=np.int64)[::2]
    kept = weighted > 0
    pieces = np.stack([starts[kept], lengths[kept]], axis=1)
    return pieces, int(np.sum(~kept)), int(np.sum(kept & (stops - starts > seq_len + 1)))


def _next_fit(sizes: np.ndarray, capacity: int) -> np.ndarray:
    """Row boundaries of items packed in order, a new row whenever the next item does not fit: rows + 1 offsets."""
    firsts, used = [0], 0
    for index, size in enumerate(sizes.tolist()):
        if used + size > capacity:
            firsts.append(index)
            used = 0
        used += size
    if len(sizes):
        firsts.append(len(sizes))
    return np.asarray(firsts, np.int64)
