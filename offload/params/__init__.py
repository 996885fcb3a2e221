"""The parameter side of a block: where its parameters live between uses (residency.py), how
uses are caught and served (offload.py), and what is read ahead of use (prefetch.py)."""
