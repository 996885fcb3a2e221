"""The one owner of the engine's hooks: module, parameter and saved-tensor hooks.

Every hook the engine puts on a model is installed here, once, and each drives a named
lifecycle verb on every participant (the engine's update wait and gradient landing,
parameter offload, activation offload), in the order they joined::

    begin_forward(in_backward)   the root module's forward starts (also a recomputation's
                                 root forward inside backward, with in_backward=True)
    pre_forward(block)           a module that reads the block's parameters starts
    post_forward(block)          ... and ends (always called, also when it raised)
    param_read(param)            a parameter reached a torch function outside its module
                                 (watched in a forward when a participant's wants_reads() says so)
    pre_backward(block)          the block's first gradient of this backward exists
    grad_ready(block, seg)       a parameter's gradient exists, before it accumulates
    grad_accumulated(block, seg, p)  after it accumulated
    post_backward(block)         all of the block's gradients have landed (called through
                                 ``Hooks.post_backward`` by the owner of the gradient window,
                                 engine/step_control.py, also for blocks a backward skipped)
    end_forward()                the root forward ends
    end_backward()               a backward has returned (after the post_backward of every
                                 block it left open)

Participants are handed ``Block`` objects (core/block.py), the engine's one per block. A
participant implements only the verbs it needs. ``pre_*``, ``begin_*`` and the gradient
verbs run in joining order, ``post_*`` and ``end_forward`` in reverse (the last to join
undoes its part first, as nested contexts unwind). Each verb moves the block's phase
(``Block.phase``, core/block.py): a module's start enters FORWARD once every participant's
``pre_forward`` has run (the engine's, first, collects the block's update), its end leaves it
(FORWARD_DONE, or BACKWARD for a recomputation inside backward); the first gradient enters
BACKWARD; ``post_backward`` returns the block to IDLE. The model's hooks hold block indices
and this object weakly, never a ``Block``: a block's parts reach the engine.

Saved tensors: while the root forward runs, ONE ``torch.autograd.graph.saved_tensors_hooks``
context packs every tensor autograd saves through a chain of handlers (``SavedTensorChain``):
the first handler whose ``pack`` claims the tensor owns it, and its ``unpack`` gives it back
in backward; a tensor no handler claims is saved as autograd would save it. Parameter
offload joins first (parameters and their views become handles to their block), activation
offload after it (large activations leave the device). Contexts nested inside the forward
(``torch.utils.checkpoint``'s own hooks) take precedence there, as torch defines it, except
for the handlers that ask to be innermost (``innermost = True``: parameter offload). Inside
a module of a block, when the innermost context is not the engine's (a checkpointed region
in forward, its recomputation in backward, or none at all in a reentrant recomputation), a
``NestedSaved`` context goes on top for the module's call: those handlers claim their tensors
first and everything else goes to the context below, as if ours were not there. A parameter
saved by a checkpointed or recomputed op is therefore always a handle of its block, never the
parameter itself (whose ``.data`` is a placeholder once the block is released): the block
stays while such handles live and is fetched again by their unpack if it was evicted.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Dict, List, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from offload.core.block import Block, BlockPhase

NOT_MINE = object()      # a handler's pack() result: the tensor is not this handler's
_PACKED = object()       # marks a tensor packed by a handler of the chain


def in_backward() -> bool:
    """Whether the calling thread is running autograd's backward (e.g. a recomputation)."""
    return torch._C._current_graph_task_id() != -1


def unclaimed(t: torch.Tensor) -> torch.Tensor:
    """What a saved-tensor context hands autograd for a tensor none of its handlers claims: a
    detached alias (same storage and version counter), never ``t`` itself. Why: autograd keeps
    a pack hook's result in the node that saves it, and a node's saved output is ``t`` with
    ``grad_fn`` that very node, a cycle in C++ the collector cannot see; a graph whose backward
    never ran to the end (a hook that raised, a loss never backwarded) then never dies, nor
    the hooks (and the engine) its saved tensors hold. Unpacking rebuilds ``grad_fn`` and
    ``requires_grad`` from what autograd recorded, as it does for its own saved tensors."""
    return t.detach()


