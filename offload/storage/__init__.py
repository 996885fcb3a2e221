"""Host and NVMe tiers: a budgeted host buffer pool and an asynchronous swap-file store."""
from offload.storage.nvme import (ChecksumError, DirectIOWarning, IOHandle, NvmeIOError, NvmeSpaceError,
                                  NvmeStore, StaleSwapDirWarning)
from offload.storage.pool import HostArena, HostBuffer, HostPool, PoolBudgetError

__all__ = ["HostPool", "HostArena", "HostBuffer", "PoolBudgetError", "NvmeStore", "IOHandle", "NvmeIOError",
           "ChecksumError", "NvmeSpaceError", "StaleSwapDirWarning", "DirectIOWarning"]
