"""Frozen parameters offloaded with their blocks: PEFT LoRA on a Hugging Face Llama (bf16
frozen base beside fp32 adapters in the same block) against plain torch, the device budget
as a contract, and the reported device peak against an independent measure."""
import collections
import os

import pytest
import torch
from torch import nn

import offload
from offload.params.budget import DeviceBudgetError
from _models import batches, clone
from _lora import base_key_map, engine_run, lora_cfg, lora_llama, save_base
from _parity import check_parity, reference_run
from _probes import swap_bytes



def block_bytes(model):
    """Device bytes of each block root's parameters as the engine stores them (bf16 base,
    fp32 adapters): a lower bound for the budget."""
    from offload.core.blocks import auto_block_roots
    mods = dict(model.named_modules())
    return {r: sum(p.numel() * p.element_size() for p in mods[r].parameters()) for r in auto_block_roots(model)}


@pytest.mark.parametrize("param", ["cpu", "nvme"])
def test_lora_llama_matches_torch_within_budget(param, tmp_path):
    base = lora_llama()
    data = batches(6, vocab=97)
    sizes = block_bytes(base)
    layer = max(v for k, v in sizes.items() if ".layers." in k)
    budget = 2 * max(sizes.values()) + 8192       # two blocks: one in use, one arriving
    assert budget < sum(sizes.values())           # the base does not fit: offload must work
    ref = reference_run(clone(base), data)
    ref_fused = reference_run(clone(base), data, fused=True)
    got, stats, probe_peak, _ = engine_run(clone(base), data, lora_cfg(tmp_path, param, budget), probe=True)
    trainable = [k for k in ref[0] if "lora_" in k]
    check_parity([{k: s[k] for k in trainable} for s in ref], [{k: s[k] for k in trainable} for s in ref_fused],
                 [{k: s[k] for k in trainable} for s in got])
    for k in ref[0]:                               # the frozen base is untouched, in its dtype
        if "lora_" not in k:
            assert torch.equal(got[-1][k], ref[-1][k].float()), k
    peak = stats["device_param_bytes_peak"]
    assert layer <= probe_peak <= peak <= budget, (layer, probe_peak, peak, budget)
    assert stats["param_budget_overruns"] == 0
    assert stats["prefetch"]["hits"] > stats["prefetch"]["misses"]


def test_frozen_base_lives_on_its_tier_in_its_dtype(tmp_path):
    model = lora_llama(layers=2)
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    eng = offload.initialize(model, lora_cfg(tmp_path, "nvme"))
    frozen = [b for b in eng.blocks if b.frozen]
    assert frozen and all(p.dtype == torch.bfloat16 for u in frozen for p in u.frozen)
    mixed = [b for b in eng.blocks if b.frozen and b.trainable is not None]
    assert mixed and all(u.trainable.dtype == torch.float32 for u in mixed)
    # between uses nothing of the base is on the device, and it has no optimizer state
    assert all(p.numel() == 0 for p in model.parameters())
    assert sum(b.layout.numel for b in eng.blocks if b.trains) == n_trainable
    eng.close()


def test_budget_too_small_fails_at_initialize_with_the_smallest_that_works(tmp_path):
    model = lora_llama(layers=2)
    with pytest.raises(DeviceBudgetError) as err:
        offload.initialize(clone(model), lora_cfg(tmp_path, "cpu", budget=4096))
    msg = str(err.value)
    assert "device_budget_bytes=4096" in msg and "smallest budget that works is" in msg
    need = int(msg.split("smallest budget that works is ")[1].split(";")[0])
    assert need >= max(block_bytes(model).values())
    # exactly that budget trains, and stays within it
    _, stats, probe_peak, _ = engine_run(clone(model), batches(2, vocab=97), lora_cfg(tmp_path, "cpu", need), probe=True)
    assert probe_peak <= stats["device_param_bytes_peak"] <= need


