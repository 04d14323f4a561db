"""A small decoder-only transformer in plain PyTorch, trained by xlatrain through `model.name: torch`.

Nothing here knows about JAX: xlatrain builds the module on the CPU (seeded from the config's `seed`),
takes its parameters and buffers, and traces `forward` into its compiled train step with torchax.

The blocks sit in an nn.ModuleList called `blocks`, and `before_blocks` / `after_blocks` hold what comes
before and after them: that is the contract that lets xlatrain pipeline the model (`mesh.stage`).
The architecture matches xlatrain's built-in GPT (pre-LayerNorm blocks, tanh GELU, learned positions).
"""

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int, heads: int, mlp_ratio: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.ln_attn = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.attn_out = nn.Linear(width, width)
        self.ln_mlp = nn.LayerNorm(width)
        self.mlp_in = nn.Linear(width, mlp_ratio * width)
        self.mlp_out = nn.Linear(mlp_ratio * width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln_attn(x)).view(batch, length, 3, self.heads, width // self.heads).unbind(2)
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True)
        x = x + self.dropout(self.attn_out(attended.transpose(1, 2).reshape(batch, length, width)))
        return x + self.dropout(self.mlp_out(F.gelu(self.mlp_in(self.ln_mlp(x)), approximate="tanh")))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 256, width: int = 128, layers: int = 4, heads: int = 4, mlp_ratio: int = 4,
                 max_len: int = 64, dropout: float = 0.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(max_len, width)
        self.blocks = nn.ModuleList(Block(width, heads, mlp_ratio, dropout) for _ in range(layers))
        self.ln_final = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def before_blocks(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.embed(tokens) + self.position(positions)[None]

    def after_blocks(self, x):
        return self.head(self.ln_final(x))

    def forward(self, tokens):
        x = self.before_blocks(tokens)
        for block in self.blocks:
            x = block(x)
        return self.after_blocks(x)
