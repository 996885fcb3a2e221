"""Made-up machines for the planner's tests: a ``Profile`` (every rate given, nothing
measured), a measured ``Compute`` of a GPU, and the matmul rates of a CPU without native
bf16 / fp16 (for the ``matmul_rates`` fixture): the numbers are chosen, not read from this
machine, so the plans they give are the same everywhere."""
from offload.planner import measure

# The matmul rates (TFLOP/s) of a CPU without native bf16 / fp16 (AVX2): bf16 45x slower than fp32.
AVX2_RATES = {"fp32": 0.9, "bf16": 0.02, "fp16": 0.03}
GPU = measure.Compute(forward_s=1.0, backward_s=2.0, measured=True, shares_cpu=False)


def profile(**kw):
    base = dict(device="NVIDIA test", cpu_threads=2, adam_params_per_s=1e9, adam_backend="test",
                device_adam_params_per_s=50e9, h2d_gbps=20.0, d2h_gbps=20.0, host_memcpy_gbps=10.0,
                nvme_read_gbps=4.0, nvme_write_gbps=2.0, nvme_read_latency_s=0.0, nvme_write_latency_s=0.0,
                nvme_duplex=0.0, io_backend="test", nvme_path="/tmp", matmul_tflops=100.0)
    base.update(kw)
    return measure.Profile(**base)
