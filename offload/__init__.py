"""offload: a ZeRO-Offload engine for PyTorch."""
from offload._native import native_info

__all__ = ["native_info"]
__version__ = "0.1.0"
