"""Giving a model its values: streamed from a pretrained checkpoint, or from the model's own
initialisation, one group of parameters (a block) at a time.

    loader = WeightLoader(model, weights="llama-dir", key_map=None, init_fn=None)
    loader.schedule([[params of block 0], [params of block 1], ...])   # read ahead in this order
    loader.load(params_of_block_0)        # materialized (if on meta) and filled, identity kept
    ...
    loader.load_rest(model, skip_ids, device, dtype)   # parameters outside blocks, then buffers
    loader.close()

Matching (all checked in the constructor, before anything is allocated): every checkpoint key
(after ``key_map(key)``, None to skip it) names a ``model.state_dict()`` key directly, or after
removing PEFT's wrappers (``base_model.model.``, ``.base_layer.``), or with / without the Hugging
Face ``base_model_prefix``. A parameter reached by several keys (tied weights) needs one of
them in the file. Checkpoint keys matching nothing are unexpected (unless the model lists them
in ``_keys_to_ignore_on_load_unexpected``, or they name a buffer); parameters no key reaches
are missing, except adapter parameters (PEFT), those the model lists in
``_keys_to_ignore_on_load_missing``, and any when ``init_fn`` is given: those are initialised.
Shapes must agree. Each problem raises ``WeightsError`` naming the key.

Initialisation of a parameter with no value (absent from the checkpoint and on the meta
device, or every meta parameter when there is no checkpoint): it is filled with NaN, then the
model's own code runs on its module until no NaN is left, in this order: PEFT's adapter
initialisation (``reset_lora_parameters``: LoRA's B is zero), the nearest Hugging Face
model's ``_init_weights(module)``, the module's ``reset_parameters()``; ``init_fn(module)``,
when given, replaces all three. Values the module already had from the checkpoint are put
back after each step. A parameter still NaN after all of them is an error naming it.
Non-persistent buffers on the meta device (rotary frequencies) are recomputed the same way.
The module's train / eval mode is never changed.

Reading: safetensors extents of the next scheduled group are read on one background thread
(O_DIRECT, into one of two pool buffers) while the current group is converted, so host memory
holds about two groups of checkpoint bytes. Converted values are copied into the parameter's
own dtype (fp32 parameters from a bf16 file, for example); the engine then builds the fp32
master and the compute-dtype copy from them, block by block.

Frozen parameters loaded from safetensors are remembered with a CRC32C of their bytes
(``base_reference()``), so checkpoints can refer to the base's files instead of copying them.
"""
from __future__ import annotations

import re
import time
import zlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from offload.io.peft_names import canonical_key
from offload.io.safetensors import ReadAhead, ReadGroup, WeightFiles, WeightsError


def checksum(t: torch.Tensor) -> Tuple[str, int]:
    """(algorithm, checksum) of a CPU tensor's bytes: CRC32C with the native library, else CRC32."""
    t = t.contiguous()
    n = t.numel() * t.element_size()
    from offload import _native
    if _native.lib() is not None:
        return "crc32c", _native.crc32c(t.data_ptr(), n) if n else 0
    return "crc32", zlib.crc32(t.reshape(-1).view(torch.uint8).numpy()) if n else 0


def _adapter_layers(model: nn.Module) -> Dict[int, Tuple[nn.Module, str, str]]:
    """id(adapter parameter) -> (PEFT tuner layer, adapter name, layer attribute) for every
    parameter PEFT added (lora_A, lora_B, ...)."""
    out = {}
    for layer in model.modules():
        names = getattr(layer, "adapter_layer_names", None)
        if not names or not hasattr(layer, "get_base_layer"):
            continue
        for ln in names:
            holder = getattr(layer, ln, None)
            if isinstance(holder, (nn.ModuleDict, nn.ParameterDict)):
                for adapter, sub in holder.items():
                    ps = sub.parameters() if isinstance(sub, nn.Module) else [sub]
                    for p in ps:
                        out[id(p)] = (layer, adapter, ln)
    return out


def _peft_configs(model: nn.Module) -> dict:
    for m in model.modules():
        cfg = getattr(m, "peft_config", None)
        if isinstance(cfg, dict) and cfg:
            return cfg
    return {}


def _hf_roots(model: nn.Module) -> List[nn.Module]:
    """Modules with a model-level ``_init_weights(module)`` (every Hugging Face model, and
    ``offload.models.gpt.GPT``), outer ones first."""
    return [m for m in model.modules() if callable(getattr(m, "_init_weights", None))]


def _has_nan(t: torch.Tensor) -> bool:
    return t.is_floating_point() and bool(torch.isnan(t).any())


