"""The process of its own for tests/storage/test_nvme.py's write-error case: a child forked by
tests/_forked.py, so that its file-size limit is its own."""
import resource
import signal

import torch

from offload.storage import NvmeIOError, NvmeStore


def write_past_file_size_limit(path: str, block: int, backend_args: dict) -> dict:
    """Under a 1 MiB file-size limit (writes past it fail with EFBIG): a small write, a 3 MiB
    write, then a read of the key the large write failed to fill. Returns what each raised."""
    s = NvmeStore(path, block_size=block, **backend_args)
    s.reserve({"a": 64 << 10, "big": 3 << 20})
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
    s.write("a", torch.ones(64 << 10, dtype=torch.uint8)).wait()   # below the limit: fine
    out = {}
    try:
        s.write("big", torch.ones(3 << 20, dtype=torch.uint8)).wait()
    except NvmeIOError as e:
        out["errno"], out["msg"] = e.errno, str(e)
    try:
        s.read("big", torch.ones(3 << 20, dtype=torch.uint8)).wait()
    except NvmeIOError as e:
        out["read"], out["read_errno"], out["read_file"] = str(e), e.errno, e.filename
    out["file"] = s._keys["big"].file.path
    s.close()
    return out
