"""Lightning on the engine: ``OffloadStrategy`` for ``lightning.Trainer`` and
``OffloadFabricStrategy`` for ``lightning.Fabric`` (strategy.py, fabric.py).

    import offload.lightning                                  # registers strategy="offload"
    trainer = lightning.Trainer(strategy=offload.lightning.OffloadStrategy(offload_config={...}))
    fabric = lightning.Fabric(strategy=offload.lightning.OffloadFabricStrategy(offload_config={...}))

Importing this package imports Lightning and registers both under the name ``"offload"``
(``Trainer(strategy="offload")``, ``Fabric(strategy="offload")``, with the engine's default
config); ``import offload`` does not need Lightning.
"""
from offload.lightning.fabric import OffloadFabricStrategy
from offload.lightning.strategy import EnginePrecision, OffloadStrategy

__all__ = ["OffloadStrategy", "OffloadFabricStrategy", "EnginePrecision"]
