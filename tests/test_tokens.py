"""Language-model data: tokenizers, `xlatrain data prepare` and its shards, windows and packed documents, packed
attention against documents run one by one, pipelines and torch models on packed data, exact resume, and every
bad input as one line."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, TINY_GPT, run_cli, token_batch
from test_pipeline import PIPELINE, relative_errors

from xlatrain.cli import main
from xlatrain.commands.prepare import Request, prepare
from xlatrain.config import load_config
from xlatrain.data.shards import MANIFEST, open_shards
from xlatrain.data.sources import open_dataset, run_tokenizer
from xlatrain.data.tokenizers import byte_tokenizer, load_tokenizer, rounded_vocab, train_bpe
from xlatrain.data.tokens import PackedRows, ShardWindows
from xlatrain.errors import UserError
from xlatrain.models.interface import Documents
from xlatrain.program import build_program
from xlatrain.run.metrics import read_metrics
from xlatrain.trainer import train

WORDS = "the a model data token shard train step loss batch device mesh pipeline tensor gradient optimizer".split()


def write_corpus(directory, documents=300, seed=0):
    """A JSONL file of documents of 1..150 words (two in three shorter than 12) and a few text files (one document
    each)."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / "docs.jsonl").open("w") as lines:
        for i in range(documents):
            words = rng.choice(WORDS, size=int(rng.integers(1, 12) if i % 3 else rng.integers(12, 150)))
            lines.write(json.dumps({"text": " ".join(words), "id": i}) + "\n")
    for i in range(4):
        (directory / f"file{i}.txt").write_text("\n".join(" ".join(rng.choice(WORDS, 12)) for _ in range(20)))
    return directory


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def shards(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("shards") / "bpe"
    prepare(Request((corpus,), out, train_vocab=320, holdout=0.05, shard_tokens=5_000))
    return out


TINY_MODEL = [o for o in TINY_GPT if not o.startswith("data.")]


def tokens_run(shards, *overrides):
    return [*TINY_MODEL, "data.source=tokens", f"data.path={shards}", "data.seq_len=32", *overrides]


# --- tokenizers ---

def bos_tokenizer(directory, corpus, *, add_bos_token=None):
    """A byte-level BPE learned from the corpus whose template begins every text with `<bos>`, as Llama's and
    Gemma's tokenizer.json do; `add_bos_token`: what a tokenizer_config.json beside it says (None: there is none)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors

    tokenizer = HFTokenizer.from_str(train_bpe([p.read_text() for p in sorted(corpus.iterdir())], 300).serialized)
    tokenizer.add_special_tokens(["<bos>"])
    bos = tokenizer.token_to_id("<bos>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    if add_bos_token is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": add_bos_token,
                                                                     "bos_token": "<bos>"}))
    return directory, bos


def test_a_tokenizer_begins_texts_with_its_bos_as_transformers_encodes_them(corpus, tmp_path):
    from transformers import PreTrainedTokenizerFast

    directory, bos = bos_tokenizer(tmp_path / "bos", corpus)
    reference = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
    ours = load_tokenizer(str(directory))
    expected = reference("the model trains")["input_ids"]
    assert ours.bos == bos == expected[0]
    assert [ours.bos, *ours.encode_batch(["the model trains"])[0].tolist()] == expected
    assert load_tokenizer(str(bos_tokenizer(tmp_path / "off", corpus, add_bos_token=False)[0])).bos is None
    assert byte_tokenizer().bos is None and train_bpe(["a b c"], 300).bos is None


def test_prepared_and_text_documents_begin_with_the_bos_the_data_chooses(corpus, tmp_path):
    directory, bos = bos_tokenizer(tmp_path / "bos", corpus)
    for flag, begins in (([], True), (["--no-bos"], False)):
        out = tmp_path / ("without" if flag else "with")
        assert main(["data", "prepare", str(corpus), "--out", str(out), "--tokenizer", str(directory), *flag]) == 0
        opened = open_shards(out)
        firsts = {int(shard.tokens[start]) for shard in opened.train for start in shard.bounds[:-1]}
        assert (firsts == {bos}) == begins and (bos in firsts) == begins
        assert opened.manifest["tokenizer"].get("bos") == (bos if begins else None)
        assert run_tokenizer(load_config(None, tokens_run(out)).data, tmp_path).bos == (bos if begins else None)
    text = [*TINY_MODEL, "data.source=text", f"data.path={corpus}", "data.glob='*.txt'", f"data.tokenizer={directory}"]
    for add_bos, begins in (("null", True), ("false", False)):
        dataset = open_dataset(load_config(None, [*text, f"data.add_bos={add_bos}"]).data)
        assert (int(dataset.train[0]["inputs"][0]) == bos) == begins
        assert dataset.spec.tokenizer.get("bos") == (bos if begins else None)


def test_a_text_run_started_before_add_bos_existed_resumes_without_one(corpus, tmp_path):
    """Older versions tokenized text without a BOS: their saved config (no data.add_bos) reads as false, and the
    same config file, whose add_bos is null, resumes that run as it was."""
    from xlatrain.config import config_to_yaml
    from xlatrain.run.directory import check_run_dir, open_run_dir

    directory, _ = bos_tokenizer(tmp_path / "bos", corpus)
    config = load_config(None, [*TINY_MODEL, "data.source=text", f"data.path={corpus}", "data.glob='*.txt'",
                                f"data.tokenizer={directory}", f"trainer.run_dir={tmp_path / 'run'}"])
    assert config.data.add_bos is None
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(config_to_yaml(config).replace("  add_bos: null\n", ""))
    assert check_run_dir(config).data.add_bos is False
    resumed = open_run_dir(config, echo=lambda _: None)
    assert resumed.data.add_bos is False and run_tokenizer(resumed.data, tmp_path / "run").bos is None
    with pytest.raises(UserError, match=r"holds a run with a different config \(data.add_bos differ\)"):
        check_run_dir(config.model_copy(update={"data": config.data.model_copy(update={"add_bos": True})}))

def test_the_byte_tokenizer_adds_an_end_of_text_past_the_bytes():
    tokenizer = byte_tokenizer()
    assert (tokenizer.vocab_size, tokenizer.end_of_text) == (257, 256)
    assert tokenizer.encode_batch(["hé"])[0].tolist() == [104, 195, 169]
    assert tokenizer.decode([104, 195, 169, 256]) == "hé"


def test_a_trained_bpe_round_trips_through_its_file_and_a_directory(tmp_path):
    tokenizer = train_bpe([" ".join(WORDS)] * 20, 300)
    assert tokenizer.vocab_size == 300 and tokenizer.end_of_text == 0
    (tmp_path / "tokenizer.json").write_text(tokenizer.serialized)
    for spec in (tmp_path / "tokenizer.json", tmp_path):
        loaded = load_tokenizer(str(spec))
        assert loaded.fingerprint == tokenizer.fingerprint
        ids = loaded.encode_batch(["the model trains"])[0]
        assert len(ids) < len("the model trains") and loaded.decode(ids) == "the model trains"


def test_a_sentencepiece_model_loads_through_the_optional_package(tmp_path):
    sentencepiece = pytest.importorskip("sentencepiece")
    (tmp_path / "text.txt").write_text("\n".join(" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))) * 5)
    sentencepiece.SentencePieceTrainer.train(input=str(tmp_path / "text.txt"), model_prefix=str(tmp_path / "sp"),
                                            vocab_size=60, model_type="bpe", minloglevel=2)
    tokenizer = load_tokenizer(str(tmp_path / "sp.model"))
    assert tokenizer.vocab_size == 60 and tokenizer.end_of_text == 2  # sentencepiece's </s>
    assert tokenizer.decode(tokenizer.encode_batch(["the model"])[0]) == "the model"
    assert tokenizer.bos is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True, "bos_token": "<s>"}))
    assert load_tokenizer(str(tmp_path / "sp.model")).bos == 1  # sentencepiece's <s>, as its tokenizer_config says


def test_the_vocabulary_defaults_to_the_tokenizers_rounded_up_and_a_smaller_one_is_refused(shards):
    program = build_program(load_config(None, tokens_run(shards, "model.vocab_multiple=64")), jax.devices()[:1])
    assert program.abstract_state.params["head"]["kernel"].shape[-1] == rounded_vocab(320, 64) == 320
    with pytest.raises(UserError, match=r"model.vocab=300 is smaller than the tokenizer's 320 ids"):
        build_program(load_config(None, tokens_run(shards, "model.vocab=300")), jax.devices()[:1])
    default = load_config(None, [])
    assert default.model.vocab is None and open_dataset(default.data).spec.num_outputs == 256  # bytes: as before


# --- data prepare and its shards ---

def test_prepare_writes_shards_and_a_manifest_and_a_repeat_does_nothing(corpus, shards, capsys):
    manifest = json.loads((shards / MANIFEST).read_text())
    train_split, held_out = manifest["splits"]["train"], manifest["splits"]["eval"]
    assert manifest["dtype"] == "uint16" and manifest["tokenizer"]["vocab_size"] == 320
    assert train_split["documents"] + held_out["documents"] == 304 and held_out["documents"] == 16  # 1 in 20
    assert len(train_split["shards"]) > 1  # shard_tokens=5_000
    opened = open_shards(shards)
    eot = manifest["tokenizer"]["end_of_text"]
    first = opened.train[0]
    assert [int(first.tokens[b - 1]) for b in first.bounds[1:4]] == [eot] * 3  # every document ends with it
    before = {p.name: p.stat().st_mtime_ns for p in shards.iterdir()}
    prepare(Request((corpus,), shards, train_vocab=320, holdout=0.05, shard_tokens=5_000))
    assert "nothing to do" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in shards.iterdir()} == before


def test_prepare_reads_parquet_with_the_optional_pyarrow(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as parquet

    parquet.write_table(pyarrow.table({"body": ["one document", "another one", "a third"] * 4}),
                        tmp_path / "docs.parquet")
    prepare(Request((tmp_path / "docs.parquet",), tmp_path / "out", field="body", holdout=0.25))
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert manifest["splits"]["eval"]["documents"] == 3 and manifest["dtype"] == "uint16"
    held_out = open_shards(tmp_path / "out").eval[0]
    assert bytes(held_out.tokens[:12].astype(np.uint8)).decode() == "one document"


def test_an_interrupted_prepare_leaves_no_shard_a_run_would_read_and_a_rerun_finishes(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", documents=20_000)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "xlatrain.cli", "data", "prepare", str(corpus), "--out", str(out),
               "--shard-tokens", "50000"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not list(out.glob("train-*.bin")) and time.monotonic() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert list(out.glob("train-*.bin")) and not (out / MANIFEST).exists()
    refused = run_cli("train", *tokens_run(out), f"trainer.run_dir={tmp_path / 'run'}")
    assert refused.returncode == 2 and "has no manifest.json" in refused.stderr
    finished = subprocess.run(command, capture_output=True, text=True)
    assert finished.returncode == 0, finished.stderr
    documents = 20_000 + 4  # the JSONL lines and the text files
    assert open_shards(out).manifest["splits"]["train"]["documents"] == documents - -(-documents // 100)


def test_windows_cross_documents_and_packed_rows_keep_to_them(shards):
    opened = open_shards(shards)
    windows = ShardWindows(opened.train, 32)
    stream = np.concatenate([s.tokens[: (len(s.tokens) - 1) // 32 * 32 + 1] for s in opened.train[:1]])
    np.testing.assert_array_equal(windows[1]["inputs"], stream[32:64])
    np.testing.assert_array_equal(windows[1]["targets"], stream[33:65])
    packed = PackedRows(opened.train, 32)
    seen_pairs = 0
    for index in range(len(packed)):
        row = packed[index]
        real = row["mask"] > 0
        assert np.all(row["segment_ids"][real] > 0) and np.all(row["segment_ids"][~real] == 0)
        for segment in np.unique(row["segment_ids"][real]):
            at = row["segment_ids"] == segment
            np.testing.assert_array_equal(row["positions"][at], np.arange(at.sum()))
        seen_pairs += int(real.sum())
    documents = np.concatenate([np.diff(s.bounds) for s in opened.train])
    assert seen_pairs == int(np.sum(documents - 1))  # every next-token pair of every document, once
    long_documents = np.sum(documents > 33)
    assert long_documents > 0  # documents longer than a row are split, not dropped


def test_packed_attention_equals_each_document_on_its_own(shards):
    """The GPT on a packed row gives each document's positions the logits it gives that document alone."""
    program = build_program(load_config(None, tokens_run(shards, "data.packing=true")), jax.devices()[:1])
    params = program.create_state().params
    row = next(program.dataset.train[i] for i in range(len(program.dataset.train))
               if program.dataset.train[i]["segment_ids"].max() >= 3)
    packed = program.model.apply(params, row["inputs"][None], documents=Documents(
        row["segment_ids"][None], row["positions"][None]))[0]
    unpacked = program.model.apply(params, row["inputs"][None])[0]
    for segment in range(1, 4):
        at = np.flatnonzero(row["segment_ids"] == segment)
        alone = program.model.apply(params, row["inputs"][None, at])[0]
        np.testing.assert_allclose(packed[at], alone, atol=2e-5)
        if segment > 1:  # without the documents, the later ones attend what precedes them
            assert np.max(np.abs(unpacked[at] - alone)) > 1e-3


def test_a_pipeline_on_packed_documents_equals_the_unpipelined_model(shards, devices):
    def program_for(overrides, devices=None):
        return build_program(load_config(None, tokens_run(shards, *PIPELINE, "data.packing=true", *overrides)),
                             devices)

    common = []
    pipelined = program_for([*common, "mesh.stage=2", "parallel.pipeline.microbatches=2"])
    state, batch = pipelined.create_state(), token_batch(pipelined)
    assert "segment_ids" in batch
    grads, sums = pipelined.compiled_gradients(state, batch)(state, batch)
    reference = program_for([*common, "parallel.mode=jit", "mesh.data=1", "batch.microbatches=8"], devices[:1])
    expected_grads, expected_sums = jax.device_get(reference.gradients(reference.create_state(),
                                                                       token_batch(reference)))
    np.testing.assert_allclose(sums["loss"], expected_sums["loss"], rtol=1e-5)
    assert float(sums["weight"]) == float(expected_sums["weight"]) < 16 * pipelined.derived.global_batch
    errors = relative_errors(expected_grads, pipelined.pipeline.layout.layer_params(grads))
    assert max(jax.tree.leaves(errors)) < 1e-5, errors


@pytest.mark.slow
def test_a_resumed_packed_run_reads_exactly_the_examples_of_an_uninterrupted_one(shards, tmp_path):
    common = tokens_run(shards, "data.packing=true", "optimizer.schedule=constant", "trainer.checkpoint_every=3",
                        "batch.global_size=8", "mesh.data=2", "trainer.steps_per_sync=2")

    def run(name, steps):
        return train(load_config(None, [*common, f"trainer.steps={steps}", f"trainer.run_dir={tmp_path / name}"]),
                     devices=jax.devices()[:2], echo=lambda _: None)

    straight = run("straight", 10)
    run("resumed", 6)
    resumed = run("resumed", 10)
    assert resumed.start_step == 6
    logged = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "resumed" / "metrics.jsonl") if "loss" in r}
    assert [logged[s] for s in range(1, 11)] == [straight.losses[s] for s in range(1, 11)]


