"""Across ranks: process groups with timeouts and byte accounting (comm.py), per-block gradient
collectives in a fixed order (grad_sync.py), and shard arithmetic (sharding.py)."""
