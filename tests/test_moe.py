"""Mixture-of-experts models (issue 44): fused 3-D expert tensors quantized per expert
(params/quantized.py), transformers' own MoE families trained by the engine against a plain
torch / PEFT loop over the same quantized-then-dequantized base (a covering array of
fine-tune mode x base format x parameter tier x gradient checkpointing, the router's
auxiliary loss on), the router trainable or frozen, and the estimate of the real models'
configs (tests/fixtures/hf_configs/)."""
import pytest
import torch
from torch import nn

import offload
from offload import quantize as qz
from offload.core import blocks as blk
from offload.params import quantized
from _models import batches, clone
from test_engine import max_diff, parity_bounds

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
transformers.logging.set_verbosity_error()

MIN_NUMEL = 256           # the test models' tensors are small: quantize every 2-D / 3-D one of them
VOCAB = 97


# ---- the codec: per expert ------------------------------------------------------------------
class _Experts(nn.Module):
    def __init__(self, experts, rows, cols):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, rows, cols))
        self.norm = nn.Parameter(torch.randn(cols))
        self.down_proj = nn.Parameter(torch.randn(experts, cols, rows))


def _codec(fmt, double_quant, experts=5, rows=9, cols=13):
    torch.manual_seed(0)
    m = _Experts(experts, rows, cols).to(torch.bfloat16).requires_grad_(False)
    [(_, _, [part])] = blk.frozen_parts(m, [""], lambda p: torch.bfloat16)
    codec = quantized.QuantizedPart.for_part(part, torch.bfloat16, fmt, double_quant, MIN_NUMEL // 4)
    return m, part, codec


@pytest.mark.parametrize("fmt,double_quant", [("nf4", False), ("nf4", True), ("int8", False)])
def test_experts_quantized_per_expert_and_dequantized_alone(fmt, double_quant, monkeypatch):
    """A 3-D tensor [E, R, C] is quantized per expert (an odd R * C, not a multiple of the
    NF4 block: blocks restart at each expert), in chunks smaller than an expert: the part's
    values equal ``round_trip`` of each whole tensor; expert e dequantizes alone (native and
    torch paths) to the same bits after every byte of its neighbours' codes and scales is
    overwritten; nf4 / int8 experts equal the expert quantized as its own tensor; the bytes
    are ``tensor_bytes``'."""
    monkeypatch.setattr(quantized, "_CHUNK", 64)
    m, part, codec = _codec(fmt, double_quant)
    assert [sc.fmt for sc in codec.segments] == [fmt, "raw", fmt]
    blob = codec.fill(torch.full((codec.nbytes,), 0xAB, dtype=torch.uint8))
    out = codec.values(blob)
    for sc in codec.segments:
        if sc.fmt != "raw":
            assert sc.experts == 5 and sc.nbytes == quantized.tensor_bytes(sc.shape, fmt, double_quant)
            want = quantized.round_trip(sc.param.data, fmt, double_quant)
            assert torch.equal(out[sc.offset:sc.offset + sc.numel].view(sc.shape), want), sc.name
            err = (want.float() - sc.param.data.float()).abs().max().item()    # of the bf16 values
            ulp = sc.param.data.float().abs().max().item() / 256             # bf16 rounding of the values
            assert sc.max_abs_error == pytest.approx(err, abs=ulp)
    ref = torch.empty_like(out)
    codec.dequantize(blob, ref, reference=True)
    assert torch.equal(ref, out)
    name, e = "down_proj", 3
    sc = next(s for s in codec.segments if s.name == name)
    whole = out[sc.offset:sc.offset + sc.numel].view(sc.shape)
    alone = codec.dequantize_expert(blob, name, e)
    assert torch.equal(alone, whole[e])
    if not double_quant:                       # each expert is its own tensor's quantization
        assert torch.equal(alone, quantized.round_trip(sc.param.data[e], fmt))
    keep = torch.zeros(codec.nbytes, dtype=torch.bool)     # expert e's bytes of every piece
    per = sc.numel // sc.experts
    for piece, (off, nbytes) in sc.pieces.items():
        if piece == "absmax_scale":
            w = 4 * quantized.q8.nblocks(qz.nblocks_of(per))
        else:
            w = nbytes // sc.experts
        keep[off + e * w:off + (e + 1) * w] = True
    scrambled = torch.where(keep, blob, torch.randint(0, 256, blob.shape, dtype=torch.uint8))
    assert torch.equal(codec.dequantize_expert(scrambled, name, e), alone)
    assert torch.equal(codec.dequantize_expert(scrambled, name, e, reference=True), alone)
    with pytest.raises(IndexError, match="it has 5"):
        codec.dequantize_expert(blob, name, 5)


def test_experts_of_whole_blocks_have_the_whole_flats_codes():
    """Experts of a multiple of 64 elements: per-expert NF4 (no double quant) is the whole
    flat's quantization, and one expert with double quant is ``quantize_nf4``'s."""
    torch.manual_seed(1)
    x = torch.randn(4, 16, 24, dtype=torch.bfloat16)
    per = qz.quantize_nf4_experts(x)
    whole = qz.quantize_nf4(x)
    assert torch.equal(torch.cat([t.packed for t in per]), whole.packed)
    assert torch.equal(torch.cat([t.absmax for t in per]), whole.absmax)
    [one] = qz.quantize_nf4_experts(x[:1], double_quant=True)
    ref = qz.quantize_nf4(x[0], double_quant=True)
    assert torch.equal(one.absmax_q, ref.absmax_q) and torch.equal(one.absmax_scale, ref.absmax_scale)
    assert one.absmax_offset == ref.absmax_offset
