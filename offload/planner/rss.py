"""Peak host memory (RSS) of a training process, term by term.

``offload estimate`` and ``offload plan`` count model states per tier; a process's peak RSS
holds more than that. ``predict_rss`` names every term that is resident at the peak, so a
prediction can be put beside a measured ``ru_maxrss`` / ``VmHWM`` term by term:

  baseline            the process before ``offload.initialize``: the interpreter, torch and
                      the libraries it imported (their mapped code pages count as RSS: file
                      pages of a mapping are resident memory, not only page cache), the model
                      built on the meta device. ``measure_baseline`` measures it in a fresh
                      interpreter that imports the same modules.
  pool <name>         each host pool of the engine's memory plan (``engine/memory_plan.py``,
                      the one source of pool sizes: this file never sizes a pool), whole.
                      Pools are anonymous mappings whose pages become resident when first
                      written; over a few steps every slot is lent (which slot a block gets
                      follows the order buffers come back in), so all of a pool is resident.
  device model states on a CPU-only machine the device is the process heap: the plan's
                      device bytes that are not already a pool (parameters without parameter
                      offload, gradients and state with ``offload_optimizer.device: none``;
                      offloaded parameters are used in their staging slots, not copied).
  activations         the tensors autograd saves in one micro-step's forward (parameters
                      excluded), on a CPU-only machine (on CUDA they are on the device;
                      offloaded ones are in the ``offload-activations`` pool).
                      ``saved_activation_bytes`` counts them by running the model on the
                      meta device: each storage once, no memory, no compute.
  gradients in flight on a CPU-only machine, backward's gradients before the engine copies
                      them into a gradient buffer: a block's trainable parameters' gradients
                      in the compute dtype (autograd's output for one block at a time).

Terms that are not predicted here: memory the allocator keeps after a free (glibc arenas),
and other processes' pages that a fork shares. The model's step-to-step behaviour is
deterministic, so the peak is the sum of what one step holds at its busiest: every term is
resident during backward of the first block of the last micro-step.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

GIB = 2 ** 30


@dataclass(frozen=True)
class RssTerm:
    name: str           # "baseline", "pool offload-swap", "activations", ...
    nbytes: int
    note: str           # what it holds / where the number came from


@dataclass(frozen=True)
class RssPrediction:
    terms: Tuple[RssTerm, ...]

    @property
    def total(self) -> int:
        return sum(t.nbytes for t in self.terms)

    def term(self, name: str) -> int:
        return sum(t.nbytes for t in self.terms if t.name == name)

    def as_dict(self) -> dict:
        return {"total_bytes": self.total, "terms": {t.name: t.nbytes for t in self.terms}}

    def lines(self, measured: Optional[int] = None) -> list:
        """One line per term (GiB), the total, and against ``measured`` when given."""
        out = [f"  {t.name:<28}{t.nbytes / GIB:8.3f} GiB  {t.note}" for t in self.terms]
        out.append(f"  {'predicted peak RSS':<28}{self.total / GIB:8.3f} GiB")
        if measured:
            out.append(f"  {'measured':<28}{measured / GIB:8.3f} GiB  (error "
                       f"{abs(self.total - measured) / measured:.1%})")
        return out


# ---- measurements --------------------------------------------------------------------------------
_BASELINE = r"""
import json, sys
for m in sys.argv[2:]:
    exec("import " + m)
exec(sys.argv[1])
with open("/proc/self/status") as f:
    st = {k: int(v.split()[0]) * 1024 for k, v in (l.split(":", 1) for l in f) if k in ("VmRSS", "VmHWM")}
print("RSS " + json.dumps(st))
"""


def measure_baseline(imports: Sequence[str] = ("torch", "offload"), setup: str = "", timeout: float = 300.0) -> int:
    """Resident bytes of a fresh interpreter (this one, this ``sys.path``) after importing
    ``imports`` and running ``setup`` (e.g. building the model on the meta device, which loads
    the library code that model needs): the process's floor before any model state."""
    r = subprocess.run([sys.executable, "-c", _BASELINE, setup, *imports], capture_output=True, text=True,
                       timeout=timeout)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RSS ")), None)
    if r.returncode != 0 or line is None:
        raise RuntimeError(f"measuring the baseline RSS (python -c 'import {', '.join(imports)}') failed: "
                           f"{r.stderr.strip().splitlines()[-1:] or r.returncode}")
    return json.loads(line[4:])["VmRSS"]


