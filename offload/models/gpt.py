"""A small GPT-style language model, defined here so `offload train` needs no downloads.

Token + position embedding, ``n_layer`` pre-norm transformer blocks in ``GPT.blocks`` (an
``nn.ModuleList``: each block is a natural unit of residency for the engine), a final
LayerNorm and an LM head whose weight is TIED to the token embedding.

    model = GPT(GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256))
    loss = model(idx, targets)      # targets given: the mean cross-entropy
    logits = model(idx)             # no targets: (B, T, vocab_size) logits
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256        # byte-level tokenizer
    block_size: int = 128        # context length
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    dropout: float = 0.0

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")

    def num_params(self) -> int:
        """Parameter count (the tied LM head counted once)."""
        d, L = self.n_embd, self.n_layer
        per_block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
        return self.vocab_size * d + self.block_size * d + L * per_block + 2 * d


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class GPTLayer(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd), nn.Dropout(cfg.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(GPTLayer(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight   # tied: one tensor, two modules
        self.apply(self._init_weights)

    def _init_weights(self, m: nn.Module) -> None:
        """The model's initialisation of one module (also what the engine runs on a GPT built
        on the meta device): N(0, 0.02) weights, zero biases, and GPT-2's scaled init of the
        residual projections, which keeps the residual stream's variance flat. LayerNorms
        keep their constructor's values (``reset_parameters``)."""
        if isinstance(m, (nn.Linear, nn.Embedding)):
            residual = any(m is b.attn.proj or m is b.mlp[2] for b in self.blocks)
            nn.init.normal_(m.weight, 0.0, 0.02 / math.sqrt(2 * self.cfg.n_layer) if residual else 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size={self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def gpt(n_layer: int = 4, n_head: int = 4, n_embd: int = 256, block_size: int = 128,
        vocab_size: int = 256) -> GPT:
    """A ``module:callable`` for ``offload estimate --model offload.models.gpt:gpt``."""
    return GPT(GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer,
                         n_head=n_head, n_embd=n_embd))


def gpt2_small() -> GPT:
    """GPT-2 small's shape (124M parameters), for estimates and plans (build on the meta device)."""
    return GPT(GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768))
