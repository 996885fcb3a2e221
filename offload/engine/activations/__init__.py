"""Activation offload: tensors saved for backward leave the device during forward and come
back ahead of their use in backward.

A handler of the saved-tensor chain (core/hooks.py). ``pack`` claims a saved tensor of at
least ``min_bytes`` that is not a parameter, a view of a parameter or a buffer (parameter
offload owns those), copies it off the device and returns a handle; ``unpack`` returns the
tensor from the handle, bit for bit, with its shape, strides and dtype. A tensor saved twice
(the same tensor object, unmodified) gets a second handle to the same copy. Packing happens
only in the root forward: inside ``torch.utils.checkpoint`` regions the checkpoint's own
hooks take precedence, so only the checkpoint boundaries (its saved inputs) move, and
recomputation in backward saves its tensors on the device for their short life.

saved.py: one saved tensor's record and its states; keys.py: the NVMe keys the copies are
written to; handler.py: ``ActivationOffload``, the handler, which moves the records (host
pool, NVMe, back to the device in the expected order).
"""
from offload.engine.activations.handler import ActivationHostBudgetError, ActivationOffload
from offload.engine.activations.saved import Saved, SavedState

__all__ = ["ActivationOffload", "ActivationHostBudgetError", "Saved", "SavedState"]
