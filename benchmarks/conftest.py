"""The pytest-benchmark suites' ``benchmark`` fixture: pytest-benchmark's, whose clock on CUDA waits for the
device's work before each read (``_common.device_clock``), so the suites time what the calls do on the GPU,
as the scripts' tables do, not only their launches."""

import pytest
import torch

from _common import default_device, device_clock


@pytest.fixture
def benchmark(benchmark):
    device_clock(benchmark, torch.device(default_device()))
    return benchmark