class WeightLoader:
    """Values for a model's parameters and buffers: from ``weights`` (a path, or None) or the
    model's own initialisation. See the module docstring for the rules."""

    def __init__(self, model: nn.Module, weights=None, key_map: Optional[Callable[[str], Optional[str]]] = None,
                 init_fn: Optional[Callable[[nn.Module], None]] = None):
        self.model = model
        self.init_fn = init_fn
        self.files = WeightFiles(weights) if weights is not None else None
        self._source: Dict[int, str] = {}          # id(tensor) -> checkpoint key
        self._names: Dict[int, List[str]] = {}     # id(tensor) -> its state_dict keys
        self._owner: Dict[int, Tuple[nn.Module, str, bool]] = {}  # id -> (module, attr, is_param)
        self._hf = _hf_roots(model)
        self._hf_of: Optional[Dict[int, nn.Module]] = None
        self._adapters = _adapter_layers(model)
        self._ahead: Optional[ReadAhead] = None     # the reader thread, once scheduled
        self._base: Dict[str, dict] = {}           # state_dict key -> base file reference
        self._done = set()                         # ids of tensors given their values
        self.seconds = {"read_wait": 0.0, "convert": 0.0, "init": 0.0}
        self.bytes_read = 0
        for mname, m in model.named_modules():
            for n, p in m._parameters.items():
                if p is not None:
                    self._owner.setdefault(id(p), (m, n, True))
                    self._names.setdefault(id(p), []).append(f"{mname}.{n}" if mname else n)
            for n, b in m._buffers.items():
                if b is not None:
                    self._owner.setdefault(id(b), (m, n, False))
                    self._names.setdefault(id(b), []).append(f"{mname}.{n}" if mname else n)
        if self.files is not None:
            self._match(key_map)

    # ---- matching -------------------------------------------------------------------------
    def _match(self, key_map) -> None:
        model = self.model
        sd = model.state_dict(keep_vars=True)
        persistent = {k: v for k, v in sd.items()}
        by_key: Dict[str, torch.Tensor] = dict(persistent)
        for mname, m in model.named_modules():      # non-persistent buffers may be in a file too
            for n, b in m._buffers.items():
                if b is not None:
                    by_key.setdefault(f"{mname}.{n}" if mname else n, b)
        canon: Dict[str, str] = {}
        for k in by_key:
            canon.setdefault(canonical_key(k), k)
        prefixes = [r.base_model_prefix for r in self._hf if getattr(r, "base_model_prefix", "")]
        ignore_unexpected = [re.compile(p) for r in self._hf for p in (getattr(r, "_keys_to_ignore_on_load_unexpected",
                                                                               None) or [])]
        unexpected, shape_errors = [], []
        for ck in self.files.keys():
            mk = key_map(ck) if key_map is not None else ck
            if mk is None:
                continue
            target = mk if mk in by_key else canon.get(canonical_key(mk))
            if target is None:
                for p in prefixes:
                    alt = mk[len(p) + 1:] if mk.startswith(p + ".") else f"{p}.{mk}"
                    target = alt if alt in by_key else canon.get(canonical_key(alt))
                    if target is not None:
                        break
            if target is None:
                if not any(r.search(mk) for r in ignore_unexpected):
                    unexpected.append(ck if mk == ck else f"{ck} (mapped to {mk})")
                continue
            t = by_key[target]
            if tuple(self.files.shape(ck)) != tuple(t.shape):
                shape_errors.append(f"{ck}: the checkpoint has shape {list(self.files.shape(ck))}, the model's "
                                    f"{target} has {list(t.shape)}")
                continue
            self._source.setdefault(id(t), ck)
        if shape_errors:
            raise WeightsError(f"shape mismatch between {self.files.path} and the model: " + "; ".join(shape_errors[:5])
                               + (f" (and {len(shape_errors) - 5} more)" if len(shape_errors) > 5 else "")
                               + ": it is a checkpoint of another model size, or key_map maps the wrong keys")
        if unexpected:
            raise WeightsError(f"unexpected key{'s' if len(unexpected) > 1 else ''} in {self.files.path}: "
                               f"{', '.join(unexpected[:5])}" + (f" (and {len(unexpected) - 5} more)"
                                                                 if len(unexpected) > 5 else "")
                               + ": the model has no such parameter or buffer; map it with key_map "
                               "(return None to skip a key)")
        ignore_missing = [re.compile(p) for r in self._hf for p in (getattr(r, "_keys_to_ignore_on_load_missing",
                                                                            None) or [])]
        missing, seen = [], set()
        for k, t in persistent.items():
            if id(t) in self._source or id(t) in seen:
                continue
            seen.add(id(t))
            if id(t) in self._adapters or self.init_fn is not None or any(r.search(k) for r in ignore_missing):
                continue
            missing.append(k)
        if missing:
            raise WeightsError(f"missing key{'s' if len(missing) > 1 else ''} in {self.files.path}: "
                               f"{', '.join(missing[:5])}" + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
                               + ": the checkpoint has no value for them; map its keys with key_map, or pass "
                               "init_fn to initialise parameters the checkpoint does not hold")

    def source_key(self, t: torch.Tensor) -> Optional[str]:
        """The checkpoint key a parameter or buffer is read from (None: initialised)."""
        return self._source.get(id(t))

    def source_extent(self, t: torch.Tensor):
        """Where a parameter's value lies in the checkpoint files (``SourceExtent``: file,
        offset, length, dtype, shape), usable as a read-only home for a frozen parameter;
        None when it is not in a safetensors file."""
        k = self._source.get(id(t))
        return self.files.extent(k) if k is not None else None

    # ---- reading ahead ---------------------------------------------------------------------
    def schedule(self, groups: Sequence[Sequence[torch.Tensor]]) -> None:
        """The order in which ``load`` will be called (groups of tensors): the next group's
        bytes are read while the current one is converted."""
        if self.files is None:
            return
        keys = [self._keys_of(g) for g in groups]
        if self._ahead is None and any(keys):
            self._ahead = ReadAhead(self.files, max(self.files.read_bytes_needed(k) for k in keys))
        if self._ahead is not None:
            self._ahead.enqueue(keys)

    def _keys_of(self, tensors) -> List[str]:
        """The checkpoint keys ``load(tensors)`` will read, in its order."""
        ks = [self._source[id(t)] for t in tensors if id(t) not in self._done and id(t) in self._source]
        return list(dict.fromkeys(ks))

    def _group(self, keys: List[str]) -> ReadGroup:
        if self._ahead is not None:
            return self._ahead.take(keys)
        return ReadAhead.read_once(self.files, keys)

    # ---- loading ---------------------------------------------------------------------------
    def load(self, tensors: Sequence[torch.Tensor], device=None, dtype: Optional[torch.dtype] = None,
             frozen_reference: bool = False) -> None:
        """Give each of ``tensors`` (parameters or buffers of the model, by identity) its
        value. A meta tensor is materialized on ``device`` (default: the CPU) in ``dtype``
        (floating point only; default: its own); a real one is overwritten in place.
        ``frozen_reference``: remember the safetensors origin of frozen parameters loaded
        here (``base_reference``)."""
        tensors = list({id(t): t for t in tensors if id(t) not in self._done}.values())
        if not tensors:
            return
        keys = self._keys_of(tensors)
        group = self._group(keys) if keys else None
        try:
            t0 = time.perf_counter()
            absent = []
            for t in tensors:
                was_meta = t.is_meta
                new = self._materialize(t, device, dtype)
                k = self._source.get(id(new))
                if k is None:
                    if was_meta:
                        absent.append(new)
                    self._done.add(id(new))
                    continue
                src = group.tensors[k]
                with torch.no_grad():
                    new.copy_(src)
                if frozen_reference and isinstance(new, nn.Parameter) and not new.requires_grad \
                        and self.files.extent(k) is not None:
                    algo, crc = checksum(src)
                    for name in self._names.get(id(new), []):
                        self._base[name] = {"file": self.files.extent(k).file, "key": k, algo: crc}
                self._done.add(id(new))
            if group is not None:
                self.bytes_read += group.nbytes
            self.seconds["convert"] += time.perf_counter() - t0
        finally:
            if group is not None:
                group.release()
        if absent:
            t0 = time.perf_counter()
            self._initialise(absent)
            self.seconds["init"] += time.perf_counter() - t0

    def _materialize(self, t: torch.Tensor, device, dtype) -> torch.Tensor:
        """``t`` itself with real memory (NaN-filled when it was meta and floating point)."""
        if not t.is_meta:
            return t
        mod, attr, is_param = self._owner[id(t)]
        dt = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
        new = torch.empty(t.shape, dtype=dt, device=device or "cpu")
        if new.is_floating_point():
            new.fill_(float("nan"))
        if is_param:
            torch.utils.swap_tensors(t, nn.Parameter(new, requires_grad=t.requires_grad))
            t.__dict__.pop("_is_hf_initialized", None)   # a flag about the meta tensor's (absent) values
            return t
        mod._buffers[attr] = new
        old = id(t)
        self._owner[id(new)] = self._owner[old]
        self._names[id(new)] = self._names.get(old, [])
        if old in self._source:
            self._source[id(new)] = self._source[old]
        return new

    # ---- initialisation by the model's own code -------------------------------------------
    def _initialise(self, tensors: List[torch.Tensor]) -> None:
        """Run the model's own initialisation on the modules owning ``tensors`` (NaN-filled)
        until none is NaN; see the module docstring for the order."""
        pending = {id(t): t for t in tensors if t.is_floating_point()}
        by_module: Dict[int, Tuple[nn.Module, list]] = {}
        for t in tensors:
            m = self._owner[id(t)][0]
            by_module.setdefault(id(m), (m, []))[1].append(t)
        peft_cfg = _peft_configs(self.model)
        done_layers = set()
        for m, ts in by_module.values():
            steps = self._init_steps(m, ts, peft_cfg, done_layers)
            for step in steps:
                if not any(id(t) in pending and _has_nan(t) for t in ts):
                    break
                keep = [(p, p.detach().clone()) for p in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
                        if not any(p is t for t in ts) and not p.is_meta]
                with torch.no_grad():
                    step()
                    for p, v in keep:
                        p.copy_(v)
            if not ts[0].is_floating_point() and not steps:
                raise WeightsError(f"{self._name(ts[0])} is on the meta device, not in the checkpoint, and no "
                                   f"initialisation of the model computes it: build the model with it materialized, "
                                   f"or pass init_fn")
        left = [t for t in pending.values() if _has_nan(t)]
        if left:
            names = ", ".join(self._name(t) for t in left[:5])
            raise WeightsError(f"no initialisation covers {names}" + (f" (and {len(left) - 5} more)" if len(left) > 5
                                                                       else "")
                               + ": it is not in the checkpoint, and neither PEFT, the model's _init_weights nor its "
                               "module's reset_parameters() sets it; pass init_fn(module) to initialise it, or "
                               "materialize it before offload.initialize")

    def _init_steps(self, m: nn.Module, ts, peft_cfg, done_layers) -> List[Callable[[], None]]:
        if self.init_fn is not None:
            return [lambda: self.init_fn(m)]
        steps = []
        ad = [self._adapters.get(id(t)) for t in ts]
        for a in ad:
            if a is None or (id(a[0]), a[1]) in done_layers:
                continue
            layer, adapter, _ = a
            cfg = peft_cfg.get(adapter)
            how = getattr(cfg, "init_lora_weights", True) if cfg is not None else True
            if hasattr(layer, "reset_lora_parameters"):
                if how not in (True, False) and str(how).lower() != "gaussian":
                    raise WeightsError(f"{self._name(ts[0])}: PEFT's init_lora_weights={how!r} needs the base "
                                       f"weights when the adapter is created; build the PEFT model on real base "
                                       f"weights, or pass init_fn")
                done_layers.add((id(layer), adapter))
                steps.append(lambda layer=layer, adapter=adapter, how=how: layer.reset_lora_parameters(adapter, how))
        hf = self._nearest_hf(m)
        if hf is not None:
            steps.append(lambda: hf._init_weights(m))
        if hasattr(m, "reset_parameters"):
            steps.append(m.reset_parameters)
        return steps

    def _nearest_hf(self, m: nn.Module):
        if self._hf_of is None:          # outer models first: an inner model overrides for its modules
            self._hf_of = {}
            for r in self._hf:
                for x in r.modules():
                    self._hf_of[id(x)] = r
        return self._hf_of.get(id(m))

    def _name(self, t: torch.Tensor) -> str:
        names = self._names.get(id(t))
        return repr(names[0]) if names else "a tensor"

    def load_rest(self, model: nn.Module, skip: set, device, dtype: torch.dtype,
                  groups: Sequence[nn.Module] = ()) -> None:
        """Every parameter not in ``skip`` (ids) and every buffer, in ``groups`` (module
        subtrees, read together) then the rest: materialized on ``device``, floating point in
        ``dtype`` for parameters (buffers keep theirs). Non-persistent buffers not in the
        checkpoint keep their values; meta ones are recomputed by the model's own code."""
        def todo(mods):
            ps, bs = [], []
            for m in mods:
                for p in m._parameters.values():
                    if p is not None and id(p) not in skip and id(p) not in self._done:
                        ps.append(p)
                for b in m._buffers.values():
                    if b is not None and id(b) not in self._done and (b.is_meta or id(b) in self._source):
                        bs.append(b)
            return list({id(t): t for t in ps}.values()), list({id(t): t for t in bs}.values())
        claimed = set()
        batches = []
        for g in groups:
            mods = [m for m in g.modules() if id(m) not in claimed]
            claimed.update(id(m) for m in mods)
            batches.append(todo(mods))
        batches.append(todo([m for m in model.modules() if id(m) not in claimed]))
        self.schedule([ps for ps, _ in batches])
        for ps, bs in batches:
            self.load(ps, device=device, dtype=dtype, frozen_reference=True)
            self.load(bs, device=device)

    def read_only(self, groups: Sequence[Sequence[torch.Tensor]]) -> Tuple[int, float]:
        """Read every group's checkpoint bytes exactly as loading does (planned ranges,
        O_DIRECT, the next group in flight), converting nothing: the read path alone, for
        benchmarks. Returns the bytes of the tensors read and the seconds from the first
        read to the last (buffers allocated before)."""
        keys = [k for k in (self._keys_of(g) for g in groups) if k]
        ahead = ReadAhead(self.files, max(self.files.read_bytes_needed(k) for k in keys))
        try:
            t0 = time.perf_counter()
            ahead.enqueue(keys)
            total = 0
            for k in keys:
                grp = ahead.take(k)
                total += grp.nbytes
                grp.release()
            return total, time.perf_counter() - t0
        finally:
            ahead.close()

    def refer(self, t: torch.Tensor, value: Optional[torch.Tensor] = None) -> None:
        """Record frozen parameter ``t`` as read in place from its safetensors extent (its
        home is the checkpoint file, nothing is copied): checkpoints then refer to it.
        ``value``: its bytes if the caller has them (for the checksum), else they are read."""
        ext = self.source_extent(t)
        if ext is None:
            raise WeightsError(f"{self._name(t)} is not in a safetensors file of the checkpoint: it cannot be "
                               f"read in place")
        if value is None:
            with open(ext.file, "rb") as f:
                f.seek(ext.offset)
                value = torch.frombuffer(bytearray(f.read(ext.length)), dtype=torch.uint8)
        algo, crc = checksum(value)
        for name in self._names.get(id(t), []):
            self._base[name] = {"file": ext.file, "key": self._source[id(t)], algo: crc}
        self._done.add(id(t))

    def in_place_extents(self, tensors: Sequence[torch.Tensor], dtype: torch.dtype):
        """The safetensors extents of ``tensors`` when every one of them can be read in place
        as ``dtype`` (stored in that dtype, at an offset aligned for it), else None."""
        out = []
        for t in tensors:
            ext = self.source_extent(t) if self.files is not None else None
            if ext is None or ext.dtype != dtype or tuple(ext.shape) != tuple(t.shape) \
                    or ext.offset % dtype.itemsize:
                return None
            out.append(ext)
        return out

    def refer_all(self, tensors: Sequence[torch.Tensor]) -> Dict[int, int]:
        """Record frozen parameters ``tensors`` as read in place from their safetensors
        extents (as ``refer``), reading their bytes once, through the read-ahead as ``load``
        does, for their checksums; a meta parameter becomes an empty real one (its values
        are read from the file around each use). Returns ``id(tensor) -> checksum``, taken
        with ``checksum``."""
        tensors = [t for t in {id(t): t for t in tensors}.values() if id(t) not in self._done]
        keys = self._keys_of(tensors)
        group = self._group(keys)
        out = {}
        try:
            for t in tensors:
                k = self._source[id(t)]
                algo, crc = checksum(group.tensors[k])
                ext = self.files.extent(k)
                for name in self._names.get(id(t), []):
                    self._base[name] = {"file": ext.file, "key": k, algo: crc}
                if t.is_meta:
                    torch.utils.swap_tensors(t, nn.Parameter(torch.empty(0, dtype=t.dtype), requires_grad=False))
                    t.__dict__.pop("_is_hf_initialized", None)
                self._done.add(id(t))
                out[id(t)] = crc
            self.bytes_read += group.nbytes
        finally:
            group.release()
        return out

    def base_reference(self) -> Dict[str, dict]:
        """state_dict key -> {"file", "key", checksum} of frozen parameters loaded from the
        checkpoint's safetensors files (they never change, so a checkpoint may refer to them)."""
        return dict(self._base)

    def close(self) -> None:
        """Stop reading ahead and release the read buffers (the model keeps its values)."""
        if self._ahead is not None:
            self.seconds["read_wait"] += self._ahead.wait_seconds
            self._ahead.close()
            self._ahead = None
        if self.files is not None:
            self.files.close()
