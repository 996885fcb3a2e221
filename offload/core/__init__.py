"""The engine's low core: blocks and their sharding, the hook owner, the lookahead, telemetry, errors.

Every other layer may import from here; nothing here imports from the layers above
(engine/, params/, optim/, storage/, io/, dist/, hf/, planner/, cli/), only the two
boundaries beneath them all (``offload.device``, ``offload._native``) and ``offload.dtypes``.
"""
