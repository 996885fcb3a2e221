"""Where bytes live: one enum for every owner of offloaded bytes (optimizer state, parameter
homes, gradients, activations) and for the tiers that hold them.

The config names placements as strings (``offload_*.device``: ``none``, ``cpu``, ``nvme``);
the config layer turns each into a ``Placement`` once, where it is read (each offload
section's ``placement``), and everything below uses the enum. It sits beside the other
boundaries at the bottom of the package (``dtypes``, ``units``), importing nothing from it,
because the lowest layer that needs it is storage (a tier's ``kind``) and the config reads it
too.
"""
from __future__ import annotations

import enum


class Placement(enum.Enum):
    DEVICE = "device"   # the compute device's memory (config "none": not offloaded)
    HOST = "host"       # host memory, in budgeted pools (config "cpu")
    NVME = "nvme"       # swap files on NVMe, visiting a host buffer around each use (config "nvme")

    @classmethod
    def from_config(cls, device: str) -> "Placement":
        """The placement a config's ``device`` string names ("none", "cpu", "nvme")."""
        try:
            return _FROM_CONFIG[device]
        except KeyError:
            raise ValueError(f"{device!r} is not a placement: use one of {', '.join(_FROM_CONFIG)}") from None


_FROM_CONFIG = {"none": Placement.DEVICE, "cpu": Placement.HOST, "nvme": Placement.NVME}
