"""Fine-tuning data from a local file, tokenized with the model's own tokenizer.

The kind is told by the content, whatever the file's name: a file whose first line is a JSON
object is JSONL (a ``.jsonl`` file always is, and a ``.json`` file must be: a JSON array or a
pretty-printed object is refused, saying so, rather than trained on as text).

- A text file: the whole text is tokenized and packed into rows of ``seq_len`` tokens (the
  remainder is dropped); the loss is on every token.
- A JSONL file: one object per line, either ``{"text": ...}`` (loss on every token) or
  ``{"prompt": ..., "completion": ...}`` (loss on the completion only: the prompt's labels
  are -100). Each example ends with the tokenizer's EOS token, is cut at ``seq_len`` tokens
  and padded in its batch. A third kind, ``{"messages": [{"role": ..., "content": ...}, ...]}``
  ending with an assistant turn, is rendered with the tokenizer's chat template (the loss on
  that last assistant turn only, which the template ends with its end-of-turn token).

The held-out split is the tail of the rows (text: the end of the file, so no training window
overlaps it) or of the examples after a seeded shuffle (JSONL); with ``eval_path`` it is that
file's rows instead, and all of ``path`` trains.
"""
from __future__ import annotations

import json
import os
import random
from typing import Dict, List, Optional, Tuple

import torch

from offload.core.errors import OffloadError

IGNORE = -100


class DataError(ValueError, OffloadError):
    """The data file cannot be used; the message names the file, the line and the fix."""


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows: List[Dict[str, torch.Tensor]]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return self.rows[i]


class PadCollator:
    """Pads a batch to its longest example: input_ids with ``pad_id``, labels with -100,
    attention_mask 0 on padding."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, batch: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        n = max(len(b["input_ids"]) for b in batch)
        out = {"input_ids": torch.full((len(batch), n), self.pad_id, dtype=torch.long),
               "labels": torch.full((len(batch), n), IGNORE, dtype=torch.long),
               "attention_mask": torch.zeros((len(batch), n), dtype=torch.long)}
        for i, b in enumerate(batch):
            k = len(b["input_ids"])
            out["input_ids"][i, :k] = b["input_ids"]
            out["labels"][i, :k] = b["labels"]
            out["attention_mask"][i, :k] = 1
        return out


def load(path: str, tokenizer, seq_len: int, eval_fraction: float = 0.05, seed: int = 0,
         eval_path: Optional[str] = None) -> Tuple[Rows, Rows, str]:
    """(train, held-out, description)."""
    if seq_len < 2:
        raise DataError(f"seq_len={seq_len} must be >= 2")
    if eval_path is None and not 0.0 < eval_fraction < 1.0:
        raise DataError(f"eval_fraction={eval_fraction} must be in (0, 1)")
    rows, kind, jsonl = _rows(path, "--data", tokenizer, seq_len)
    if jsonl:
        random.Random(seed).shuffle(rows)
    if eval_path is not None:
        held, held_kind, _ = _rows(eval_path, "--eval-data", tokenizer, seq_len)
        if not held:
            raise DataError(f"--eval-data {eval_path} holds no example: give one or leave the flag out")
        train, kind = rows, f"{kind}; held out: {eval_path}, {held_kind}"
    if len(rows) < (1 if eval_path is not None else 2):
        raise DataError(f"{path} gives {len(rows)} training example(s) of at most {seq_len} tokens: give more "
                        "data or a smaller --seq-len")
    if eval_path is None:
        n_eval = max(1, int(round(eval_fraction * len(rows))))
        train, held = rows[:-n_eval], rows[-n_eval:]
    tokens = sum(int((r["labels"] != IGNORE).sum()) for r in train + held)
    return Rows(train), Rows(held), f"{kind}: {len(train)} train / {len(held)} held-out examples, {tokens:,} target tokens"


def _rows(path: str, flag: str, tokenizer, seq_len: int):
    """(rows, description, whether the file is JSONL) of one data file; an empty file is a DataError."""
    if not os.path.isfile(path):
        raise DataError(f"{flag} {path!r} does not exist: give a .txt or .jsonl file")
    jsonl = _is_jsonl(path, flag)
    rows, kind = (_jsonl_rows if jsonl else _packed_rows)(path, tokenizer, seq_len)
    if not rows and kind == "empty":
        raise DataError(f"{flag} {path!r} is empty: give a text file, or JSONL with one example per line")
    return rows, kind, jsonl


def _first_line(path: str) -> str:
    """The first line with something on it ('' when there is none)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                return line.strip()
    return ""


