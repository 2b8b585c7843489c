"""Block-sparse attention: layouts, the compact form, the masked reference and the CUDA kernel."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from minfer import ops
from minfer.attention import BlockSparseAttention, attention_class
from minfer.attention.layouts import (LayoutError, build_layout, compact, compact_layout, density, parse_layout,
                                      plot_layout)
from minfer.bench import attention_suite
from minfer.config import ModelConfig
from minfer.errors import MinferError
from minfer.kv_cache import KVCache
from tests.conftest import requires_cuda
from tests.helpers import APP, assert_input_error, in_process, load_app
from tests.numerics import rel_error

NAMED = ["dense", "causal", "sink-window:sink=70,window=130", "strided:local=100,stride=128",
         "bigbird:window=90,global=64,random=2,seed=3"]


def reference(q, k, v, layout, scale):
    return ops.blocksparse_attention_reference(q, k, v, layout.tile_ptr, layout.key_tiles, layout.heads, scale)


def naive_attention64(q, k, v, layout, block_size, scale):
    """Row by row in float64: query i of head h sees key j <= i when layout[h or 0, i // B, j // B]."""
    batch, q_heads, seq_len, _ = q.shape
    group = q_heads // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for h in range(q_heads):
        head_layout = layout[h if layout.shape[0] > 1 else 0]
        for i in range(seq_len):
            keys = [j for j in range(i + 1) if head_layout[i // block_size, j // block_size]]
            if not keys:
                continue
            kk = k[:, h // group, keys].double()
            scores = torch.einsum("bd,bjd->bj", q[:, h, i].double(), kk) * scale
            out[:, h, i] = torch.einsum("bj,bjd->bd", scores.softmax(-1), v[:, h // group, keys].double())
    return out


def random_qkv(batch, q_heads, kv_heads, seq_len, head_dim, dtype, device="cpu"):
    q = torch.randn(batch, q_heads, seq_len, head_dim, dtype=dtype, device=device)
    k = torch.randn(batch, kv_heads, seq_len, head_dim, dtype=dtype, device=device)
    v = torch.randn(batch, kv_heads, seq_len, head_dim, dtype=dtype, device=device)
    return q, k, v


# ---- layouts and the reference (CPU) ----


@pytest.mark.parametrize("name", NAMED)
@pytest.mark.parametrize("block_size", [64, 128])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_reference_matches_naive_masked_attention(name, block_size, heads):
    torch.manual_seed(0)
    seq_len, head_dim = 203, 16  # not a multiple of either block
    q, k, v = random_qkv(1, *heads, seq_len, head_dim, torch.float64)
    layout = build_layout(name, heads[0], seq_len, block_size)
    out = compact(layout, seq_len, block_size).attend(q, k, v, 0.25)
    assert rel_error(out, naive_attention64(q, k, v, layout, block_size, 0.25)) < 1e-12


def test_sink_window_keeps_exactly_the_blocks_with_needed_tokens():
    sink, window, block, seq_len = 70, 130, 64, 700
    layout = build_layout(f"sink-window:sink={sink},window={window}", 1, seq_len, block)[0]
    for i in range(layout.shape[0]):
        for j in range(layout.shape[1]):
            queries = range(i * block, min((i + 1) * block, seq_len))
            needed = any(kk < sink or q - window < kk <= q
                         for q in queries for kk in range(j * block, min((j + 1) * block, q + 1)))
            assert bool(layout[i, j]) == needed, (i, j)


def test_layout_shapes_density_and_per_head_random_blocks():
    dense = build_layout("dense", 8, 1000, 64)
    assert dense.shape == (1, 16, 16) and density(dense) == 1.0
    assert torch.equal(dense, build_layout("causal", 8, 1000, 64))
    bigbird = build_layout("bigbird:window=64,global=0,random=3,seed=7", 8, 2048, 64)
    assert bigbird.shape == (8, 32, 32)
    assert not all(torch.equal(bigbird[0], bigbird[h]) for h in range(1, 8))  # heads draw their own blocks
    assert torch.equal(bigbird, build_layout("bigbird:window=64,global=0,random=3,seed=7", 8, 2048, 64))
    window = build_layout("sink-window:sink=0,window=64", 1, 64 * 20, 64)
    assert 0 < density(window) < 0.2


@pytest.mark.parametrize("name", NAMED)
def test_a_shorter_sequence_keeps_the_top_left_corner_of_a_longer_ones_layout(name):
    """A prompt's prefill (built for its length) and the decode steps after it (built for the whole cache)
    see the same blocks; bigbird's random blocks too, and they differ between rows, heads and seeds."""
    longer = build_layout(name, 4, 2000, 64)
    for seq_len in (1, 65, 700, 1999):
        shorter = build_layout(name, 4, seq_len, 64)
        blocks = shorter.shape[-1]
        assert torch.equal(shorter, longer[:, :blocks, :blocks]), seq_len
    random = build_layout("bigbird:window=1,global=0,random=2,seed=3", 4, 2000, 64)
    assert (random.sum(-1)[:, 2:] == 3).all()  # the diagonal and exactly `random` earlier blocks
    assert not torch.equal(random, build_layout("bigbird:window=1,global=0,random=2,seed=4", 4, 2000, 64))
    assert len({tuple(random[0, row].nonzero().flatten().tolist()) for row in range(20, 31)}) > 5


@pytest.mark.parametrize("name", NAMED)
@pytest.mark.parametrize("block_size,seq_len", [(64, 1), (64, 1000), (128, 1000), (128, 129)])
def test_compact_form_round_trips(name, block_size, seq_len):
    layout = build_layout(name, 3, seq_len, block_size)
    packed = compact(layout, seq_len, block_size)
    assert torch.equal(packed.to_layout(), layout)
    assert packed.tile_ptr.dtype == packed.key_tiles.dtype == torch.int32
    assert int(packed.tile_ptr[-1]) == packed.key_tiles.numel()
    counts = packed.tile_ptr[1:] - packed.tile_ptr[:-1]
    for row, start in enumerate(packed.tile_ptr[:-1].tolist()):
        tiles = packed.key_tiles[start:start + int(counts[row])]
        assert torch.all(tiles[1:] > tiles[:-1]) and torch.all(tiles <= row % packed.q_tiles)  # ascending, causal
    assert packed.kept_fraction() == pytest.approx(density(layout), abs=0.05)


def test_compact_layout_is_built_once_per_layout_and_length():
    first = compact_layout("sink-window:sink=64,window=256", 4, 999)
    assert compact_layout("sink-window:sink=64,window=256", 4, 999) is first
    assert compact_layout("sink-window:sink=64,window=256", 4, 1000) is not first


def test_a_query_tile_with_no_kept_block_gives_zeros_and_no_nan():
    seq_len = 150
    layout = build_layout("causal", 1, seq_len, 64)
    layout[0, 1] = False  # the second query tile keeps nothing
    q, k, v = random_qkv(1, 2, 1, seq_len, 16, torch.float32)
    out = compact(layout, seq_len, 64).attend(q, k, v, 0.25)
    assert not out.isnan().any()
    assert torch.all(out[:, :, 64:128] == 0) and out[:, :, :64].abs().sum() > 0


def test_file_layout_is_read_from_safetensors(tmp_path):
    path = tmp_path / "layout.safetensors"
    user = torch.rand(2, 10, 10) > 0.5
    save_file({"layout": user.to(torch.uint8)}, str(path))
    layout = build_layout(f"file:path={path}", 2, 8 * 64 - 5, 64)
    assert torch.equal(layout, user[:, :8, :8] & torch.ones(8, 8, dtype=torch.bool).tril())
    save_file({"layout": user[0]}, str(path))
    assert build_layout(f"file:path={path}", 5, 640, 64).shape == (1, 10, 10)


@pytest.mark.parametrize("text,message", [
    ("banded", "unknown layout 'banded'"),
    ("sink-window:sink=4", "missing window"),
    ("sink-window:sink=4,window=0", "window must be >= 1"),
    ("sink-window:sink=four,window=8", "is not a whole number"),
    ("sink-window:sink=4,window=8,sink=2", "sink is given twice"),
    ("causal:window=3", "causal takes no parameters"),
    ("strided:local=64,stride", "is not key=value"),
    ("bigbird:window=64,global=64,random=-1,seed=0", "random must be >= 0"),
])
def test_bad_layout_strings_give_one_line_errors(text, message):
    with pytest.raises(LayoutError, match=message) as info:
        parse_layout(text)
    assert "\n" not in str(info.value)


def test_bad_block_sizes_lengths_and_files_give_one_line_errors(tmp_path):
    cases = [(lambda: build_layout("causal", 1, 100, 32), "block size must be one of"),
             (lambda: build_layout("causal", 1, 0, 64), "sequence length must be in"),
             (lambda: build_layout("strided:local=64,stride=96", 1, 500, 64), "stride must be a multiple"),
             (lambda: build_layout(f"file:path={tmp_path}/missing.safetensors", 1, 100, 64), "no such file"),
             (lambda: build_layout(f"file:path={tmp_path}/layout.pt", 1, 100, 64), "never unpickled")]
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    cases.append((lambda: build_layout(f"file:path={tmp_path}/junk.safetensors", 1, 100, 64), "not a readable"))
    save_file({"layout": torch.ones(2, 2, dtype=torch.bool)}, str(tmp_path / "small.safetensors"))
    cases.append((lambda: build_layout(f"file:path={tmp_path}/small.safetensors", 1, 1000, 64), "does not cover"))
    save_file({"layout": torch.ones(4, 4)}, str(tmp_path / "float.safetensors"))
    cases.append((lambda: build_layout(f"file:path={tmp_path}/float.safetensors", 1, 100, 64), "bool or integer"))
    q, k, v = random_qkv(1, 2, 1, 100, 16, torch.float32)
    cases.append((lambda: compact_layout("causal", 2, 99).attend(q, k, v, 1.0), "built for 99"))
    bigbird = compact_layout("bigbird:window=64,global=0,random=1,seed=0", 3, 100)
    cases.append((lambda: bigbird.attend(q, k, v, 1.0), "has 3 heads"))
    short = compact_layout("causal", 1, 64)
    cases.append((lambda: ops.blocksparse_attention(q, k, v, short.tile_ptr, short.key_tiles, 1, 1.0),
                  "tile_ptr has 2 entries"))
    for call, message in cases:
        with pytest.raises(MinferError, match=message) as info:
            call()
        assert "\n" not in str(info.value)


def test_unknown_kernel_name_is_refused():
    q, k, v = random_qkv(1, 2, 1, 70, 16, torch.float32)
    with pytest.raises(MinferError, match="kernel must be one of"):
        compact_layout("causal", 2, 70).attend(q, k, v, 1.0, kernel="tma")


def test_attention_suite_fit_and_report(monkeypatch, capsys):
    slope, intercept, r2 = attention_suite.linear_fit([0.1, 0.5, 1.0], [1.2, 3.0, 5.25])
    assert slope == pytest.approx(4.5) and intercept == pytest.approx(0.75) and r2 == pytest.approx(1.0)
    monkeypatch.setattr(attention_suite, "kernel_variants", lambda: ("mma",))
    rows = [{"layout": "dense", "seq_len": 16384, "kept": 1.0, "minfer_ms": 4.0, "mma_ms": 7.0, "flex_ms": 5.0,
             "vs_flex": 1.25}, {"layout": "causal", "seq_len": 4096, "minfer_ms": 0.3, "flex_error": "Boom: no"}]
    fit = {"seq_len": 16384, "kept": [0.1, 1.0], "minfer_ms": [0.5, 4.0], "slope_ms": 3.9, "intercept_ms": 0.1,
           "r_squared": 1.0}
    attention_suite.print_report({"device": "GPU", "copy_gbs": 4000.0, "matmul_tflops": 660.0}, rows, fit, "float16")
    printed = capsys.readouterr().out
    assert "kernel variants" in printed and "7.000" in printed and "FlexAttention failed at causal 4096" in printed
    assert "R^2 = 1.0000 over 2 layouts" in printed


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "layout.png"
    plot_layout(build_layout("bigbird:window=128,global=64,random=2,seed=0", 2, 2000, 64), path, "bigbird")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- the attention backend and generate.py ----

BACKEND_CONFIG = ModelConfig(vocab_size=50, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                             intermediate_size=32, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                             max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def random_cache(max_seq_len, seed):
    generator = torch.Generator().manual_seed(seed)
    cfg = BACKEND_CONFIG
    cache = KVCache(1, cfg.num_kv_heads, max_seq_len, cfg.head_dim, torch.float64, "cpu")
    cache.k_cache.copy_(torch.randn(cache.k_cache.shape, generator=generator))
    cache.v_cache.copy_(torch.randn(cache.v_cache.shape, generator=generator))
    return cache


@pytest.mark.parametrize("name", NAMED[2:])
@pytest.mark.parametrize("tokens", [1, 150, 203])
def test_backend_prefill_matches_sdpa_with_the_layout_mask(name, tokens):
    cfg = BACKEND_CONFIG
    backend = attention_class("blocksparse").create(cfg, 1, 300, torch.float64, torch.device("cpu"), layout=name)
    assert isinstance(backend, BlockSparseAttention)
    cache = random_cache(300, tokens)
    q = torch.randn(1, tokens, cfg.num_heads, cfg.head_dim, dtype=torch.float64)
    with backend.forward_pass(torch.arange(tokens), tokens, tokens) as step:
        out = backend.prefill(q, cache, step)
    layout = build_layout(name, cfg.num_heads, tokens, 64)
    index = torch.arange(tokens) // 64
    mask = layout[:, index][:, :, index] & torch.ones(tokens, tokens, dtype=torch.bool).tril()
    group = cfg.num_heads // cfg.num_kv_heads
    k, v = (c[:, :, :tokens].repeat_interleave(group, dim=1) for c in (cache.k_cache, cache.v_cache))
    expected = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[None], scale=backend.scale)
    assert rel_error(out, expected.transpose(1, 2)) < 1e-12


def test_backend_refuses_an_offset_prefill():
    """(Decode over the layout: tests/test_blocksparse_decode.py.)"""
    cfg = BACKEND_CONFIG
    backend = attention_class("blocksparse").create(cfg, 1, 300, torch.float64, torch.device("cpu"),
                                                    layout="sink-window:sink=0,window=64")
    cache = random_cache(300, 5)
    q = torch.randn(1, 1, cfg.num_heads, cfg.head_dim, dtype=torch.float64)
    with backend.forward_pass(torch.arange(100, 103), 3, 103) as step, pytest.raises(MinferError, match="0..T-1"):
        backend.prefill(q.expand(1, 3, -1, -1), cache, step)


def test_backend_refuses_a_bad_layout_at_setup():
    with pytest.raises(LayoutError, match="unknown layout 'banded'"):
        attention_class("blocksparse").create(BACKEND_CONFIG, 1, 300, torch.float64, torch.device("cpu"),
                                              layout="banded")


def test_generate_blocksparse_causal_gives_the_dense_tokens_and_a_plot(tmp_path, capsys):
    app = load_app(APP)
    argv = ["--device", "cpu", "--max-new-tokens", "12", "--json"]
    dense = in_process(app, argv, capsys)
    plot = tmp_path / "causal.png"
    sparse = in_process(app, [*argv, "--attention", "blocksparse", "--layout", "causal", "--layout-plot", str(plot)],
                        capsys)
    assert dense.returncode == sparse.returncode == 0, sparse.stderr
    assert json.loads(sparse.stdout)["generated_ids"] == json.loads(dense.stdout)["generated_ids"]
    assert "layout causal: 1.000 of the causal blocks kept" in sparse.stderr
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, fragments", [
    (["--layout", "causal"], ["--layout needs --attention blocksparse"]),
    (["--attention", "blocksparse"], ["--attention blocksparse needs --layout"]),
    (["--layout-plot", "x.png"], ["--layout-plot needs"]),
    (["--attention", "sliding"], ["--attention", "invalid choice", "blocksparse"]),
    (["--attention", "blocksparse", "--layout", "banded"], ["unknown layout 'banded'"]),
    (["--attention", "blocksparse", "--layout", "sink-window:sink=4"], ["missing window"]),
    (["--attention", "blocksparse", "--layout", "causal", "--layout-plot", "x.jpg"], ["name a .png file"]),
    (["--attention", "blocksparse", "--layout", "causal", "--layout-plot", "/no/such/dir/x.png"], ["does not exist"]),
    (["--attention", "blocksparse", "--layout", "file:path=/no/such.safetensors"], ["no such file"]),
])
def test_generate_bad_attention_flags_give_one_line(args, fragments, capsys):
    assert_input_error(in_process(load_app(APP), ["--device", "cpu", *args], capsys), *fragments)


# ---- the CUDA kernel ----

GPU_LAYOUTS = NAMED + ["sink-window:sink=0,window=64"]


def hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def gpu_kernels():
    """The kernels this GPU runs: the wgmma ones (wgmma, the warp-specialized ws) need sm_90."""
    return ["wgmma", "ws", "mma"] if hopper() else ["mma"]


@requires_cuda
@pytest.mark.parametrize("kernel", gpu_kernels())
@pytest.mark.parametrize("dtype,tolerance", [(torch.float16, 4e-3), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("seq_len", [1, 63, pytest.param(65, marks=pytest.mark.memcheck), 200, 1000])
@pytest.mark.parametrize("block_size", [64, 128])
def test_kernel_matches_float64_reference(kernel, dtype, tolerance, head_dim, heads, seq_len, block_size):
    torch.manual_seed(seq_len * head_dim + heads[1])
    q, k, v = random_qkv(2, *heads, seq_len, head_dim, dtype, "cuda")
    scale = 1 / math.sqrt(head_dim)
    for name in GPU_LAYOUTS:
        layout = compact_layout(name, heads[0], seq_len, block_size, device="cuda")
        out = torch.full_like(q, float("nan"))
        layout.attend(q, k, v, scale, out, kernel=kernel)
        ref = reference(q.double(), k.double(), v.double(), layout, scale)
        assert not out.isnan().any(), name
        assert rel_error(out, ref) < tolerance, name


@requires_cuda
@pytest.mark.skipif(not hopper(), reason="the warp-specialized kernel needs sm_90")
@pytest.mark.parametrize("kernel", ["ws", "ws-grid", "ws-nopp"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_warp_specialized_variants_over_more_pairs_than_multiprocessors(kernel, head_dim):
    # 16 pairs x 8 heads x 2 batches = 256 items: the persistent grid gives a block several, so its
    # barriers' phases, the ring and Q carry over from one item to the next
    seq_len = 2001
    torch.manual_seed(head_dim)
    q, k, v = random_qkv(2, 8, 2, seq_len, head_dim, torch.float16, "cuda")
    scale = 1 / math.sqrt(head_dim)
    for name, block_size in [("causal", 128), ("sink-window:sink=64,window=256", 64), (NAMED[-1], 64)]:
        layout = compact_layout(name, 8, seq_len, block_size, device="cuda")
        out = torch.full_like(q, float("nan"))
        layout.attend(q, k, v, scale, out, kernel=kernel)
        ref = reference(q.double(), k.double(), v.double(), layout, scale)
        assert not out.isnan().any(), name
        assert rel_error(out, ref) < 4e-3, name


@requires_cuda
@pytest.mark.memcheck
@pytest.mark.parametrize("kernel", gpu_kernels())
def test_kernel_takes_strided_views_and_writes_only_out(kernel):
    torch.manual_seed(1)
    batch, seq_len, q_heads, kv_heads, head_dim = 1, 333, 8, 2, 128
    q = torch.randn(batch, seq_len, q_heads, head_dim, dtype=torch.float16, device="cuda").transpose(1, 2)
    k = torch.randn(batch, kv_heads, 512, head_dim, dtype=torch.float16, device="cuda")[:, :, :seq_len]
    v = torch.randn(batch, kv_heads, 512, head_dim, dtype=torch.float16, device="cuda")[:, :, :seq_len]
    store = torch.full((batch, seq_len + 1, q_heads, head_dim), 7.0, dtype=torch.float16, device="cuda")
    out = store[:, :seq_len].transpose(1, 2)
    layout = compact_layout("bigbird:window=64,global=64,random=1,seed=2", q_heads, seq_len, device="cuda")
    layout.attend(q, k, v, 0.1, out, kernel=kernel)
    ref = reference(q.double(), k.double(), v.double(), layout, 0.1)
    assert rel_error(out, ref) < 4e-3
    assert torch.all(store[:, seq_len] == 7.0)


@requires_cuda
@pytest.mark.memcheck
@pytest.mark.racecheck
@pytest.mark.parametrize("kernel", gpu_kernels())
def test_kernel_gives_zeros_for_a_tile_with_no_kept_block(kernel):
    seq_len = 300
    layout = build_layout("sink-window:sink=0,window=64", 1, seq_len, 64)
    layout[0, 2] = False
    packed = compact(layout, seq_len, 64).to("cuda")
    q, k, v = random_qkv(1, 4, 4, seq_len, 64, torch.float16, "cuda")
    out = torch.full_like(q, float("nan"))
    packed.attend(q, k, v, 0.125, out, kernel=kernel)
    assert not out.isnan().any()
    assert torch.all(out[:, :, 128:192] == 0)
    ref = reference(q.double(), k.double(), v.double(), packed, 0.125)
    assert rel_error(out, ref) < 4e-3


@requires_cuda
def test_opcheck():
    seq_len = 130
    q, k, v = random_qkv(1, 4, 2, seq_len, 64, torch.float16, "cuda")
    layout = compact_layout("sink-window:sink=64,window=64", 4, seq_len, device="cuda")
    out = torch.empty_like(q)
    torch.library.opcheck(torch.ops.minfer.blocksparse_attention.default,
                          (q, k, v, layout.tile_ptr, layout.key_tiles, layout.heads, 0.125, out))
    torch.library.opcheck(torch.ops.minfer.blocksparse_attention_tuned.default,
                          (q, k, v, layout.tile_ptr, layout.key_tiles, layout.heads, 0.125, out, "mma"))


@requires_cuda
def test_graph_capture_replays_with_new_inputs():
    seq_len = 700
    q, k, v = random_qkv(1, 8, 2, seq_len, 128, torch.bfloat16, "cuda")
    layout = compact_layout("strided:local=128,stride=256", 8, seq_len, device="cuda")
    out = torch.empty_like(q)
    layout.attend(q, k, v, 0.09, out)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layout.attend(q, k, v, 0.09, out)
    for t in (q, k, v):
        t.copy_(torch.randn_like(t))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = reference(q.double(), k.double(), v.double(), layout, 0.09)
    assert rel_error(out, ref) < 2e-2
    assert ops.current_backend() == "minfer"
