"""One block, one object (core/block.py): the phase table, and one list of ``Block``s through a
real step, blocks of frozen parameters only included."""
from concurrent.futures import Future

import pytest
import torch
from torch import nn

import offload
from offload.core.block import Block, BlockPhase, BlockPhaseError
from offload.core.errors import BlockError
from tests._models import batches, make_model

P = BlockPhase


def _block() -> Block:
    return Block(0, "layer", nn.Linear(2, 2), torch.device("cpu"))


def test_phase_table_legal_paths():
    b = _block()
    b.enter_forward()
    b.enter_forward()                      # a module re-used within one forward nests
    b.exit_forward(in_backward=False)
    assert b.phase is P.FORWARD
    b.exit_forward(in_backward=False)
    assert b.phase is P.FORWARD_DONE
    assert b.enter_backward() and not b.enter_backward()   # the first gradient only
    b.enter_forward()                      # a recomputation inside backward
    b.exit_forward(in_backward=True)
    assert b.phase is P.BACKWARD
    b.end_backward()
    b.close_window()
    job = Future()
    assert b.start_update(lambda: job) is job
    assert (b.phase, b.update.future) == (P.UPDATING, job)
    job.set_result(None)
    b.wait_update()                        # collected: the parameters are current
    assert (b.phase, b.update.future) == (P.IDLE, None)
    b2 = _block()
    b2.close_window()
    b2.skip_update()                       # no gradient in the window
    assert b2.phase is P.IDLE


@pytest.mark.parametrize("path, verb", [
    ((), "exit_forward"),                              # never entered
    (("enter_forward",), "close_window"),              # step() while a module runs
    (("close_window",), "enter_forward"),              # a forward inside the commit
    (("close_window", "start_update"), "enter_forward"),   # a forward that did not collect the update
    (("close_window", "start_update"), "enter_backward"),
    ((), "start_update"),                              # an update outside a commit
])
def test_phase_table_illegal_moves_raise(path, verb):
    b = _block()
    call = {"exit_forward": lambda: b.exit_forward(False), "start_update": lambda: b.start_update(lambda: None)}
    for v in path:
        call.get(v, getattr(b, v))()
    before = b.phase
    with pytest.raises(BlockPhaseError, match=f"block 0 \\(layer\\).*{verb}") as info:
        call.get(verb, getattr(b, verb))()
    assert isinstance(info.value, BlockError)
    assert b.phase is before


def test_one_block_list_through_a_step(tmp_path):
    """Parameter offload over a model with a frozen layer: that layer is a block of its own in
    the engine's one list (no gradients, no state, after the trained ones), and every block
    moves FORWARD_DONE -> IDLE -> UPDATING (a committed update not yet collected) -> the next
    forward collects it; the loss follows plain torch on the same seed."""
    model, ref = make_model(layers=2), make_model(layers=2)
    eng = offload.initialize(model, {"optimizer": {"lr": 1e-3, "weight_decay": 0.0},
                                     "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
                                     "overlap_step": True})
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)
    try:
        blocks = eng.blocks
        assert [b.index for b in blocks] == list(range(len(blocks)))
        frozen = [b for b in blocks if not b.trains]
        assert [b.name for b in frozen] == ["layers.1"] and frozen[0] is blocks[-1]
        assert frozen[0].grads is None and frozen[0].state is None and frozen[0].frozen
        for step, (x, y) in enumerate(batches(2)):
            loss = eng(x, y)
            assert {b.phase for b in blocks} == {P.FORWARD_DONE}
            eng.backward(loss)
            assert {b.phase for b in blocks} == {P.IDLE}
            assert eng.step()
            assert {b.phase for b in blocks if b.trains} == {P.UPDATING} and frozen[0].phase is P.IDLE
            ref_loss = ref(x, y)
            ref_loss.backward()
            opt.step()
            opt.zero_grad()
            torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
        eng.synchronize()
        assert {b.phase for b in blocks} == {P.IDLE}      # synchronize collected every update
    finally:
        eng.close()
