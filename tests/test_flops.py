"""Model FLOPs and MFU: the jaxpr count against hand counts (MLP, GPT, the 6 x params x tokens rule), loops
counted by their trip counts, and the rates in metrics.jsonl."""

import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest
from conftest import DIGITS_MLP, TINY_GPT
from xlatrain.lowering.flops import COUNTED, UncountedLoop, attended_pairs, step_flops

from xlatrain.config import load_config
from xlatrain.models.attention import query_blocks
from xlatrain.models.linear import dense_dot_general
from xlatrain.observe.peaks import known_peak
from xlatrain.program import build_program
from xlatrain.trainer import train


def gpt_flops(layers, width, mlp_ratio, seq, vocab, batch, blocks):
    """Per token, forward: qkv, attention out, the MLP and every layer's q.k and p.v products, then the head.
    On CPU a causal attention runs in `blocks` blocks of consecutive queries, each over the keys up to its
    last query: n(n+1)/2 of the n^2 blocks of a dense attention's products. The backward is twice the forward:
    every matmul gives its input's and its weight's gradient (the embedding's is a scatter, no matmul)."""
    rows = seq // blocks
    keys_per_query = rows * rows * blocks * (blocks + 1) / 2 / seq
    forward = layers * (2 * 3 * width**2 + 2 * width**2 + 2 * 2 * mlp_ratio * width**2 + 2 * 2 * keys_per_query * width)
    return 3 * (forward + 2 * width * vocab) * batch * seq


@pytest.mark.parametrize("scan", ["true", "false"])
def test_the_gpt_is_counted_as_by_hand_and_near_the_6nt_rule(scan, devices):
    program = build_program(load_config(None, [f"model.scan_layers={scan}"]), devices[:1])
    m, d = program.config.model, program.derived
    seq = program.config.data.seq_len
    assert (seq, query_blocks(seq)) == (64, 2)
    tokens = d.global_batch * seq
    flops = program.measured.model_flops_per_step
    vocab = program.abstract_state.params["head"]["kernel"].shape[-1]
    assert vocab == 256  # model.vocab null: the bytes' 256
    assert flops == gpt_flops(m.layers, m.width, m.mlp_ratio, seq, vocab, d.global_batch, 2)
    assert 0.95 < flops / (6 * program.param_count * tokens) < 1.05


def test_accumulation_and_pipelines_count_the_same_model(devices):
    flops = {name: build_program(load_config(None, [*TINY_GPT, "batch.global_size=32", *overrides]),
                                 devices).measured.model_flops_per_step
             for name, overrides in {"plain": [], "accumulated": ["batch.microbatches=4"],
                                     "pipelined": ["mesh.stage=2", "parallel.mode=shard_map"]}.items()}
    assert len(set(flops.values())) == 1, flops


def test_a_scan_counts_its_body_times_its_length_and_a_while_loop_is_refused():
    x = jax.ShapeDtypeStruct((16, 64), jnp.float32)
    weights = jax.ShapeDtypeStruct((5, 64, 64), jnp.float32)

    def scanned(ws, x):
        return jnp.sum(jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)[0])

    assert step_flops(scanned, weights, x) == 5 * 2 * 16 * 64 * 64
    assert step_flops(jax.grad(scanned), weights, x) == 3 * 5 * 2 * 16 * 64 * 64  # the body gives dx for all 5
    with pytest.raises(UncountedLoop):
        step_flops(lambda n, x: jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] @ c[1]),
                                                   (0, x))[1], jax.ShapeDtypeStruct((), jnp.int32),
                   jax.ShapeDtypeStruct((8, 8), jnp.float32))


def test_a_dense_layers_forward_mode_counts_as_a_plain_matmuls():
    x, w = jax.ShapeDtypeStruct((16, 8), jnp.float32), jax.ShapeDtypeStruct((8, 32), jnp.float32)
    dense = (((1,), (0,)), ((), ()))

    def jvp_of(dot_general):
        return lambda x, w: jax.jvp(lambda x, w: jnp.tanh(dot_general(x, w, dense)), (x, w), (x, w))

    assert step_flops(jvp_of(dense_dot_general), x, w) == step_flops(jvp_of(jax.lax.dot_general), x, w) == \
        3 * 2 * 16 * 8 * 32


