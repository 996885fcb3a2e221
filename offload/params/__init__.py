"""The parameter side of a block: one parameter part and where it lives between uses
(part.py), the updated parameters' way home (write_back.py), how uses are caught and served
(participant.py) within the device budget (budget.py), what is read ahead of use
(prefetch.py), which updated blocks stay staged (write_through.py), frozen parts in
checkpoints (frozen_io.py), and where each part's home is made (homes.py)."""