class SavedTensorChain:
    """Handlers in order; each has ``pack(t) -> payload | NOT_MINE`` and ``unpack(payload)``;
    a tensor none claims is saved as ``unclaimed(t)``."""

    def __init__(self) -> None:
        self.handlers: List = []

    def join(self, handler) -> None:
        self.handlers.append(handler)

    def pack(self, t: torch.Tensor):
        for k, h in enumerate(self.handlers):
            payload = h.pack(t)
            if payload is not NOT_MINE:
                return (_PACKED, k, payload)
        return unclaimed(t)

    def unpack(self, packed):
        if type(packed) is tuple and len(packed) == 3 and packed[0] is _PACKED:
            return self.handlers[packed[1]].unpack(packed[2])
        return packed


def _innermost_saved_hooks():
    """The (pack, unpack) pair of the innermost saved-tensor hooks context on this thread,
    or None (torch's own query, the one its AOT autograd uses)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


class NestedSaved:
    """A saved-tensor context over another one (``outer``: its (pack, unpack), or None):
    the chain's handlers ``ks`` claim their tensors first, the rest are packed by ``outer``
    (or saved as autograd saves them), and each payload is unpacked by whoever packed it.

    ``context()`` is the torch context to enter; the object does not keep it: holding it would
    be a cycle (context, bound pack, self) that keeps ``outer`` (torch checkpoint's frame,
    whose saved inputs hold the engine's hooks where the collector cannot see them) until a
    collection pass, so a dropped engine would be collected only by a second one."""

    def __init__(self, chain: SavedTensorChain, ks: Sequence[int], outer) -> None:
        self.chain, self.ks, self.outer = chain, tuple(ks), outer

    def context(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor):
        for k in self.ks:
            payload = self.chain.handlers[k].pack(t)
            if payload is not NOT_MINE:
                return (_PACKED, k, payload)
        return self.outer[0](t) if self.outer is not None else unclaimed(t)

    def unpack(self, packed):
        if type(packed) is tuple and len(packed) == 3 and packed[0] is _PACKED:
            return self.chain.handlers[packed[1]].unpack(packed[2])
        return self.outer[1](packed) if self.outer is not None else packed


class _OutsideReads(TorchFunctionMode):
    """Reports parameters that reach a torch function (reads outside their module's hooks).

    Entered for whole forwards (every torch call of the forward passes here), so the check
    per call is kept to a dict lookup per argument: only parameters some participant tracks
    (the hook owner's ``_owner``: trained blocks' and offloaded blocks' parameters) are looked
    for, by id, and confirmed as Parameters only on a hit (``isinstance(x, Parameter)``
    runs Python code of torch's for every tensor it is asked about)."""

    def __init__(self, hooks: "Hooks"):
        super().__init__()
        self.hooks = hooks
        self.watched = hooks._owner              # id(param) -> block; lives as long as the hooks

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        watched, params = self.watched, None
        for a in args:
            if isinstance(a, _SEQUENCES):
                for x in a:
                    if id(x) in watched and isinstance(x, nn.Parameter):
                        params = (params or []) + [x]
            elif id(a) in watched and isinstance(a, nn.Parameter):
                params = (params or []) + [a]
        for a in kwargs.values():
            if id(a) in watched and isinstance(a, nn.Parameter):
                params = (params or []) + [a]
        if params is None:
            return func(*args, **kwargs)
        held = self.hooks.param_read(params)      # kept in use until the op returns
        try:
            return func(*args, **kwargs)
        finally:
            self.hooks.param_read_done(held)


_SEQUENCES = (list, tuple)


_HANDLES: Dict[int, list] = {}     # token -> an owner's hook handles (see Hooks.__init__)
_TOKENS = itertools.count()


def _weakly(method):
    """``method`` of the hook owner as a hook the model keeps: it holds the owner weakly, so
    the model never keeps the engine alive (an engine nobody holds is collected and closed,
    Engine.__del__); once the owner is gone it does nothing."""
    ref = weakref.WeakMethod(method)

    def hook(*args, **kwargs):
        m = ref()
        return None if m is None else m(*args, **kwargs)
    return hook


def _weakly_with(method, *first):
    """``_weakly`` with the leading arguments ``first`` bound (the block indices a hook serves:
    indices, not ``Block`` objects, which would keep the engine alive through the model)."""
    ref = weakref.WeakMethod(method)

    def hook(*args):
        m = ref()
        return None if m is None else m(*first, *args)
    return hook


class Hooks:
    """Installs and removes every hook on ``model`` for ``blocks`` (the engine's, every block,
    ``blocks[i].index == i``).

    ``join(participant)`` before ``install()``; ``remove()`` takes every hook off again. The
    hooks hold this object (and through it the engine) weakly: what keeps an engine alive is
    whoever holds it, never the model it trains."""

    def __init__(self, model: nn.Module, blocks: Sequence[Block]) -> None:
        """``blocks``: the trained ones' parameters get gradient hooks; the offloaded parts'
        parameters (frozen ones, blocks of frozen parameters only) get forward hooks too."""
        self.model = model
        self.blocks = list(blocks)
        if any(b.index != i for i, b in enumerate(self.blocks)):
            raise ValueError("Hooks needs the engine's blocks in index order (blocks[i].index == i)")
        self.participants: List = []
        self.saved = SavedTensorChain()
        self._owner: Dict[int, Block] = {id(s.param): b for b in self.blocks if b.trains for s in b.layout.segments}
        self._roots: Dict[int, List[int]] = {}      # id(module) -> indices of the blocks rooted there
        for b in self.blocks:
            if b.trains:
                self._roots.setdefault(id(b.module), []).append(b.index)
        for b in self.blocks:
            for _, s in b.segments:
                self._owner.setdefault(id(s.param), b)
            if b.parts and b.index not in self._roots.get(id(b.module), ()):
                self._roots.setdefault(id(b.module), []).append(b.index)
        # the hooks' handles, in a table of this module: an owner nobody holds is collected with
        # its own weak references cleared, and the handles must outlive it to take the hooks off
        self._token = next(_TOKENS)
        self._handles: list = _HANDLES.setdefault(self._token, [])
        self._context = None                         # the saved-tensor hooks context while a forward runs
        self._chain_pack = self.saved.pack           # the root context's pack, as pushed (identity checks)
        # per hooked module call: (its NestedSaved's context or None, the blocks it entered)
        self._nested: List = []
        self._mode = None                            # the outside-reads mode while a forward runs
        self._installed = False

    def join(self, participant) -> None:
        """Add a participant (verbs called in joining order); its ``saved_tensors`` handler,
        if it has one, joins the saved-tensor chain."""
        if self._installed:
            raise RuntimeError("participants join before install()")
        self.participants.append(participant)
        handler = getattr(participant, "saved_tensors", None)
        if handler is not None:
            self.saved.join(handler)

    def _each(self, verb: str):
        return [f for f in (getattr(p, verb, None) for p in self.participants) if f is not None]

    # ---- installation ------------------------------------------------------------------
    def install(self) -> None:
        model = self.model
        self._pre, self._post = self._each("pre_forward"), self._each("post_forward")[::-1]
        self._reads = [(p.param_read, getattr(p, "param_read_done", None)) for p in self.participants
                       if getattr(p, "param_read", None) is not None]
        # a participant with param_read and no wants_reads wants every forward's reads
        self._watch = [getattr(p, "wants_reads", lambda: True) for p in self.participants
                       if getattr(p, "param_read", None) is not None]
        self._grad_ready, self._grad_acc = self._each("grad_ready"), self._each("grad_accumulated")
        self._pre_bwd, self._post_bwd = self._each("pre_backward"), self._each("post_backward")[::-1]
        self._begin, self._end = self._each("begin_forward"), self._each("end_forward")[::-1]
        self._end_bwd = self._each("end_backward")[::-1]
        self._innermost = [k for k, h in enumerate(self.saved.handlers) if getattr(h, "innermost", False)]
        root = bool(self.saved.handlers or self._reads or self._begin or self._end)
        if root:   # before the root's own block hooks: the chain is active for all of the forward
            self._handles.append(model.register_forward_pre_hook(_weakly(self._enter_forward), prepend=True))
        for m in model.modules():
            used = sorted({self._owner[id(p)].index for p in m.parameters(recurse=False) if id(p) in self._owner}
                          | set(self._roots.get(id(m), ())))
            if used:
                self._handles.append(m.register_forward_pre_hook(_weakly_with(self._pre_forward, used)))
                self._handles.append(m.register_forward_hook(_weakly_with(self._post_forward, used),
                                                             always_call=True))
        for b in self.blocks:
            for k, s in enumerate(b.layout.segments if b.trains else ()):
                if self._grad_ready:
                    self._handles.append(s.param.register_hook(_weakly_with(self._grad_ready_hook, b.index, k)))
                self._handles.append(s.param.register_post_accumulate_grad_hook(
                    _weakly_with(self._grad_accumulated_hook, b.index, k)))
        if root:
            self._handles.append(model.register_forward_hook(_weakly(self._exit_forward), always_call=True))
        self._installed = True

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        _HANDLES.pop(self._token, None)

    # ---- the root forward ----------------------------------------------------------------
    def _enter_forward(self, module, args) -> None:
        if self._context is not None:
            return                               # a re-entrant call of the root module
        back = in_backward()
        for f in self._begin:
            f(back)
        if self.saved.handlers:
            self._context = torch.autograd.graph.saved_tensors_hooks(self._chain_pack, self.saved.unpack)
            self._context.__enter__()
        else:
            self._context = False                # marks "inside" without a context
        # the mode costs a check per torch call: only when a participant wants this forward's reads
        if self._reads and any(f() for f in self._watch):
            self._mode = _OutsideReads(self)
            self._mode.__enter__()

    def _exit_forward(self, module, args, output) -> None:
        if self._context is None:
            return
        mode, self._mode = self._mode, None
        context, self._context = self._context, None
        if mode is not None:
            mode.__exit__(None, None, None)
        if context:
            context.__exit__(None, None, None)
        for f in self._end:
            f()

    def param_read(self, params) -> list:
        """Parameters reached one torch op: each participant's ``param_read(p)`` per
        parameter; what they return is handed back to their ``param_read_done`` when the op
        has returned (parameter offload holds the blocks the op reads)."""
        return [(done, [f(p) for p in params]) for f, done in self._reads]

    def param_read_done(self, held: list) -> None:
        for done, tokens in held:
            if done is not None:
                done(tokens)

    # ---- nested saved-tensor contexts ------------------------------------------------------
    def _ours(self, hooks) -> bool:
        pack = hooks[0]
        return pack is self._chain_pack or isinstance(getattr(pack, "__self__", None), NestedSaved)

    def _enter_nested(self, entered: list) -> None:
        """A hooked module's call starts: the innermost handlers go on top of a context that
        is not the engine's (one entry per call, with the blocks it enters, popped by
        ``_post_forward``)."""
        context = None
        if self._innermost:
            top = _innermost_saved_hooks()
            if top is None or not self._ours(top):
                context = NestedSaved(self.saved, self._innermost, top).context()
                context.__enter__()
        self._nested.append((context, entered))

    # ---- block verbs ---------------------------------------------------------------------
    def _pre_forward(self, used: List[int], module, args) -> None:
        """The module's blocks enter FORWARD once every participant's pre_forward has run
        (the engine's collects each block's update first); a participant that raises leaves
        them where they were (``_post_forward`` still runs: torch calls it always)."""
        entered: list = []
        self._enter_nested(entered)
        blocks = [self.blocks[i] for i in used]
        for f in self._pre:
            for b in blocks:
                f(b)
        for b in blocks:
            b.enter_forward()
            entered.append(b)

    def _post_forward(self, used: List[int], module, args, output) -> None:
        back = in_backward()
        context, entered = self._nested.pop() if self._nested else (None, ())
        try:
            for b in entered:
                b.exit_forward(back)
            for f in self._post:
                for i in used:
                    f(self.blocks[i])
        finally:
            if context is not None:
                context.__exit__(None, None, None)

    def _enter_backward(self, block: Block) -> None:
        if block.enter_backward():
            for f in self._pre_bwd:
                f(block)

    def _grad_ready_hook(self, i: int, k: int, grad):
        block = self.blocks[i]
        self._enter_backward(block)
        for f in self._grad_ready:
            f(block, k)
        return grad

    def _grad_accumulated_hook(self, i: int, k: int, param) -> None:
        block = self.blocks[i]
        self._enter_backward(block)
        for f in self._grad_acc:
            f(block, k, param)

    def end_backward(self) -> None:
        """A backward has returned: blocks that get no gradient (frozen parameters only, or
        trained blocks that took no part) end their backward too."""
        for b in self.blocks:
            if b.phase in (BlockPhase.FORWARD_DONE, BlockPhase.BACKWARD) and not b.in_forward:
                self.post_backward(b)
        for f in self._end_bwd:
            f()

    def post_backward(self, block: Block) -> None:
        """``block``'s gradients of this backward are complete (or it took no part in it)."""
        block.end_backward()
        for f in self._post_bwd:
            f(block)
