"""Parity with plain PyTorch, one copy for every test: the distance between two runs
(``max_diff``), torch's own noise (the distance between its single-tensor and fused AdamW on
the same run) and the bound taken from it (``noise_bound``: twice the noise plus 1e-6), and the
plain-torch AdamW loop the engine is compared with (``reference_run``, ``check_parity``).

Why a measured bound: one-ulp differences in an update grow through the next steps'
gradients, so a fixed tolerance is either loose or flaky; torch's two implementations show
how far two correct updates drift on this run, and a wrong update (no bias correction, wrong
decay) falls far outside twice that."""
import torch

# What the noise bound adds to twice the measured noise: two runs that happen to agree
# exactly still leave room for one rounding.
FLOOR = 1e-6


def max_diff(a: dict, b: dict) -> float:
    """The largest elementwise ``|a[k] - b[k]|`` (in fp32) over two dicts of tensors that hold
    the same keys (state dicts, snapshots); a key in one and not the other is an error."""
    assert a.keys() == b.keys(), set(a) ^ set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def noise(ref, other) -> float:
    """How far torch's two implementations are apart: ``max_diff`` for dicts of tensors, the
    largest elementwise difference for tensors (losses stacked), ``|ref - other|`` for numbers."""
    if isinstance(ref, dict):
        return max_diff(ref, other)
    if isinstance(ref, torch.Tensor):
        return (ref - other).abs().max().item()
    return abs(ref - other)


def noise_bound(ref, other) -> float:
    """The tolerance against ``ref``: twice the noise between ``ref`` and ``other`` (torch's
    single-tensor and fused runs) plus ``FLOOR``."""
    return 2 * noise(ref, other) + FLOOR


def parity_bounds(ref, ref_fused) -> list:
    """Per-step bounds for two lists of snapshots (single-tensor and fused AdamW)."""
    return [noise_bound(a, b) for a, b in zip(ref, ref_fused)]


def check_parity(ref, ref_fused, got, keys=None) -> None:
    """``got`` has one snapshot per snapshot of ``ref`` (at least one), each holding ``ref``'s
    keys in its order and within that step's bound of ``ref``; ``keys``: compare (and bound)
    only those (the adapters of a LoRA model, say)."""
    assert len(got) == len(ref) > 0
    pick = (lambda s: {k: s[k] for k in keys}) if keys else (lambda s: s)
    bounds = parity_bounds([pick(s) for s in ref], [pick(s) for s in ref_fused])
    for step, (r, g, b) in enumerate(zip(ref, got, bounds)):
        assert list(r) == list(g)
        d = max_diff(pick(r), pick(g))
        assert d <= b, f"step {step}: the engine differs from torch by {d}, bound {b}"


def reference_run(model, data, *, lr=1e-3, wd=0.01, clip=0.0, gas=1, adamw=True, groups=None, sched=None,
                  fused=False):
    """Plain PyTorch: AdamW (foreach=False, or fused), clip_grad_norm_, loss / gas. Returns
    the parameter snapshots after every optimizer step."""
    params = [p for p in model.parameters() if p.requires_grad]
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    kind = {"fused": True} if fused else {"foreach": False}
    opt = cls(groups(model) if groups else params, lr=lr, weight_decay=wd, **kind)
    sch = sched(opt) if sched else None
    snaps = []
    for i, (x, y) in enumerate(data):
        loss = model(x, y)
        (loss / gas if gas > 1 else loss).backward()
        if (i + 1) % gas == 0:
            if clip:
                torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if sch:
                sch.step()
            snaps.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return snaps


def plain_run(model, data, fused=False, lr=1e-3, wd=0.01):
    """The plain loop (plain torch / PEFT): AdamW, single-tensor or fused, on the trainable
    parameters; each step's state_dict and loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=wd, **({"fused": True} if fused else {"foreach": False}))
    snaps, losses = [], []
    for x, y in data:
        loss = model(x, y)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        snaps.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return snaps, losses
