"""The watchdog's judgement (pure) and the processes' agreements (start-up, stopping), without processes."""

from types import SimpleNamespace

import jax
import pytest

from xlatrain.config import Config, DistributedConfig, StallTimeouts, flatten
from xlatrain.runtime import distributed
from xlatrain.runtime.distributed import StopAgreement, as_primary_has_it, check_processes_agree, disagreements
from xlatrain.runtime.watchdog import Observer, coordinator_lost, final_line, newest_checkpoint, verdict

CONFIG = DistributedConfig(stall_timeout={"training": 30, "hook": 5}, heartbeat_timeout=10)


def published(step, phase, beat=1, checkpoint=None, error="", host="h"):
    return {"host": host, "beat": beat, "step": step, "phase": phase, "last_checkpoint": checkpoint, "error": error}


def observer_at(now, **ranks) -> Observer:
    observer = Observer()
    observer.update({int(r[1:]): p for r, p in ranks.items()}, now)
    return observer


def test_a_single_number_sets_every_phase():
    assert StallTimeouts.model_validate(7).hook == 7 and StallTimeouts.model_validate(7).compiling == 7
    assert DistributedConfig(stall_timeout=7).stall_timeout.training == 7


def test_all_alive_and_moving_is_no_verdict():
    observer = observer_at(0, r0=published(5, "training"), r1=published(5, "training"))
    observer.update({0: published(6, "training", beat=2), 1: published(6, "training", beat=2)}, 8)
    assert verdict(observer, 2, 9, CONFIG) is None


def test_a_rank_without_heartbeats_is_named_with_its_step_phase_and_the_last_checkpoint():
    observer = observer_at(0, r0=published(57, "training", checkpoint=50), r1=published(57, "training", host="b"))
    observer.update({0: published(58, "training", beat=2, checkpoint=50), 1: published(57, "training", host="b")}, 9)
    message = verdict(observer, 2, 10.5, CONFIG)
    assert message == "rank 1 (host b) stopped responding at step 57 while training (no heartbeat for 10 s)"
    assert final_line(message, observer.seen).endswith("(no heartbeat for 10 s); last checkpoint: step 50")


def test_the_rank_behind_is_blamed_not_the_ones_waiting_for_it():
    observer = observer_at(0, r0=published(59, "training"), r1=published(57, "hook", host="b"))
    beats = {0: published(59, "training", beat=9), 1: published(57, "hook", beat=9, host="b")}
    observer.update(beats, 4)
    assert verdict(observer, 2, 4.5, CONFIG) is None  # within hook's 5 s
    observer.update(beats | {0: published(59, "training", beat=10), 1: published(57, "hook", beat=10, host="b")}, 6)
    assert verdict(observer, 2, 6, CONFIG) == ("rank 1 (host b) has been in a hook at step 57 for 6 s, longer than "
                                               "distributed.stall_timeout.hook=5")


def test_a_process_waiting_for_a_slow_compile_elsewhere_is_no_stall():
    observer = observer_at(0, r0=published(0, "training"), r1=published(0, "compiling"))
    observer.update({0: published(0, "training", beat=90), 1: published(0, "compiling", beat=90)}, 100)
    assert verdict(observer, 2, 100, CONFIG) is None


def test_every_process_stuck_at_the_same_place_is_said_so():
    observer = observer_at(0, r0=published(7, "training"), r1=published(7, "training"))
    observer.update({0: published(7, "training", beat=40), 1: published(7, "training", beat=40)}, 31)
    assert verdict(observer, 2, 31, CONFIG).startswith("every process has been training at step 7 for 31 s")


def test_a_failed_rank_is_reported_with_its_error_and_a_finished_one_never_as_dead():
    observer = observer_at(0, r0=published(3, "training"), r1=published(3, "failed", error="boom"))
    assert verdict(observer, 2, 1, CONFIG) == "rank 1 (host h) failed at step 3: boom"
    observer = observer_at(0, r0=published(9, "finished"), r1=published(9, "training"))
    observer.update({1: published(10, "training", beat=2)}, 60)
    assert verdict(observer, 2, 60, CONFIG) is None


def test_an_unreachable_store_names_the_coordinator():
    observer = observer_at(0, r0=published(4, "training"), r1=published(4, "training"))
    observer.store_unreachable(1)
    assert verdict(observer, 2, 5, CONFIG) is None
    assert verdict(observer, 2, 12, CONFIG).startswith("rank 0 (the coordinator, host h) stopped responding at "
                                                       "step 4 while training: the key-value store has been "
                                                       "unreachable")


def test_a_lost_coordinator_before_anything_was_seen_is_lost_while_starting():
    assert coordinator_lost({}, "gone") == "rank 0 (the coordinator) stopped responding while starting: gone"
    observer = observer_at(0, r0=published(9, "checkpointing", checkpoint=5, host="a"))
    assert coordinator_lost(observer.seen, "gone") == ("rank 0 (the coordinator, host a) stopped responding at step "
                                                       "9 while checkpointing: gone")


