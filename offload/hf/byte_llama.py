"""A small Llama-shaped model with a byte-level tokenizer, written in Hugging Face layout
with nothing downloaded: the starting point of ``make train``.

    write_byte_llama("runs/base-init", hidden=256, layers=4)
    AutoTokenizer.from_pretrained("runs/base-init")          # byte-level BPE without merges
    AutoModelForCausalLM.from_pretrained("runs/base-init")   # freshly initialised weights

The tokenizer is built locally with the ``tokenizers`` library: one token per byte (GPT-2's
byte-to-unicode alphabet, id = 3 + byte value) and ``<pad>``, ``<s>``, ``</s>``, so any text
round-trips and the vocabulary is 259.
"""
from __future__ import annotations

import os
from typing import Dict

SPECIALS = ("<pad>", "<s>", "</s>")


def _bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters (what the byte-level
    pre-tokenizer emits)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def byte_tokenizer():
    """A ``PreTrainedTokenizerFast``: one token per byte plus the three special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for b, ch in sorted(_bytes_to_unicode().items()):
        vocab[ch] = len(SPECIALS) + b
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def write_byte_llama(out_dir: str, *, hidden: int = 256, layers: int = 4, heads: int = 4,
                     intermediate: int = None, max_positions: int = 512, seed: int = 0) -> str:
    """Write a freshly initialised ``LlamaForCausalLM`` (the model's own initialisation, fp32
    safetensors) with the byte-level tokenizer to ``out_dir``; returns ``out_dir``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    if hidden % heads:
        raise ValueError(f"hidden={hidden} must be a multiple of heads={heads}")
    tok = byte_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate or 4 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                      max_position_embeddings=max_positions, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir
