import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def ranges_entered(monkeypatch):
    """The names of the torch profiler ranges entered during the test, under either of
    torch's names for record_function (torch's optimizer step wrapper uses the autograd one)."""
    import torch
    entered = []
    real = torch.profiler.record_function

    def counting(name, *a, **kw):
        entered.append(name)
        return real(name, *a, **kw)
    monkeypatch.setattr(torch.profiler, "record_function", counting)
    monkeypatch.setattr(torch.autograd.profiler, "record_function", counting)
    return entered


@pytest.fixture
def matmul_rates(monkeypatch):
    """``use(table)``: offload.planner.precision reads its matmul rates per precision from
    ``table`` instead of measuring this machine; nothing has been told yet in the test."""
    from offload.planner import precision
    monkeypatch.setattr(precision, "_told", set())

    def use(table):
        monkeypatch.setattr(precision, "matmul_tflops", lambda p, device=None: table[p])
    return use
