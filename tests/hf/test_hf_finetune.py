"""offload finetune / offload new-model / offload corpus on a model directory written by
save_pretrained: full and LoRA, the loss falls, the output loads with transformers / PEFT."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from offload import cli  # noqa: E402
from offload.hf import data as data_mod  # noqa: E402
from offload.hf.finetune import LoraSpec, parse_lora  # noqa: E402
from _profile import AVX2_RATES  # noqa: E402
from _paths import TESTS  # noqa: E402
import _forked  # noqa: E402


def run(argv, capsys):
    code = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A fresh byte-level Llama written by `offload new-model`, and a ~40 KB text."""
    d = tmp_path_factory.mktemp("ft")
    assert cli.main(["new-model", str(d / "base"), "--hidden", "32", "--layers", "2", "--heads", "2",
                     "--max-positions", "64"]) == 0
    assert cli.main(["corpus", "--pydoc", str(d / "all.txt"), "--stdlib", str(d / "all_code.txt")]) == 0
    text = (d / "all.txt").read_text()[:40_000]
    (d / "text.txt").write_text(text)
    (d / "code.txt").write_text((d / "all_code.txt").read_text()[:40_000])
    return d


def summary(out):
    return json.load(open(os.path.join(out, "finetune_summary.json")))


def test_new_model_loads_with_auto_classes(base):
    tok = transformers.AutoTokenizer.from_pretrained(base / "base")
    s = "déjà vu: def f(x):\n\treturn x"
    assert tok.decode(tok(s)["input_ids"]) == s and len(tok) == 259
    m = transformers.AutoModelForCausalLM.from_pretrained(base / "base")
    assert m.config.vocab_size == 259 and m.config.num_hidden_layers == 2


@pytest.fixture(scope="module")
def full_run(base):
    """Full fine-tune of the fresh model on prose, placement left to the planner."""
    import contextlib
    import io
    out, buf = base / "full", io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli.main([str(a) for a in ["finetune", base / "base", "--data", base / "text.txt", "--out", out,
                                          "--steps", 30, "--batch-size", 4, "--seq-len", 32, "--lr", "1e-2",
                                          "--warmup", 3, "--log-steps", 5]])
    return code, buf.getvalue(), out


def test_full_finetune_planner_chooses_and_loss_falls(base, full_run):
    code, text, out = full_run
    assert code == 0, text
    assert "placement (planner): --offload-optimizer" in text      # no placement given: the planner's, with reason
    s = summary(out)
    assert s["mode"] == "full" and s["steps"] == 30
    losses = [l for _, l in s["losses"]]
    assert losses[-1] < losses[0] - 0.5 and s["eval_loss_end"] < s["eval_loss_start"] - 0.5, s["losses"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert os.path.isfile(out / "config.json") and len(tok) == 259
    base_w = transformers.AutoModelForCausalLM.from_pretrained(base / "base").state_dict()
    assert any(not torch.equal(v, base_w[k]) for k, v in loaded.state_dict().items())


def test_lora_base_on_nvme_writes_adapter(base, full_run, capsys, tmp_path):
    """LoRA on the prose model, on code: the loss falls; the adapter loads with PEFT."""
    pretrained, out = full_run[2], base / "lora"
    code, text, err = run(["finetune", pretrained, "--data", base / "code.txt", "--out", out, "--steps", 30,
                           "--batch-size", 4, "--seq-len", 32, "--lr", "2e-2", "--warmup", 3, "--log-steps", 5,
                           "--lora", "r=8,alpha=16,targets=q_proj,k_proj,v_proj,o_proj,up_proj,down_proj",
                           "--offload-optimizer", "nvme", "--offload-param", "nvme", "--nvme-path", tmp_path], capsys)
    assert code == 0, err
    assert "parameters -> nvme" in text and "LoRA adapter" in text and "nvme " in text   # bar shows the nvme tier
    s = summary(out)
    losses = [l for _, l in s["losses"]]
    assert losses[-1] < losses[0] - 0.3 and s["eval_loss_end"] < s["eval_loss_start"], s["losses"]
    assert os.path.isfile(out / "adapter_config.json") and os.path.isfile(out / "tokenizer.json")
    assert not [f for f in os.listdir(out) if f.startswith(".offload-export")]   # no scratch left behind
    model = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(pretrained), out)
    lora_b = [v for k, v in model.state_dict().items() if "lora_B" in k]
    assert lora_b and any(v.abs().max() > 0 for v in lora_b)
    assert not os.listdir(tmp_path) or all(not f.startswith("offload-") for f in os.listdir(tmp_path))


