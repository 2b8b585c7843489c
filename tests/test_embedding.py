"""Token embedding lookup: the kernel copies rows exactly, from a table on the GPU or in pinned host
memory (what Transformer.place_embedding("host") uses), inside CUDA graphs too."""

import pytest
import torch
import torch.nn.functional as F

from minfer import ops
from minfer.errors import DeviceError
from tests.conftest import requires_cuda

pytestmark = pytest.mark.memcheck  # scripts/device_check.sh: compute-sanitizer memcheck runs this file

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def test_cpu_path_is_torch_embedding():
    table = torch.randn(50, 12)
    tokens = torch.tensor([[3, 0, 49], [7, 7, 1]])
    assert torch.equal(ops.embedding(table, tokens), F.embedding(tokens, table))


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("where", ["host", "gpu"])
@pytest.mark.parametrize("vocab, dim", [(32000, 4096), (1999, 256), (37, 7), (5, 1)])
def test_rows_copied_exactly(vocab, dim, where, dtype):
    """dim 7 and 1 give rows that are not whole 16-byte vectors (the 2-byte path)."""
    table = torch.randn(vocab, dim).to(dtype)
    table = table.pin_memory() if where == "host" else table.cuda()
    tokens = torch.randint(0, vocab, (3, 5), device="cuda")
    tokens[0, 0], tokens[0, 1] = 0, vocab - 1
    out = ops.embedding(table, tokens)
    assert out.shape == (3, 5, dim) and out.device.type == "cuda"
    assert torch.equal(out, ops.embedding_reference(table, tokens))


@requires_cuda
@pytest.mark.parametrize("where", ["host", "gpu"])
def test_table_not_16_byte_aligned(where):
    """A table view 2 bytes past an aligned start takes the 2-byte path, though its rows are whole vectors."""
    storage = torch.randn(100 * 64 + 1).to(torch.float16)
    storage = storage.pin_memory() if where == "host" else storage.cuda()
    table = storage[1:].view(100, 64)
    tokens = torch.tensor([0, 99, 42], device="cuda")
    assert torch.equal(ops.embedding(table, tokens), ops.embedding_reference(table, tokens))


@requires_cuda
def test_host_table_in_a_cuda_graph_reads_new_tokens():
    table = torch.randn(1000, 64, dtype=torch.float16).pin_memory()
    tokens = torch.zeros(1, 1, dtype=torch.int64, device="cuda")
    out = torch.empty(1, 1, 64, dtype=torch.float16, device="cuda")
    ops.embedding(table, tokens, out=out)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.embedding(table, tokens, out=out)
    for token in (5, 999, 0):
        tokens.fill_(token)
        graph.replay()
        assert torch.equal(out.view(-1).cpu(), table[token])


@requires_cuda
@pytest.mark.memcheck_skip
def test_opcheck():
    table = torch.randn(40, 24, dtype=torch.float16)
    tokens = torch.tensor([1, 39, 0], device="cuda")
    out = torch.empty(3, 24, dtype=torch.float16, device="cuda")
    # opcheck copies its inputs, and a copy of a pinned tensor is pageable (which the op refuses):
    # the pinned table is covered by the tests above.
    torch.library.opcheck(torch.ops.minfer.embedding, (table.cuda(), tokens, out))


@requires_cuda
def test_bad_arguments_are_refused():
    tokens = torch.tensor([1, 2], device="cuda")
    with pytest.raises(RuntimeError, match="pinned host memory"):
        ops.embedding(torch.randn(10, 8, dtype=torch.float16), tokens)  # pageable host memory
    with pytest.raises(RuntimeError, match="int64"):
        ops.embedding(torch.randn(10, 8, device="cuda"), tokens.int())
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        ops.embedding(torch.ones(10, 7, dtype=torch.uint8, device="cuda"), tokens)
    with ops.backend("torch"), pytest.raises(DeviceError, match="host memory"):
        ops.embedding(torch.randn(10, 8).pin_memory(), tokens)
