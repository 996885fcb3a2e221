"""The device budget of parameter offload: the working set one module's forward needs at once
(``working_set``, checked at initialize) and the error a budget that cannot hold it raises
(``DeviceBudgetError``)."""
from __future__ import annotations

from typing import Dict, Sequence

from torch import nn

from offload.core.errors import BudgetError


class DeviceBudgetError(RuntimeError, BudgetError):
    """offload_param.device_budget_bytes cannot hold the parameters needed at once."""


def working_set(model: nn.Module, owner: Dict[int, int], module_of: Sequence[nn.Module],
                nbytes: Sequence[int]) -> tuple:
    """(bytes, blocks) of the largest set of blocks that one module's forward needs on the
    device at once: the blocks whose parameters the module holds (tied ones included) or
    whose root it is, together with those of every enclosing module with such hooks (a
    parent block stays in use while its children run). ``owner`` maps ``id(param)`` to its
    block, ``module_of[i]`` is block i's root module, ``nbytes[i]`` its device bytes."""
    roots = {id(m): i for i, m in enumerate(module_of)}
    best = (0, ())

    def visit(m: nn.Module, above: frozenset) -> None:
        nonlocal best
        used = {owner[id(p)] for p in m.parameters(recurse=False) if id(p) in owner}
        if id(m) in roots:
            used.add(roots[id(m)])
        here = above | used
        total = sum(nbytes[i] for i in here)
        if total > best[0]:
            best = (total, tuple(sorted(here)))
        for c in m.children():
            visit(c, here)
    visit(model, frozenset())
    return best