@pytest.mark.hf_versions
def test_lora_merge_and_prompt_completion_jsonl(base, capsys):
    rows = [{"prompt": f"Q: {i} + {i}?\nA: ", "completion": str(2 * i)} for i in range(40)]
    path = base / "qa.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = base / "merged"
    code, text, err = run(["finetune", base / "base", "--data", path, "--out", out, "--steps", 4, "--batch-size", 4,
                           "--seq-len", 32, "--lora", "r=4,alpha=8,targets=q_proj,v_proj", "--merge",
                           "--offload-optimizer", "cpu", "--log-steps", 2, "--log-every", 0], capsys)
    assert code == 0, err
    assert "loss on the completion only" in text and "merged in" in text
    assert not os.path.exists(out / "adapter_config.json")
    m = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in k for k in m.state_dict())
    # the bar (a line per draw here: not a terminal, --log-every 0) shows each step's own loss
    logged = {int(k): float(v) for k, v in re.findall(r"step +(\d+): loss ([0-9.]+)", text)}
    bars = {int(k): float(v) for k, v in re.findall(r"\| (\d+)/4 \[[^]]*loss ([0-9.]+)", text)}
    assert sorted(logged) == [2, 4] and all(bars[k] == round(logged[k], 3) for k in logged), (logged, bars, text)


def test_prompt_tokens_carry_no_loss(base):
    tok = transformers.AutoTokenizer.from_pretrained(base / "base")
    path = base / "pc.jsonl"
    path.write_text('{"prompt": "abc", "completion": "de"}\n{"prompt": "x", "completion": "yz"}\n'
                    '{"prompt": "p", "completion": "q"}\n')
    train, held, desc = data_mod.load(str(path), tok, seq_len=16, eval_fraction=0.3)
    for r in list(train) + list(held):
        n_prompt = {6: 3, 4: 1, 3: 1}[len(r["input_ids"])]   # prompt + completion + EOS
        assert (r["labels"][:n_prompt] == -100).all() and (r["labels"][n_prompt:] == r["input_ids"][n_prompt:]).all()
    batch = data_mod.PadCollator(tok.pad_token_id)([train[0], held[0]])
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape


TEMPLATE = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '</s>' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")


def chat(q, a=None):
    msgs = [{"role": "user", "content": q}] + ([{"role": "assistant", "content": a}] if a is not None else [])
    return json.dumps({"messages": msgs})


@pytest.fixture(scope="module")
def chat_base(base):
    """The toy model with a chat template, and chat JSONL files: 40 to train on, 4 held out."""
    import shutil
    d = base / "chat-base"
    shutil.copytree(base / "base", d)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(d)
    (base / "chat-train.jsonl").write_text("".join(chat(f"{i} + {i}?", str(2 * i)) + "\n" for i in range(40)))
    (base / "chat-held.jsonl").write_text("".join(chat(f"{i} plus {i}?", str(2 * i)) + "\n" for i in range(4)))
    return d


def test_chat_rows_carry_the_loss_on_the_answer(base, chat_base):
    tok = transformers.AutoTokenizer.from_pretrained(chat_base)
    train, held, desc = data_mod.load(str(base / "chat-train.jsonl"), tok, 64,
                                      eval_path=str(base / "chat-held.jsonl"))
    assert (len(train), len(held)) == (40, 4) and "JSONL chat (loss on the last assistant turn only)" in desc
    for r in held:
        n = int((r["labels"] == data_mod.IGNORE).sum())
        assert tok.decode(r["input_ids"][:n]).startswith("user: ") and tok.decode(r["input_ids"][:n]).endswith(
            "</s>assistant: ")
        assert (r["labels"][n:] == r["input_ids"][n:]).all() and tok.decode(r["input_ids"][n:]).endswith("</s>")
    assert [tok.decode(r["input_ids"][-2:]) for r in held][:1] == ["0</s>"]
    with pytest.raises(data_mod.DataError, match="chat template"):
        data_mod.load(str(base / "chat-train.jsonl"), transformers.AutoTokenizer.from_pretrained(base / "base"), 64)