def test_the_last_checkpoint_is_the_newest_anyone_published_or_the_judge_found_written_since():
    observer = observer_at(0, r0=published(27, "training", checkpoint=10), r1=published(27, "training"))
    assert final_line("boom", observer.seen) == "boom; last checkpoint: step 10"
    assert final_line("boom", observer.seen, mine=20) == "boom; last checkpoint: step 20"
    assert final_line("boom", observer_at(0, r0=published(3, "training")).seen) == "boom; no checkpoint yet"


def facts(of: Config, **changes) -> dict:
    flat = flatten(of.model_dump(mode="json"))
    base = {"host": "a", "config": flat, "config_hash": str(sorted(flat.items())), "xlatrain": "0.1.0",
            "jax": "0.10.2", "jaxlib": "0.10.2", "platform": "cpu", "local_devices": 4, "devices": 8}
    return base | changes


def test_disagreements_name_the_rank_and_the_differing_keys():
    config = Config()
    other = config.model_copy(update={"seed": 3})
    flat_other = flatten(other.model_dump(mode="json"))
    found = disagreements([facts(config), facts(config, host="b"),
                           facts(config, host="c", jax="0.12.0", local_devices=2, config=flat_other,
                                 config_hash="x")])
    assert found == ["rank 2 (host c) differs from rank 0 (host a): jax 0.12.0 vs 0.10.2, local_devices 2 vs 4, "
                     "seed=3 vs 0"]


@pytest.fixture
def process_0_of_2(monkeypatch) -> dict[str, bytes]:
    """Process 0 of two, over an in-memory key-value store in which process 1 publishes what process 0 does."""
    store: dict[str, bytes] = {}

    def publish(key: str, value: bytes) -> None:
        store[key] = value
        if key.endswith("/0"):
            store[key[:-1] + "1"] = value

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    monkeypatch.setattr(distributed, "key_value_set", publish)
    monkeypatch.setattr(distributed, "key_value_get", lambda key, timeout_s=0: store[key])
    monkeypatch.setattr(distributed, "key_value_dir_get",
                        lambda prefix: [(k, v) for k, v in store.items() if k.startswith(prefix)])
    return store


def test_a_second_run_in_one_distributed_session_reads_nothing_the_first_published(process_0_of_2):
    first = StopAgreement(SimpleNamespace(requested=True))
    assert [first.should_stop(boundary) for boundary in (1, 2, 3)] == [False, False, True]
    second = StopAgreement(SimpleNamespace(requested=False))
    assert not any(second.should_stop(boundary) for boundary in range(1, 10))

    written = set(process_0_of_2)
    check_processes_agree(Config())
    first_facts = set(process_0_of_2) - written
    check_processes_agree(Config(seed=3))
    assert len(first_facts) == 2 and not first_facts & (set(process_0_of_2) - written - first_facts)

    assert as_primary_has_it("verdict", "refused") == "refused"
    assert as_primary_has_it("verdict", "") == ""


def test_the_watchdogs_error_line_starts_a_line_of_its_own_under_a_progress_bar(monkeypatch):
    import io

    from tqdm import tqdm

    from xlatrain.runtime.watchdog import say_error

    terminal = io.StringIO()
    monkeypatch.setattr("sys.stderr", terminal)
    bar = tqdm(total=100, file=terminal, unit="step")
    bar.update(7)
    say_error("rank 1 stopped sending heartbeats")
    bar.close()
    before, said, _ = terminal.getvalue().partition("xlatrain: error: rank 1 stopped sending heartbeats\n")
    # on a terminal, the line the error starts on holds nothing else: the bar's frame was written over with blanks
    last_line = before.rsplit("\n", 1)[-1].split("\r")
    assert said and before.endswith(("\r", "\n")) and last_line[-2].strip() == "", repr(before[-120:])


def test_a_dead_rank_is_named_at_least_at_the_checkpoint_every_rank_passed():
    """A rank publishes its step every BEAT_S: with fast steps, its last published step can lie below a checkpoint
    it took part in, and the line named a step before the checkpoint it gave."""
    observer = observer_at(0, r0=published(18, "training", checkpoint=10), r1=published(18, "training", host="b"))
    observer.update({0: published(25, "training", beat=2, checkpoint=20), 1: published(18, "training", host="b")}, 9)
    newest = newest_checkpoint(observer.seen, mine=20)
    message = verdict(observer, 2, 10.5, CONFIG, reached=newest)
    assert final_line(message, observer.seen, mine=20) == ("rank 1 (host b) stopped responding at step 20 while "
                                                           "training (no heartbeat for 10 s); last checkpoint: step 20")
    starting = observer_at(0, r0=published(0, "starting", checkpoint=20), r1=published(0, "starting"))
    starting.update({0: published(0, "starting", beat=2, checkpoint=20)}, 11)
    assert "at step 0 while" in verdict(starting, 2, 11, CONFIG, reached=20)  # a resumed run not yet stepping
