"""The ``offload`` command (main.py), one module per subcommand, with its corpus and
progress display."""
from offload.cli.common import REPO_ROOT
from offload.cli.main import main

__all__ = ["main", "REPO_ROOT"]