def saved_activation_bytes(model, forward: Callable[[object], object]) -> int:
    """Bytes of the tensors autograd saves for backward while ``forward(model)`` runs (the
    model's parameters excluded), each storage counted once. Run it on a model built on the
    meta device with meta inputs: shapes and dtypes are exact, nothing is allocated. On the
    meta device attention would take torch's composite path (which saves the probabilities);
    it is run as the CPU's fused kernel where the CPU would choose it (``_CpuAttention``), so
    the count is what a CPU-device step saves."""
    import torch
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    saved = {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in params:
            saved[st._cdata] = st.nbytes()
        return t.detach()          # not t: a node saving its own output would keep the graph (core/hooks.unclaimed)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _cpu_attention():
        forward(model)
    return int(sum(saved.values()))


def _cpu_attention():
    """A torch function mode that runs ``scaled_dot_product_attention`` on meta tensors as the
    CPU would: its fused flash kernel (``_scaled_dot_product_flash_attention_for_cpu``, which
    has a meta implementation) where ``torch._fused_sdp_choice`` picks it for CPU tensors of
    the same dtype and head size, else torch's own path."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    class _CpuAttention(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention and args and args[0].device.type == "meta":
                out = _flash_on_meta(*args, **kwargs)
                if out is not None:
                    return out
            return func(*args, **kwargs)

    def _flash_on_meta(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if q.dim() != 4 or (k.size(-3) != q.size(-3) and not enable_gqa):
            return None
        stand = [torch.empty((1, t.size(-3), 2, t.size(-1)), dtype=t.dtype) for t in (q, k, v)]
        mask = None if attn_mask is None else torch.empty((1, 1, 2, 2), dtype=attn_mask.dtype)
        choice = torch._fused_sdp_choice(*stand, mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        if choice != torch.nn.attention.SDPBackend.FLASH_ATTENTION.value:
            return None
        if attn_mask is not None and attn_mask.dtype == torch.bool:      # as torch converts it
            attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill(
                attn_mask.logical_not(), float("-inf"))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
    return _CpuAttention()


# ---- the prediction -------------------------------------------------------------------------------
def predict_rss(mplan, *, baseline: int, activations: Optional[int], device_is_host: bool,
                grad_in_flight: int = 0, baseline_note: str = "measured") -> RssPrediction:
    """The terms of the module docstring for one run: ``mplan`` is the engine's memory plan
    (``memory_plan.plan``) of the run's blocks and config; ``activations`` the bytes one
    micro-step saves (None: not known, left out and said so); ``device_is_host``: no
    accelerator (the device's bytes are the process's); ``grad_in_flight``: bytes of the
    largest block's trainable gradients in the compute dtype."""
    terms = [RssTerm("baseline", int(baseline), f"interpreter, libraries, meta model ({baseline_note})")]
    for p in mplan.pools:
        terms.append(RssTerm(f"pool {p.name}", p.nbytes, p.holds))
    if device_is_host:
        dev = mplan.device - (mplan.param_budget or 0)       # offloaded parameters live in their slots
        if dev > 0:
            terms.append(RssTerm("device model states", dev, "the device is the process heap"))
        if mplan.param_budget and any(b.frozen_home != b.frozen for b in mplan.blocks):
            terms.append(RssTerm("dequantized parameters", mplan.param_budget,
                                 "frozen parts stored quantized are dequantized into copies of their own"))
        terms.append(RssTerm("gradients in flight", int(grad_in_flight),
                             "one block's gradients from autograd, before the copy into their buffer"))
        if activations is None:
            terms.append(RssTerm("activations", 0, "not counted: give the batch shape"))
        else:
            terms.append(RssTerm("activations", int(activations), "saved by autograd in one micro-step"))
    return RssPrediction(tuple(terms))


def placement_rss(spec, optimizer: str, param: str, precision: str = "bf16", *, baseline: int,
                  saved_activations: Optional[int], device_is_host: bool, baseline_note: str = "measured",
                  host_available: Optional[int] = None, **config) -> RssPrediction:
    """``predict_rss`` for a model description (``estimate.ModelSpec``) at one placement, with
    ``saved_activations`` bytes saved per micro-step (None: unknown); ``config``: ``estimate.plan_config``'s keywords (buffer_count, gradient_clipping,
    gradient_accumulation_steps, grad_host_bytes, device_budget_bytes, host_lookahead_bytes,
    world_size, activations, activation_host_bytes), and ``rule`` / ``state_dtype``."""
    from offload.engine import memory_plan as mp
    from offload.planner import estimate as est
    rule, state_dtype = config.pop("rule", None), config.pop("state_dtype", None)
    world = config.get("world_size", 1)
    cfg = est.plan_config(optimizer, param, precision, **config)
    blocks = est.spec_blocks(spec, precision)
    mplan = mp.plan(blocks, cfg, world_size=world, rank=0, rule=rule, state_dtype=state_dtype,
                    host_available=host_available)
    largest = max((b.numel for b in blocks), default=0) * est.BYTES_PER_PARAM[precision]
    return predict_rss(mplan, baseline=baseline, activations=saved_activations, device_is_host=device_is_host,
                       grad_in_flight=largest, baseline_note=baseline_note)
