"""Token data: `xlatrain data prepare` against Hugging Face `tokenizers` alone, the tokens loader against the step
it feeds, and the shard format (flat memory-mapped arrays vs ArrayRecord read through grain).

The corpus is this Python's standard-library sources (the first CORPUS_BYTES of them, copied to a scratch
directory), tokenized by a byte-level BPE of 4,096 ids trained on its first 4 MB.

- prepare: MB/s of text of `prepare` (read, encode, write shards and manifest) against reading the same files,
  calling the tokenizer's `encode_batch_fast` on the same batches with the same threads (tokenizers' own pool) and
  taking each document's ids; rounds alternate; target >= 0.9x.
- loader: the default GPT trained on `data.source: tokens` (packing on, 200 steps): the share of the time the
  loop waits for data (the time breakdown; target < 1%), and the device loader alone (batches on the device, as
  the step takes them) against the steps per second of that run (target >= 10x).
- format: random windows of seq_len + 1 tokens read per second from the flat shards (np.memmap, what
  `data.source: tokens` reads) and from the same tokens written as ArrayRecord records of seq_len + 1 tokens each,
  read through grain's ArrayRecordDataSource (one record per window: ArrayRecord cannot cut a window at any
  token).

    python3 -m bench.token_data            # writes bench/results/token_data.json
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from bench.common import write_results
from xlatrain.commands.prepare import BATCH_BYTES, Request, prepare
from xlatrain.config import load_config
from xlatrain.data.loader import device_train_loader
from xlatrain.data.shards import open_shards
from xlatrain.data.sources import default_text_dir, open_dataset
from xlatrain.data.tokenizers import load_tokenizer, train_bpe
from xlatrain.mesh import build_mesh
from xlatrain.trainer import train

CORPUS_BYTES = 24 << 20
ROUNDS = 5
SEQ_LEN = 64


def copy_corpus(into: Path) -> int:
    total = 0
    for index, path in enumerate(sorted(default_text_dir().glob("**/*.py"))):
        if total >= CORPUS_BYTES:
            break
        data = path.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if data:
            (into / f"{index:05d}.py").write_bytes(data)
            total += len(data)
    return total


def encode_directly(corpus: Path, tokenizer_file: Path) -> None:
    """What prepare does of the tokenizer's work, and nothing else: read each file, encode the batches, take each
    document's ids (the list `Encoding.ids` builds: the least a caller needs to have the tokens)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    texts, size = [], 0
    for path in sorted(corpus.glob("**/*")):
        text = path.read_bytes().decode("utf-8")
        texts.append(text)
        size += len(text)
        if size >= BATCH_BYTES:
            [e.ids for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
            texts, size = [], 0
    if texts:
        [e.ids for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]


def prepare_throughput(scratch: Path, corpus: Path, tokenizer_file: Path, total: int) -> dict:
    seconds: dict[str, list[float]] = {"xlatrain data prepare": [], "tokenizers encode_batch_fast": []}
    for round_index in range(ROUNDS):
        for name in seconds if round_index % 2 == 0 else reversed(list(seconds)):
            start = time.perf_counter()
            if name == "xlatrain data prepare":
                out = scratch / f"prepared-{round_index}"
                prepare(Request((corpus,), out, tokenizer=str(tokenizer_file)))
            else:
                encode_directly(corpus, tokenizer_file)
            seconds[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    mb_s = {name: round(total / 1e6 / value, 2) for name, value in medians.items()}
    return {"mb_per_s": mb_s, "ratio": round(mb_s["xlatrain data prepare"] / mb_s["tokenizers encode_batch_fast"], 3),
            "seconds": seconds, "corpus_bytes": total}


def loader_against_step(scratch: Path, shards: Path) -> dict:
    overrides = ["data.source=tokens", f"data.path={shards}", f"data.seq_len={SEQ_LEN}", "data.packing=true",
                 "trainer.steps=200", "trainer.progress=false", "trainer.eval_every=100000",
                 "trainer.checkpoint_every=100000", "mesh.data=1", f"trainer.run_dir={scratch / 'run'}"]
    config = load_config(None, overrides)
    result = train(config, devices=jax.devices()[:1], echo=lambda _: None)
    summary = result.summary
    steps = summary.final_step - summary.start_step
    steps_per_s = steps / summary.wall_seconds
    dataset = open_dataset(config.data)
    mesh = build_mesh(config, jax.devices()[:1])
    loader = device_train_loader(dataset, mesh, seed=0, shuffle=True, global_batch=16, microbatches=1,
                                 steps_per_sync=1, prefetch=2, data_state=None, moved=lambda _: None)
    for _ in range(20):
        jax.block_until_ready(next(loader))
    batches, start = 500, time.perf_counter()
    for _ in range(batches):
        jax.block_until_ready(next(loader))
    loader_per_s = batches / (time.perf_counter() - start)
    loader.close()
    return {"step_per_s": round(steps_per_s, 2), "loader_batches_per_s": round(loader_per_s, 1),
            "loader_over_step": round(loader_per_s / steps_per_s, 1),
            "data_wait_share": round(summary.data_wait_seconds / summary.wall_seconds, 5),
            "time_breakdown": summary.time_breakdown}


def shard_format(scratch: Path, shards: Path) -> dict:
    import grain
    from array_record.python.array_record_module import ArrayRecordWriter

    tokens = np.concatenate([np.asarray(s.tokens) for s in open_shards(shards).train])
    windows = (len(tokens) - 1) // SEQ_LEN
    path = scratch / "windows.array_record"
    writer = ArrayRecordWriter(str(path), "group_size:1")
    for index in range(windows):
        writer.write(tokens[index * SEQ_LEN:index * SEQ_LEN + SEQ_LEN + 1].tobytes())
    writer.close()
    records = grain.sources.ArrayRecordDataSource([str(path)])
    flat = np.memmap(next(shards.glob("train-00000.bin")), dtype=tokens.dtype, mode="r")
    flat_windows = (len(flat) - 1) // SEQ_LEN
    order = np.random.default_rng(0).permutation(min(windows, flat_windows))[:20_000]

    def read_flat():
        for index in order:
            np.asarray(flat[index * SEQ_LEN:index * SEQ_LEN + SEQ_LEN + 1], np.int32)

    def read_records():
        for index in order:
            np.frombuffer(records[int(index)], tokens.dtype).astype(np.int32)

    seconds: dict[str, list[float]] = {"flat memmap": [], "ArrayRecord (grain)": []}
    readers = {"flat memmap": read_flat, "ArrayRecord (grain)": read_records}
    for round_index in range(ROUNDS):
        for name in seconds if round_index % 2 == 0 else reversed(list(seconds)):
            start = time.perf_counter()
            readers[name]()
            seconds[name].append(time.perf_counter() - start)
    per_s = {name: round(len(order) / statistics.median(v)) for name, v in seconds.items()}
    return {"windows_per_s": per_s, "flat_over_array_record": round(per_s["flat memmap"] /
                                                                     per_s["ArrayRecord (grain)"], 2),
            "bytes_on_disk": {"flat": int(sum(p.stat().st_size for p in shards.glob("train-*"))),
                              "array_record": path.stat().st_size}}


def main() -> None:
    scratch = Path(tempfile.mkdtemp(prefix="xlatrain-bench-tokens-"))
    try:
        corpus = scratch / "corpus"
        corpus.mkdir()
        total = copy_corpus(corpus)
        sample = [p.read_text() for p in sorted(corpus.iterdir())]
        sample = sample[: next(i for i in range(len(sample)) if sum(map(len, sample[:i])) > 4 << 20)]
        tokenizer_file = scratch / "tokenizer.json"
        tokenizer_file.write_text(train_bpe(sample, 4096).serialized)
        load_tokenizer(str(tokenizer_file))
        throughput = prepare_throughput(scratch, corpus, tokenizer_file, total)
        shards = scratch / "prepared-0"
        loader = loader_against_step(scratch, shards)
        formats = shard_format(scratch, shards)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"data prepare {throughput['mb_per_s']} MB/s: ratio {throughput['ratio']} (target >= 0.9)")
    print(f"loader {loader['loader_batches_per_s']} batches/s vs step {loader['step_per_s']} steps/s: "
          f"{loader['loader_over_step']}x (target >= 10x); waiting for data {100 * loader['data_wait_share']:.3f}% "
          "(target < 1%)")
    print(f"random windows per second: {formats['windows_per_s']} ({formats['flat_over_array_record']}x)")
    write_results("token_data", "python3 -m bench.token_data",
                  {"prepare": throughput, "loader": loader, "format": formats})


if __name__ == "__main__":
    main()
