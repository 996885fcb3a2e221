"""The UpdateRule protocol: what an optimizer is, for the engine and for the standalone CPU
optimizers, written once per rule; and AdamW / Adam, the engine's default rule, beside it
(with ``adam_step``, the same rule as a function). The others: lion.py, sgd.py, adagrad.py,
adafactor.py.

A rule says
  * the state it keeps: named rows (torch's state names) with their int8 code sign and
    initial value; elementwise rows have the parameter's numel, Adafactor's factored rows
    the shape they derive from the parameter's (``rows(group, shape)``);
  * its bytes per parameter on each tier, for every ``state_dtype`` (fp32 | bf16 | int8);
  * its hyper-parameters: torch's names and defaults (``defaults``), checked by ``validate``;
  * ``cpu_step``: one step of a flat CPU shard, by the native kernel named ``kernel``
    (native/<kernel>.c, through offload/_native.py; the GIL is released) or, with
    ``OFFLOAD_NATIVE=off`` or no native kernel, by ``reference`` in torch;
  * ``device_step``: a step of tensors on the compute device with torch's fused / foreach
    kernels where torch has them;
  * ``reference``: the plain-torch update on fp32 tensors, in torch's single-tensor order.

State of one shard (``State``): a dict from row name to tensor. fp32 / bf16 rows are tensors
of that dtype; an int8 row ``name`` is ``name`` (uint8 codes) plus ``name + "_absmax"`` (fp32
scales, quant.py). Every tensor flat, contiguous, on the CPU.

Adding a rule: a subclass of UpdateRule in its own file (rows, defaults, validate, native_hparams,
reference), its per-element math in native/<rule>.c, and one line ``register(MyRule)`` in
offload/optim/__init__.py.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import math
import operator
from typing import ClassVar, Dict, Optional, Sequence

import torch

from offload import _native, dtypes
from offload.optim import quant
from offload.optim import reference as _reference

from offload.dtypes import STATE_DTYPES  # noqa: E402  (re-exported: offload.optim.rule.STATE_DTYPES)

_TORCH_DTYPE = {name: dtypes.state_storage_dtype(name) for name in ("fp32", "bf16")}   # the float rows
_ROW_DTYPES = tuple(dtypes.state_storage_dtype(name) for name in STATE_DTYPES)        # elementwise rows
# the float dtypes a kernel reads or writes (grad, param_copy, float state rows): native codes
_NATIVE_DTYPE = {torch.float32: _native.DTYPE_F32, torch.bfloat16: _native.DTYPE_BF16,
                 torch.float16: _native.DTYPE_F16}

State = Dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Row:
    """One named row of optimizer state.

    name: torch's state key (``exp_avg``, ``momentum_buffer``, ``sum``, ``row_var``, ...).
    signed: whether values may be negative (picks the int8 code; quant.py).
    init: the group key holding its initial value (Adagrad's ``initial_accumulator_value``),
        or None for zeros.
    shape: None for an elementwise row (the parameter's numel), else the row's shape.
    """
    name: str
    signed: bool = True
    init: Optional[str] = None
    shape: Optional[tuple] = None

    @property
    def elementwise(self) -> bool:
        return self.shape is None


class UpdateRule:
    """Base of every rule; subclasses set the class attributes and the hooks below."""

    name: ClassVar[str]                          # the config's optimizer.type
    kernel: ClassVar[Optional[str]] = None       # native/<kernel>.c, or None: torch only
    hparams_type: ClassVar[Optional[type]] = None  # ctypes mirror of the kernel's hparams struct
    torch_optimizer: ClassVar[Optional[str]] = None  # torch.optim class with the same update
    optimizer_class: ClassVar[Optional[str]] = None  # another library's class with it ("module.Name")
    defaults: ClassVar[dict] = {}                # torch's hyper-parameter names and defaults
    state_dtypes: ClassVar[tuple] = STATE_DTYPES
    per_tensor: ClassVar[bool] = False           # state depends on each parameter's shape (Adafactor):
                                                 # the engine steps it per tensor (StateLayout.for_shard)

    # ---- what the rule keeps ---------------------------------------------------------------
    def rows(self, group: dict, shape: Optional[Sequence[int]] = None) -> tuple:
        """The state rows for a parameter of ``shape`` in ``group``."""
        raise NotImplementedError

    def state_bytes_per_param(self, state_dtype: str = "fp32", group: Optional[dict] = None) -> float:
        """Bytes of state per parameter (elementwise rows; a factored rule reports its
        unfactored worst case), the fp32 master excluded."""
        rows = self.rows(dict(self.defaults, **(group or {})))
        per_row = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / quant.BLOCK}[state_dtype]
        return per_row * len(rows)

    def bytes_per_param(self, tier: str, state_dtype: str = "fp32", group: Optional[dict] = None) -> float:
        """Bytes per parameter the optimizer keeps on ``tier``: ``device`` holds the state next
        to fp32 parameters; ``host`` / ``nvme`` hold the fp32 master and the state."""
        state = self.state_bytes_per_param(state_dtype, group)
        if tier == "device":
            return state
        if tier in ("host", "nvme"):
            return 4.0 + state
        raise ValueError(f"tier={tier!r}: use device, host or nvme")

    def passes(self) -> int:
        """Passes over the parameter's bytes per step (1 for elementwise rules)."""
        return 1

    # ---- hyper-parameters --------------------------------------------------------------------
    def validate(self, group: dict) -> None:
        """Raise ValueError naming the key for a hyper-parameter out of range."""
        for key in ("lr", "weight_decay", "eps"):
            if key in group and not isinstance(group[key], (tuple, list)):
                value = float(group[key])
                if not (math.isfinite(value) and value >= 0.0):
                    raise ValueError(f"{self.name}: {key}={group[key]!r} must be a finite number >= 0")
        if "betas" in group:
            betas = tuple(group["betas"])
            if len(betas) != 2 or not all(math.isfinite(float(b)) and 0.0 <= float(b) < 1.0 for b in betas):
                raise ValueError(f"{self.name}: betas={betas!r} must be two numbers in [0, 1)")

    def native_hparams(self, group: dict, step: int, grad_scale: float) -> ctypes.Structure:
        """The kernel's per-call scalars for 1-based ``step``, computed in double as torch does."""
        raise NotImplementedError

    # ---- the update ----------------------------------------------------------------------------
    def reference(self, param: torch.Tensor, grad: torch.Tensor, state: State, group: dict, step: int,
                  grad_scale: float = 1.0) -> None:
        """The plain-torch update in place: fp32 ``param``, fp32 ``grad`` (not modified), fp32
        state rows; torch's single-tensor order of operations."""
        raise NotImplementedError

    def init_state(self, param: torch.Tensor, group: dict, state_dtype: str = "fp32") -> State:
        """Fresh state for ``param`` (its shape matters for factored rows), flat, on the CPU."""
        out: State = {}
        for row in self.rows(group, tuple(param.shape)):
            numel = param.numel() if row.elementwise else math.prod(row.shape)
            value = float(group[row.init]) if row.init else 0.0
            fp32 = torch.full((numel,), value, dtype=torch.float32)
            store_row(out, row, fp32, state_dtype if row.elementwise else "fp32")
        return out

    def cpu_step(self, param: torch.Tensor, grad: torch.Tensor, state: State, group: dict, step: int, *,
                 param_copy: Optional[torch.Tensor] = None, grad_scale: float = 1.0,
                 shape: Optional[Sequence[int]] = None, src: Optional[tuple] = None) -> None:
        """One step of a flat CPU shard in place. param: fp32; grad: fp32 / bf16 / fp16 (read
        only); state: this rule's rows (any of its state dtypes); param_copy: None or bf16 /
        fp16, receives the new param rounded to nearest even, or fp32, receives the new param
        itself (in the same pass). ``shape``: the parameter's shape
        (factored rules). ``src``: None, or (param, state) before the step, laid out as
        ``param`` / ``state`` and not overlapping them: the step reads those and writes
        ``param`` / ``state`` (an update into a second buffer, optim/ahead.py); the native
        kernel reads them in its one pass, elsewhere they are copied over first. Native
        kernel when loaded, else the reference in torch."""
        rows = self.rows(group, shape)
        n = param.numel()
        _check_flat("param", param, (torch.float32,), n)
        _check_flat("grad", grad, tuple(_NATIVE_DTYPE), n)
        if param_copy is not None:
            _check_flat("param_copy", param_copy, tuple(_NATIVE_DTYPE), n)
        for row in rows:
            if row.elementwise:
                _check_flat(row.name, state[row.name], _ROW_DTYPES, n)
        dtype = state_dtype_of(state, rows)
        with _profiler_range(self.kernel or self.name.lower()):
            L = _native.lib() if self.kernel else None
            native = L is not None and all(r.elementwise for r in rows)
            if src is not None and (not native or dtype == "int8"):
                _copy_state(src, param, state)    # then in place
                src = None
            if not native:
                with torch.no_grad():
                    self._torch_step(param, grad, state, rows, group, step, param_copy, grad_scale, shape)
                return
            args = _native.StepArgs(param=param.data_ptr(), grad=grad.data_ptr(), n=n, nrows=len(rows),
                                    grad_dtype=_NATIVE_DTYPE[grad.dtype],
                                    copy_dtype=_native.DTYPE_NONE if param_copy is None else _NATIVE_DTYPE[param_copy.dtype],
                                    param_copy=None if param_copy is None else param_copy.data_ptr())
            args.state_dtype = _native.DTYPE_Q8 if dtype == "int8" else _NATIVE_DTYPE[_TORCH_DTYPE[dtype]]
            if src is not None:
                _check_flat("src param", src[0], (torch.float32,), n)
                args.param_src = src[0].data_ptr()
            for r, row in enumerate(rows):
                args.state[r] = state[row.name].data_ptr()
                if src is not None:
                    from_row = src[1][row.name]
                    _check_flat(f"src {row.name}", from_row, (state[row.name].dtype,), n)
                    args.state_src[r] = from_row.data_ptr()
                if dtype == "int8":
                    args.absmax[r] = state[row.name + "_absmax"].data_ptr()
                    args.qcode[r] = quant.dynamic_map(row.signed).data_ptr()
            _native.kernel_step(L, self.kernel, args, self.native_hparams(group, step, grad_scale))

    def _torch_step(self, param, grad, state, rows, group, step, param_copy, grad_scale, shape) -> None:
        """The fallback: widen the rows to fp32, run the reference, store them back."""
        fp32 = {row.name: load_row(state, row) for row in rows}
        g = grad if grad.dtype == torch.float32 else grad.float()
        p, g = (param.view(shape), g.view(shape)) if shape is not None else (param, g)
        self.reference(p, g, fp32, group, step, grad_scale)
        for row in rows:
            store_row(state, row, fp32[row.name], state_dtype_of(state, (row,)))
        if param_copy is not None:
            param_copy.copy_(param)

    def device_step(self, params: list, grads: list, states: list, group: dict, steps: list) -> None:
        """A step of fp32 tensors on the compute device (any shape), state rows fp32. Default:
        the reference per tensor; rules with torch kernels override it."""
        for p, g, s, step in zip(params, grads, states, steps):
            self.reference(p, g, s, group, step)


def _copy_state(src: tuple, param: torch.Tensor, state: State) -> None:
    """``src``'s param and every row (int8 scales included) over ``param`` / ``state``."""
    param.copy_(src[0])
    for name, t in state.items():
        t.copy_(src[1][name])


# ---- state rows ---------------------------------------------------------------------------------
def state_dtype_of(state: State, rows: Sequence[Row]) -> str:
    """fp32 | bf16 | int8, from the tensors (every elementwise row has the same)."""
    dtypes = {state[r.name].dtype for r in rows if r.elementwise}
    if not dtypes:
        return "fp32"
    if len(dtypes) > 1:
        raise TypeError(f"state rows have dtypes {sorted(map(str, dtypes))}: every row must have the same dtype")
    d = dtypes.pop()
    if d == torch.uint8:
        return "int8"
    for name, td in _TORCH_DTYPE.items():
        if td == d:
            return name
    raise TypeError(f"state dtype {d} is not one of fp32, bf16, int8 (uint8 codes)")


def load_row(state: State, row: Row) -> torch.Tensor:
    """The row as a flat fp32 tensor (the stored tensor itself when it is fp32)."""
    t = state[row.name]
    if t.dtype == torch.uint8:
        return quant.dequantize(t, state[row.name + "_absmax"], row.signed)
    return t.view(-1) if t.dtype == torch.float32 else t.float().view(-1)


def store_row(state: State, row: Row, fp32: torch.Tensor, state_dtype: str) -> None:
    """Store flat fp32 values into the row (created when missing), rounding or quantizing."""
    t = state.get(row.name)
    if state_dtype == "int8":
        if t is None:
            t = state[row.name] = torch.empty(fp32.numel(), dtype=torch.uint8)
            state[row.name + "_absmax"] = torch.empty(quant.nblocks(fp32.numel()), dtype=torch.float32)
        quant.quantize(fp32, t, state[row.name + "_absmax"], row.signed)
        return
    if t is None:
        state[row.name] = fp32.to(_TORCH_DTYPE[state_dtype], copy=True).view(-1)
    elif t.data_ptr() != fp32.data_ptr():
        t.view(-1).copy_(fp32.view(-1))


def _check_flat(name: str, t, dtypes: tuple, n: int) -> None:
    """Raise a clear error unless ``t`` is a dense, contiguous, flat CPU tensor of one of
    ``dtypes`` with ``n`` elements (the kernels take raw addresses: nothing is converted)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} has layout {t.layout}; cpu_step takes dense tensors: densify it first")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}; cpu_step updates CPU tensors: keep the fp32 master, grad "
                         f"and state in host memory (device_step is for tensors on the compute device)")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; it must be one of {', '.join(map(str, dtypes))} "
                        f"(cpu_step converts nothing: allocate it with an allowed dtype)")
    if t.dim() != 1:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; cpu_step takes flat 1-D tensors: pass {name}.view(-1)")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous (stride {t.stride()}); cpu_step never copies: pass a "
                         f"contiguous tensor, e.g. a slice of a flat buffer")
    if t.numel() != n:
        raise ValueError(f"{name} has {t.numel()} elements but param has {n}: every tensor of a step must "
                         f"cover the same elements")


def _profiler_range(name: str):
    """The named range ``offload::cpu_<name>``, entered only while a profiler records."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(f"offload::cpu_{name}")
    return contextlib.nullcontext()


# ---- the kernels' threads -----------------------------------------------------------------------
_requested_threads: Optional[int] = None


def set_num_threads(n: int) -> None:
    """Threads a native kernel call uses, the calling thread included (default: the CPUs this
    process may run on). The pool's workers persist; the torch fallback ignores it."""
    global _requested_threads
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 256:
        raise ValueError(f"set_num_threads({n!r}): n must be an int in [1, 256]")
    _requested_threads = n
    L = _native.lib()
    if L is not None:
        _native.kernel_set_num_threads(L, n)


def get_num_threads() -> int:
    """Threads a native kernel call uses (the value set, when the library is off)."""
    L = _native.lib()
    if L is not None:
        return L.offload_kernel_get_num_threads()
    return _requested_threads if _requested_threads is not None else torch.get_num_threads()


# ---- AdamW / Adam: the CPU Adam kernel (native/adam.c, bit-exact with torch's single-tensor
# order, see reference.py) behind the protocol, and ``adam_step``, the same rule as a function
# of flat CPU tensors ---------------------------------------------------------------------------
class AdamHparams(ctypes.Structure):
    """Mirror of offload_adam_hparams (native/adam.c)."""
    _fields_ = [(name, ctypes.c_float) for name in (
        "grad_scale", "l2", "decay", "lerp_weight", "beta2", "one_minus_beta2",
        "bias_correction2_sqrt", "eps", "neg_step_size")]


def adam_hparams(step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                 adamw_mode: bool, grad_scale: float) -> AdamHparams:
    """The kernel's scalars, computed in double exactly as torch's single-tensor Adam does."""
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    return AdamHparams(
        grad_scale=grad_scale, l2=0.0 if adamw_mode else weight_decay,
        decay=1 - lr * weight_decay if adamw_mode else 1.0, lerp_weight=1 - beta1, beta2=beta2,
        one_minus_beta2=1 - beta2, bias_correction2_sqrt=bias_correction2**0.5, eps=eps,
        neg_step_size=-(lr / bias_correction1))


class AdamW(UpdateRule):
    """torch.optim.AdamW: decoupled weight decay. Rows exp_avg (signed), exp_avg_sq (unsigned)."""
    name = "AdamW"
    kernel = "adam"
    hparams_type = AdamHparams
    torch_optimizer = "AdamW"
    defaults = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    decoupled = True

    def rows(self, group, shape=None):
        return (Row("exp_avg", signed=True), Row("exp_avg_sq", signed=False))

    def native_hparams(self, group, step, grad_scale):
        b1, b2 = (float(b) for b in group["betas"])
        return adam_hparams(step, float(group["lr"]), b1, b2, float(group["eps"]), float(group["weight_decay"]),
                            self.decoupled, float(grad_scale))

    def reference(self, param, grad, state, group, step, grad_scale=1.0):
        _reference.adam_step(param.view(-1), grad.reshape(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1),
                             step=step, lr=float(group["lr"]), betas=tuple(float(b) for b in group["betas"]),
                             eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                             adamw_mode=self.decoupled, grad_scale=grad_scale)

    def _torch_step(self, param, grad, state, rows, group, step, param_copy, grad_scale, shape):
        if state_dtype_of(state, rows) != "fp32":
            return super()._torch_step(param, grad, state, rows, group, step, param_copy, grad_scale, shape)
        # torch's fused CPU kernel: fp32 grads only, and its grad_scale divides in place, so a
        # low-precision or scaled grad goes through an fp32 temporary (the kernel's values).
        if grad.dtype != torch.float32 or grad_scale != 1.0:
            grad = grad.to(torch.float32, copy=True).mul_(grad_scale)
        b1, b2 = (float(b) for b in group["betas"])
        fused = torch._fused_adamw_ if self.decoupled else torch._fused_adam_
        fused([param], [grad], [state["exp_avg"]], [state["exp_avg_sq"]], [], [torch.tensor(float(step))],
              lr=float(group["lr"]), beta1=b1, beta2=b2, weight_decay=float(group["weight_decay"]),
              eps=float(group["eps"]), amsgrad=False, maximize=False)
        if param_copy is not None:
            param_copy.copy_(param)

    def device_step(self, params, grads, states, group, steps):
        b1, b2 = (float(b) for b in group["betas"])
        fused = torch._fused_adamw_ if self.decoupled else torch._fused_adam_
        # the step count filled on the device (torch.tensor(..., device=) would be a synchronising copy)
        step_t = [torch.full((), float(s), dtype=torch.float32, device=p.device) for p, s in zip(params, steps)]
        fused(params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], [], step_t,
              lr=float(group["lr"]), beta1=b1, beta2=b2, weight_decay=float(group["weight_decay"]),
              eps=float(group["eps"]), amsgrad=False, maximize=False)


class Adam(AdamW):
    """torch.optim.Adam: L2 weight decay added to the gradient."""
    name = "Adam"
    torch_optimizer = "Adam"
    defaults = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    decoupled = False


_ADAM_RULES = {True: AdamW(), False: Adam()}   # adamw_mode -> the rule adam_step runs


def adam_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
              *, step: int, lr: float, betas: tuple, eps: float, weight_decay: float,
              adamw_mode: bool = True, param_copy: torch.Tensor | None = None, grad_scale: float = 1.0) -> None:
    """One AdamW (``adamw_mode=True``) or Adam (L2 decay) step, in place, on flat CPU tensors:
    the rule's ``cpu_step`` (native kernel, else torch), with its hyper-parameters as arguments.

    param: 1-D fp32, updated in place. grad: 1-D fp32, bf16 or fp16, read only. exp_avg,
    exp_avg_sq: 1-D, both fp32 or both bf16, updated in place. param_copy: None, or a 1-D bf16 /
    fp16 tensor that receives the updated param rounded to nearest even, or fp32, the param
    itself, in the same pass. All contiguous, same number of elements, any alignment. step:
    the 1-based count of this update. grad_scale multiplies the gradient in fp32 first (loss
    unscaling times the clipping coefficient). Wrong dtype / device / size / layout raises
    TypeError or ValueError naming the argument; nothing is converted or copied."""
    if not isinstance(step, (bool, int)):
        try:
            step = operator.index(step)  # numpy / torch integers
        except TypeError:
            pass
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step={step!r} must be an int >= 1 (the 1-based count of this update)")
    grad_scale = float(grad_scale)
    if not math.isfinite(grad_scale):
        raise ValueError(f"grad_scale={grad_scale!r} must be finite (skip the step on overflow instead)")
    rule = _ADAM_RULES[bool(adamw_mode)]
    group = {"lr": float(lr), "betas": tuple(float(b) for b in betas), "eps": float(eps),
             "weight_decay": float(weight_decay)}
    rule.validate(group)
    rule.cpu_step(param, grad, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, group, step,
                  param_copy=param_copy, grad_scale=grad_scale)


# ---- registry ---------------------------------------------------------------------------------
RULES: Dict[str, type] = {}


def register(cls: type) -> type:
    """Make ``cls`` selectable as ``optimizer.type = cls.name`` (case-insensitive)."""
    RULES[cls.name.lower()] = cls
    return cls


def get_rule(name: str) -> UpdateRule:
    """The rule for an ``optimizer.type``, or a ValueError listing the known ones."""
    cls = RULES.get(str(name).lower())
    if cls is None:
        raise ValueError(f"optimizer type {name!r} is unknown: use one of {', '.join(c.name for c in RULES.values())}")
    return cls()