def test_fused_attention_counts_the_unmasked_pairs_with_the_dense_attentions_products():
    """cuDNN's attention is traced on GPUs only, so its equations are built here: the layout, mask and operand
    shapes that jax's dot_product_attention_fwd/_bwd carry."""
    batch, length, heads, head_dim = 2, 128, 4, 32
    q = jax.ShapeDtypeStruct((batch, length, heads, head_dim), jnp.float32)
    dense = step_flops(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla"), q, q, q)
    assert dense == 2 * 2 * batch * heads * length * length * head_dim

    def fused(kind, mask, layout=0, window=None):
        shape = q.shape if layout == 0 else (batch, heads, length, head_dim)
        eqn = SimpleNamespace(invars=[SimpleNamespace(aval=jax.ShapeDtypeStruct(shape, jnp.bfloat16))] * 3,
                              params={"layout": layout, "mask_type": mask, "sliding_window_length": window})
        return COUNTED[f"dot_product_attention_{kind}"](eqn)

    causal = SimpleNamespace(name="CAUSAL")
    assert fused("fwd", SimpleNamespace(name="NO_MASK")) == dense
    assert fused("fwd", causal) == fused("fwd", causal, layout=1) == dense * (length + 1) / (2 * length)
    assert fused("bwd", causal) == 2 * fused("fwd", causal)
    assert fused("fwd", causal, window=16) == dense / length**2 * (16 * 17 / 2 + (length - 16) * 16)
    assert attended_pairs(4, 6, causal=True, window=None) == 1 + 2 + 3 + 4
    assert attended_pairs(6, 4, causal=True, window=None) == 1 + 2 + 3 + 4 + 4 + 4


def test_known_devices_have_datasheet_peaks():
    assert known_peak("NVIDIA H100 80GB HBM3", "bfloat16") == pytest.approx(989.4e12)
    assert known_peak("NVIDIA H100 PCIe", "bfloat16") == pytest.approx(756e12)
    assert known_peak("NVIDIA L40S", "float32") == pytest.approx(183e12)
    assert known_peak("NVIDIA L4", "float16") == pytest.approx(121e12)
    assert known_peak("NVIDIA GH200 480GB", "bfloat16") == pytest.approx(989.4e12)
    assert known_peak("Some new accelerator", "bfloat16") is None
    assert known_peak("NVIDIA A100-SXM4-40GB", "bfloat16") == pytest.approx(312e12)
    assert known_peak("TPU v5 lite", "bfloat16") == pytest.approx(197e12)
    # other devices whose names contain a listed one's: not given that one's peak
    assert known_peak("NVIDIA L40", "bfloat16") is None and known_peak("NVIDIA A10G", "bfloat16") is None


def test_metrics_carry_tflops_per_device_and_mfu(tmp_path, devices):
    config = load_config(None, [*DIGITS_MLP, "trainer.steps=10", f"trainer.run_dir={tmp_path}"])
    lines = []
    train(config, echo=lines.append)
    flops = 2 * 32 * (3 * 32 * 10 + 2 * 64 * 32)
    assert any(f"model FLOPs per step {flops:.4g}" in line and "measured float32 matmul" in line for line in lines)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rated = [r for r in records if "mfu" in r]
    assert rated, records
    for r in rated:
        steps_per_sec = r["samples_per_sec"] / 32
        assert r["tflops_per_sec_per_device"] == pytest.approx(flops * steps_per_sec / 8 / 1e12, rel=1e-2)
        assert 0 < r["mfu"] < 1


def _throughput_clock(now: list[float]):
    """8 samples of 64 tokens and 2e9 FLOPs per step on one device of 1e12 FLOP/s."""
    from xlatrain.observe.throughput import Throughput

    return Throughput(8, 8 * 64, 2e9, 1e12, clock=lambda: now[0])


def test_rates_on_an_asynchronous_device_count_each_step_once():
    """A device runs each 10 ms step while the host dispatches the next and then waits for the one before (as
    on a GPU): a window starts where that wait ended, not at its first step's dispatch, which came while the
    device was still busy with the step before."""
    now = [0.0]
    clock = _throughput_clock(now)
    clock.dispatching(1)
    rates = []
    for step in range(1, 21):
        now[0] = (step - 1) * 0.010 + 0.001
        clock.dispatching(step + 1)  # queued behind `step`
        now[0] = step * 0.010  # the host waited for `step` until it finished
        clock.boundary_done(step, 1, seen_finishing=now[0])
        rates.append(dict(clock.last))
    assert [r["samples_per_sec"] for r in rates] == pytest.approx([800.0] * 20)
    assert rates[-1]["tokens_per_sec"] == pytest.approx(800 * 64)
    assert rates[-1]["mfu"] == pytest.approx(2e9 / 0.010 / 1e12)


def test_a_boundary_read_early_by_a_checkpoint_reports_the_pace_and_leaves_the_checkpoint_out():
    """Fused steps (10 per boundary) at a pace of 30 ms a boundary, each boundary's results read 1 ms into the next
    one. The fifth boundary's checkpoint reads its results 2 ms after its dispatch, then saves for 500 ms: its window
    stays open, the save is taken out, and every rate is the pace (once, 40,000 samples/s was logged there: 80
    samples in 2 ms)."""
    from xlatrain.observe.throughput import Throughput

    now, excluded = [0.0], [0.0]
    clock = Throughput(8, 8 * 64, 2e9, 1e12, clock=lambda: now[0], excluded=lambda: excluded[0])
    rates, began, read_early = [], 0.0, None

    def read(first, **early):
        clock.boundary_done(first, 10, seen_finishing=now[0], **early)
        rates.append(clock.last["samples_per_sec"])

    for boundary in range(1, 11):
        first = 10 * boundary - 9
        now[0] = began
        clock.dispatching(first)
        if boundary > 1 and first - 10 != read_early:
            now[0] = began + 0.001
            read(first - 10)
        if boundary == 5:
            now[0] = began + 0.002
            read(first, early=True)
            read_early, excluded[0] = first, 0.5
            began += 0.5
        began += 0.030
    assert rates[1:] == pytest.approx([80 / 0.030] * (len(rates) - 1), rel=1e-6)


def test_a_run_logs_at_each_checkpoint_step_the_rate_of_the_window_before(tmp_path):
    """trainer.steps_per_sync=10: the checkpoints at steps 20 and 40 read their boundary's results early."""
    train(load_config(None, [*DIGITS_MLP, "trainer.steps=50", "trainer.steps_per_sync=10", "trainer.log_every=10",
                             "trainer.checkpoint_every=20", f"trainer.run_dir={tmp_path}"]), echo=lambda _: None)
    rates = {r["step"]: r["samples_per_sec"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text()
                                                           .splitlines()) if "samples_per_sec" in r}
    assert sorted(rates) == [10, 20, 30, 40, 50]
    assert rates[20] == rates[10] and rates[40] == rates[30] and rates[50] == rates[40]


def test_rates_are_not_overstated_when_the_results_were_ready_before_the_host_read_them():
    """The host spends 30 ms per step (a hook, data) and finds each 10 ms step long finished: the steps of a
    window ran no earlier than its first dispatch, so the rate is the host's pace, 8 samples per 30 ms."""
    now = [0.0]
    clock = _throughput_clock(now)
    rates = []
    for step in range(1, 21):
        now[0] = (step - 1) * 0.030
        clock.dispatching(step)
        now[0] += 0.030 - 1e-6  # just before the next dispatch: `step` finished long ago
        clock.boundary_done(step, 1, seen_finishing=None)
        rates.append(clock.last["samples_per_sec"])
    assert rates[5:] == pytest.approx([8 / 0.030] * 15, rel=1e-3)