def test_chat_lora_held_out_file_questions_and_merged_copy(base, chat_base, capsys, tmp_path):
    """--eval-data holds out its own file, --ask answers it before and after (the after
    answers are plain transformers' greedy ones from the merged copy), --merged-out writes the
    base with the adapter merged in beside the adapter: equal to PEFT's own merge."""
    out, merged = tmp_path / "adapter", tmp_path / "merged"
    code, text, err = run(["finetune", chat_base, "--data", base / "chat-train.jsonl", "--out", out,
                           "--eval-data", base / "chat-held.jsonl", "--ask", base / "chat-held.jsonl",
                           "--ask-tokens", 4, "--merged-out", merged, "--steps", 6, "--batch-size", 4,
                           "--seq-len", 32, "--lr", "1e-2", "--warmup", 0, "--log-steps", 2,
                           "--lora", "r=4,alpha=8,targets=q_proj,v_proj", "--offload-optimizer", "cpu"], capsys)
    assert code == 0, err
    s = summary(out)
    assert "40 train / 4 held-out examples" in text and s["eval_loss_end"] < s["eval_loss_start"]
    assert f"merged copy {merged}/: AutoModelForCausalLM.from_pretrained loads it" in text
    assert "greedy answers before -> after training" in text and text.count("     after:  ") == 4
    assert os.path.isfile(out / "adapter_config.json") and os.path.isfile(merged / "config.json")
    want = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(chat_base),
                                          out).merge_and_unload().state_dict()
    got = transformers.AutoModelForCausalLM.from_pretrained(merged)
    assert set(got.state_dict()) == set(want) and all(torch.equal(v, want[k]) for k, v in got.state_dict().items())
    tok = transformers.AutoTokenizer.from_pretrained(merged)
    assert tok.chat_template == TEMPLATE
    for a in s["answers"]:
        assert a["expected"] == str(2 * int(a["question"].split()[0]))
        enc = tok(tok.apply_chat_template([{"role": "user", "content": a["question"]}], add_generation_prompt=True,
                                          tokenize=False), add_special_tokens=False, return_tensors="pt")
        ids = got.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
        assert a["after"] == tok.decode(ids[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()


@pytest.mark.parametrize("argv,msg", [
    (["--lora", "r=4,rank=3"], "--lora key 'rank' is unknown"),
    (["--lora", "r=4,targets=nope"], "are not modules of this model: choose from"),
    (["--merge"], "--merge needs --lora"),
    (["--merged-out", "m"], "--merged-out needs --lora"),
    (["--lora", "r=4", "--merge", "--merged-out", "m"], "--merge writes the merged model in place"),
    (["--ask", "text.txt"], "chat template"),
    (["--eval-data", "missing.jsonl"], "--eval-data"),
])
def test_finetune_errors_name_the_fix(base, capsys, argv, msg):
    argv = [base / a if a in ("text.txt", "missing.jsonl") else a for a in argv]
    code, _, err = run(["finetune", base / "base", "--data", base / "text.txt", "--out", base / "err", "--steps", 1,
                        "--offload-optimizer", "cpu", *argv], capsys)
    assert code == 2 and msg in err, err


def test_finetune_precision_fits_the_machine(base, capsys, tmp_path, matmul_rates):
    """bf16 45x slower than fp32 (an AVX2 CPU's rates): no --precision trains in fp32 and says
    why, --precision bf16 trains in bf16 and tells the factor; each once (not again by Trainer)."""
    matmul_rates(AVX2_RATES)
    common = ["--data", base / "text.txt", "--steps", 1, "--batch-size", 2, "--seq-len", 16, "--offload-optimizer", "cpu"]
    code, text, err = run(["finetune", base / "base", "--out", tmp_path / "fp32", *common], capsys)
    assert code == 0, err
    said = [ln for ln in (text + err).splitlines() if "bf16 computes 45x slower" in ln]
    assert len(said) == 1 and said[0].startswith("precision fp32 (none asked for): bf16 computes 45x slower than fp32")
    assert re.search(r"^tiers: .*; precision fp32$", text, re.M)
    matmul_rates(AVX2_RATES)                    # a fresh process's worth of telling
    code, text, err = run(["finetune", base / "base", "--out", tmp_path / "bf16", "--precision", "bf16", *common], capsys)
    assert code == 0, err
    said = [ln for ln in (text + err).splitlines() if "bf16 computes 45x slower" in ln]
    assert len(said) == 1 and said[0].startswith("precision bf16 as asked, but bf16 computes 45x slower than fp32")
    assert re.search(r"^tiers: .*; precision bf16$", text, re.M) and summary(tmp_path / "bf16")["steps"] == 1


def test_finetune_input_errors(base, capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "typo"}\n')
    code, _, err = run(["finetune", base / "base", "--data", bad, "--out", tmp_path / "o", "--offload-optimizer", "cpu"],
                       capsys)
    assert code == 2 and "bad.jsonl:2: expected" in err
    code, _, err = run(["finetune", tmp_path / "nope", "--data", bad, "--out", tmp_path / "o"], capsys)
    assert code == 2 and "does not exist" in err


def test_data_kind_is_told_by_content_and_an_empty_file_says_so(base, tmp_path):
    """JSONL is read as JSONL whatever the file's name; a .json file that is not JSONL is
    refused saying what it holds; an empty file is told it is empty."""
    tok = transformers.AutoTokenizer.from_pretrained(base / "base")
    rows = "".join(json.dumps({"prompt": f"{i} + {i} = ", "completion": str(2 * i)}) + "\n" for i in range(6))
    for name in ("qa.json", "qa.data", "qa.txt"):
        (tmp_path / name).write_text(rows)
        train, held, desc = data_mod.load(str(tmp_path / name), tok, seq_len=16, eval_fraction=0.3)
        assert desc.startswith("JSONL prompt/completion") and len(train) + len(held) == 6, (name, desc)
        brace = tok.convert_tokens_to_ids("{")
        assert all(not (r["input_ids"] == brace).any() for r in list(train) + list(held))   # no JSON trained on
    (tmp_path / "code.txt").write_text("{ not json, a text that starts with a brace }\n" * 20)
    assert data_mod.load(str(tmp_path / "code.txt"), tok, seq_len=16)[2].startswith("text packed")
    for text, holds in (('[{"text": "a"}, {"text": "b"}]', "a JSON array"),
                        ('{\n  "text": "pretty"\n}\n', "JSON whose first line is not a whole object")):
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(data_mod.DataError, match=f"is named .json but holds {holds}: give JSONL"):
            data_mod.load(str(tmp_path / "bad.json"), tok, seq_len=16)
    for name, text in (("empty.txt", ""), ("blank.jsonl", "\n  \n"), ("blank.json", " \n")):
        (tmp_path / name).write_text(text)
        with pytest.raises(data_mod.DataError, match=f"{name}' is empty: give a text file, or JSONL"):
            data_mod.load(str(tmp_path / name), tok, seq_len=16)


def test_job_rank_0_prints_and_shares_and_its_failures_reach_every_rank():
    """offload.hf.job on 2 gloo ranks: only rank 0 prints; main_only runs on rank 0 and gives
    its result to both; a failure there is raised on rank 0 as itself, on rank 1 naming it."""
    from _job_worker import rank_main
    port = _forked.free_port()
    kids = [_forked.Child(rank_main, r, 2, port) for r in range(2)]
    got = [k.result(timeout_s=120, what=f"job rank {r}") for r, k in enumerate(kids)]
    assert [g["rank"] for g in got] == [0, 1] and all(g["world"] == 2 for g in got)
    assert got[0]["printed"] == "printed by rank 0\n" and got[1]["printed"] == ""
    assert all(g["shared"] == {"chosen by": 0} for g in got)
    assert got[0]["failed"] == "ZeroDivisionError: division by zero"
    assert got[1]["failed"] == "JobError: rank 0 failed merging the adapter: ZeroDivisionError: division by zero"



def test_finetune_under_torchrun_rank_0_plans_prints_merges_and_writes(base, tmp_path):
    """`torchrun --nproc_per_node 2 -m offload.cli finetune --lora --merge` (gloo): one planner
    run, every line printed once, the merged model written by rank 0 alone and loadable (two
    ranks merging at once deleted the adapter files the other was reading)."""
    here = TESTS
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    out = tmp_path / "merged"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_forked.free_port()),
           "-m", "offload.cli", "finetune", str(base / "base"), "--data", str(base / "text.txt"), "--out", str(out),
           "--steps", "4", "--batch-size", "2", "--seq-len", "32", "--log-steps", "2",
           "--lora", "r=4,alpha=8,targets=q_proj,v_proj", "--merge", "--plan-nvme-path", str(tmp_path),
           "--max-minutes", "60"]       # the deadline, decided by both ranks together at each step
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    lines = p.stdout.splitlines()
    for start in ("placement: none given", "placement (planner):", "tiers:", "model ", "data ", "loss ", "wrote "):
        assert sum(l.startswith(start) for l in lines) == 1, (start, p.stdout)
    assert "2 ranks (torchrun)" in p.stdout and sum("step     4: loss" in l for l in lines) == 1
    s = summary(out)
    assert s["mode"] == "lora-merged" and s["steps"] == 4 and "adapter_config.json" not in s["written"]
    assert sorted(os.listdir(out)) == sorted(s["written"] + ["finetune_summary.json"])
    merged = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    base_w = transformers.AutoModelForCausalLM.from_pretrained(base / "base").state_dict()
    assert merged.keys() == base_w.keys()
    assert any(not torch.equal(merged[k], base_w[k]) for k in merged if "q_proj" in k)   # the adapter merged in
    assert all(torch.equal(merged[k], base_w[k]) for k in merged if "mlp" in k)          # the rest untouched


