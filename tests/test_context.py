"""Context parallelism: the sequence split over `mesh.context`, attention by ring or all-gather (docs/parallelism.md).
Each composition once, on a tiny Llama with packed documents, grouped-query heads and a sliding window, against
one device."""

import json

import jax
import numpy as np
import pytest
from conftest import DIGITS_MLP, TINY_GPT, token_batch
from jax.sharding import PartitionSpec as P
from test_tensor_parallel import TP_GPT, assert_leaves_close
from test_tokens import write_corpus
from xlatrain.lowering.inspect import collectives

from xlatrain.commands.prepare import Request, prepare
from xlatrain.config import load_config
from xlatrain.mesh import eval_batch_sharding
from xlatrain.models.blockwise import Visibility
from xlatrain.models.context import balanced_order, gathered_pairs, ring_pairs
from xlatrain.program import build_program
from xlatrain.trainer import train

LLAMA = [*[o for o in TP_GPT if not o.startswith("data.")], "model.name=llama", "model.heads=4", "model.kv_heads=2",
         "model.sliding_window=12", "model.layer_types=[sliding,full]"]


def gradients_and_losses(overrides, devices, steps=3):
    """The first batch's gradients and loss sum, the eval step's loss on the first held-out rows, and the losses
    of `steps` steps on the batch."""
    program = build_program(load_config(None, overrides), devices)
    state, batch = program.create_state(), token_batch(program)
    grads, sums = program.gradients(state, batch)
    grads = jax.device_get(program.pipeline.layout.layer_params(grads) if program.pipeline else grads)
    rows = [program.dataset.eval[i] for i in range(program.derived.global_batch)]
    held_out = jax.device_put({k: np.stack([r[k] for r in rows]) for k in rows[0]}, eval_batch_sharding(program.mesh))
    losses = [float(program.eval_step(state, held_out)["eval_loss"])]
    for _ in range(steps):
        state, metrics = program.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return program, grads, float(sums["loss"]), losses


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """Token shards whose documents are shorter and longer than a row: packed rows hold several."""
    out = tmp_path_factory.mktemp("shards") / "bpe"
    prepare(Request((write_corpus(tmp_path_factory.mktemp("corpus"), documents=120),), out, train_vocab=300,
                    holdout=0.05))
    return [*LLAMA, "data.source=tokens", f"data.path={out}", "data.packing=true", "data.seq_len=32"]


@pytest.fixture(scope="module")
def one_device(packed):
    return gradients_and_losses([*packed, "mesh.data=1"], jax.devices()[:1])


@pytest.mark.parametrize("split", [["mesh.context=2", "mesh.data=2"],
                                   ["mesh.context=4", "mesh.data=2", "parallel.strategy=fsdp"],
                                   ["mesh.context=2", "mesh.data=1", "mesh.tensor=2",
                                    "parallel.sequence_parallel=true"],
                                   ["mesh.context=2", "mesh.data=2", "parallel.mode=shard_map", "batch.microbatches=2"],
                                   ["mesh.context=2", "mesh.data=2", "parallel.mode=shard_map",
                                    "parallel.context_attention=all_gather", "parallel.strategy=zero1"],
                                   ["mesh.context=4", "mesh.data=1", "parallel.mode=shard_map",
                                    "collectives.impl=custom"],
                                   ["mesh.context=2", "mesh.data=1", "mesh.tensor=2", "parallel.mode=shard_map",
                                    "parallel.sequence_parallel=true", "collectives.impl=custom"],
                                   ["mesh.context=2", "mesh.stage=2", "mesh.data=1", "collectives.impl=custom"]],
                         ids=["ring-c2", "ring-c4-fsdp", "ring-c2-t2-sp",
                              "shard_map-ring-c2-accumulated", "shard_map-all_gather-c2-zero1",
                              "shard_map-custom-ring-c4", "shard_map-custom-c2-t2-sp", "pipeline-custom-ring-c2-s2"])
def test_context_parallel_loss_and_every_gradient_equal_one_device(split, packed, one_device, devices):
    _, reference, reference_loss, reference_losses = one_device
    mesh = {o.split("=")[0].removeprefix("mesh."): int(o.split("=")[1]) for o in split if o.startswith("mesh.")}
    program, grads, loss, losses = gradients_and_losses([*packed, *split], devices[:int(np.prod([*mesh.values()]))])
    assert {k: v for k, v in program.mesh.shape.items() if v > 1} == {k: v for k, v in mesh.items() if v > 1}
    np.testing.assert_allclose(loss, reference_loss, rtol=1e-5)
    assert_leaves_close(grads, reference)
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-5)  # the eval step's, then the train steps'
    if "parallel.strategy=fsdp" in split:  # the context group's devices hold each their block of the params
        specs = jax.tree.leaves(program.specs.params, is_leaf=lambda x: isinstance(x, P))
        assert all(("data", "context") in spec for spec in specs), specs
    if "collectives.impl=custom" in split:  # the ring's transfers are xlatrain's ppermute calls, not XLA's
        kinds = {c["kind"] for c in collectives(program.train_step.first.compiled.as_text())}
        assert "xlatrain ppermute" in kinds and "collective-permute" not in kinds, kinds


def test_balanced_order_gives_each_device_an_early_and_a_late_chunk():
    assert balanced_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert balanced_order(8, 1).tolist() == list(range(8))


@pytest.mark.parametrize("size, window", [(2, None), (4, None), (4, 12), (4, 5)])
def test_each_device_reads_exactly_the_block_pairs_that_hold_a_visible_key(size, window):
    """Every device, by ring steps and with gathered keys: the (query block, key block) pairs it reads are those
    where some query's window (causal order, `window` latest keys) reaches some key, by their places in the row."""
    length, block = 64, 4
    visibility = Visibility(True, window, 1.0, None)
    row = balanced_order(length, size).reshape(size, -1)  # each device's tokens' places in the row
    chunk = length // (2 * size)

    def visible(queries, keys):  # block pairs of a device's queries over `keys` (places) with a visible key
        q, k = queries.reshape(-1, block), keys.reshape(-1, block)
        return {(i, j) for i in range(len(q)) for j in range(len(k))
                if any(b <= a and (window is None or b > a - window) for a in q[i] for b in k[j])}

    def listed(table):
        return {(int(i), int(j)) for i, j, counts in table if counts}

    for r in range(size):
        assert listed(gathered_pairs(size, chunk, block, visibility)[r]) == visible(row[r], row.reshape(-1))
        for step in range(size):
            assert listed(ring_pairs(size, step, chunk, block, visibility)[r]) == visible(row[r], row[r - step])
    if window is not None and window < 2 * chunk:
        assert len(listed(ring_pairs(size, 1, chunk, block, visibility)[0])) < (chunk // block) ** 2


def test_each_device_runs_its_share_of_the_attention_products():
    """The train step at 2048 tokens, compiled: the matmul FLOPs under jax.named_scope('attention') of each
    device's program under mesh.context=2 (its two chunks' 2C+1 = 5 pairs of 512 x 512 blocks) are at most 1.05x
    the one-device step's (blockwise past 1024 tokens: 10 visible pairs of 4 blocks of 512) divided by 2."""
    from xlatrain.lowering.kernels import matmul_flops_in

    full = [o for o in LLAMA if not o.startswith(("model.sliding_window", "model.layer_types"))]
    common = [*full, "data.seq_len=2048", "batch.global_size=1", "mesh.data=1"]
    flops = [matmul_flops_in(build_program(load_config(None, [*common, f"mesh.context={c}"]), jax.devices()[:c])
                             .train_step.first.compiled.as_text(), "attention") for c in (1, 2)]
    assert 0 < flops[1] <= 1.05 * flops[0] / 2, flops


def test_a_run_resumes_on_another_context_size_as_if_uninterrupted(packed, tmp_path):
    """3 steps at mesh.context=2, then 2 more at mesh.context=4 (fsdp: the state split over data x context, laid out
    anew): the losses of one uninterrupted context=2 run (its 5 steps fused into one program)."""
    common = [*packed, "batch.global_size=8", "trainer.checkpoint_every=3", "trainer.progress=false",
              "parallel.strategy=fsdp"]
    for steps, context in ((3, 2), (5, 4)):
        train(load_config(None, [*common, f"mesh.context={context}", f"trainer.steps={steps}",
                                 f"trainer.run_dir={tmp_path / 'elastic'}"]), echo=lambda _: None)
    from xlatrain.run.metrics import read_metrics

    resumed = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "elastic" / "metrics.jsonl") if "loss" in r}
    straight = train(load_config(None, [*common, "mesh.context=2", "trainer.steps=5", "trainer.steps_per_sync=5",
                                        "trainer.checkpoint_every=5", f"trainer.run_dir={tmp_path / 'straight'}"]),
                     echo=lambda _: None).losses
    np.testing.assert_allclose([resumed[s] for s in range(1, 6)], [straight[s] for s in range(1, 6)], rtol=1e-5)


@pytest.mark.parametrize("overrides, message", [
    ([*DIGITS_MLP, "mesh.context=2"], "mesh.context=2 splits the sequence of the built-in "
                                                                 "decoders' attention (gpt, llama); model.name=mlp"),
    ([*TINY_GPT, "mesh.context=4", "data.seq_len=36"], "data.seq_len=36 is not a multiple of 8"),
    ([*TINY_GPT, "mesh.context=2", "parallel.mode=pmap"], "pmap maps the step over `data` alone, with no axis to "
                                                          "split the sequence over"),
    ([*TINY_GPT, "mesh.context=2", "mesh.stage=2"], "XLA's collective-permute waits for every device of the mesh"),
])
def test_what_context_parallelism_cannot_run_is_one_line(overrides, message, capsys):
    from xlatrain.cli import main

    assert main(["config", *overrides]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_lower_names_the_attention_the_train_step_runs(packed, capsys):
    """`xlatrain lower` lists the compiled step's attention: the ring alone, not the one-device attention of the model
    traced to count its FLOPs."""
    from xlatrain.cli import main

    assert main(["lower", *packed, "mesh.context=2", "mesh.data=4", "--json"]) == 0
    kernels = {path["kernel"] for path in json.loads(capsys.readouterr().out)["attention"]}
    assert kernels == {"ring over mesh.context=2, blockwise"}, kernels