def test_resuming_on_shards_of_another_tokenizer_is_refused(corpus, tmp_path):
    run_dir, path = tmp_path / "run", tmp_path / "shards"
    prepare(Request((corpus,), path, train_vocab=320, holdout=0.05))
    train(load_config(None, tokens_run(path, "trainer.steps=2", "model.vocab=320", f"trainer.run_dir={run_dir}")),
          echo=lambda _: None)
    for file in path.iterdir():
        file.unlink()
    prepare(Request((corpus,), path, holdout=0.05))  # bytes, in the place of the BPE's shards
    refused = run_cli("train", *tokens_run(path, "trainer.steps=4", "model.vocab=320", f"trainer.run_dir={run_dir}"))
    assert refused.returncode == 2, refused.stderr
    assert "was trained on ids of tokenizer" in refused.stderr and refused.stderr.count("\n") == 1


def test_a_torch_model_gets_segment_ids_when_its_forward_takes_them_and_is_refused_otherwise(shards, tmp_path):
    pytest.importorskip("torch")
    common = ["data.source=tokens", f"data.path={shards}", "data.seq_len=32", "data.packing=true",
              "trainer.progress=false", "model.name=torch", "model.kwargs.vocab=320",
              "model.kwargs.width=32", "model.kwargs.max_len=32", "trainer.steps=2"]
    taking = train(load_config(None, [*common, "model.target=torch_models:PackedTinyLM",
                                      f"trainer.run_dir={tmp_path / 'a'}"]), echo=lambda _: None)
    assert np.isfinite(taking.losses[2])
    with pytest.raises(UserError, match="cannot keep attention inside the documents"):
        build_program(load_config(None, [*common, "model.target=torch_models:UnpackedTinyLM"]), jax.devices()[:1])