def _is_jsonl(path: str, flag: str = "--data") -> bool:
    """Whether the file holds JSONL: its first line parses as a JSON object (or it is named
    .jsonl). A .json file that is not JSONL is a DataError saying why."""
    first = _first_line(path)
    if path.endswith(".jsonl"):
        return True
    try:
        is_object = first.startswith("{") and isinstance(json.loads(first), dict)
    except json.JSONDecodeError:
        is_object = False
    if is_object:
        return True
    if path.endswith(".json") and first:
        what = "a JSON array" if first.startswith("[") else \
            "JSON whose first line is not a whole object" if first.startswith("{") else "not JSON"
        raise DataError(f"{flag} {path!r} is named .json but holds {what}: give JSONL, one object per line "
                        f"({{\"text\": ...}}, {{\"prompt\": ..., \"completion\": ...}} or {{\"messages\": [...]}}), "
                        "or plain text in a file not named .json")
    return False


def _packed_rows(path: str, tokenizer, seq_len: int):
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if not text.strip():
        return [], "empty"
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    n = ids.numel() // seq_len
    rows = [{"input_ids": r, "labels": r.clone(), "attention_mask": torch.ones_like(r)}
            for r in ids[:n * seq_len].view(n, seq_len)]
    return rows, f"text packed into {seq_len}-token rows"


def _jsonl_rows(path: str, tokenizer, seq_len: int):
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the tokenizer has no EOS token: JSONL examples need one to end them")
    rows, kinds, cut = [], set(), 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{path}:{lineno}: each line must be a JSON object")
            if "prompt" in obj or "completion" in obj:
                if not isinstance(obj.get("prompt"), str) or not isinstance(obj.get("completion"), str):
                    raise DataError(f"{path}:{lineno}: give both \"prompt\" and \"completion\" as strings")
                p = tokenizer(obj["prompt"], add_special_tokens=False)["input_ids"]
                c = tokenizer(obj["completion"], add_special_tokens=False)["input_ids"] + [eos]
                ids, labels = p + c, [IGNORE] * len(p) + c
                kinds.add("prompt/completion")
            elif "messages" in obj:
                ids, labels = _chat_ids(obj["messages"], tokenizer, f"{path}:{lineno}")
                kinds.add("chat")
            elif isinstance(obj.get("text"), str):
                ids = tokenizer(obj["text"], add_special_tokens=False)["input_ids"] + [eos]
                labels = list(ids)
                kinds.add("text")
            else:
                raise DataError(f"{path}:{lineno}: expected {{\"text\": ...}}, {{\"prompt\": ..., \"completion\": ...}} "
                                f"or {{\"messages\": [...]}}, got keys {sorted(obj)}")
            if len(ids) > seq_len:
                cut += 1
                ids, labels = ids[:seq_len], labels[:seq_len]
            if all(l == IGNORE for l in labels[1:]):
                raise DataError(f"{path}:{lineno}: the prompt fills all {seq_len} tokens, nothing of the completion "
                                f"is left to learn: raise --seq-len or shorten the prompt")
            ids_t = torch.tensor(ids, dtype=torch.long)
            rows.append({"input_ids": ids_t, "labels": torch.tensor(labels, dtype=torch.long)})
    if not rows:
        return [], "empty"
    if len(kinds) > 1:
        raise DataError(f"{path}: mixes {' and '.join(sorted(kinds))} lines: use one kind per file")
    kind = "JSONL " + (kinds.pop() if kinds else "(empty)")
    if "prompt" in kind:
        kind += " (loss on the completion only)"
    elif "chat" in kind:
        kind += " (loss on the last assistant turn only)"
    if cut:
        kind += f", {cut} example(s) cut at {seq_len} tokens"
    return rows, kind


def chat_prompt(messages, tokenizer, where: str) -> str:
    """The conversation ``messages`` rendered with the tokenizer's chat template, ending with
    the assistant's turn opened (what a model answers from)."""
    _check_chat(messages, tokenizer, where)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _check_chat(messages, tokenizer, where: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: chat examples need the tokenizer's chat template, and this tokenizer has none: "
                        "use {\"prompt\", \"completion\"} lines instead")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise DataError(f"{where}: \"messages\" must be a list of {{\"role\": ..., \"content\": ...}} objects")


def _chat_ids(messages, tokenizer, where: str):
    """(ids, labels) of a conversation ending with an assistant turn: the template's prompt
    carries no loss, the last turn (up to and with the template's end-of-turn) does."""
    _check_chat(messages, tokenizer, where)
    if len(messages) < 2 or messages[-1]["role"] != "assistant":
        raise DataError(f"{where}: \"messages\" must hold a turn to answer and end with an "
                        "{\"role\": \"assistant\"} turn (the one learned)")
    prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    if not full.startswith(prompt):
        raise DataError(f"{where}: the chat template renders the conversation without its generation prompt "
                        "as a prefix, so the answer cannot be told from the prompt: use {\"prompt\", "
                        "\"completion\"} lines instead")
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    c = tokenizer(full[len(prompt):], add_special_tokens=False)["input_ids"]
    return p + c, [IGNORE] * len(p) + c
