"""`xlatrain train` for the multi-process tests, with one fault or delay injected into rank 1:
python tests/multiprocess_driver.py FAULT CONFIG [key=value ...], FAULT one of
  stuck-hook     rank 1 blocks in a hook at step 20
  stuck-loader   rank 1 blocks reading its batch after step 20
  slow-start     rank 1 compiles and checkpoints 6 s slower than rank 0 (no fault: the run must finish)
  small-host     rank 1's host has 64 KiB of RAM
"""

import sys
import time

import jax

from xlatrain import checkpoint, state, trainer
from xlatrain.cli import main
from xlatrain.data.loader import DeviceLoader

FOREVER_S = 3600


def on_rank_1(fn):
    def only_there(*args, **kwargs):
        if jax.process_index() == 1:
            fn(*args, **kwargs)

    return only_there


def stuck_hook() -> None:
    original = trainer.train

    def hook(boundary):
        if boundary.step == 20:
            time.sleep(FOREVER_S)

    trainer.train = lambda config, **kw: original(config, hooks=[on_rank_1(hook)], **kw)


def stuck_loader() -> None:
    original, calls = DeviceLoader.__next__, [0]

    def next_batch(self):
        calls[0] += 1
        if calls[0] > 20 and jax.process_index() == 1:
            time.sleep(FOREVER_S)
        return original(self)

    DeviceLoader.__next__ = next_batch


def slow_start() -> None:
    build, save = trainer.build_program, checkpoint.Checkpoints.save

    def slow_build(*args, **kwargs):
        on_rank_1(time.sleep)(6)
        return build(*args, **kwargs)

    def slow_save(self, *args):
        on_rank_1(time.sleep)(6)
        return save(self, *args)

    trainer.build_program, checkpoint.Checkpoints.save = slow_build, slow_save


def small_host() -> None:
    real = state.host_memory

    def host_memory():
        return (64 * 2**10, "a host's 64 KiB of RAM") if jax.process_index() == 1 else real()

    state.host_memory = host_memory


if __name__ == "__main__":
    {"stuck-hook": stuck_hook, "stuck-loader": stuck_loader, "slow-start": slow_start,
     "small-host": small_host}[sys.argv[1]]()
    sys.exit(main(["train", *sys.argv[2:]]))