# --- bad input: one line, exit 2, nothing overwritten ---

@pytest.mark.parametrize("case", ["empty", "glob", "utf8", "json_field", "not_json", "tokenizer", "tokenizer_config",
                                  "parquet_field", "not_a_shard_dir", "other_inputs"])
def test_bad_prepare_input_is_one_line_naming_the_file(case, tmp_path):
    inputs = tmp_path / "in"
    inputs.mkdir()
    out = tmp_path / "out"
    extra = []
    if case == "empty":
        (inputs / "a.txt").write_text("")
        expected = "a.txt is empty"
    elif case == "glob":
        (inputs / "a.txt").write_text("text")
        extra, expected = ["--glob", "*.md"], "has no files matching --glob '*.md'"
    elif case == "utf8":
        (inputs / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
        expected = "latin.txt is not UTF-8 text (byte 3"
    elif case == "json_field":
        (inputs / "d.jsonl").write_text('{"text": "x"}\n{"body": "y"}\n')
        expected = "d.jsonl:2 has no field 'text' (it has: body)"
    elif case == "not_json":
        (inputs / "d.jsonl").write_text('{"text": "x"}\nnot json\n')
        expected = "d.jsonl:2 is not a JSON object"
    elif case == "tokenizer":
        (inputs / "a.txt").write_text("text")
        (tmp_path / "tokenizer.json").write_text('{"not": "a tokenizer"}')
        extra, expected = ["--tokenizer", str(tmp_path / "tokenizer.json")], "is not a Hugging Face tokenizer.json"
    elif case == "tokenizer_config":
        (inputs / "a.txt").write_text("text")
        (tmp_path / "tok").mkdir()
        (tmp_path / "tok" / "tokenizer.json").write_text(train_bpe(["a b c"], 300).serialized)
        (tmp_path / "tok" / "tokenizer_config.json").write_text('{"add_bos_token": true, "bos_token": "<bos>"}')
        extra, expected = ["--tokenizer", str(tmp_path / "tok")], "sets add_bos_token, but its bos_token '<bos>' is not"
    elif case == "parquet_field":
        pyarrow = pytest.importorskip("pyarrow")
        import pyarrow.parquet as parquet

        parquet.write_table(pyarrow.table({"body": ["x"]}), inputs / "d.parquet")
        expected = "d.parquet is a record of no known format (its fields: body)"
    elif case == "not_a_shard_dir":
        (inputs / "a.txt").write_text("text")
        out.mkdir()
        (out / "notes.md").write_text("mine")
        expected = "holds files that are not token shards (notes.md)"
    else:
        write_corpus(inputs, documents=40)
        prepare(Request((inputs,), out, holdout=0.1))
        (inputs / "more.txt").write_text("another document")
        expected = "holds shards prepared from other inputs or options"
    before = sorted(p.name for p in out.iterdir()) if out.exists() else None
    done = run_cli("data", "prepare", str(inputs), "--out", str(out), *extra)
    assert done.returncode == 2 and expected in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert (sorted(p.name for p in out.iterdir()) if out.exists() else None) == before


@pytest.mark.parametrize("case", ["vocab_huge", "vocab_one", "glob_outside", "refused_midway", "bos_of_bytes",
                                  "bos_of_a_trained_bpe"])
def test_prepare_options_out_of_range_are_one_line_and_a_refusal_leaves_no_out(case, tmp_path, capsys):
    """--train-tokenizer 1099511627776 ended in SIGABRT (a 72 TB allocation), 1 made a 257-id BPE silently,
    --glob '../*' read files outside the input directory, and a refusal while reading left its new, empty --out
    (with the parents it made)."""
    inputs = write_corpus(tmp_path / "in", documents=20)
    (tmp_path / "outside.txt").write_text("not under the input directory")
    out = tmp_path / "new" / "out"
    options = {"vocab_huge": (["--train-tokenizer", "1099511627776"], "--train-tokenizer 1099511627776 is outside "
                                                                      "257..1,048,576"),
               "vocab_one": (["--train-tokenizer", "1"], "--train-tokenizer 1 is outside 257..1,048,576"),
               "glob_outside": (["--glob", "../*"], "--glob '../*' must be a non-empty pattern relative to each INPUT "
                                                    "directory, without `..`"),
               "refused_midway": (["--field", "id"], "field 'id' holds int, not text"),
               "bos_of_bytes": (["--bos"], "data prepare --bos: the tokenizer bytes has no BOS token"),
               "bos_of_a_trained_bpe": (["--bos", "--train-tokenizer", "300"], "the byte-level BPE trained here has "
                                                                                 "no BOS token")}[case]
    assert main(["data", "prepare", str(inputs), "--out", str(out), *options[0]]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and options[1] in lines[0], lines
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("case", ["no_manifest", "truncated_manifest", "truncated_shard", "other_tokenizer",
                                  "max_len", "vocab_dtype"])
def test_bad_shards_are_one_line_naming_the_file(case, shards, tmp_path):
    broken = tmp_path / "shards"
    broken.mkdir()
    for path in shards.iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    overrides = []
    if case == "no_manifest":
        (broken / MANIFEST).unlink()
        expected = "has no manifest.json"
    elif case == "truncated_manifest":
        (broken / MANIFEST).write_text((shards / MANIFEST).read_text()[:200])
        expected = "manifest.json could not be read as JSON"
    elif case == "truncated_shard":
        shard = broken / "train-00000.bin"
        shard.write_bytes(shard.read_bytes()[:-6])
        expected = "train-00000.bin holds"
    elif case == "other_tokenizer":
        overrides, expected = ["data.tokenizer=bytes"], "was prepared with tokenizer bpe-320"
    elif case == "max_len":
        overrides, expected = ["model.max_len=16"], "model.max_len=16 is shorter than data.seq_len=32"
    else:
        manifest = json.loads((broken / MANIFEST).read_text())
        manifest["tokenizer"]["vocab_size"] = 70_000
        from xlatrain.data.shards import manifest_fingerprint

        manifest["fingerprint"] = manifest_fingerprint(manifest)
        (broken / MANIFEST).write_text(json.dumps(manifest))
        expected = "a vocabulary of 70000 ids does not fit the shards' dtype uint16"
    done = run_cli("train", *tokens_run(broken, *overrides), f"trainer.run_dir={tmp_path / 'run'}")
    assert done.returncode == 2 and expected in done.stderr and done.stderr.count("\n") == 1, done.stderr


def copied_shards(shards, to, edit_manifest=None):
    """A copy of `shards`, its manifest edited by `edit_manifest(manifest)` and its fingerprint made to match."""
    from xlatrain.data.shards import manifest_fingerprint

    to.mkdir()
    for path in shards.iterdir():
        (to / path.name).write_bytes(path.read_bytes())
    manifest = json.loads((to / MANIFEST).read_text())
    (edit_manifest or (lambda _: None))(manifest)
    manifest["fingerprint"] = manifest_fingerprint(manifest)
    (to / MANIFEST).write_text(json.dumps(manifest))
    return to


def without_max_ids(manifest):
    """As manifests were before they recorded each shard's largest id."""
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            del shard["max_id"]


@pytest.mark.parametrize("case", ["vocab_zero", "bound_past_the_end", "bound_negative", "bounds_decreasing",
                                  "id_in_an_old_manifests_shard", "recorded_id", "unreadable"])
def test_damaged_shards_are_found_before_training(case, shards, tmp_path, monkeypatch):
    """Each of these trained: vocab_size 0 ended in a ZeroDivisionError at the model, a boundary past the end in a
    ValueError of packing, a negative or decreasing boundary and ids past the tokenizer's (read as padding rows)
    silently, an unreadable shard in a PermissionError traceback."""
    edit, damage = None, None
    index = "train-00000.idx.npy"
    if case == "vocab_zero":
        def edit(manifest):
            manifest["tokenizer"]["vocab_size"] = 0
        expected = "outside its vocabulary of 0 ids"
    elif case.startswith("bound"):
        def damage(directory):
            bounds = np.load(directory / index)
            bounds[3] = {"bound_past_the_end": bounds[-1] + 9, "bound_negative": -5,
                         "bounds_decreasing": bounds[1] - 1}[case]
            np.save(directory / index, bounds)
        expected = f"{index}: document boundary 3"
    elif case == "id_in_an_old_manifests_shard":
        edit = without_max_ids

        def damage(directory):
            tokens = np.memmap(directory / "train-00001.bin", dtype=np.uint16, mode="r+")
            tokens[7] = 330  # past the BPE's 320 ids, short of the model's 384 rows
            tokens.flush()
        expected = "train-00001.bin holds the id 330, outside its tokenizer's 320 ids"
    elif case == "recorded_id":
        def edit(manifest):
            manifest["splits"]["eval"]["shards"][0]["max_id"] = 999
        expected = "eval-00000.bin holds the id 999"
    else:
        memmap = np.memmap

        def refused(path, *args, **kwargs):  # as chmod 000 without CAP_DAC_OVERRIDE
            if str(path).endswith(".bin"):
                raise PermissionError(13, "Permission denied", str(path))
            return memmap(path, *args, **kwargs)
        monkeypatch.setattr(np, "memmap", refused)
        expected = "train-00000.bin could not be read (Permission denied); let this user read it"
    broken = copied_shards(shards, tmp_path / "shards", edit)
    (damage or (lambda _: None))(broken)
    config = load_config(None, tokens_run(broken, "data.packing=true"))
    with pytest.raises(UserError) as refused:
        open_dataset(config.data)
    assert expected in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def test_shards_prepared_before_manifests_recorded_their_ids_are_scanned_once_per_run(shards, tmp_path, monkeypatch):
    from xlatrain.data import shards as shard_format

    old = copied_shards(shards, tmp_path / "shards", without_max_ids)
    run_dir = tmp_path / "run"
    config = load_config(None, tokens_run(old, f"trainer.run_dir={run_dir}", "trainer.steps=2"))
    scanned = []
    monkeypatch.setattr(shard_format, "largest_id", lambda tokens: scanned.append(len(tokens)) or int(tokens.max()))
    train(config, echo=lambda _: None)
    manifest = json.loads((old / MANIFEST).read_text())
    shard_count = sum(len(split["shards"]) for split in manifest["splits"].values())
    assert len(scanned) == shard_count
    kept = json.loads((run_dir / "shard-scans.json").read_text())
    assert kept["manifest"] == manifest["fingerprint"] and len(kept["max_id"]) == shard_count
    train(config.model_copy(update={"trainer": config.trainer.model_copy(update={"steps": 4})}), echo=lambda _: None)
    assert len(scanned) == shard_count  # the resume read the scan it kept


def test_a_text_run_trains_its_tokenizer_once_and_reuses_it_on_resume(corpus, tmp_path):
    common = [*TINY_GPT, f"data.path={corpus}", "data.glob='*.txt'", "data.tokenizer.train.vocab_size=300",
              "data.seq_len=16", f"trainer.run_dir={tmp_path / 'run'}"]
    train(load_config(None, [*common, "trainer.steps=2"]), echo=lambda _: None)
    saved = tmp_path / "run" / "tokenizer-bpe-300.json"
    stamp = saved.stat().st_mtime_ns
    again = train(load_config(None, [*common, "trainer.steps=3"]), echo=lambda _: None)
    assert again.start_step == 2 and saved.stat().st_mtime_ns == stamp
    refused = run_cli("train", *[o.replace("vocab_size=300", "vocab_size=400") for o in common], "trainer.steps=4")
    assert refused.returncode == 2 and "data.tokenizer.train.vocab_size" in refused.stderr


def test_the_example_config_trains_the_gpt_on_prepared_shards(shards, tmp_path):
    done = run_cli("train", str(REPO / "examples" / "configs" / "gpt_tokens.yaml"), f"data.path={shards}",
                   "trainer.steps=3", "trainer.log_every=1", "model.layers=1", "model.width=32",
                   f"trainer.run_dir={tmp_path / 'run'}",
                   env={"XLA_FLAGS": os.environ["XLA_FLAGS"]})
    assert done.returncode == 0, done.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r] == [1, 2, 3]


def test_attention_with_segments_in_query_blocks_equals_the_dense_mask():
    from xlatrain.models.attention import causal_attention_in_query_blocks

    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (2, 64, 2, 8)) for i in range(3))
    segments = jnp.asarray(np.repeat([[1, 2, 3, 0], [1, 1, 2, 2]], 16, axis=1), jnp.int32)
    same = segments[:, :, None] == segments[:, None, :]
    dense = jax.nn.dot_product_attention(q, k, v, is_causal=True, mask=same[:, None])
    np.testing.assert_allclose(causal_attention_in_query_blocks(q, k, v, 2, None, segments), dense, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero1", "fsdp"])
def test_packed_data_trains_as_on_one_device_under_every_strategy(strategy, shards, tmp_path):
    common = tokens_run(shards, "data.packing=true", "trainer.steps=4", "batch.global_size=16")

    def losses(name, *overrides, devices=None):
        config = load_config(None, [*common, *overrides, f"trainer.run_dir={tmp_path / name}"])
        result = train(config, devices=devices, echo=lambda _: None)
        return np.array([result.losses[s] for s in sorted(result.losses)])

    single = losses("one", "mesh.data=1", devices=jax.devices()[:1])
    np.testing.assert_allclose(losses("eight", f"parallel.strategy={strategy}"), single, rtol=2e-4)


def test_the_gpt_trains_on_arrays_of_token_ids(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, size=(64, 17)).astype(np.int32)
    np.savez(tmp_path / "tokens.npz", inputs=tokens[:, :-1], targets=tokens[:, 1:])
    config = load_config(None, [*TINY_MODEL, "data.source=arrays", f"data.path={tmp_path / 'tokens.npz'}",
                                "trainer.steps=2", f"trainer.run_dir={tmp_path / 'run'}"])
    result = train(config, devices=jax.devices()[:1], echo=lambda _: None)
    assert np.isfinite(result.losses[2])
    assert build_program(config, jax.devices()[:1]).abstract_state.params["head"]["kernel"].shape[-1] == 64


def test_a_run_saved_before_the_vocabulary_followed_the_tokenizer_resumes_with_the_defaults(tmp_path):
    """Older versions saved model.vocab: 256 (its default then) and no model.vocab_multiple; null gives bytes 256."""
    common = [*TINY_GPT, f"trainer.run_dir={tmp_path / 'run'}"]
    train(load_config(None, [*common, "trainer.steps=2"]), echo=lambda _: None)
    saved = tmp_path / "run" / "config.yaml"
    text = saved.read_text()
    assert "vocab: null" in text and "vocab_multiple: 64" in text
    saved.write_text(text.replace("vocab: null", "vocab: 256").replace("  vocab_multiple: 64\n", ""))
    resumed = train(load_config(None, [*common, "trainer.steps=3"]), echo=lambda _: None)
    assert resumed.start_step == 2 and resumed.final_step == 3
