"""What tests read of a running engine beyond its public API: the blocks that update ahead,
the bytes of the parameter swap files, and an independent measure of the device bytes the
model's parameters hold (``ParamBytesProbe``). One copy each, so that a change to the
engine's internals is followed in one place."""
import os

import torch


def ahead_blocks(eng) -> int:
    """The blocks whose updates update_ahead computes during backward: every one, the first
    (whose gradients land last) included, on every device."""
    slots = [b.update.ahead is not None for b in eng.blocks if b.trains]
    assert slots == [True] * len(slots), slots
    return sum(slots)


def swap_bytes(eng) -> int:
    """The bytes of the engine's parameter swap files (``*.swap`` in its params swap folder)."""
    d = eng.swap_dirs()["params"]
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".swap"))


class ParamBytesProbe:
    """An independent measure of device parameter bytes (CPU device): the bytes of live
    tensors the model's parameters hold, sampled in every module's forward pre/post hook and
    in every trainable parameter's gradient hook (backward). Storage-free stubs (stride 0)
    and empty placeholders hold nothing."""

    def __init__(self, model):
        self.model, self.peak, self.hooks = model, 0, []
        for m in model.modules():
            self.hooks.append(m.register_forward_pre_hook(lambda *a: self.sample()))
            self.hooks.append(m.register_forward_hook(lambda *a: self.sample()))
        for p in model.parameters():
            if p.requires_grad:
                self.hooks.append(p.register_hook(lambda g: self.sample()))

    def sample(self):
        seen, total = set(), 0
        # outside torch-function handling: reading a parameter must not itself fetch its block
        with torch._C.DisableTorchFunction():
            for p in self.model.parameters():
                if p.numel() == 0 or 0 in p.stride() or p.data_ptr() in seen:
                    continue
                seen.add(p.data_ptr())
                total += p.numel() * p.element_size()
        self.peak = max(self.peak, total)

    def remove(self):
        for h in self.hooks:
            h.remove()
