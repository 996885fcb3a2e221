"""The ``offload`` command (commands.py), with its corpus and progress display."""
from offload.cli.commands import main

__all__ = ["main"]
