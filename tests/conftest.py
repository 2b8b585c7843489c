import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device)")


def pytest_report_header(config):
    return f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}"


@pytest.fixture(scope="session", autouse=True)
def minfer_kernels():
    """Tests call torch.ops.minfer directly, in any order (and in fresh xdist workers): build first."""
    if torch.cuda.is_available():
        from minfer import ops

        ops.build()