def test_finetune_help_mentions_torchrun(capsys):
    with pytest.raises(SystemExit):
        cli.main(["finetune", "--help"])
    assert "torchrun --nproc_per_node N -m offload.cli finetune" in " ".join(capsys.readouterr().out.split())


def test_parse_lora():
    assert parse_lora("r=16,alpha=32,targets=q_proj,v_proj") == LoraSpec(16, 32.0, 0.0, ("q_proj", "v_proj"))
    with pytest.raises(ValueError, match="must be a number"):
        parse_lora("r=x")


def test_finetune_optimizer_flag_selects_the_rule(base, capsys):
    """--optimizer reaches the engine with its own hyper-parameters (--momentum, Adagrad's --eps
    go to the engine's config; --lr to Trainer's arguments); the loss falls."""
    out = base / "sgd"
    code, text, err = run(["finetune", base / "base", "--data", base / "text.txt", "--out", out, "--steps", 6,
                           "--batch-size", 4, "--seq-len", 32, "--optimizer", "SGD", "--momentum", "0.9",
                           "--lr", "0.05", "--offload-optimizer", "cpu", "--log-steps", 2], capsys)
    assert code == 0, err
    opt = summary(out)["optimizer"]
    assert (opt["type"], opt["momentum"], opt["lr"]) == ("SGD", 0.9, 0.05)
    losses = [l for _, l in summary(out)["losses"]]
    assert losses[-1] < losses[0]
    out = base / "adagrad"
    code, text, err = run(["finetune", base / "base", "--data", base / "text.txt", "--out", out, "--steps", 1,
                           "--batch-size", 2, "--seq-len", 16, "--optimizer", "Adagrad", "--eps", "1e-6",
                           "--offload-optimizer", "cpu"], capsys)
    assert code == 0, err
    assert (summary(out)["optimizer"]["type"], summary(out)["optimizer"]["eps"]) == ("Adagrad", 1e-6)


