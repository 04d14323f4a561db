"""Sources, deterministic shuffling, per-process shards, and the device loader's resumable position."""

import subprocess
import sys

import jax
import numpy as np
import pytest

from xlatrain.config import load_config
from xlatrain.data.loader import DeviceLoader, eval_batches, make_global, split_microbatches, train_iterator
from xlatrain.data.sources import TokenWindows, open_dataset, read_text_corpus
from xlatrain.errors import UserError
from xlatrain.mesh import build_mesh, train_batch_sharding


def dataset(*overrides):
    return open_dataset(load_config(None, list(overrides)).data)


def test_digits_has_a_disjoint_held_out_split():
    data = dataset("model.name=mlp", "data.source=digits")
    assert len(data.train) + len(data.eval) == 1797 and len(data.eval) == 359
    assert not set(data.train.rows) & set(data.eval.rows)
    assert data.spec.input_shape == (8, 8) and data.spec.num_outputs == 10


def test_digits_are_scikit_learns_without_importing_it(monkeypatch):
    """Read from the file scikit-learn ships, as its load_digits reads it, in a process that never imports it; and
    through load_digits where the file is not found."""
    from sklearn.datasets import load_digits

    from xlatrain.data import sources

    expected = load_digits()
    for found in (True, False):
        if not found:
            monkeypatch.setattr(sources.importlib.util, "find_spec", lambda name: None)
        images, labels = sources.digits_images_and_labels()
        np.testing.assert_array_equal(images, expected.images)
        np.testing.assert_array_equal(labels, expected.target)
    read_alone = ("import sys; from xlatrain.data.sources import digits_images_and_labels; "
                  "digits_images_and_labels(); assert 'sklearn' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", read_alone], check=True, capture_output=True)


def test_text_windows_are_next_token_pairs(tmp_path):
    (tmp_path / "a.txt").write_bytes(bytes(range(200)))
    data = dataset(f"data.path={tmp_path}", "data.glob='*.txt'", "data.seq_len=16")
    record = data.train[1]
    np.testing.assert_array_equal(record["inputs"][1:], record["targets"][:-1])
    assert record["inputs"][0] == 16 and len(data.train) + len(data.eval) == 200 // 16


def test_default_corpus_is_the_standard_library():
    data = dataset("data.max_bytes=100000")
    assert isinstance(data.train, TokenWindows) and len(data.train) > 1000


def test_text_dir_without_matching_files(tmp_path):
    with pytest.raises(UserError, match="no files matching"):
        read_text_corpus(tmp_path, "*.txt", 1000)


def test_memory_mapped_npy_and_npz(tmp_path):
    inputs = np.arange(40, dtype=np.float32).reshape(20, 2)
    np.save(tmp_path / "inputs.npy", inputs)
    np.save(tmp_path / "targets.npy", np.arange(20) % 3)
    from_dir = dataset("model.name=mlp", "data.source=arrays", f"data.path={tmp_path}")
    assert isinstance(from_dir.train.inputs, np.memmap) and from_dir.spec.num_outputs == 3
    np.savez(tmp_path / "both.npz", inputs=inputs, targets=np.arange(20) % 3)
    from_npz = dataset("model.name=mlp", "data.source=arrays", f"data.path={tmp_path / 'both.npz'}")
    np.testing.assert_array_equal(from_npz.train[3]["inputs"], from_dir.train[3]["inputs"])


def test_npz_without_the_expected_keys(tmp_path):
    np.savez(tmp_path / "bad.npz", x=np.zeros(3))
    with pytest.raises(UserError, match="needs inputs, targets"):
        dataset("model.name=mlp", "data.source=arrays", f"data.path={tmp_path / 'bad.npz'}")


def test_shuffle_is_deterministic_per_seed_and_reshuffles_each_epoch():
    source = dataset("model.name=mlp", "data.source=digits").train

    def labels(seed, batches):
        it = train_iterator(source, seed=seed, shuffle=True, local_batch=1438, block=0, blocks=1)
        return [next(it)["targets"] for _ in range(batches)]

    first, second = labels(0, 2), labels(0, 2)
    np.testing.assert_array_equal(first[0], second[0])
    assert not np.array_equal(first[0], first[1])
    assert not np.array_equal(first[0], labels(1, 1)[0])


def test_processes_read_disjoint_parts_of_each_global_batch():
    source = dataset("model.name=mlp", "data.source=digits").train
    rows = []
    for process in range(2):
        it = train_iterator(source, seed=0, shuffle=False, local_batch=8, block=process, blocks=2)
        rows.append(next(it)["inputs"].reshape(8, -1))
    whole = next(train_iterator(source, seed=0, shuffle=False, local_batch=16, block=0, blocks=1))
    assert sorted(map(bytes, np.concatenate(rows))) == sorted(map(bytes, whole["inputs"].reshape(16, -1)))


def test_eval_batches_are_fixed_and_bounded():
    source = dataset("model.name=mlp", "data.source=digits").eval
    batches = eval_batches(source, local_batch=100, max_batches=10, block=0, blocks=1)
    assert len(batches) == 3


def test_device_loader_prefetches_sharded_batches_and_resumes_at_the_consumed_position(devices):
    config = load_config(None, ["model.name=mlp", "data.source=digits"])
    source = open_dataset(config.data).train
    sharding = train_batch_sharding(build_mesh(config))

    def loader(state=None):
        host = train_iterator(source, seed=3, shuffle=True, local_batch=32, block=0, blocks=1)
        if state is not None:
            host.set_state(state)
        return DeviceLoader(host, lambda b: make_global(split_microbatches(b[0], 2), sharding, 1, 1), prefetch=3)

    first = loader()
    consumed = [next(first) for _ in range(4)]
    assert consumed[0]["inputs"].sharding == sharding and consumed[0]["inputs"].shape == (2, 16, 8, 8)
    position = first.state()
    following = next(first)
    first.close()
    resumed = loader(position)
    np.testing.assert_array_equal(jax.device_get(next(resumed)["targets"]), jax.device_get(following["targets"]))
    resumed.close()
