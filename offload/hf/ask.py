"""Questions put to a model before and after fine-tuning (``offload finetune --ask FILE``):
greedy answers through the tokenizer's chat template, to see what the training changed.

The file is JSONL in the chat format of ``offload.hf.data`` (``{"messages": [...]}``; the
conversation up to its last user turn is asked, and a final assistant turn, when present, is
the expected answer shown beside the model's), or a text file with one question per line.
The model answering is a whole one in host memory (``from_pretrained``), not the engine's.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import List, Optional, Sequence

import torch

from offload.hf.data import DataError, chat_prompt


@dataclasses.dataclass(frozen=True)
class Question:
    messages: tuple              # the conversation asked, ending with a user turn
    expected: Optional[str]      # the file's answer, when it gives one

    @property
    def text(self) -> str:
        return self.messages[-1]["content"]


def load(path: str, tokenizer) -> List[Question]:
    """The questions in ``path``; each is checked against the tokenizer's chat template now,
    before any training."""
    if not os.path.isfile(path):
        raise DataError(f"--ask {path!r} does not exist: give a .jsonl chat file or a text file, one question a line")
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            if not path.endswith(".jsonl"):
                q = Question(({"role": "user", "content": line.strip()},), None)
            else:
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{where}: not valid JSON ({exc.msg})") from None
                msgs = obj.get("messages") if isinstance(obj, dict) else None
                if not isinstance(msgs, list) or not msgs:
                    raise DataError(f"{where}: --ask takes {{\"messages\": [...]}} lines (or a text file, one "
                                    "question a line)")
                expected = None
                if isinstance(msgs[-1], dict) and msgs[-1].get("role") == "assistant":
                    expected, msgs = msgs[-1].get("content"), msgs[:-1]
                if not msgs or not isinstance(msgs[-1], dict) or msgs[-1].get("role") != "user":
                    raise DataError(f"{where}: the conversation to ask must end with a user turn")
                q = Question(tuple(msgs), expected)
            chat_prompt(list(q.messages), tokenizer, where)
            out.append(q)
    if not out:
        raise DataError(f"--ask {path} holds no question")
    return out


@torch.no_grad()
def answers(model, tokenizer, questions: Sequence[Question], max_new_tokens: int = 48) -> List[str]:
    """Each question's greedy answer (special tokens dropped), one question at a time."""
    model.eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = []
    for q in questions:
        enc = tokenizer(chat_prompt(list(q.messages), tokenizer, "--ask"), add_special_tokens=False,
                        return_tensors="pt")
        ids = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
        out.append(tokenizer.decode(ids[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip())
    return out


def one_line(text: str, width: int = 110) -> str:
    """``text`` on one line, cut at ``width`` characters."""
    s = " ".join(text.split())
    return s if len(s) <= width else s[:width - 3] + "..."
