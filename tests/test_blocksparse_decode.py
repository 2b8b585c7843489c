"""Block-sparse decode: the layout's decode form (union per KV group, head bits), the references against a
float64 oracle built from the prefill mask (decode at position p attends as prefill row p does), and the
split-K kernel over the kept tiles, listed or (sink-window) computed from the position: every named layout
at odd lengths, GQA and MHA, heads of a group with different tiles, a query with no kept tile, every split
count, the newest row written by the kernel right before, CUDA-graph replay as the position advances, and
opcheck."""

import dataclasses
import math

import pytest
import torch

from minfer import ops
from minfer.attention import attention_class
from minfer.attention.layouts import KERNEL_TILE, build_layout, compact, decode_layout, parse_layout
from minfer.errors import MinferError
from minfer.kv_cache import KVCache
from tests.conftest import requires_cuda
from tests.numerics import rel_error
from tests.test_blocksparse_attention import BACKEND_CONFIG, random_cache
from tests.test_decode_attention import counters_at_rest

NAMED = ["dense", "sink-window:sink=70,window=130", "strided:local=100,stride=128",
         "bigbird:window=90,global=64,random=2,seed=3"]
TOLERANCE = {torch.float16: 3e-3, torch.bfloat16: 2e-2}


def layout_for(name: str, q_heads: int, kv_heads: int, max_seq_len: int, block_size: int = 64, device="cpu"):
    """(prefill compact form, decode form) of a named layout over the whole cache."""
    packed = compact(build_layout(name, q_heads, max_seq_len, block_size), max_seq_len, block_size)
    return packed, decode_layout(packed, kv_heads, parse_layout(name)).to(device)


