"""Decode attention (split-K flash-decoding, GQA) against float64 SDPA: odd live lengths, every
split count and ring depth, strided q, CUDA-graph replay with the position advancing, and opcheck."""

import math

import pytest
import torch
import torch.nn.functional as F

from minfer import ops
from minfer.errors import MinferError
from minfer.ops import attention as attention_ops
from tests.conftest import requires_cuda
from tests.numerics import rel_error

pytestmark = pytest.mark.memcheck  # scripts/device_check.sh: compute-sanitizer memcheck runs this file

DTYPES = [torch.float16, torch.bfloat16]
TOLERANCE = {torch.float16: 3e-3, torch.bfloat16: 2e-2}  # P is rounded to the dtype for the P V product
# (B, Hq, Hkv, D, max_seq_len): Llama-3-8B, Llama-2-7B (MHA), odd group size 3 with D 64, group 16.
SHAPES = [(1, 32, 8, 128, 4100), (1, 32, 32, 128, 2048), (2, 12, 4, 64, 600), (1, 16, 1, 64, 300)]
LIVE = [1, 17, 1000, 4097]


def attention64(q, k_cache, v_cache, live: int, scale: float) -> torch.Tensor:
    k = k_cache[:, :, :live].double().cpu()
    v = v_cache[:, :, :live].double().cpu()
    out = F.scaled_dot_product_attention(q[:, :, None].double().cpu(), k, v, scale=scale, enable_gqa=True)
    return out[:, :, 0]


def problem(batch, q_heads, kv_heads, head_dim, max_seq_len, live, dtype, device="cuda", q_scale=1.0):
    """Random q and caches whose positions past `live` hold NaN, so reading them fails the test."""
    q = (torch.randn(batch, q_heads, head_dim, device=device) * q_scale).to(dtype)
    shape = (batch, kv_heads, max_seq_len, head_dim)
    k_cache = torch.randn(shape, device=device).to(dtype)
    v_cache = torch.randn(shape, device=device).to(dtype)
    k_cache[:, :, live:] = float("nan")
    v_cache[:, :, live:] = float("nan")
    pos = torch.tensor([live - 1], device=device)
    return q, k_cache, v_cache, pos


def run_kernel(q, k_cache, v_cache, pos, scale, num_splits=None):
    batch, q_heads, head_dim = q.shape
    workspace = ops.decode_attention_workspace(batch, q_heads, k_cache.shape[1], head_dim, k_cache.shape[2],
                                               q.device, num_splits=num_splits)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    ops.decode_attention(q, k_cache, v_cache, pos, scale, out=out, workspace=workspace)
    return out, workspace


def counters_at_rest(workspace: torch.Tensor, batch: int, kv_heads: int) -> bool:
    counters = workspace[: attention_ops._decode_attention_counter_floats(batch, kv_heads)].view(torch.int32)
    return bool((counters == 0).all())


def test_reference_matches_sdpa_and_ignores_dead_positions():
    q, k_cache, v_cache, pos = problem(2, 6, 2, 16, 40, 23, torch.float32, device="cpu")
    out = ops.decode_attention(q, k_cache, v_cache, pos, 0.25)
    assert rel_error(out, attention64(q, k_cache, v_cache, 23, 0.25)) < 1e-6


def test_workspace_of_the_wrong_size_is_refused():
    workspace = torch.zeros(100)
    with pytest.raises(MinferError, match="decode_attention_workspace"):
        attention_ops._decode_attention_workspace_splits(workspace, 1, 32, 8, 128)
    with pytest.raises(MinferError, match="num_splits"):
        ops.decode_attention_workspace(1, 32, 8, 128, 4096, "cpu", num_splits=0)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("live", LIVE)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.memcheck_skip
def test_matches_float64_sdpa(shape, live, dtype):
    batch, q_heads, kv_heads, head_dim, max_seq_len = shape
    live = min(live, max_seq_len)
    q, k_cache, v_cache, pos = problem(batch, q_heads, kv_heads, head_dim, max_seq_len, live, dtype)
    scale = 1 / math.sqrt(head_dim)
    out, workspace = run_kernel(q, k_cache, v_cache, pos, scale)
    assert not out.isnan().any(), "some outputs were never written (or dead positions were read)"
    assert rel_error(out, attention64(q, k_cache, v_cache, live, scale)) < TOLERANCE[dtype]
    assert counters_at_rest(workspace, batch, kv_heads)


@requires_cuda
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 64, 256])
@pytest.mark.parametrize("live", [1, 100, 3001])
def test_every_split_count(num_splits, live):
    """More splits than live rounds leaves blocks idle; fewer makes long shares; sharp softmax."""
    q, k_cache, v_cache, pos = problem(1, 8, 2, 128, 3001, live, torch.float16, q_scale=4.0)
    out, workspace = run_kernel(q, k_cache, v_cache, pos, 0.125, num_splits=num_splits)
    assert rel_error(out, attention64(q, k_cache, v_cache, live, 0.125)) < TOLERANCE[torch.float16]
    assert counters_at_rest(workspace, 1, 2)


@requires_cuda
@pytest.mark.parametrize("head_dim, stages", [pytest.param(head_dim, stages, marks=pytest.mark.racecheck)
                                              if (head_dim, stages) == (128, 2) else (head_dim, stages)
                                              for stages in (2, 3, 4, 7) for head_dim in (64, 128)])
