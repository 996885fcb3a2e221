"""The training engine: the facade users call (engine.py) and the per-block pieces of one step:
blocks.py (grouping parameters into flat blocks), block_shard.py (one block shard's runtime
owner), grads.py (gradient landing and the accumulation window), telemetry.py."""
from offload.engine.engine import Engine, initialize

__all__ = ["Engine", "initialize"]
