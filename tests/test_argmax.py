"""Greedy argmax over logits: the single-pass kernel against torch.argmax on float64 (first index on ties)."""

import pytest
import torch

from minfer import ops
from tests.conftest import requires_cuda

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# (B, V): the Llama-2 / Llama-3 vocabularies, and odd V whose rows are not 16-byte aligned.
SHAPES = [(1, 32000), (1, 128256), (4, 50257), (3, 1001), (2, 7)]


def run_argmax(logits: torch.Tensor) -> torch.Tensor:
    out = torch.full(logits.shape[:-1], -1, dtype=torch.int64, device=logits.device)
    return ops.argmax(logits, out=out)


def test_cpu_path_matches_torch():
    logits = torch.randn(2, 3, 100)
    assert torch.equal(ops.argmax(logits), torch.argmax(logits, dim=-1))


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("b,v", SHAPES)
def test_argmax_random_logits(b, v, dtype):
    logits = (torch.randn(b, v, device="cuda") * 4).to(dtype)
    expected = torch.argmax(logits.cpu().double(), dim=-1)
    assert torch.equal(run_argmax(logits).cpu(), expected)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("b,v", SHAPES)
def test_argmax_ties_pick_the_first(b, v, dtype):
    logits = torch.randint(0, 3, (b, v), device="cuda").to(dtype)
    expected = torch.argmax(logits.cpu().double(), dim=-1)
    assert torch.equal(run_argmax(logits).cpu(), expected)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_argmax_special_values(dtype):
    v = 32003
    logits = torch.randn(4, v, device="cuda").to(dtype)
    logits[0, -1] = 100.0  # the maximum in the scalar tail
    logits[1, [900, 17, 30000]] = float("nan")  # the first NaN wins, as in torch.argmax
    logits[2] = float("-inf")  # nothing beats -inf: index 0
    logits[3, 5] = float("inf")
    logits[3, 6] = float("inf")
    assert run_argmax(logits).tolist() == [v - 1, 17, 0, 5]


@requires_cuda
def test_argmax_in_cuda_graph():
    logits = torch.randn(2, 32000, device="cuda", dtype=torch.float16)
    out = torch.empty(2, dtype=torch.int64, device="cuda")
    ops.argmax(logits, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.argmax(logits, out=out)
    for _ in range(3):
        logits.copy_(torch.randn_like(logits))
        out.fill_(-1)
        graph.replay()
        assert torch.equal(out, torch.argmax(logits, dim=-1))


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_argmax_opcheck(dtype):
    logits = torch.randn(3, 1000, device="cuda").to(dtype)
    out = torch.empty(3, dtype=torch.int64, device="cuda")
    torch.library.opcheck(torch.ops.minfer.argmax.default, (logits, out))