class OutsideRead(nn.Module):
    """A module that reads another block's parameter while its own block is in use: the
    one use the static working set cannot see."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.a.register_forward_hook(lambda m, i, o: o + torch.cat([self.b.weight, self.c.weight]).sum())

    def forward(self, x, y=None):
        return self.c(self.b(self.a(x))).pow(2).mean()


def test_runtime_overrun_is_an_error(tmp_path):
    torch.manual_seed(0)
    model = OutsideRead()
    one = 1024 * 4                                 # one block: the padded flat of one Linear, fp32
    eng = offload.initialize(model, lora_cfg(tmp_path, "cpu", budget=2 * one))
    with pytest.raises(DeviceBudgetError, match="raise the budget to at least"):
        eng(torch.randn(2, 8))
    eng.close()


# ---- the frozen base read in place from the checkpoint's own files ----------------------------
@pytest.mark.parametrize("in_place", [True, False])
def test_lora_base_read_in_place_matches_torch(in_place, tmp_path):
    """LoRA with the bf16 base read in place from its safetensors files trains as plain torch
    does (within torch's own fused-vs-single noise); the swap file holds no frozen byte."""
    base = lora_llama()
    ck = save_base(base, tmp_path / "ck")
    data = batches(6, vocab=97)
    ref = reference_run(clone(base), data)
    ref_fused = reference_run(clone(base), data, fused=True)
    c = lora_cfg(tmp_path, "nvme")
    c["offload_param"]["frozen_in_place"] = in_place
    eng = offload.initialize(clone(base), c, weights=ck, key_map=base_key_map)
    got = []
    for x, y in data:
        loss = eng(x, y)
        eng.backward(loss)
        eng.step()
        got.append(eng.full_state_dict())
    trainable = [k for k in ref[0] if "lora_" in k]
    check_parity([{k: s[k] for k in trainable} for s in ref], [{k: s[k] for k in trainable} for s in ref_fused],
                 [{k: s[k] for k in trainable} for s in got])
    for k in ref[0]:                               # the frozen base is the file's, in its dtype
        if "lora_" not in k:
            assert torch.equal(got[-1][k], ref[-1][k].float()), k
    trained = sum(-(-u.trainable.home_nbytes // 4096) * 4096 for u in eng.blocks if u.trainable is not None)
    frozen = sum(p.home_nbytes for u in eng.blocks for p in u.frozen)
    st = eng.stats()
    if in_place:                                   # the swap file holds the adapters only
        assert swap_bytes(eng) == trained and st["source_bytes"] >= frozen
        assert st["bytes"]["nvme_read"] >= 6 * frozen      # the base is read from the checkpoint each step
    else:
        assert swap_bytes(eng) >= trained + frozen and "source_bytes" not in st
    eng.close()


def test_backward_reads_each_frozen_block_at_most_once(tmp_path, monkeypatch):
    """The base read in place is read once by each forward and at most once more by each
    backward. A LoRA layer's frozen weights are unpacked for the input gradient after its
    adapters' gradients landed: the block is kept until then, not released at the gradients
    and read again (which made a 7B LoRA step read 2.9x its base instead of 1.9x). The
    backward does not stage the next forward's first blocks either (the embedding, which no
    backward uses, is read once per step, after step()). So each step reads at most twice
    the parameters' home bytes (what ``offload plan``'s parameter reads assume before the
    device budget's share) and at least the base once, and trains as torch."""
    from offload.storage.source import SourceStore
    reads = collections.Counter()
    read = SourceStore.read

    def counted(self, key, dst):
        reads[key] += 1
        return read(self, key, dst)
    monkeypatch.setattr(SourceStore, "read", counted)
    base = lora_llama(layers=6)
    ck = save_base(base, tmp_path / "ck")
    data = batches(6, vocab=97)
    ref = reference_run(clone(base), data)
    ref_fused = reference_run(clone(base), data, fused=True)
    c = lora_cfg(tmp_path, "nvme")
    c["offload_optimizer"] = {"device": "cpu"}          # NVMe reads: the parameters' alone
    eng = offload.initialize(clone(base), c, weights=ck, key_map=base_key_map)
    base_bytes = eng.stats()["source_bytes"]
    home = base_bytes + swap_bytes(eng)
    embed = [p.key for bp in eng.param_offload.offloaded if bp.name.endswith("embed_tokens")
             for p in bp.frozen]
    assert len(embed) == 1
    got, per_step, per_key = [], [], []
    for x, y in data:
        before = eng.stats()["bytes"].get("nvme_read", 0)
        reads.clear()
        loss = eng(x, y)
        eng.backward(loss)
        eng.step()
        eng.synchronize()
        per_step.append((eng.stats()["bytes"]["nvme_read"] - before) / home)
        per_key.append(dict(reads))
        got.append(eng.full_state_dict())
    eng.close()
    trainable = [k for k in ref[0] if "lora_" in k]
    check_parity([{k: s[k] for k in trainable} for s in ref], [{k: s[k] for k in trainable} for s in ref_fused],
                 [{k: s[k] for k in trainable} for s in got])
    # Over the steps after the first (which records the prefetch trace): each block read at
    # most twice a step, the embedding once; plus once more for the step after the last (a
    # step() stages the next forward's first blocks when their updates are done, else that
    # forward reads them: a read may fall in either step)
    steps = per_key[1:]
    total = collections.Counter()
    for step in steps:
        total.update(step)
    assert max(total.values()) <= 2 * len(steps) + 1 and total[embed[0]] <= len(steps) + 1, per_key
    steady = per_step[1:]
    assert sum(steady) <= 2 * len(steady), per_step
    assert min(steady) >= base_bytes / home, per_step  # the forward reads the whole base every step


@pytest.mark.parametrize("how", ["same_size_and_mtime", "appended"])
def test_checkpoint_changed_under_the_run_is_detected(how, tmp_path):
    base = lora_llama(layers=2)
    ck = save_base(base, tmp_path / "ck")
    eng = offload.initialize(clone(base), lora_cfg(tmp_path, "nvme"), weights=ck, key_map=base_key_map)
    data = batches(4, vocab=97)
    x, y = data[0]
    eng.backward(eng(x, y))
    eng.step()
    from offload.io.safetensors import WeightFiles
    ext = WeightFiles(ck).extent("model.layers.1.mlp.up_proj.weight")
    st = os.stat(ext.file)
    with open(ext.file, "r+b" if how == "same_size_and_mtime" else "ab") as f:
        if how == "appended":
            f.write(b"x")
        else:                                      # one flipped byte; size and mtime kept
            f.seek(ext.offset + 5)
            b = f.read(1)
            f.seek(ext.offset + 5)
            f.write(bytes([b[0] ^ 0xFF]))
    if how == "same_size_and_mtime":
        os.utime(ext.file, ns=(st.st_atime_ns, st.st_mtime_ns))
        msg = r"model\.layers\.1\.mlp\.up_proj\.weight' read in place from .* does not match the checksum"
    else:
        msg = r"checkpoint file .* read in place for frozen parameters, changed under the run"
    with pytest.raises(offload.BlockError, match=msg) as err:
        for x, y in data[1:]:
            eng.backward(eng(x, y))
            eng.step()
        eng.synchronize()
    assert "parameter read of block 1 (m.base_model.model.model.layers.1)" in str(err.value)
    assert ext.file in str(err.value)
    eng.close(restore=False)            # returns; restoring would read the changed file again
