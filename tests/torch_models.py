"""Small torch modules for tests/test_torch.py (importable as `torch_models:Name` with tests/ on PYTHONPATH)."""

import torch
from torch import nn


class Flat(nn.Module):
    """Outputs [B] instead of logits: does not fit cross_entropy."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(64, 1)

    def forward(self, images):
        return self.linear(images.flatten(1))[:, 0]


class Unlowerable(nn.Module):
    """Uses an op torchax has no lowering for, inside a submodule."""

    class Pool(nn.Module):
        def forward(self, x):
            lengths = torch.full((x.shape[0],), x.shape[1])
            return torch.segment_reduce(x.flatten(), "sum", lengths=lengths)

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(64, 10)
        self.pool = self.Pool()

    def forward(self, images):
        return self.linear(images.flatten(1)) + self.pool(images.flatten(1))[:, None]


def not_a_module(width: int = 4):
    return [width]
