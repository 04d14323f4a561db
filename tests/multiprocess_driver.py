"""`xlatrain train` for the multi-process tests, with one fault or delay injected into rank 1:
python tests/multiprocess_driver.py FAULT CONFIG [key=value ...], FAULT one of
  stuck-hook     rank 1 blocks in a hook at step 20
  stuck-loader   rank 1 blocks reading its batch after step 20
  slow-start     rank 1 compiles and checkpoints 6 s slower than rank 0 (no fault: the run must finish)
"""

import sys
import time

import jax

from xlatrain import checkpoint, trainer
from xlatrain.cli import main
from xlatrain.data.loader import DeviceLoader

FOREVER_S = 3600


def on_rank_1(fn):
    return lambda *args, **kwargs: (jax.process_index() == 1 and fn(*args, **kwargs))


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
    trainer.build_program = lambda *a, **kw: (on_rank_1(time.sleep)(6), build(*a, **kw))[1]
    checkpoint.Checkpoints.save = lambda self, *a: (on_rank_1(time.sleep)(6), save(self, *a))[1]


if __name__ == "__main__":
    {"stuck-hook": stuck_hook, "stuck-loader": stuck_loader, "slow-start": slow_start}[sys.argv[1]]()
    sys.exit(main(["train", *sys.argv[2:]]))