def test_every_ring_depth(head_dim, stages):
    """The shared-memory ring's depth is a launch knob; each depth must give the same attention."""
    live = 2500
    q, k_cache, v_cache, pos = problem(1, 8, 2, head_dim, 2600, live, torch.bfloat16)
    workspace = ops.decode_attention_workspace(1, 8, 2, head_dim, 2600, "cuda", num_splits=5)
    out = torch.full_like(q, float("nan"))
    torch.ops.minfer.decode_attention_tuned(q, k_cache, v_cache, pos, 0.125, out, workspace, 5, stages)
    assert rel_error(out, attention64(q, k_cache, v_cache, live, 0.125)) < TOLERANCE[torch.bfloat16]


@requires_cuda
def test_strided_q_and_float32_reference_path():
    batch, q_heads, kv_heads, head_dim, live = 2, 8, 4, 64, 333
    _, k_cache, v_cache, pos = problem(batch, q_heads, kv_heads, head_dim, 400, live, torch.float16)
    q = torch.randn(batch, 1, q_heads + 2 * kv_heads, head_dim, device="cuda").half()[:, 0, :q_heads]
    out, _ = run_kernel(q, k_cache, v_cache, pos, 0.125)
    assert rel_error(out, attention64(q, k_cache, v_cache, live, 0.125)) < TOLERANCE[torch.float16]
    out32 = ops.decode_attention(q.float(), k_cache.float(), v_cache.float(), pos, 0.125)
    assert rel_error(out32, attention64(q, k_cache, v_cache, live, 0.125)) < 1e-5


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_graph_replay_as_the_context_grows(dtype):
    batch, q_heads, kv_heads, head_dim, max_seq_len = 1, 32, 8, 128, 5000
    q, k_cache, v_cache, pos = problem(batch, q_heads, kv_heads, head_dim, max_seq_len, max_seq_len, dtype)
    workspace = ops.decode_attention_workspace(batch, q_heads, kv_heads, head_dim, max_seq_len, "cuda")
    out = torch.empty_like(q)
    pos.fill_(100)
    ops.decode_attention(q, k_cache, v_cache, pos, 0.1, out=out, workspace=workspace)  # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.decode_attention(q, k_cache, v_cache, pos, 0.1, out=out, workspace=workspace)
    for live in (1, 17, 1000, 4097, 5000):
        pos.fill_(live - 1)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_error(out, attention64(q, k_cache, v_cache, live, 0.1)) < TOLERANCE[dtype]
    assert counters_at_rest(workspace, batch, kv_heads)


@requires_cuda
def test_other_head_dims_run_the_reference_and_large_groups_are_refused():
    q, k_cache, v_cache, pos = problem(1, 4, 2, 96, 64, 10, torch.float16)
    out = ops.decode_attention(q, k_cache, v_cache, pos, 0.1)
    assert rel_error(out, attention64(q, k_cache, v_cache, 10, 0.1)) < TOLERANCE[torch.float16]
    q, k_cache, v_cache, pos = problem(1, 34, 2, 64, 64, 10, torch.float16)
    with pytest.raises(MinferError, match="1..16 query heads"):
        ops.decode_attention(q, k_cache, v_cache, pos, 0.1)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.memcheck_skip
def test_opcheck(dtype):
    q = torch.randn(2, 8, 128, device="cuda").to(dtype)
    k_cache = torch.randn(2, 2, 700, 128, device="cuda").to(dtype)
    v_cache = torch.randn_like(k_cache)
    pos = torch.tensor([650], device="cuda")
    workspace = ops.decode_attention_workspace(2, 8, 2, 128, 700, "cuda", num_splits=5)
    out = torch.empty_like(q)
    torch.library.opcheck(torch.ops.minfer.decode_attention.default,
                          (q, k_cache, v_cache, pos, 0.1, out, workspace, 5))
    torch.library.opcheck(torch.ops.minfer.decode_attention_tuned.default,
                          (q, k_cache, v_cache, pos, 0.1, out, workspace, 5, 3))


@requires_cuda
@pytest.mark.parametrize("head_dim", [64, pytest.param(128, marks=pytest.mark.racecheck)])
def test_newest_row_from_the_kernel_right_before(head_dim):
    """The kernel reads the cache rows before input_pos ahead of griddepcontrol.wait and only the
    newest row, which rope_write_kv writes just before it, after. Each replay first NaNs the
    newest row with a plain torch op, then rope_write_kv rewrites it: reading it early fails."""
    batch, q_heads, kv_heads, max_seq_len = 1, 32, 8, 1200
    q, k_cache, v_cache, pos = problem(batch, q_heads, kv_heads, head_dim, max_seq_len, max_seq_len, torch.float16)
    qkv = torch.randn(batch, 1, q_heads + 2 * kv_heads, head_dim, device="cuda").half()
    q_new, k_new, v_new = qkv.split([q_heads, kv_heads, kv_heads], dim=2)
    cos = torch.ones(max_seq_len, head_dim // 2, device="cuda")  # RoPE as the identity: k_new lands as it is
    sin = torch.zeros(max_seq_len, head_dim // 2, device="cuda")
    workspace = ops.decode_attention_workspace(batch, q_heads, kv_heads, head_dim, max_seq_len, "cuda")
    out = torch.empty_like(q)

    def step():
        k_cache.index_fill_(2, pos, float("nan"))
        v_cache.index_fill_(2, pos, float("nan"))
        ops.rope_write_kv(q_new, k_new, v_new, cos, sin, pos, k_cache, v_cache)
        ops.decode_attention(q_new[:, 0], k_cache, v_cache, pos, 0.1, out=out, workspace=workspace)

    pos.fill_(0)
    step()  # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for live in (1, 16, 17, 63, 64, 65, 300, 777, 1200):  # the newest row at every offset in a step and round
        pos.fill_(live - 1)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        expected = attention64(q_new[:, 0], k_cache, v_cache, live, 0.1)
        assert rel_error(out, expected) < TOLERANCE[torch.float16], live
    assert counters_at_rest(workspace, batch, kv_heads)
