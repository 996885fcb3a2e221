"""The planner's entry: measure this machine (measure.py), predict each placement's step time
(predict.py), rank the placements (rank.py), check predictions against the engine
(validate.py). Re-exports their names for callers that take the planner as one module
(``choose.py``, ``offload plan``, the benchmarks)."""
from offload.planner.measure import (Compute, NvmeRates, Profile, _fit, _measure_file_io,  # noqa: F401
                                     adam_probe, measure_compute, measure_cpu_adam, measure_crc32c,
                                     measure_device_adam, measure_links, measure_matmul, measure_nvme,
                                     measure_profile)
from offload.planner.predict import Prediction, error, flops_compute, predict  # noqa: F401
from offload.planner.rank import RankedPlacement, fits_without_offload, rank  # noqa: F401
from offload.planner.validate import CheckCase, CheckResult, check, measure_case  # noqa: F401
