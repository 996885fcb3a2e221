"""The offloaded frozen parameters as checkpoints and state dicts read and write them
(``FrozenIO``): from and to their parts' homes, a part stored quantized as its blob."""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

import torch

from offload.core.block import Block


class FrozenIO:
    """The frozen parts of ``blocks`` (the offloaded ones); ``release(block)`` takes a block's
    device copy away before its home is rewritten (parameter offload's)."""

    def __init__(self, blocks: Sequence[Block], release: Callable[[Block], None]):
        self._blocks = list(blocks)
        self._release = release

    def parts(self):
        """``(block, part)`` of every offloaded frozen part."""
        for b in self._blocks:
            for part in b.frozen:
                yield b, part

    def read(self, wanted=None) -> Dict[int, torch.Tensor]:
        """``id(param) -> host tensor`` of every offloaded frozen parameter (those in
        ``wanted``, ids, when given), read from its home (one read per part; for checkpoints
        and state dicts)."""
        out = {}
        for _, part in self.parts():
            if wanted is not None and not any(id(s.param) in wanted for s in part.layout.segments):
                continue
            flat = part.read_home()
            for s in part.layout.segments:
                out[id(s.param)] = flat[s.offset:s.offset + s.numel].view(s.shape)
        return out

    def write(self, values: Dict[int, torch.Tensor]) -> None:
        """Replace offloaded frozen parameters' home values (``id(param) -> tensor``); parts
        with no entry keep theirs (in a part stored quantized, only the tensors given are
        quantized, the others keep their stored bytes). Device copies become stale and are
        refetched on use."""
        for b, part in self.parts():
            mine = [s for s in part.layout.segments if id(s.param) in values]
            if not mine:
                continue
            self._release(b)
            if part.codec is not None:
                home = part.codec.fill(part.read_home(raw=True), {id(s.param): values[id(s.param)] for s in mine})
            else:
                home = part.read_home()
                for s in mine:
                    home[s.offset:s.offset + s.numel].copy_(values[id(s.param)].reshape(-1))
            part.write_home(home)

    def read_quantized(self, wanted=None) -> List[Tuple[List[int], torch.Tensor, dict]]:
        """The offloaded frozen parts stored quantized (those with a parameter in ``wanted``,
        ids, when given), as stored: ``(parameter ids in part order, blob, codec.code())``
        each, so a checkpoint keeps a quantized base as it is, not its dequantized values."""
        out = []
        for _, part in self.parts():
            ids = [id(s.param) for s in part.layout.segments]
            if part.codec is not None and (wanted is None or any(i in wanted for i in ids)):
                out.append((ids, part.read_home(raw=True), part.codec.code()))
        return out

    def write_quantized(self, ids: List[int], blob: torch.Tensor, code: dict) -> bool:
        """Restore one part stored quantized from a blob ``read_quantized`` gave (the
        part holding exactly the parameters ``ids``, in order): written as it is, not
        quantized again. False (nothing written) where no part of this engine has those
        parameters laid out and coded as ``code`` says (another ``frozen_dtype``, another
        grouping): the caller restores the values instead."""
        for b, part in self.parts():
            if part.codec is None or [id(s.param) for s in part.layout.segments] != list(ids):
                continue
            if not part.codec.adopt(code):
                return False
            self._release(b)
            part.write_home(blob.view(torch.uint8)[:part.home_nbytes].contiguous())
            return True
        return False

    def ids(self) -> set:
        return {id(s.param) for b in self._blocks for part in b.frozen for s in part.layout.segments}
