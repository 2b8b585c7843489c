"""RoPE fused with the KV-cache write: against an HF-formula float64 oracle, strided q/k/v views,
CUDA-graph replay with moving positions, and opcheck."""

import pytest
import torch

from minfer import ops
from tests.conftest import requires_cuda
from tests.numerics import rel_error

pytestmark = pytest.mark.memcheck  # scripts/device_check.sh: compute-sanitizer memcheck runs this file

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}
# (B, T, Hq, Hkv, D, S): Llama-3 decode, Llama-2 (MHA) prefill, odd head counts with D/2 odd.
CASES = [(1, 1, 32, 8, 128, 64), (2, 7, 4, 4, 64, 33), (3, 5, 6, 2, 10, 19)]


def tables(max_seq_len: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(max_seq_len, dtype=torch.float64)[:, None] * inv_freq
    return angles.cos().float().to(device), angles.sin().float().to(device)


def rope64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """HF apply_rotary_pos_emb: x * cos + rotate_half(x) * sin with the half tables repeated."""
    c = torch.cat((cos, cos), dim=-1)[positions].double()[:, None, :]
    s = torch.cat((sin, sin), dim=-1)[positions].double()[:, None, :]
    x = x.double()
    x1, x2 = x.chunk(2, dim=-1)
    return x * c + torch.cat((-x2, x1), dim=-1) * s


def fused_qkv(batch, tokens, q_heads, kv_heads, head_dim, dtype, device):
    """q, k, v as strided views of one fused projection output, as the model produces them."""
    qkv = torch.randn(batch, tokens, (q_heads + 2 * kv_heads) * head_dim, device=device).to(dtype)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    shape = (batch, tokens, -1, head_dim)
    return q.view(shape), k.view(shape), v.view(shape)


def nan_caches(batch, kv_heads, max_seq_len, head_dim, dtype, device):
    shape = (batch, kv_heads, max_seq_len, head_dim)
    return (torch.full(shape, float("nan"), dtype=dtype, device=device),
            torch.full(shape, float("nan"), dtype=dtype, device=device))


def check(q_before, k, v, q, k_cache, v_cache, cos, sin, positions, dtype):
    tol = TOLERANCE[dtype]
    assert rel_error(q, rope64(q_before, cos, sin, positions)) < tol
    written = k_cache[:, :, positions].transpose(1, 2)
    assert not written.isnan().any()
    assert rel_error(written, rope64(k, cos, sin, positions)) < tol
    assert torch.equal(v_cache[:, :, positions].transpose(1, 2), v)
    untouched = torch.ones(k_cache.shape[2], dtype=torch.bool, device=k_cache.device)
    untouched[positions] = False
    assert k_cache[:, :, untouched].isnan().all() and v_cache[:, :, untouched].isnan().all()


def test_reference_matches_hf_apply_rotary_pos_emb():
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama")
    batch, tokens, heads, head_dim = 2, 5, 3, 16
    cos, sin = tables(32, head_dim, "cpu")
    positions = torch.tensor([3, 4, 9, 10, 31])
    q, k, v = fused_qkv(batch, tokens, heads, heads, head_dim, torch.float32, "cpu")
    k_cache, v_cache = nan_caches(batch, heads, 32, head_dim, torch.float32, "cpu")
    full_cos = torch.cat((cos, cos), dim=-1)[positions][None]  # [1, T, D]
    full_sin = torch.cat((sin, sin), dim=-1)[positions][None]
    hf_q, hf_k = modeling.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), full_cos, full_sin)
    ops.rope_write_kv_reference(q, k, v, cos, sin, positions, k_cache, v_cache)
    torch.testing.assert_close(q, hf_q.transpose(1, 2))
    torch.testing.assert_close(k_cache[:, :, positions], hf_k)


def test_cpu_wrapper_uses_the_reference():
    cos, sin = tables(16, 8, "cpu")
    q, k, v = fused_qkv(1, 3, 2, 1, 8, torch.float32, "cpu")
    q_before = q.clone()
    k_cache, v_cache = nan_caches(1, 1, 16, 8, torch.float32, "cpu")
    positions = torch.tensor([0, 7, 15])
    ops.rope_write_kv(q, k, v, cos, sin, positions, k_cache, v_cache)
    check(q_before, k, v, q, k_cache, v_cache, cos, sin, positions, torch.float32)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_rope_write_kv_matches_float64(case, dtype):
    batch, tokens, q_heads, kv_heads, head_dim, max_seq_len = case
    cos, sin = tables(max_seq_len + 3, head_dim, "cuda")  # tables may be longer than the cache
    q, k, v = fused_qkv(batch, tokens, q_heads, kv_heads, head_dim, dtype, "cuda")
    q_before, k_before = q.clone(), k.clone()
    k_cache, v_cache = nan_caches(batch, kv_heads, max_seq_len, head_dim, dtype, "cuda")
    positions = torch.randperm(max_seq_len, device="cuda")[:tokens]
    ops.rope_write_kv(q, k, v, cos, sin, positions, k_cache, v_cache)
    assert torch.equal(k, k_before), "k itself stays unrotated"
    check(q_before, k, v, q, k_cache, v_cache, cos, sin, positions, dtype)


@requires_cuda
def test_positions_outside_the_cache_are_skipped():
    cos, sin = tables(16, 8, "cuda")
    q, k, v = fused_qkv(1, 2, 2, 1, 8, torch.float16, "cuda")
    q_before = q.clone()
    k_cache, v_cache = nan_caches(1, 1, 8, 8, torch.float16, "cuda")
    torch.ops.minfer.rope_write_kv(q, k, v, cos, sin, torch.tensor([8, -1], device="cuda"), k_cache, v_cache)
    assert torch.equal(q, q_before)
    assert k_cache.isnan().all() and v_cache.isnan().all()


@requires_cuda
def test_cuda_graph_replay_follows_the_position():
    batch, q_heads, kv_heads, head_dim, max_seq_len = 1, 8, 2, 64, 40
    dtype = torch.float16
    cos, sin = tables(max_seq_len, head_dim, "cuda")
    q, k, v = fused_qkv(batch, 1, q_heads, kv_heads, head_dim, dtype, "cuda")
    k_cache, v_cache = nan_caches(batch, kv_heads, max_seq_len, head_dim, dtype, "cuda")
    position = torch.zeros(1, dtype=torch.int64, device="cuda")
    source = q.clone()

    def step():
        q.copy_(source)
        ops.rope_write_kv(q, k, v, cos, sin, position, k_cache, v_cache)

    step()  # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for pos in (3, 17, 39):
        position.fill_(pos)
        graph.replay()
        torch.cuda.synchronize()
        expected = rope64(source, cos, sin, position)
        assert rel_error(q, expected) < TOLERANCE[dtype]
        assert rel_error(k_cache[:, :, pos], rope64(k, cos, sin, position)[:, 0]) < TOLERANCE[dtype]


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.memcheck_skip
def test_opcheck(dtype):
    cos, sin = tables(24, 64, "cuda")
    q, k, v = (t.contiguous() for t in fused_qkv(2, 3, 4, 2, 64, dtype, "cuda"))
    k_cache = torch.zeros(2, 2, 24, 64, dtype=dtype, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    positions = torch.tensor([5, 6, 7], device="cuda")
    torch.library.opcheck(torch.ops.minfer.rope_write_kv.default, (q, k, v, cos, sin, positions, k_cache, v_cache))
