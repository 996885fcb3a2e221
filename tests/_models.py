"""Small models for engine tests: a GPT-style stack with tied embeddings and a frozen layer;
a stack of wide linear blocks with tiny activations (``Wide``); a plain residual stack
(``RuleNet``) whose blocks hold 2-D weights, for the update-rule tests."""
import copy

import torch
from torch import nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab=64, d=32, layers=4, heads=2, ctx=16, frozen_layer=1):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.layers = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight            # tied
        if frozen_layer is not None:
            for p in self.layers[frozen_layer].parameters():
                p.requires_grad_(False)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_model(seed=0, net=None, **kw):
    """``net(**kw)`` (a ``TinyGPT`` by default) built right after ``torch.manual_seed(seed)``:
    every run of a test, the plain reference and the engine's, starts from the same weights."""
    torch.manual_seed(seed)
    return (net or TinyGPT)(**kw)


def batches(n, batch=4, ctx=16, vocab=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, vocab, (batch, ctx + 1), generator=g)
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


class Wide(nn.Module):
    """Low arithmetic density: big parameter blocks, tiny activations (long transfers, quick
    compute), so a race between prefetch, update and use shows up as a wrong value."""

    def __init__(self, layers=10, d=128):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(layers))

    def forward(self, x, y=None):
        for layer in self.layers:
            x = x + layer(x)
        out = x.pow(2).mean()
        return out if y is None else out + 0 * y.sum()


class RuleLayer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.lin(self.ln(x)))


class RuleNet(nn.Module):
    """Blocks tok, layers.0, layers.1, head: 2-D weights (Adafactor's factored rows), sizes
    set by ``vocab`` and ``d`` (large enough, state chunks)."""

    def __init__(self, vocab, d):
        super().__init__()
        self.vocab = vocab
        self.tok = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(RuleLayer(d) for _ in range(2))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx, targets):
        x = self.tok(idx)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(x).reshape(-1, self.vocab), targets.reshape(-1))


def rule_batches(n, vocab, seed=1):
    """``n`` (x, y) batches of 4 sequences of 8 tokens for a RuleNet."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (n, 4, 9), generator=g)
    return [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in x]


def clone(model):
    return copy.deepcopy(model)


def resume_and_train(eng, ckpt, data):
    """Load ``ckpt`` into ``eng``, take one step per ``(x, y)`` of ``data`` and return the
    full state dict; ``eng`` is closed afterwards, whatever happens."""
    try:
        eng.load_checkpoint(str(ckpt))
        for x, y in data:
            eng.backward(eng(x, y))
            eng.step()
        return eng.full_state_dict()
    finally:
        eng.close()