@pytest.mark.parametrize("argv,msg", [
    (["--optimizer", "SGD", "--betas", "0.9,0.95"], "SGD"),
    (["--optimizer", "Lamb"], "Lamb"),
])
def test_finetune_optimizer_errors(base, capsys, argv, msg):
    code, _, err = run(["finetune", base / "base", "--data", base / "text.txt", "--out", base / "err", "--steps", 1,
                        "--offload-optimizer", "cpu", *argv], capsys)
    lines = [ln for ln in err.splitlines() if ln.startswith("offload: error:")]
    assert code == 2 and len(lines) == 1 and msg in lines[0], err


def test_lora_over_an_nf4_base_merges_into_the_dequantized_base(base, capsys, tmp_path):
    """offload_param.frozen_dtype nf4 through finetune: the base trains stored quantized
    (stats report it) and --merge merges into the dequantized base, saying so."""
    cfg = tmp_path / "nf4.json"
    cfg.write_text(json.dumps({"offload_optimizer": {"device": "cpu"},
                               "offload_param": {"device": "cpu", "frozen_dtype": "nf4", "frozen_quant_min_numel": 1024}}))
    out = tmp_path / "merged"
    code, text, err = run(["finetune", base / "base", "--data", base / "code.txt", "--out", out, "--steps", 2,
                           "--batch-size", 2, "--seq-len", 32, "--lora", "r=4,alpha=8,targets=q_proj,v_proj", "--merge",
                           "--config", cfg, "--log-every", 0], capsys)
    assert code == 0, err
    assert "merged into the dequantized nf4 base" in text, text
    assert summary(out)["stats"]["frozen_quant"]["tensors"] > 0
    m = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in k for k in m.state_dict())
