"""A GGUF file as a Hugging Face model directory: read once with transformers' GGUF reader
(dequantized), written as safetensors in the training dtype with the tokenizer and its chat
template, into a cache the next run reuses.

    path = convert("SmolLM2-135M-Instruct.Q4_1.gguf")       # ~/.cache/offload/gguf/<name>-fp32-<key>/
    model = AutoModelForCausalLM.from_pretrained(path)       # or: offload finetune path ...

Why a copy: the engine streams a checkpoint block by block from safetensors, and a GGUF file's
tensors are quantized in llama.cpp's layout (transformers permutes and dequantizes them on load).

The cache entry is named by the file's name, the dtype and a key over the file's absolute path,
size and modification time, so an edited or replaced file is converted again. It is written
into a hidden ``.partial-*`` sibling, synced, and renamed into place only when complete: a crash
leaves no entry that a later run could take for a whole one (the stale partial is removed then).
The conversion holds the whole model in host memory once (in ``dtype``); training then streams it.
``gguf`` is an optional dependency (``pip install 'offload[gguf]'``).
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import uuid
from typing import Callable, Optional, Union

import torch

from offload.core.errors import OffloadError

PathLike = Union[str, os.PathLike]
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
MARKER = "offload_gguf.json"        # written last inside the entry: where it came from


class GGUFError(ValueError, OffloadError):
    """The GGUF input cannot be used; the message names the file and the fix."""


def default_cache_dir() -> pathlib.Path:
    """``$OFFLOAD_CACHE/gguf``, else ``$XDG_CACHE_HOME/offload/gguf``, else ``~/.cache/offload/gguf``."""
    root = os.environ.get("OFFLOAD_CACHE")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "offload")
    return pathlib.Path(root) / "gguf"


def find(src: PathLike) -> Optional[pathlib.Path]:
    """The GGUF file ``src`` names: ``src`` itself when it is a ``.gguf`` file, the one
    ``.gguf`` file in ``src`` when it is a directory without ``config.json``; None when ``src``
    is anything else (a Hugging Face directory, a missing path)."""
    p = pathlib.Path(src)
    if p.is_file() and p.suffix.lower() == ".gguf":
        return p
    if not p.is_dir() or (p / "config.json").is_file():
        return None
    found = sorted(f for f in p.iterdir() if f.suffix.lower() == ".gguf" and f.is_file())
    if len(found) > 1:
        raise GGUFError(f"{str(src)!r} holds {len(found)} GGUF files ({', '.join(f.name for f in found)}): "
                        "give the path of the one to use")
    return found[0] if found else None


def convert(src: PathLike, cache_dir: Optional[PathLike] = None, dtype: torch.dtype = torch.float32,
            say: Optional[Callable[[str], None]] = None) -> pathlib.Path:
    """The Hugging Face directory (config.json, model.safetensors in ``dtype``, tokenizer files
    with the chat template, generation_config.json) converted from the GGUF file ``src`` (or
    the one in the directory ``src``); converted now unless the cache already holds it.
    ``say`` gets one line on what was done. Raises GGUFError for a missing ``gguf`` package,
    an architecture transformers cannot read, or a path that names no GGUF file."""
    path, target = _entry(src, cache_dir, dtype)
    _require_gguf()
    st = path.stat()
    root, name = target.parent, target.name
    if (target / MARKER).is_file():
        if say:
            say(f"model {path.name}: converted earlier, reusing {target}")
        return target
    arch, kind = _describe(path)
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale(root, name)
    tmp = root / f".{name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        if say:
            say(f"model {path.name} ({arch}, {kind}): converting once to {DTYPE_NAMES[dtype]} safetensors in {target}")
        _write(path, arch, tmp, dtype)
        (tmp / MARKER).write_text(json.dumps({"source": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                                              "architecture": arch, "file_type": kind,
                                              "dtype": DTYPE_NAMES[dtype]}, indent=2))
        _sync(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / MARKER).is_file():    # not another run's finished copy: a real failure
                raise
            shutil.rmtree(tmp, ignore_errors=True)
        _fsync(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def cache_entry(src: PathLike, cache_dir: Optional[PathLike] = None, dtype: torch.dtype = torch.float32) -> pathlib.Path:
    """Where ``convert(src, cache_dir, dtype)`` writes its copy, and finds it again."""
    return _entry(src, cache_dir, dtype)[1]


def _entry(src: PathLike, cache_dir: Optional[PathLike], dtype: torch.dtype):
    """(the GGUF file, its cache entry)."""
    path = find(src)
    if path is None:
        raise GGUFError(f"{str(src)!r} is not a .gguf file nor a directory holding one")
    if dtype not in DTYPE_NAMES:
        raise GGUFError(f"dtype {dtype} is not one to train in: use torch.float32, torch.bfloat16 or torch.float16")
    path = path.resolve()
    st = path.stat()
    key = hashlib.sha1(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    root = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return path, root / f"{path.stem}-{DTYPE_NAMES[dtype]}-{key}"


def _require_gguf() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise GGUFError("reading a .gguf file needs the gguf package: pip install 'offload[gguf]' "
                        "(or pip install gguf)") from None


def _describe(path: pathlib.Path):
    """(architecture, quantization type name) from the file's metadata, without its tensors."""
    import gguf
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:   # a truncated or foreign file: gguf raises ValueError / struct errors
        raise GGUFError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc})") from None
    arch = reader.get_field("general.architecture")
    if arch is None:
        raise GGUFError(f"{path} has no general.architecture field: not a model GGUF file")
    ft = reader.get_field("general.file_type")
    try:
        kind = gguf.LlamaFileType(int(ft.contents())).name.replace("MOSTLY_", "") if ft is not None else "unknown"
    except ValueError:
        kind = "unknown"
    return str(arch.contents()), kind


def _supported() -> str:
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
        return ", ".join(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))
    except ImportError:
        return "see transformers' GGUF documentation"


def _write(path: pathlib.Path, arch: str, out: pathlib.Path, dtype: torch.dtype) -> None:
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    try:
        loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    except ValueError as exc:
        if "not supported" not in str(exc) and "Unrecognized configuration" not in str(exc):
            raise
        raise GGUFError(f"{path.name}: transformers {transformers.__version__} cannot read GGUF architecture "
                        f"{arch!r} as a causal language model ({exc}); it reads: {_supported()}. Convert the "
                        "model to a Hugging Face directory another way and give that directory") from None
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # save_pretrained refuses a model loaded from GGUF ("quantized with gguf"): the same
    # tensors, assigned into a model built from the config without the quantization entry
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = ""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    del loaded
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def _sync(d: pathlib.Path) -> None:
    """The entry's files and directory on disk before it is renamed into place."""
    for f in d.iterdir():
        _fsync(f)
    _fsync(d)


def _fsync(p: pathlib.Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale(root: pathlib.Path, name: str) -> None:
    """Partial copies of this entry left by runs that are no longer alive."""
    for p in root.glob(f".{name}.partial-*"):
        try:
            pid = int(p.name[len(f".{name}.partial-"):].split("-", 1)[0])
        except ValueError:
            continue
        if pid == os.getpid() or _alive(pid):
            continue
        shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
