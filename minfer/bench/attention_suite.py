"""Attention benchmark: minfer's block-sparse prefill kernel against torch SDPA (dense causal) and
FlexAttention given the same BlockMask, B=1, H=32, D=128, across lengths and layouts, and the prefill
time against the kept-block fraction with the R^2 of a straight-line fit; then block-sparse decode (one
query at the cache's last position, GQA 32/8) against dense SDPA decode and FlexAttention decode with the
same layout row as its BlockMask, beside minfer's dense split-K decode.

Each prefill case states its floor: max(FLOPs / the matrix rate, bytes / the copy rate), both measured in
the same run. FLOPs count the (query, key) pairs the layout's kept tiles hold, 4 * D per pair (Q K^T and
P V); bytes are Q, K, V and the output once each. A decode case's floor is the K and V bytes of the
positions it reads (for a per-head layout, the union over each KV head's group) at the copy rate.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F

from .. import ops
from ..attention.layouts import KERNEL_TILE, DecodeLayout, build_layout, compact, decode_layout, parse_layout
from ..errors import MinferError
from .report import Column
from .suites import Suite, SuiteRun, register
from .timing import copy_bandwidth_gbs, rotation_count, time_graph

HEADS, HEAD_DIM, BLOCK_SIZE = 32, 128, 128
LENGTHS = (4096, 8192, 16384, 32768)
SINK_WINDOW = "sink-window:sink=128,window=1024"
LAYOUTS = ("dense", SINK_WINDOW, "strided:local=1024,stride=2048", "bigbird:window=1024,global=128,random=4,seed=0")
FRACTION_LENGTH = 16384
FRACTION_WINDOWS = (256, 1024, 2048, 4096, 8192, 12288)  # with sink=128: 6% to 94% kept; dense adds 100%
PHASES = ("prefill", "decode")
DECODE_KV_HEADS = 8
DECODE_LAYOUTS = ("dense", "sink-window:sink=128,window=2048", "strided:local=1024,stride=2048",
                  "bigbird:window=1024,global=128,random=4,seed=0")
DECODE_SPLIT_FACTORS = (2, 4)  # more splits than the default, timed for the sink-window layout at the longest length

COLUMNS = [
    Column("layout", "layout"),
    Column("seq_len", "S"),
    Column("kept", "kept", "{:.3f}"),
    Column("floor_ms", "floor ms", "{:.3f}"),
    Column("minfer_ms", "minfer ms", "{:.3f}"),
    Column("tflops", "TFLOP/s", "{:.0f}"),
    Column("of_floor", "floor/minfer", "{:.2f}"),
    Column("sdpa_ms", "SDPA causal ms", "{:.3f}"),
    Column("vs_sdpa", "SDPA/minfer", "{:.2f}"),
    Column("flex_ms", "Flex ms", "{:.3f}"),
    Column("vs_flex", "Flex/minfer", "{:.2f}"),
]


DECODE_COLUMNS = [
    Column("layout", "layout"),
    Column("seq_len", "S"),
    Column("read", "read", "{:.3f}"),
    Column("kv_mb", "KV MB read", "{:.1f}"),
    Column("floor_us", "floor us", "{:.1f}"),
    Column("copy_us", "same-bytes copy us", "{:.1f}"),
    Column("minfer_us", "minfer us", "{:.1f}"),
    Column("pct_copy", "% copy", "{:.0f}"),
    Column("sdpa_us", "SDPA dense us", "{:.1f}"),
    Column("vs_sdpa", "SDPA/minfer", "{:.2f}"),
    Column("flex_us", "Flex us", "{:.1f}"),
    Column("vs_flex", "Flex/minfer", "{:.2f}"),
]


def matmul_tflops() -> float:
    """fp16 8192^3 matrix product through torch (cuBLAS): the matrix-unit ceiling of this run."""
    a = torch.randn(8192, 8192, dtype=torch.float16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.float16, device="cuda")
    ms = time_graph(lambda i: torch.mm(a, b), copies=1, replays=10)
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def kept_pairs(layout: torch.Tensor, seq_len: int, heads: int) -> int:
    """(query, key) pairs the kernel computes for all heads: full tiles, plus the causal half of diagonal ones."""
    packed = compact(layout, seq_len, BLOCK_SIZE)
    tiles = packed.tile_layout()
    diagonal = tiles.diagonal(dim1=-2, dim2=-1).sum().item()
    pairs = (tiles.sum().item() - diagonal) * KERNEL_TILE**2 + diagonal * KERNEL_TILE * (KERNEL_TILE + 1) // 2
    return pairs * (heads // layout.shape[0])


def flex_block_mask(layout: torch.Tensor, seq_len: int):
    """FlexAttention's BlockMask of the same layout: off-diagonal kept blocks are full, diagonal ones
    partial (causal mask_mod)."""
    from torch.nn.attention.flex_attention import BlockMask

    n = layout.shape[-1]
    diagonal = torch.eye(n, dtype=torch.bool)
    full = layout & ~diagonal
    partial = layout & diagonal

    def as_kv_blocks(kept: torch.Tensor):
        counts = kept.sum(-1).to(torch.int32)
        order = torch.argsort((~kept).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # kept blocks first
        return counts[None].cuda(), order[None].cuda()

    def causal(b, h, q, kv):
        return q >= kv

    return BlockMask.from_kv_blocks(*as_kv_blocks(partial), *as_kv_blocks(full), BLOCK_SIZE=BLOCK_SIZE,
                                    mask_mod=causal, seq_lengths=(seq_len, seq_len))


def _inputs(seq_len: int, dtype: torch.dtype):
    shape = (1, HEADS, seq_len, HEAD_DIM)
    return [torch.randn(shape, dtype=dtype, device="cuda") for _ in range(3)] + [torch.empty(shape, dtype=dtype,
                                                                                               device="cuda")]


def _time(fn: Callable[[], object]) -> float:
    return time_graph(lambda i: fn(), copies=1, replays=10)


def kernel_variants() -> tuple[str, ...]:
    """The kernels timed beside the default (ws-grid on sm_90) at every length and in the kept-fraction sweep:
    the other warp-specialized variants, the plain wgmma kernel and mma.sync."""
    return ("ws", "ws-nopp", "wgmma", "mma") if torch.cuda.get_device_capability()[0] == 9 else ()


def prefill_row(layout_name: str, seq_len: int, dtype: torch.dtype, copy_gbs: float, tflops_ceiling: float,
                flex: Callable | None, sdpa_ms: float | None, variants: tuple[str, ...] = ()) -> dict:
    q, k, v, out = _inputs(seq_len, dtype)
    layout = build_layout(layout_name, HEADS, seq_len, BLOCK_SIZE)
    packed = compact(layout, seq_len, BLOCK_SIZE).to("cuda")
    scale = 1 / math.sqrt(HEAD_DIM)
    flops = 4 * HEAD_DIM * kept_pairs(layout, seq_len, HEADS)
    nbytes = 4 * q.numel() * q.element_size()
    floor_ms = max(flops / (tflops_ceiling * 1e12), nbytes / (copy_gbs * 1e9)) * 1e3
    minfer_ms = _time(lambda: packed.attend(q, k, v, scale, out))
    row = {"layout": layout_name, "seq_len": seq_len, "kept": packed.kept_fraction(), "flops": flops,
           "bytes": nbytes, "floor_ms": floor_ms, "minfer_ms": minfer_ms,
           "tflops": flops / (minfer_ms * 1e-3) / 1e12, "of_floor": floor_ms / minfer_ms, "sdpa_ms": sdpa_ms,
           "vs_sdpa": sdpa_ms / minfer_ms if sdpa_ms else None}
    for kernel in variants:
        row[f"{kernel}_ms"] = _time(lambda: packed.attend(q, k, v, scale, out, kernel=kernel))
    if flex is not None:
        try:
            mask = flex_block_mask(layout, seq_len)
            row["flex_ms"] = _time(lambda: flex(q, k, v, block_mask=mask, scale=scale))
            row["vs_flex"] = row["flex_ms"] / minfer_ms
        except Exception as exc:  # a baseline that fails to compile or run leaves its cells empty, not the suite
            row["flex_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return row


def decode_kv_bytes(layout: DecodeLayout, seq_len: int, kv_heads: int, element_size: int) -> int:
    """K and V bytes decode reads at the last position: each KV head's listed tiles, up to the position."""
    q_tile = (seq_len - 1) // KERNEL_TILE
    positions = 0
    for group in range(layout.groups):
        row = group * layout.q_tiles + q_tile
        tiles = layout.key_tiles[layout.tile_ptr[row]:layout.tile_ptr[row + 1]].long()
        positions += int((seq_len - tiles * KERNEL_TILE).clamp(max=KERNEL_TILE).sum())
    return positions * (kv_heads // layout.groups) * HEAD_DIM * 2 * element_size


def same_bytes_copy_us(nbytes: int, dtype: torch.dtype) -> float:
    """Microseconds of the copy kernel that defines the copy rate (copy_bandwidth_gbs) moving `nbytes` in all
    (half read, half written), rotated past L2: the fixed costs a launch of that size carries."""
    elements = max(nbytes // 2 // torch.empty((), dtype=dtype).element_size(), 1)
    copies = rotation_count(nbytes)
    sources = [torch.randn(elements, device="cuda").to(dtype) for _ in range(copies)]
    target = torch.empty_like(sources[0])
    return time_graph(lambda i: torch.mul(sources[i], 1.0, out=target), copies=copies, replays=10) * 1e3


def flex_decode_block_mask(layout: torch.Tensor, seq_len: int):
    """FlexAttention's BlockMask for one query at position seq_len - 1: the layout's row of that query's
    block, every kept block full (each key before the query is visible)."""
    from torch.nn.attention.flex_attention import BlockMask

    row = layout[:, (seq_len - 1) // BLOCK_SIZE]  # (heads, k_blocks)
    counts = row.sum(-1).to(torch.int32)[None, :, None].cuda()
    order = torch.argsort((~row).to(torch.int8), dim=-1, stable=True).to(torch.int32)[None, :, None].cuda()
    return BlockMask.from_kv_blocks(torch.zeros_like(counts), torch.zeros_like(order), counts, order,
                                    BLOCK_SIZE=BLOCK_SIZE, seq_lengths=(1, seq_len))


def decode_inputs(seq_len: int, copies: int, dtype: torch.dtype):
    """(q, K caches, V caches, out, position): `copies` full caches of seq_len positions (DECODE_KV_HEADS), one
    query at the last position."""
    shape = (1, DECODE_KV_HEADS, seq_len, HEAD_DIM)
    k_caches = [torch.randn(shape, device="cuda").to(dtype) for _ in range(copies)]
    v_caches = [torch.randn(shape, device="cuda").to(dtype) for _ in range(copies)]
    q = torch.randn(1, HEADS, HEAD_DIM, device="cuda").to(dtype)
    return q, k_caches, v_caches, torch.empty_like(q), torch.tensor([seq_len - 1], device="cuda")


def decode_rows(seq_len: int, dtype: torch.dtype, copy_gbs: float, flex: Callable | None) -> list[dict]:
    """One row per DECODE_LAYOUTS entry at this cache length ("dense": minfer's dense split-K decode)."""
    kv_heads, element = DECODE_KV_HEADS, torch.empty((), dtype=dtype).element_size()
    cache_bytes = 2 * kv_heads * seq_len * HEAD_DIM * element
    layouts = {name: build_layout(name, HEADS, seq_len, BLOCK_SIZE) for name in DECODE_LAYOUTS}
    forms = {name: decode_layout(compact(layout, seq_len, BLOCK_SIZE), kv_heads, parse_layout(name)).to("cuda")
             for name, layout in layouts.items()}
    read = {name: decode_kv_bytes(form, seq_len, kv_heads, element) for name, form in forms.items()}
    copies = rotation_count(min(read.values()))  # every case cycles through copies that overflow L2
    q, k_caches, v_caches, out, position = decode_inputs(seq_len, copies, dtype)
    scale = 1 / math.sqrt(HEAD_DIM)

    def timed(fn: Callable[[int], object]) -> float:
        return time_graph(fn, copies=copies, replays=10) * 1e3

    sdpa_us = timed(lambda i: F.scaled_dot_product_attention(q[:, :, None], k_caches[i], v_caches[i], scale=scale,
                                                             enable_gqa=True))
    rows = []
    for name, form in forms.items():
        most = form.most_kept_positions

        def minfer_decode(splits: int | None = None, listed: bool = False):
            workspace = ops.decode_attention_workspace(1, HEADS, kv_heads, HEAD_DIM, most, "cuda", splits)
            if name == "dense":
                return lambda i: ops.decode_attention(q, k_caches[i], v_caches[i], position, scale, out, workspace)
            return lambda i: form.attend(q, k_caches[i], v_caches[i], position, scale, out, workspace, listed)

        minfer_us = timed(minfer_decode())
        row = {"layout": name, "seq_len": seq_len, "kv_heads": kv_heads, "read": read[name] / cache_bytes,
               "kv_mb": read[name] / 1e6, "floor_us": read[name] / (copy_gbs * 1e3),
               "copy_us": same_bytes_copy_us(read[name], dtype), "minfer_us": minfer_us,
               "pct_copy": 100 * read[name] / (copy_gbs * 1e3) / minfer_us, "sdpa_us": sdpa_us,
               "vs_sdpa": sdpa_us / minfer_us,
               "splits": ops.decode_attention_splits(1, kv_heads, most, "cuda")}
        if form.sink_window is not None:
            row["listed_us"] = timed(minfer_decode(listed=True))
        if name == DECODE_LAYOUTS[1] and seq_len == max(LENGTHS):
            for factor in DECODE_SPLIT_FACTORS:
                splits = min(row["splits"] * factor, ops.DECODE_ATTENTION_MAX_SPLITS)
                row[f"splits_{splits}_us"] = timed(minfer_decode(splits))
        if flex is not None:
            try:
                mask = flex_decode_block_mask(layouts[name], seq_len)
                row["flex_us"] = timed(lambda i: flex(q[:, :, None], k_caches[i], v_caches[i], block_mask=mask,
                                                      scale=scale, enable_gqa=True))
                row["vs_flex"] = row["flex_us"] / minfer_us
            except Exception as exc:  # a baseline that fails leaves its cells empty, not the suite
                row["flex_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        rows.append(row)
    return rows


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """(slope, intercept, R^2) of the least-squares line through the points."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    slope = sxy / sxx
    return slope, my - slope * mx, sxy * sxy / (sxx * syy) if syy else 1.0


def run(lengths: tuple[int, ...], dtype: torch.dtype, with_flex: bool = True,
        on_row: Callable[[dict], None] = lambda row: None,
        phases: tuple[str, ...] = PHASES) -> tuple[dict, list[dict], dict, list[dict]]:
    """(ceilings, prefill rows, the kept-fraction fit, decode rows) for every length and layout of the
    phases asked for."""
    copy_gbs = copy_bandwidth_gbs()
    ceiling = matmul_tflops() if "prefill" in phases else None
    flex = None
    if with_flex:
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
    decoded = []
    for seq_len in lengths if "decode" in phases else ():
        decoded += decode_rows(seq_len, dtype, copy_gbs, flex)
        for row in decoded[-len(DECODE_LAYOUTS):]:
            on_row(row)
    if "prefill" not in phases:
        return {"copy_gbs": copy_gbs}, [], {}, decoded
    rows = []
    for seq_len in lengths:
        q, k, v, _ = _inputs(seq_len, dtype)
        sdpa_ms = _time(partial(F.scaled_dot_product_attention, q, k, v, is_causal=True))
        del q, k, v
        variants = kernel_variants()
        for name in LAYOUTS:
            rows.append(prefill_row(name, seq_len, dtype, copy_gbs, ceiling, flex, sdpa_ms, variants))
            on_row(rows[-1])
    fraction_rows = [row for row in rows if row["seq_len"] == FRACTION_LENGTH and row["layout"] == "dense"]
    for window in FRACTION_WINDOWS:
        fraction_rows.append(prefill_row(f"sink-window:sink=128,window={window}", FRACTION_LENGTH, dtype, copy_gbs,
                                         ceiling, None, None, kernel_variants()))
        on_row(fraction_rows[-1])
    fit = {"seq_len": FRACTION_LENGTH, "kept": [r["kept"] for r in fraction_rows],
           "minfer_ms": [r["minfer_ms"] for r in fraction_rows]}
    fit["slope_ms"], fit["intercept_ms"], fit["r_squared"] = linear_fit(fit["kept"], fit["minfer_ms"])
    for kernel in kernel_variants():
        fit[f"{kernel}_ms"] = [r[f"{kernel}_ms"] for r in fraction_rows]
        fit[f"{kernel}_fit"] = linear_fit(fit["kept"], fit[f"{kernel}_ms"])
    return {"copy_gbs": copy_gbs, "matmul_tflops": ceiling}, rows, fit, decoded


def print_decode_report(env: dict, rows: list[dict], dtype_name: str) -> None:
    """The decode table, the split counts tried, and any FlexAttention failure."""
    from .report import print_table

    print_table(f"block-sparse decode, B=1 Hq={HEADS} Hkv={DECODE_KV_HEADS} D={HEAD_DIM}, one query at the cache's "
                f"last position ({env.get('device')}, {dtype_name}, layout blocks of {BLOCK_SIZE}; 'read': KV "
                f"fraction read; dense = minfer's split-K; copy {env['copy_gbs']:.0f} GB/s)", DECODE_COLUMNS, rows)
    for row in rows:
        tried = {key: value for key, value in row.items() if key.startswith("splits_")}
        if tried:
            print(f"decode {row['layout']} {row['seq_len']}: {row['splits']} splits (default) {row['minfer_us']:.1f} "
                  "us; " + "; ".join(f"{key.split('_')[1]} splits {value:.1f} us" for key, value in tried.items()))
        if "listed_us" in row:
            print(f"decode {row['layout']} {row['seq_len']}: tiles from the position {row['minfer_us']:.1f} us, "
                  f"from the lists {row['listed_us']:.1f} us")
        if "flex_error" in row:
            print(f"FlexAttention decode failed at {row['layout']} {row['seq_len']}: {row['flex_error']}")


def print_report(env: dict, rows: list[dict], fit: dict, dtype_name: str) -> None:
    """The prefill table, the kernel variants at FRACTION_LENGTH, and the kept-fraction fit."""
    from .report import print_table

    print_table(f"block-sparse prefill, B=1 H={HEADS} D={HEAD_DIM} ({env.get('device')}, {dtype_name}, layout "
                f"blocks of {BLOCK_SIZE}; copy {env['copy_gbs']:.0f} GB/s, matmul {env['matmul_tflops']:.0f} TFLOP/s)",
                COLUMNS, rows)
    names = kernel_variants()
    variant_rows = [row for row in rows if names and f"{names[0]}_ms" in row]
    if variant_rows:
        print_table("kernel variants (ms; minfer = the default)",
                    [Column("layout", "layout"), Column("seq_len", "S"), Column("minfer_ms", "minfer", "{:.3f}")]
                    + [Column(f"{name}_ms", name, "{:.3f}") for name in names], variant_rows)
    for row in rows:
        if "flex_error" in row:
            print(f"FlexAttention failed at {row['layout']} {row['seq_len']}: {row['flex_error']}")
    print(f"time vs kept fraction at {fit['seq_len']}: R^2 = {fit['r_squared']:.4f} over {len(fit['kept'])} layouts "
          f"(kept {min(fit['kept']):.3f} to {max(fit['kept']):.3f}; {fit['slope_ms']:.3f} ms per unit kept + "
          f"{fit['intercept_ms']:.3f} ms)")
    for name in names:
        if f"{name}_fit" in fit:
            slope, intercept, r_squared = fit[f"{name}_fit"]
            print(f"  {name}: R^2 = {r_squared:.4f}, {slope:.3f} ms per unit kept + {intercept:.3f} ms")


def plot_fraction(path: str, fit: dict, title: str) -> None:
    """Prefill time against the kept-block fraction, with the straight-line fit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(fit["kept"], fit["minfer_ms"], "o", label="minfer block-sparse prefill")
    ax.plot([0, 1], [fit["intercept_ms"], fit["intercept_ms"] + fit["slope_ms"]], "-",
            label=f"fit, R^2 = {fit['r_squared']:.4f}")
    ax.set_xlabel("kept-block fraction")
    ax.set_ylabel("ms")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def chosen_lengths(args) -> tuple[int, ...]:
    """--lengths as numbers, LENGTHS when not given."""
    if not args.lengths:
        return LENGTHS
    if not all(n.isdigit() and int(n) >= 1 for n in args.lengths):
        raise MinferError(f"--lengths: whole numbers >= 1, got {','.join(args.lengths)}")
    return tuple(int(n) for n in args.lengths)


def check_step(args) -> None:
    chosen_lengths(args)
    if args.phases and not set(args.phases) <= set(PHASES):
        raise MinferError(f"--phases: choose among {','.join(PHASES)}, got {','.join(args.phases)}")


def progress_line(row: dict) -> str:
    """A row as it is measured: the default kernel's time, then each variant's (a cut-short run keeps them)."""
    if "minfer_ms" not in row:
        return f"  attention {row['layout']} {row['seq_len']}: decode {row['minfer_us']:.1f} us"
    variants = "".join(f", {name} {row[f'{name}_ms']:.3f}" for name in kernel_variants() if f"{name}_ms" in row)
    return f"  attention {row['layout']} {row['seq_len']}: {row['minfer_ms']:.3f} ms{variants}"


def run_step(bench: SuiteRun) -> dict:
    ceilings, rows, fit, decoded = run(
        chosen_lengths(bench.args), bench.dtype, phases=tuple(bench.args.phases or PHASES),
        on_row=lambda row: print(progress_line(row), flush=True))
    bench.env.update({key: round(value, 1) for key, value in ceilings.items() if value is not None})
    return {"attention": rows, "attention_fit": fit, "attention_decode": decoded}


def report_step(bench: SuiteRun) -> None:
    if bench.results["attention"]:
        print_report(bench.env, bench.results["attention"], bench.results["attention_fit"], bench.args.dtype)
    if bench.results["attention_decode"]:
        print_decode_report(bench.env, bench.results["attention_decode"], bench.args.dtype)


def plot_step(bench: SuiteRun, path: str) -> bool:
    fit = bench.results["attention_fit"]
    if not fit:
        return False
    plot_fraction(path, fit, f"block-sparse prefill at {fit['seq_len']}, {bench.env.get('device')}")
    return True


register(Suite("attention", {"attention": list, "attention_fit": dict, "attention_decode": list}, run_step,
               report_step, flags=("plot", "lengths", "phases"), check=check_step, plot=plot_step))
