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


@pytest.fixture(autouse=True)
def restore_backend():
    """Apps run in-process (e.g. `generate.py --backend torch` in an input-error test) set the
    process-wide backend; later tests must not inherit it (a CUDA graph of the reference path fails)."""
    from minfer import ops

    previous = ops.backend()
    yield
    ops.set_backend(previous)
