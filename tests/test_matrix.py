"""The engine's features in combination, each cell against plain torch / PEFT on the same seed.

Factors (``FACTORS``): where the optimizer state lives (none / cpu / nvme), where the
parameters live (none / cpu / nvme), what is trained (the full model; PEFT LoRA on a frozen
base; partly frozen: the embedding, layer 0 and layer 1's MLP frozen, so one block mixes
frozen and trained parameters), activation checkpointing (off / reentrant / non-reentrant),
the switch that turns it on (Hugging Face's ``activation_checkpointing_enable``, or
``torch.utils.checkpoint`` put around each decoder layer by hand), activation offload
(none / cpu / nvme), precision (fp32 / bf16) and gradient accumulation (1 / 3).

How the cells were chosen: a pairwise covering array, built deterministically here
(``covering_array``): every value of every factor meets every value of every other factor
in at least one cell. It starts from the four cells that must be there (LoRA with
checkpointing, reentrant and not, with the base offloaded to cpu and to nvme) and adds, one
at a time, the candidate of the full product that covers the most pairs not yet covered (the
first such in product order), until none is left: fifteen cells instead of the 1,944 of the product.

Each cell trains a 3-layer Llama for two optimizer steps and compares, after each step, the
trained weights (fp32 masters in bf16 cells), and the loss of every micro-step, to plain
torch doing the same arithmetic: AdamW on fp32 masters from gradients summed in fp32 over
the micro-steps of ``loss / gas``, the model's copy rounded from the masters. The tolerance
is torch's own noise, measured in the cell: twice the distance between that reference run
with torch's single-tensor AdamW and with its fused AdamW, plus 1e-6. Frozen weights must
come back bit for bit. Cells with parameters offloaded run within a device budget the base
does not fit in, and must stay within it.
"""
import functools
import itertools
import os

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import offload
from _hf import SEQ, VOCAB, args, dataset, max_diff, train_logs, transformers

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.filterwarnings("ignore:saved activations leave a CPU device",
                                        "ignore:`use_cache=True` is incompatible")

FACTORS = {
    "opt": ("none", "cpu", "nvme"),
    "param": ("none", "cpu", "nvme"),
    "kind": ("full", "lora", "partial"),
    "ckpt": ("off", "reentrant", "non_reentrant"),
    "act": ("none", "cpu", "nvme"),
    "switch": ("hf", "torch"),
    "dtype": ("fp32", "bf16"),
    "gas": (1, 3),
}
REQUIRED = [{"kind": "lora", "ckpt": c, "param": p} for c in ("reentrant", "non_reentrant") for p in ("cpu", "nvme")]
LR, WD, STEPS = 1e-3, 0.01, 2


def _pairs(row: dict) -> set:
    return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(row, 2)}


def covering_array(factors: dict, required: list) -> list:
    """Rows (dicts) covering every pair of values of two factors; ``required`` partial rows
    come first, completed greedily (see the module's docstring)."""
    candidates = [dict(zip(factors, values)) for values in itertools.product(*factors.values())]
    uncovered = set().union(*(_pairs(r) for r in candidates))
    rows = []

    def take(pool):
        best = max(pool, key=lambda r: len(_pairs(r) & uncovered))      # first of the best: stable
        rows.append(best)
        uncovered.difference_update(_pairs(best))
    for req in required:
        take([r for r in candidates if all(r[k] == v for k, v in req.items())])
    while uncovered:
        take(candidates)
    return rows


CELLS = covering_array(FACTORS, REQUIRED)


def _cell_id(c: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in c.items())


def test_cells_cover_every_pair_and_the_required_cells():
    every = set().union(*(_pairs(dict(zip(FACTORS, v))) for v in itertools.product(*FACTORS.values())))
    assert set().union(*(_pairs(c) for c in CELLS)) == every
    for req in REQUIRED:
        assert any(all(c[k] == v for k, v in req.items()) for c in CELLS), req
    assert len(CELLS) <= 16


# ---- the model of a cell ------------------------------------------------------------------
class LM(nn.Module):
    """(x, y) -> loss for a causal LM (labels are the inputs; the model shifts them)."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x, y=None):
        return self.m(input_ids=x, labels=x, use_cache=False).loss


def _hf_model(m):
    return m.get_base_model() if isinstance(m, peft.PeftModel) else m


def _checkpoint_layers_by_hand(hf, reentrant: bool) -> None:
    """``torch.utils.checkpoint`` around each decoder layer's forward (its keyword arguments
    bound, as reentrant checkpointing takes positional tensors only)."""
    hf.enable_input_require_grads()          # the frozen embedding's output must carry a graph
    for layer in hf.model.layers:
        def forward(*a, _orig=layer.forward, **kw):
            return checkpoint(functools.partial(_orig, **kw), *a, use_reentrant=reentrant)
        layer.forward = forward


def build(cell: dict, device="cpu") -> LM:
    """The cell's model, fp32, from seed 0, its checkpointing switched on, on ``device``."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2 * SEQ)
    m = transformers.LlamaForCausalLM(cfg)
    if cell["kind"] == "lora":
        m = peft.get_peft_model(m, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                   target_modules=["q_proj", "v_proj", "down_proj"]))
        with torch.no_grad():                # B is zero at init: make step one move A too
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02)
    elif cell["kind"] == "partial":
        for n, p in m.named_parameters():
            if n.startswith(("model.embed_tokens.", "model.layers.0.", "model.layers.1.mlp.")):
                p.requires_grad_(False)
    if cell["ckpt"] != "off":
        reentrant = cell["ckpt"] == "reentrant"
        hf = _hf_model(m)
        if cell["switch"] == "hf":
            hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
        else:
            _checkpoint_layers_by_hand(hf, reentrant)
    model = LM(m).to(device)
    model.train()
    return model


