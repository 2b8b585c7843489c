"""Greedy argmax over logits: the single-pass kernel against torch.argmax on float64 (first index on ties)."""

import pytest
import torch

from minfer import ops
from minfer.errors import FormatError
from tests.conftest import requires_cuda

pytestmark = pytest.mark.memcheck  # scripts/device_check.sh: compute-sanitizer memcheck runs this file

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
@pytest.mark.racecheck
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


@pytest.mark.memcheck_skip
@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_argmax_opcheck(dtype):
    logits = torch.randn(3, 1000, device="cuda").to(dtype)
    out = torch.empty(3, dtype=torch.int64, device="cuda")
    torch.library.opcheck(torch.ops.minfer.argmax.default, (logits, out))


def test_cpu_token_handoff():
    """On the CPU the hand-off runs as torch ops: host_tokens[position + 1] = token, position += 1."""
    logits = torch.randn(1, 50)
    position, host, token = torch.tensor([4]), torch.full((8,), -1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    ops.argmax(logits, out=token, position=position, host_tokens=host)
    assert int(position) == 5 and int(host[5]) == int(torch.argmax(logits)) == int(token)
    assert (host[:5] == -1).all() and (host[6:] == -1).all()


def test_handoff_arguments_go_together():
    with pytest.raises(FormatError, match="go together"):
        ops.argmax(torch.randn(1, 5), position=torch.tensor([0]))


@requires_cuda
def test_token_handoff_in_cuda_graph():
    """A graph whose argmax hands its token to pinned host memory: each replay writes the slot after
    the current position and advances it; past the buffer's end nothing is written."""
    vocab, capacity = 32000, 6
    logits = torch.randn(1, vocab, device="cuda", dtype=torch.float16)
    token = torch.zeros(1, dtype=torch.int64, device="cuda")
    position = torch.tensor([1], device="cuda")
    host = torch.full((capacity,), -1, dtype=torch.int64, pin_memory=True)
    ops.argmax(logits, out=token, position=position, host_tokens=host)  # warm-up: slot 2, position 2
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.argmax(logits, out=token, position=position, host_tokens=host)
    expected = {2: int(torch.argmax(logits.float()))}
    for _ in range(5):  # slots 3, 4, 5, then positions 5 and 6 would write past the end
        logits.copy_(torch.randn_like(logits))
        graph.replay()
        torch.cuda.synchronize()
        slot = int(position)
        if slot < capacity:
            expected[slot] = int(torch.argmax(logits.float()))
        assert int(token) == int(torch.argmax(logits.float()))
    assert int(position) == 7
    assert host.tolist() == [-1, -1] + [expected[s] for s in range(2, capacity)]


@requires_cuda
def test_token_handoff_rejects_bad_buffers():
    logits = torch.randn(2, 100, device="cuda")
    position = torch.tensor([0], device="cuda")
    with pytest.raises(RuntimeError, match="pinned host memory"):
        ops.argmax(logits[:1], position=position, host_tokens=torch.zeros(4, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="one row"):
        ops.argmax(logits, position=position, host_tokens=torch.zeros(4, dtype=torch.int64, pin_memory=True))
