"""The parameter side of a block: where its parameters live between uses (residency.py), how
uses are caught and served, and what is read ahead of use (offload.py)."""