def data(cell: dict, device="cpu"):
    g = torch.Generator().manual_seed(1)
    return [(x.to(device), x.to(device)) for x in torch.randint(0, VOCAB, (STEPS * cell["gas"], 2, SEQ), generator=g)]


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def reference(cell: dict, *, fused: bool, device="cpu"):
    """Plain torch / PEFT on ``device``: (losses per micro-step, trained fp32 weights per step
    by key, on the CPU)."""
    model = build(cell, device)
    names = {id(p): n for n, p in model.named_parameters()}
    trained = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone() for p in trained]
    model.to(DTYPES[cell["dtype"]])          # the compute copy (buffers too, as the engine keeps them)
    opt = torch.optim.AdamW(masters, lr=LR, weight_decay=WD, **({"fused": True} if fused else {"foreach": False}))
    gas, losses, snaps = cell["gas"], [], []
    sums = [torch.zeros_like(m) for m in masters]
    for k, (x, y) in enumerate(data(cell, device)):
        loss = model(x, y)
        losses.append(loss.item())
        (loss / gas if gas > 1 else loss).backward()
        for s, p in zip(sums, trained):
            s += p.grad.float()
            p.grad = None
        if (k + 1) % gas == 0:
            for m, s in zip(masters, sums):
                m.grad = s.clone()
                s.zero_()
            opt.step()
            opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                for p, m in zip(trained, masters):
                    p.copy_(m)
            snaps.append({names[id(p)]: m.to("cpu", copy=True) for p, m in zip(trained, masters)})
    frozen = {n: p.detach().float().to("cpu", copy=True) for n, p in model.named_parameters() if not p.requires_grad}
    return torch.tensor(losses, dtype=torch.float64), snaps, frozen


def block_bytes(model: nn.Module, dtype: torch.dtype) -> dict:
    """Device bytes of each block root's parameters stored in ``dtype``."""
    from offload.core.blocks import auto_block_roots
    mods = dict(model.named_modules())
    size = torch.empty((), dtype=dtype).element_size()
    return {r: sum(p.numel() * size for p in mods[r].parameters()) for r in auto_block_roots(model)}


def engine_config(cell: dict, tmp_path, budget) -> dict:
    nvme = {"nvme_path": str(tmp_path)}
    cfg = {"optimizer": {"type": "AdamW", "lr": LR, "weight_decay": WD}, "precision": cell["dtype"],
           "gradient_accumulation_steps": cell["gas"],
           "offload_optimizer": {"device": cell["opt"], **(nvme if cell["opt"] == "nvme" else {})},
           "offload_param": {"device": cell["param"], "device_budget_bytes": budget,
                             **(nvme if cell["param"] == "nvme" else {})}}
    if cell["act"] != "none":
        cfg["offload_activations"] = {"device": cell["act"], "min_bytes": 0, "lookahead_bytes": 1 << 20,
                                      "host_bytes": 8 << 20, **(nvme if cell["act"] == "nvme" else {})}
    return cfg


def engine_run(cell: dict, tmp_path, device="cpu"):
    model = build(cell, device)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    budget = None
    if cell["param"] != "none":
        sizes = block_bytes(model, DTYPES[cell["dtype"]])
        budget = 2 * max(sizes.values()) + 8192           # two blocks: one in use, one arriving
        assert budget < sum(sizes.values())               # the model does not fit: offload must work
    eng = offload.initialize(model, engine_config(cell, tmp_path, budget))
    try:
        losses, snaps = [], []
        for k, (x, y) in enumerate(data(cell, device)):
            loss = eng(x, y)
            losses.append(loss.item())
            eng.backward(loss)
            eng.step()
            if (k + 1) % cell["gas"] == 0:
                sd = eng.full_state_dict()
                snaps.append({n: sd[n] for n in trained})
        sd = eng.full_state_dict()
        stats = eng.stats()
    finally:
        eng.close()
    return torch.tensor(losses, dtype=torch.float64), snaps, sd, stats, budget


@pytest.mark.parametrize("cell", CELLS, ids=_cell_id)
def test_cell_matches_plain_torch(cell, tmp_path):
    check_cell(cell, tmp_path)


