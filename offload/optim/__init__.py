"""CPU optimizers for offloaded training: the native fused Adam / AdamW and its torch fallback."""
from offload.optim.cpu_adam import CPUAdam, adam_step, get_num_threads, set_num_threads

__all__ = ["CPUAdam", "adam_step", "set_num_threads", "get_num_threads"]
