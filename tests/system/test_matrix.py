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
import itertools

import pytest
import torch

import offload
from _hf import args, dataset, train_logs, transformers
from _matrix import CELLS, FACTORS, REQUIRED, block_bytes, build, cell_id, check_cell, data, engine_config, hf_model, \
    pairs, peft
from _parity import max_diff, noise_bound

pytestmark = pytest.mark.filterwarnings("ignore:saved activations leave a CPU device",
                                        "ignore:`use_cache=True` is incompatible")


def test_cells_cover_every_pair_and_the_required_cells():
    every = set().union(*(pairs(dict(zip(FACTORS, v))) for v in itertools.product(*FACTORS.values())))
    assert set().union(*(pairs(c) for c in CELLS)) == every
    for req in REQUIRED:
        assert any(all(c[k] == v for k, v in req.items()) for c in CELLS), req
    assert len(CELLS) <= 16


@pytest.mark.parametrize("cell", CELLS, ids=cell_id)
def test_cell_matches_plain_torch(cell, tmp_path):
    check_cell(cell, tmp_path)


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
        assert hf_model(model).is_activation_checkpointing
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
            assert abs(g[k] - r[k]) <= noise_bound(r[k], f[k]), (k, g[k], r[k], f[k])
    bound = noise_bound(ref[1], fus[1])
    assert ref[1].keys() == got[1].keys() and max_diff(ref[1], got[1]) <= bound