def check_cell(cell: dict, tmp_path, device="cpu") -> None:
    """The cell on ``device`` (tests/test_cuda.py runs it on the GPU) against plain torch there."""
    ref_losses, ref, frozen = reference(cell, fused=False, device=device)
    fus_losses, fus, _ = reference(cell, fused=True, device=device)
    losses, got, sd, stats, budget = engine_run(cell, tmp_path, device)

    loss_bound = 2 * (ref_losses - fus_losses).abs() + 1e-6
    assert ((losses - ref_losses).abs() <= loss_bound).all(), (losses, ref_losses, loss_bound)
    assert len(got) == len(ref) == STEPS
    for step, (r, f, g) in enumerate(zip(ref, fus, got)):
        bound = 2 * max_diff(r, f) + 1e-6
        d = max_diff(r, g)
        assert d <= bound, f"step {step}: trained weights differ from torch by {d}, bound {bound}"
    start = reference_start(cell)
    assert max_diff(start, ref[-1]) > 1e-3               # the cell trains: the comparison can fail
    for n, v in frozen.items():                           # frozen weights: untouched, in their dtype
        assert torch.equal(sd[n].float(), v), n
    if budget is not None:
        assert stats["param_budget_overruns"] == 0
        assert stats["device_param_bytes_peak"] <= budget, (stats["device_param_bytes_peak"], budget)


@functools.lru_cache(maxsize=None)
def _start(kind: str):
    model = build({"kind": kind, "ckpt": "off"})
    return {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}


def reference_start(cell: dict) -> dict:
    return _start(cell["kind"])


def _last_step_fetched(cell: dict, tmp_path) -> int:
    """Parameter bytes fetched to the device (on demand and ahead) in the last of three steps."""
    model = build(cell)
    sizes = block_bytes(model, torch.float32)
    eng = offload.initialize(model, engine_config(cell, tmp_path, 2 * max(sizes.values()) + 8192))
    try:
        for x, y in data(cell)[:1] * 3:
            before = eng.telemetry.counters["param_fetched_bytes"]
            eng.backward(eng(x, y))
            eng.step()
        assert eng.stats()["param_budget_overruns"] == 0
        return eng.telemetry.counters["param_fetched_bytes"] - before
    finally:
        eng.close()


def test_recomputed_blocks_stay_for_their_backward(tmp_path):
    """A block fetched for its recomputation stays until the backward reading what the
    recomputation saved is done: under a two-block budget, a checkpointed step (reentrant or
    not) moves exactly the parameter bytes of the same step without checkpointing (no block
    is fetched twice)."""
    cell = {"kind": "lora", "ckpt": "off", "switch": "hf", "opt": "cpu", "param": "cpu", "act": "none",
            "dtype": "fp32", "gas": 1}
    plain = _last_step_fetched(cell, tmp_path)
    assert plain > 0
    for ckpt in ("reentrant", "non_reentrant"):
        assert _last_step_fetched(dict(cell, ckpt=ckpt), tmp_path) == plain, ckpt


# ---- the same recipe through Trainer --------------------------------------------------------
def _lora_llama():
    from _hf import tiny_llama
    m = tiny_llama()
    torch.manual_seed(0)
    return peft.get_peft_model(m, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                  target_modules=["q_proj", "v_proj"]))


def _trainer_run(trainer_cls, reentrant, **kw):
    model = _lora_llama()
    t = trainer_cls(model=model, args=args(max_steps=3, gradient_accumulation_steps=2, activation_checkpointing=True,
                                           activation_checkpointing_kwargs={"use_reentrant": reentrant},
                                           optim=kw.pop("optim", "adamw_torch")),
                    train_dataset=dataset(), **kw)
    try:
        t.train()
        assert _hf_model(model).is_activation_checkpointing
        weights = t.engine.full_state_dict() if hasattr(t, "engine") else \
            {k: v.detach().clone().float() for k, v in model.state_dict().items()}
        return train_logs(t), {k: v.float() for k, v in weights.items() if "lora_" in k}
    finally:
        if hasattr(t, "close"):
            t.close()


@pytest.mark.parametrize("reentrant,param", [(True, "cpu"), (False, "nvme")], ids=["reentrant-cpu", "non_reentrant-nvme"])
def test_trainer_lora_checkpointing_with_the_base_offloaded(reentrant, param, tmp_path):
    from offload.hf import Trainer
    ref = _trainer_run(transformers.Trainer, reentrant)
    fus = _trainer_run(transformers.Trainer, reentrant, optim="adamw_torch_fused")
    placement = {"offload_optimizer": {"device": "cpu"},
                 "offload_param": {"device": param, **({"nvme_path": str(tmp_path)} if param == "nvme" else {})}}
    got = _trainer_run(Trainer, reentrant, offload_config=placement)
    assert len(got[0]) == len(ref[0]) == 3
    for r, f, g in zip(ref[0], fus[0], got[0]):
        for k in ("loss", "grad_norm"):
            assert abs(g[k] - r[k]) <= 2 * abs(r[k] - f[k]) + 1e-6, (k, g[k], r[k], f[k])
    bound = 2 * max_diff(ref[1], fus[1]) + 1e-6
    assert ref[1].keys() == got[1].keys() and max_diff(ref[1], got[1]) <= bound
