"""The covering array of tests/system/test_matrix.py (run on the CPU there and on the GPU by
tests/system/test_cuda.py): the factors and the cells, each cell's model (a 3-layer Llama, full,
LoRA or partly frozen, its checkpointing switched on), its data, its plain torch / PEFT
reference, its engine run and ``check_cell``, the comparison (see tests/system/test_matrix.py)."""
import functools
import itertools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import offload
from _hf import SEQ, VOCAB, transformers
from _parity import max_diff, noise_bound

peft = pytest.importorskip("peft")

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


def pairs(row: dict) -> set:
    return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(row, 2)}


def covering_array(factors: dict, required: list) -> list:
    """Rows (dicts) covering every pair of values of two factors; ``required`` partial rows
    come first, completed greedily (see the module's docstring)."""
    candidates = [dict(zip(factors, values)) for values in itertools.product(*factors.values())]
    uncovered = set().union(*(pairs(r) for r in candidates))
    rows = []

    def take(pool):
        best = max(pool, key=lambda r: len(pairs(r) & uncovered))      # first of the best: stable
        rows.append(best)
        uncovered.difference_update(pairs(best))
    for req in required:
        take([r for r in candidates if all(r[k] == v for k, v in req.items())])
    while uncovered:
        take(candidates)
    return rows


CELLS = covering_array(FACTORS, REQUIRED)


def cell_id(c: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in c.items())


# ---- the model of a cell ------------------------------------------------------------------
class LM(nn.Module):
    """(x, y) -> loss for a causal LM (labels are the inputs; the model shifts them)."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x, y=None):
        return self.m(input_ids=x, labels=x, use_cache=False).loss


def hf_model(m):
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
        hf = hf_model(m)
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


def check_cell(cell: dict, tmp_path, device="cpu") -> None:
    """The cell on ``device`` (tests/system/test_cuda.py runs it on the GPU) against plain torch there."""
    ref_losses, ref, frozen = reference(cell, fused=False, device=device)
    fus_losses, fus, _ = reference(cell, fused=True, device=device)
    losses, got, sd, stats, budget = engine_run(cell, tmp_path, device)

    loss_bound = 2 * (ref_losses - fus_losses).abs() + 1e-6
    assert ((losses - ref_losses).abs() <= loss_bound).all(), (losses, ref_losses, loss_bound)
    assert len(got) == len(ref) == STEPS
    for step, (r, f, g) in enumerate(zip(ref, fus, got)):
        bound = noise_bound(r, f)
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