def kept_positions(packed, q_heads: int, position: int) -> torch.Tensor:
    """[Hq, S] keys query `position` sees in prefill: row `position` of the layout's token mask
    (ops.blocksparse_token_mask, built here for that row only)."""
    keys = torch.arange(packed.seq_len)
    row = packed.tile_layout()[:, position // KERNEL_TILE, keys // KERNEL_TILE] & (keys <= position)
    return row.expand(q_heads, -1)


def oracle64(q, k_cache, v_cache, kept: torch.Tensor, scale: float) -> torch.Tensor:
    """Float64 softmax attention of q [B, Hq, D] over the kept positions [Hq, S]; zeros where none."""
    group = q.shape[1] // k_cache.shape[1]
    k = k_cache.double().cpu().repeat_interleave(group, dim=1)
    v = v_cache.double().cpu().repeat_interleave(group, dim=1)
    kept = kept.cpu()
    scores = torch.einsum("bhd,bhsd->bhs", q.double().cpu(), torch.where(kept[None, :, :, None], k, 0.0)) * scale
    weights = scores.masked_fill(~kept[None], float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.einsum("bhs,bhsd->bhd", weights, torch.where(kept[None, :, :, None], v, 0.0))


def run(q, k_cache, v_cache, position, scale, layout, workspace=None, out=None, listed=False):
    pos = torch.tensor([position], device=q.device)
    return layout.attend(q, k_cache, v_cache, pos, scale, out, workspace, listed)


# ---- the decode form and the reference (CPU) ----


def test_decode_tile_is_the_layout_tile_and_the_oracle_row_is_the_token_mask_row():
    assert ops.DECODE_ATTENTION_KEY_TILE == KERNEL_TILE
    packed = compact(build_layout("bigbird:window=64,global=64,random=2,seed=1", 4, 300, 64), 300, 64)
    mask = ops.blocksparse_token_mask(packed.tile_ptr, packed.key_tiles, packed.heads, packed.seq_len)
    for position in (0, 64, 130, 299):
        assert torch.equal(kept_positions(packed, 4, position), mask[:, position])


def test_per_head_layout_becomes_the_group_union_with_head_bits():
    q_heads, kv_heads, seq_len = 8, 2, 700
    packed, layout = layout_for("bigbird:window=64,global=0,random=3,seed=5", q_heads, kv_heads, seq_len)
    assert layout.groups == kv_heads
    tiles = packed.tile_layout().view(kv_heads, 4, packed.q_tiles, packed.q_tiles)
    rebuilt = torch.zeros_like(tiles)
    for g in range(kv_heads):
        for i in range(packed.q_tiles):
            lo, hi = layout.tile_ptr[g * packed.q_tiles + i], layout.tile_ptr[g * packed.q_tiles + i + 1]
            keys = layout.key_tiles[lo:hi].long()
            assert torch.equal(keys, keys.sort().values)
            for j in range(4):
                rebuilt[g, j, i, keys] = ((layout.head_bits[lo:hi] >> j) & 1).bool()
    assert torch.equal(rebuilt, tiles)
    shared = layout_for("sink-window:sink=64,window=64", q_heads, kv_heads, seq_len)[1]
    assert shared.groups == 1 and torch.all(shared.head_bits == -1) and shared.sink_window == (64, 64, 64)
    assert layout_for("strided:local=64,stride=128", q_heads, kv_heads, seq_len)[1].sink_window is None


@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("sink, window", [(0, 1), (70, 130), (64, 64), (300, 10), (1, 2000), (128, 2048)])
def test_sink_window_from_the_position_is_the_listed_layout(sink, window, block_size):
    max_seq_len = 1111
    name = f"sink-window:sink={sink},window={window}"
    layout = layout_for(name, 4, 2, max_seq_len, block_size)[1]
    q = torch.randn(1, 4, 8, dtype=torch.float64)
    k_cache = torch.randn(1, 2, max_seq_len, 8, dtype=torch.float64)
    v_cache = torch.randn_like(k_cache)
    for position in range(0, max_seq_len, 37):
        computed = run(q, k_cache, v_cache, position, 0.5, layout)
        listed = run(q, k_cache, v_cache, position, 0.5, layout, listed=True)
        assert torch.equal(computed, listed) or rel_error(computed, listed) < 1e-14, position


def test_sink_window_decode_refuses_a_bad_block():
    q = torch.randn(1, 4, 8)
    cache = torch.randn(1, 2, 100, 8)
    with pytest.raises(MinferError, match="multiple of 64"):
        ops.sink_window_decode_attention(q, cache, cache, torch.tensor([5]), 0.1, 0, 64, 100)


@pytest.mark.parametrize("name", NAMED)
@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa"])
def test_reference_is_the_prefill_row(name, block_size, heads):
    q_heads, kv_heads = heads
    max_seq_len = 333
    packed, layout = layout_for(name, q_heads, kv_heads, max_seq_len, block_size)
    torch.manual_seed(block_size + q_heads)
    q = torch.randn(2, q_heads, 16, dtype=torch.float64)
    k_cache = torch.randn(2, kv_heads, max_seq_len, 16, dtype=torch.float64)
    v_cache = torch.randn_like(k_cache)
    for position in (0, 63, 64, 200, 332):
        out = run(q, k_cache, v_cache, position, 0.3, layout)
        expected = oracle64(q, k_cache, v_cache, kept_positions(packed, q_heads, position), 0.3)
        assert rel_error(out, expected) < 1e-12, position


def test_a_query_with_no_kept_tile_gives_zeros():
    max_seq_len = 300
    tiles = build_layout("sink-window:sink=0,window=64", 4, max_seq_len, 64).expand(4, -1, -1).clone()
    tiles[1, 3] = False  # head 1 keeps nothing in query tile 3; its group mate head 0 does
    tiles[2:, 2] = False  # the second group keeps nothing in query tile 2
    layout = decode_layout(compact(tiles, max_seq_len, 64), 2)
    q = torch.randn(1, 4, 16, dtype=torch.float64)
    k_cache = torch.randn(1, 2, max_seq_len, 16, dtype=torch.float64)
    v_cache = torch.randn_like(k_cache)
    out = run(q, k_cache, v_cache, 200, 0.25, layout)
    assert torch.all(out[:, 1] == 0) and torch.all(out[:, 0] != 0)
    out = run(q, k_cache, v_cache, 150, 0.25, layout)
    assert torch.all(out[:, 2:] == 0) and not out.isnan().any()


def test_a_layout_for_another_cache_is_refused():
    layout = layout_for("dense", 4, 2, 200)[1]
    q = torch.randn(1, 4, 16)
    cache = torch.randn(1, 2, 300, 16)
    with pytest.raises(MinferError, match="build it for them"):
        run(q, cache, cache, 10, 0.1, layout)


def test_backend_decode_follows_the_layout():
    cfg = BACKEND_CONFIG
    name = "sink-window:sink=64,window=64"
    backend = attention_class("blocksparse").create(cfg, 1, 300, torch.float64, torch.device("cpu"), layout=name)
    cache = random_cache(300, 5)
    q = torch.randn(1, 1, cfg.num_heads, cfg.head_dim, dtype=torch.float64)
    packed = compact(build_layout(name, cfg.num_heads, 300, 64), 300, 64)
    for position in (3, 250):
        with backend.forward_pass(torch.tensor([position]), 1, 256) as step:
            out = backend.decode(q, cache, step)
        expected = oracle64(q[:, 0], cache.k_cache, cache.v_cache, kept_positions(packed, cfg.num_heads, position),
                            backend.scale)
        assert rel_error(out[:, 0], expected) < 1e-12


# ---- the CUDA kernel ----


def gpu_problem(batch, q_heads, kv_heads, head_dim, max_seq_len, position, dtype, packed, seed=0):
    """Random q and caches where positions no head of a group keeps for this query (and those past it)
    hold NaN, so reading one fails the test; kept ones are finite."""
    torch.manual_seed(seed)
    q = torch.randn(batch, q_heads, head_dim, device="cuda").to(dtype)
    k_cache = torch.randn(batch, kv_heads, max_seq_len, head_dim, device="cuda").to(dtype)
    v_cache = torch.randn_like(k_cache)
    kept = kept_positions(packed, q_heads, position)
    group_kept = kept.view(kv_heads, -1, max_seq_len).any(1).to("cuda")
    k_cache.masked_fill_(~group_kept[None, :, :, None], float("nan"))
    v_cache.masked_fill_(~group_kept[None, :, :, None], float("nan"))
    return q, k_cache, v_cache, kept


GPU_SHAPES = [(1, 32, 8, 128, 4100), (1, 32, 32, 128, 1500), (2, 12, 4, 64, 600)]


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("name", NAMED)
def test_kernel_matches_float64_oracle(name, shape, dtype):
    batch, q_heads, kv_heads, head_dim, max_seq_len = shape
    packed, layout = layout_for(name, q_heads, kv_heads, max_seq_len, 128, "cuda")
    workspace = ops.decode_attention_workspace(batch, q_heads, kv_heads, head_dim, layout.most_kept_positions,
                                               "cuda")
    for position in (17, 128, max_seq_len // 2 + 1, max_seq_len - 1):
        q, k_cache, v_cache, kept = gpu_problem(batch, q_heads, kv_heads, head_dim, max_seq_len, position, dtype,
                                                packed, seed=position)
        expected = oracle64(q, k_cache, v_cache, kept, 1 / math.sqrt(head_dim))
        for listed in (False, True) if layout.sink_window else (False,):
            out = torch.full_like(q, float("nan"))
            run(q, k_cache, v_cache, position, 1 / math.sqrt(head_dim), layout, workspace, out, listed)
            assert not out.isnan().any(), (position, listed)
            assert rel_error(out, expected) < TOLERANCE[dtype], (position, listed)
            assert counters_at_rest(workspace, batch, kv_heads)


@requires_cuda
@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("sink, window", [(0, 1), (70, 130), (300, 10), (128, 2048)])
def test_kernel_sink_window_from_the_position_at_every_offset(sink, window, block_size):
    max_seq_len = 2600
    packed, layout = layout_for(f"sink-window:sink={sink},window={window}", 8, 2, max_seq_len, block_size, "cuda")
    workspace = ops.decode_attention_workspace(1, 8, 2, 128, layout.most_kept_positions, "cuda")
    for position in (0, 13, 63, 64, 127, 128, 200, 1023, 1024, 2047, 2048, 2599):
        q, k_cache, v_cache, kept = gpu_problem(1, 8, 2, 128, max_seq_len, position, torch.float16, packed)
        out = run(q, k_cache, v_cache, position, 0.125, layout, workspace)
        assert rel_error(out, oracle64(q, k_cache, v_cache, kept, 0.125)) < TOLERANCE[torch.float16], position


@requires_cuda
@pytest.mark.memcheck
@pytest.mark.racecheck
def test_kernel_gives_zeros_where_nothing_is_kept():
    max_seq_len = 300
    tiles = build_layout("bigbird:window=64,global=64,random=1,seed=1", 8, max_seq_len, 64)
    tiles[1, 3] = False
    tiles[4:, 2] = False
    packed = compact(tiles, max_seq_len, 64)
    layout = decode_layout(packed, 2).to("cuda")
    workspace = ops.decode_attention_workspace(1, 8, 2, 64, max_seq_len, "cuda", num_splits=3)
    for position, empty_heads in ((150, slice(4, 8)), (200, slice(1, 2)), (299, slice(0, 0))):
        q, k_cache, v_cache, kept = gpu_problem(1, 8, 2, 64, max_seq_len, position, torch.float16, packed)
        out = torch.full_like(q, float("nan"))
        run(q, k_cache, v_cache, position, 0.125, layout, workspace, out)
        assert not out.isnan().any()
        assert torch.all(out[:, empty_heads] == 0)
        assert rel_error(out, oracle64(q, k_cache, v_cache, kept, 0.125)) < TOLERANCE[torch.float16]


@requires_cuda
@pytest.mark.parametrize("num_splits", [1, 2, 5, 64, 256])
def test_every_split_count(num_splits):
    max_seq_len, position = 3001, 2999
    packed, layout = layout_for("strided:local=200,stride=256", 8, 2, max_seq_len, 64, "cuda")
    q, k_cache, v_cache, kept = gpu_problem(1, 8, 2, 128, max_seq_len, position, torch.float16, packed)
    q = q * 4  # a sharp softmax
    workspace = ops.decode_attention_workspace(1, 8, 2, 128, max_seq_len, "cuda", num_splits=num_splits)
    out = run(q, k_cache, v_cache, position, 0.125, layout, workspace)
    assert rel_error(out, oracle64(q, k_cache, v_cache, kept, 0.125)) < TOLERANCE[torch.float16]
    assert counters_at_rest(workspace, 1, 2)


def test_ring_depth_fits_the_steps_a_warp_takes():
    # 2304 kept positions (sink-128 + window-2048 in blocks of 128) over 16 splits: 3 steps a warp.
    assert ops.decode_attention_ring_stages(2304, 16) == 0
    assert ops.decode_attention_ring_stages(2304, 24) == 3
    assert ops.decode_attention_ring_stages(2304, 36) == 2
    assert ops.decode_attention_ring_stages(2304, 256) == 2
    assert ops.decode_attention_ring_stages(32768, 16) == 0


@requires_cuda
@pytest.mark.parametrize("listed", [False, True], ids=["from-position", "listed"])
@pytest.mark.parametrize("num_splits, stages", [(3, 2), (7, 3), (16, None), (36, None), (40, 2)])
def test_every_ring_depth(num_splits, stages, listed):
    max_seq_len, position = 4100, 4099
    packed, layout = layout_for("sink-window:sink=128,window=2048", 32, 8, max_seq_len, 128, "cuda")
    q, k_cache, v_cache, kept = gpu_problem(1, 32, 8, 128, max_seq_len, position, torch.float16, packed)
    workspace = ops.decode_attention_workspace(1, 32, 8, 128, max_seq_len, "cuda", num_splits=num_splits)
    out = layout.attend(q, k_cache, v_cache, torch.tensor([position], device="cuda"), 0.125, None, workspace,
                        listed, stages)
    assert rel_error(out, oracle64(q, k_cache, v_cache, kept, 0.125)) < TOLERANCE[torch.float16]
    assert counters_at_rest(workspace, 1, 8)


@requires_cuda
@pytest.mark.parametrize("listed", [False, True], ids=["from-position", "listed"])
@pytest.mark.parametrize("head_dim", [64, pytest.param(128, marks=[pytest.mark.memcheck, pytest.mark.racecheck])])
def test_newest_row_from_the_kernel_right_before_and_graph_replay(head_dim, listed):
    """Captured once, replayed as the position advances over tile boundaries: each replay NaNs the newest
    row, then rope_write_kv rewrites it right before the attention (which reads it after the PDL wait)."""
    batch, q_heads, kv_heads, max_seq_len = 1, 32, 8, 1200
    name = "sink-window:sink=64,window=256"
    packed, layout = layout_for(name, q_heads, kv_heads, max_seq_len, 64, "cuda")
    torch.manual_seed(head_dim)
    k_cache = torch.randn(batch, kv_heads, max_seq_len, head_dim, device="cuda").half()
    v_cache = torch.randn_like(k_cache)
    pos = torch.zeros(1, dtype=torch.int64, device="cuda")
    qkv = torch.randn(batch, 1, q_heads + 2 * kv_heads, head_dim, device="cuda").half()
    q_new, k_new, v_new = qkv.split([q_heads, kv_heads, kv_heads], dim=2)
    cos = torch.ones(max_seq_len, head_dim // 2, device="cuda")  # RoPE as the identity
    sin = torch.zeros(max_seq_len, head_dim // 2, device="cuda")
    workspace = ops.decode_attention_workspace(batch, q_heads, kv_heads, head_dim, layout.most_kept_positions,
                                               "cuda")
    out = torch.empty(batch, q_heads, head_dim, dtype=torch.float16, device="cuda")

    def step():
        k_cache.index_fill_(2, pos, float("nan"))
        v_cache.index_fill_(2, pos, float("nan"))
        ops.rope_write_kv(q_new, k_new, v_new, cos, sin, pos, k_cache, v_cache)
        layout.attend(q_new[:, 0], k_cache, v_cache, pos, 0.1, out, workspace, listed)

    step()  # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for position in (0, 16, 63, 64, 65, 300, 777, 1199):
        pos.fill_(position)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        expected = oracle64(q_new[:, 0], k_cache, v_cache, kept_positions(packed, q_heads, position), 0.1)
        assert rel_error(out, expected) < TOLERANCE[torch.float16], position
    assert counters_at_rest(workspace, batch, kv_heads)


@requires_cuda
def test_opcheck():
    q = torch.randn(2, 8, 128, device="cuda").half()
    k_cache = torch.randn(2, 2, 700, 128, device="cuda").half()
    v_cache = torch.randn_like(k_cache)
    pos = torch.tensor([650], device="cuda")
    layout = layout_for("bigbird:window=64,global=64,random=2,seed=0", 8, 2, 700, 64, "cuda")[1]
    workspace = ops.decode_attention_workspace(2, 8, 2, 128, 700, "cuda", num_splits=5)
    out = torch.empty_like(q)
    torch.library.opcheck(torch.ops.minfer.decode_attention_blocksparse.default,
                          (q, k_cache, v_cache, pos, 0.1, out, workspace, 5, layout.tile_ptr, layout.key_tiles,
                           layout.head_bits, layout.groups, 0))
    torch.library.opcheck(torch.ops.minfer.decode_attention_sink_window.default,
                          (q, k_cache, v_cache, pos, 0.1, out, workspace, 5, 64, 300, 128, 2))


@requires_cuda
def test_backend_decode_runs_the_kernel_and_matches_the_reference():
    cfg = dataclasses.replace(BACKEND_CONFIG, num_heads=8, num_kv_heads=2, head_dim=64)
    backend = attention_class("blocksparse").create(cfg, 1, 900, torch.float16, torch.device("cuda"),
                                                    layout="sink-window:sink=64,window=128")
    assert backend.workspace is not None
    cache = KVCache(1, 2, 900, 64, torch.float16, "cuda")
    cache.k_cache.copy_(torch.randn_like(cache.k_cache))
    cache.v_cache.copy_(torch.randn_like(cache.v_cache))
    q = torch.randn(1, 1, 8, 64, device="cuda").half()
    position = torch.tensor([800], device="cuda")
    with backend.forward_pass(position, 1, 900) as step:
        out = backend.decode(q, cache, step)
    expected = ops.sink_window_decode_attention_reference(q[:, 0].double(), cache.k_cache.double(),
                                                          cache.v_cache.double(), position, backend.scale, 64, 128, 64)
    assert rel_error(out[:, 0], expected) < TOLERANCE[torch.float16]
