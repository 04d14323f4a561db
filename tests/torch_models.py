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


class ClampsItsWeight(nn.Module):
    """Weight clipping inside the forward: a parameter changed in place, which a traced forward cannot keep."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, images):
        with torch.no_grad():
            self.fc.weight.clamp_(-0.01, 0.01)
        return self.fc(images.flatten(1))


class FreezesItsWeightInForward(nn.Module):
    """requires_grad_(False) inside the forward: PyTorch would stop training the weight from this step on."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, images):
        self.fc.weight.requires_grad_(False)
        return self.fc(images.flatten(1))


class KeepsRequiresGradInForward(nn.Module):
    """Setting requires_grad to what it already is changes nothing, in PyTorch as here."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 10)
        self.fc.bias.requires_grad_(False)

    def forward(self, images):
        self.fc.weight.requires_grad = True
        self.fc.bias.requires_grad_(False)
        return self.fc(images.flatten(1))


def not_a_module(width: int = 4):
    return [width]


class FrozenFirstLayer(nn.Module):
    """Fine-tuning's usual shape: a frozen first layer (requires_grad=False) under a trained head."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.body = nn.Linear(64, hidden)
        self.head = nn.Linear(hidden, 10)
        self.body.requires_grad_(False)

    def forward(self, images):
        return self.head(torch.relu(self.body(images.flatten(1))))


class WithoutGradients(nn.Module):
    """Parameters torch.optim never sees a gradient for: a feature layer run under torch.no_grad() (a frozen
    feature extractor), a head the forward does not call but for its bias's .data (a pretrained model's unused
    pooler) and a scale read through .detach()."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.features = nn.Linear(64, 32)
        self.body = nn.Linear(32, hidden)
        self.head = nn.Linear(hidden, 10)
        self.unused_head = nn.Linear(hidden, 10)
        self.scale = nn.Parameter(torch.full((hidden,), 2.0))

    def forward(self, images):
        with torch.no_grad():
            features = torch.relu(self.features(images.flatten(1)))
        hidden = torch.relu(self.body(features)) * self.scale.detach()
        return self.head(hidden) + self.unused_head.bias.data


class ChangesActivationsInPlace(nn.Module):
    """In-place ops under torch.no_grad() on tensors that have a gradient: a layer's output scaled, a slice of it
    (a view) zeroed and copied into: autograd records none of them, so the gradient reaches the body as if they
    had not happened, while everything after reads the changed values; then a slice clamped with grad mode on,
    which autograd records. (The output of a linear layer, which its backward does not read: PyTorch refuses a
    change to a value a backward needs, such as tanh's output.)"""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.body = nn.Linear(64, hidden)
        self.head = nn.Linear(hidden, 10)

    def forward(self, images):
        hidden = self.body(images.flatten(1))
        with torch.no_grad():
            hidden.mul_(3.0)
            hidden[:, :4].zero_()
            hidden[:, 4:6].copy_(hidden[:, 6:8] * 0.5)
        hidden[:, 8:12].clamp_(-0.2, 0.2)
        return self.head(torch.tanh(hidden) * hidden)


def tiny_gpt_frozen(frozen_blocks=(0,), everything=False, **kwargs):
    """TinyGPT (examples/torch_model) with its embeddings and the blocks `frozen_blocks` frozen (by default some
    stacked layers of each block parameter train and some do not), or `everything`."""
    from tiny_gpt import TinyGPT

    module = TinyGPT(**kwargs)
    for part in (module.embed, module.position, *(module.blocks[i] for i in frozen_blocks)):
        part.requires_grad_(False)
    return module.requires_grad_(not everything) if everything else module


class NoParameters(nn.Module):
    """Logits from the tokens alone: nothing to train (the GPT's sizes are taken and ignored)."""

    def __init__(self, **_sizes):
        super().__init__()

    def forward(self, tokens):
        return torch.nn.functional.one_hot(tokens.long(), 256).float()


class LongIndices(nn.Module):
    """Uses .long(), as torch code does for indices: int32 under JAX without x64."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(64, 10)

    def forward(self, images):
        bright = (images.flatten(1) > 8).long()
        return self.linear(images.flatten(1)) + bright[:, :10].float()


class Int8Scales(nn.Module):
    """A quantized-style int8 parameter (requires_grad=False, as torch requires of integers) in the forward."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(64, 10)
        self.scale = nn.Parameter(torch.arange(1, 11, dtype=torch.int8), requires_grad=False)

    def forward(self, images):
        return self.linear(images.flatten(1)) * self.scale.float() / 10


class PackedTinyLM(nn.Module):
    """One attention layer that keeps to the packed documents it is given (`segment_ids`, `positions`)."""

    def __init__(self, vocab: int, width: int, max_len: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(max_len, width)
        self.qkv = nn.Linear(width, 3 * width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens, segment_ids=None, positions=None):
        x = self.embed(tokens) + self.position(positions)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        sees = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (positions[:, None, :] <= positions[:, :, None])
        attended = torch.nn.functional.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None],
                                                                    attn_mask=sees[:, None])
        return self.head(x + attended[:, 0])


class UnpackedTinyLM(PackedTinyLM):
    """The same, but its forward takes no documents."""

    def forward(self, tokens):
        return self.head(self.embed(tokens))
