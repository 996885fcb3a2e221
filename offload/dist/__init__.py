"""Across ranks: process groups with timeouts and byte accounting (comm.py) and per-block
gradient collectives in a fixed order (grad_sync.py); the shard arithmetic they share with
one rank is core/sharding.py."""
