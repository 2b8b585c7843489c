"""Kronecker-sparse factor products (kernels/ksmm; docs/FORMATS.md, "Kronecker-sparse factors"): one fused
kernel per factor, reading x with the stride-d gather and writing y with the stride-d scatter, fp32 sums."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..errors import FormatError
from .runtime import fake_impl, is_sm90, use_kernels

KSMM_ROWS_MAX_TOKENS = 16  # kernels/ksmm/ksmm.h, kKsmmRowsMaxTokens: the bandwidth paths' batch (gemv, rows)
KSMM_ROWS_MAX_D = 64  # kernels/ksmm/ksmm.h, kKsmmRowsMaxD
# From this many tokens ksmm and a KS chain's prefill run the wgmma kernel where it takes a factor; None: never.
# 17, where the gemv path stops: the H200 timed wgmma 2.1-2.7x the ring tiles from 17 to 256 tokens on the
# monarch-50 factors (docs/perf-notes.md, 2026-11-28).
KSMM_WGMMA_MIN_TOKENS: int | None = 17
KSMM_WGMMA_MULTIPLE = 8  # kernels/ksmm/ksmm.h, kKsmmWgmmaMultiple: the wgmma kernel's b and c are multiples
# Below KSMM_WGMMA_MIN_TOKENS, from this many tokens, the wgmma kernel runs the factors of at least this many bytes:
# at 4-16 tokens the H200 timed it 0.9-3.6x the gemv kernel on the grid's d = 1 factors from 8 MB, 0.5-1.0x below
# (docs/perf-notes.md, 2026-11-28).
KSMM_WGMMA_LARGE_FACTOR_MIN_TOKENS = 4
KSMM_WGMMA_LARGE_FACTOR_BYTES = 8 << 20
# A d > 1 factor whose x must first be gathered into its batch-major order runs the wgmma kernel from this
# many weights per group (b·c), or from KSMM_WGMMA_GATHER_MANY_MIN_GROUP with at least KSMM_WGMMA_GATHER_MANY_GROUPS
# groups (a·d): the H200 grid timed gather + wgmma 1.0-3.2x the ring tiles from 256 x 1024 on, and with the block
# transposes 0.8-4.1x on 256 x 256 groups from 16 groups (2.0-4.1x from d = 16), 0.3-1.9x on smaller or fewer
# groups (docs/perf-notes.md, 2026-11-28).
KSMM_WGMMA_GATHER_MIN_GROUP = 256 * 1024
KSMM_WGMMA_GATHER_MANY_GROUPS = 16
KSMM_WGMMA_GATHER_MANY_MIN_GROUP = 64 * 1024
KSMM_WGMMA_TILES = (0, 64, 128, 192, 256)  # kernels/ksmm/ksmm_wgmma.cu: outputs per tile, 0 by shape
# kernels/ksmm/ksmm.h, KsmmPath: "auto" picks by tokens and pattern; the others force one kernel.
KSMM_PATHS = {"auto": 0, "generic": 1, "rows": 2, "tensor-core": 3, "gemv": 4, "wgmma": 5}
KSMM_DTYPES = (torch.float16, torch.bfloat16)


def ksmm_wgmma_shape(b: int, c: int) -> bool:
    """Whether the wgmma kernel takes a factor's (or a group's) b and c: multiples of KSMM_WGMMA_MULTIPLE."""
    return b >= 1 and c >= 1 and b % KSMM_WGMMA_MULTIPLE == 0 and c % KSMM_WGMMA_MULTIPLE == 0


def ksmm_wgmma_gathers(b: int, c: int, groups: int) -> bool:
    """Whether a d > 1 factor of `groups` (a·d) groups whose x is in its natural order runs the wgmma kernel after a
    gather of x into its batch-major order: groups that ksmm_wgmma_shape takes, of at least
    KSMM_WGMMA_GATHER_MIN_GROUP weights, or of KSMM_WGMMA_GATHER_MANY_MIN_GROUP when there are many."""
    least = KSMM_WGMMA_GATHER_MIN_GROUP
    if groups >= KSMM_WGMMA_GATHER_MANY_GROUPS:
        least = min(least, KSMM_WGMMA_GATHER_MANY_MIN_GROUP)
    return ksmm_wgmma_shape(b, c) and b * c >= least


def _on_sm90() -> bool:
    return torch.cuda.is_available() and is_sm90(torch.cuda.current_device())


def ksmm_kernel_takes(path: str, pattern: tuple[int, int, int, int], tokens: int) -> bool:
    """Whether the kernel `path` runs this pattern and batch, given 16-byte aligned tensors (kernels/ksmm/ksmm.h,
    KsmmPath): the fast paths read c·d runs in 16-byte chunks; "gemv" and "rows" take up to
    KSMM_ROWS_MAX_TOKENS tokens, "rows" d a power of two up to KSMM_ROWS_MAX_D, "gemv" and "tensor-core" d in
    (1, 2, 4) or a multiple of 8, "wgmma" d = 1 with b and c multiples of KSMM_WGMMA_MULTIPLE on an sm_90 GPU
    (the current device); "generic" (and "auto") anything."""
    _, b, c, d = pattern
    vectors = c * d % 8 == 0
    if path == "wgmma":
        return d == 1 and ksmm_wgmma_shape(b, c) and _on_sm90()
    if path == "rows":
        return vectors and tokens <= KSMM_ROWS_MAX_TOKENS and d & (d - 1) == 0 and d <= KSMM_ROWS_MAX_D
    if path in ("gemv", "tensor-core"):
        return vectors and (d in (1, 2, 4) or d % 8 == 0) and (path == "tensor-core" or tokens <= KSMM_ROWS_MAX_TOKENS)
    return True


def ksmm_path(pattern: tuple[int, int, int, int], tokens: int) -> str:
    """The kernel ops.ksmm runs for this pattern and batch (aligned tensors; kernels/ksmm/ksmm.h, KsmmPath):
    the first that takes it of rows (one token only), gemv, wgmma (from KSMM_WGMMA_MIN_TOKENS tokens),
    tensor-core and generic."""
    order = ("rows", "gemv") if tokens == 1 else ("gemv",)
    order += ("wgmma", "tensor-core", "generic") if ksmm_wgmma_batch(tokens) else ("tensor-core", "generic")
    return next(path for path in order if ksmm_kernel_takes(path, pattern, tokens))


def ksmm_wgmma_batch(tokens: int) -> bool:
    """Whether a batch of `tokens` is one the wgmma kernel runs (KSMM_WGMMA_MIN_TOKENS)."""
    return KSMM_WGMMA_MIN_TOKENS is not None and tokens >= KSMM_WGMMA_MIN_TOKENS


def ksmm_wgmma_factor(tokens: int, factor_bytes: int) -> bool:
    """Whether a batch of `tokens` runs a factor of `factor_bytes` on the wgmma kernel where it takes the shape:
    every factor from KSMM_WGMMA_MIN_TOKENS, the large ones (KSMM_WGMMA_LARGE_FACTOR_BYTES) from
    KSMM_WGMMA_LARGE_FACTOR_MIN_TOKENS; none when KSMM_WGMMA_MIN_TOKENS is None."""
    return ksmm_wgmma_batch(tokens) or (KSMM_WGMMA_MIN_TOKENS is not None
                                        and tokens >= KSMM_WGMMA_LARGE_FACTOR_MIN_TOKENS
                                        and factor_bytes >= KSMM_WGMMA_LARGE_FACTOR_BYTES)


@contextlib.contextmanager
def ksmm_wgmma_from(min_tokens: int | None):
    """KSMM_WGMMA_MIN_TOKENS set to `min_tokens` inside the block: benchmarks and tests compare the prefill paths."""
    global KSMM_WGMMA_MIN_TOKENS
    saved, KSMM_WGMMA_MIN_TOKENS = KSMM_WGMMA_MIN_TOKENS, min_tokens
    try:
        yield
    finally:
        KSMM_WGMMA_MIN_TOKENS = saved


def _factor_product(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """Y[n, i, j, l] = sum_k X[n, i, k, l] W[i, j, k, l] in fp32 (float64 stays float64), unrounded."""
    a, b, c, d = factor.shape
    compute = torch.promote_types(x.dtype, torch.float32)
    y = torch.einsum("nikl,ijkl->nijl", x.reshape(x.shape[0], a, c, d).to(compute), factor.to(compute))
    return y.reshape(x.shape[0], a * b * d)


def ksmm_reference(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """x [T, a·c·d] times the (a, b, c, d) factor's matrix transposed, [T, a·b·d], in fp32 (float64 stays
    float64), rounded to x's dtype: Y[n, i, j, l] = sum_k X[n, i, k, l] W[i, j, k, l]. The views do the
    stride-d gather and scatter; the CPU path and the oracle."""
    return _factor_product(x, factor).to(x.dtype)


def ksmm_gemv_reference(x: torch.Tensor, factor: torch.Tensor, norm_weight: torch.Tensor | None = None,
                        eps: float = 0.0, residual: torch.Tensor | None = None,
                        silu_mul: bool = False) -> torch.Tensor:
    """ksmm_reference with a decode projection's fusions, as ops.linear_reference computes them for a dense
    matrix: with `norm_weight` g the factor applied to g * x rounded to the dtype, times each token's
    rsqrt(mean(x^2) + eps); with `silu_mul` silu(first half) * second half of the outputs; with `residual`
    residual + that; rounded once to x's dtype."""
    if norm_weight is None:
        y = _factor_product(x, factor)
    else:
        compute = torch.promote_types(x.dtype, torch.float32)
        scale = torch.rsqrt(x.to(compute).square().mean(dim=-1, keepdim=True) + eps)
        y = _factor_product(x * norm_weight, factor) * scale
    if silu_mul:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if residual is not None:
        y = y + residual.to(y.dtype)
    return y.to(x.dtype)


@fake_impl("minfer::ksmm")
def _ksmm_fake(x, factor, out):
    return None


@fake_impl("minfer::ksmm_tuned")
def _ksmm_tuned_fake(x, factor, out, path):
    return None


@fake_impl("minfer::ksmm_gemv")
def _ksmm_gemv_fake(x, factor, out, norm_weight=None, eps=0.0, accumulate=False, silu_mul=False):
    return None


def ksmm_gemv_fuses(pattern: tuple[int, int, int, int], tokens: int, silu_mul: bool = False) -> bool:
    """Whether ksmm_gemv runs this factor and batch on the kernel (aligned tensors; kernels/ksmm/ksmm.h,
    ksmm_gemv_fusion_supports): 1..KSMM_ROWS_MAX_TOKENS tokens on a pattern the gemv kernel takes, and for
    silu_mul a == 1 and an even b (the [gate; up] halves are the rows j < b/2 and j >= b/2)."""
    a, b, c, _ = pattern
    return (1 <= tokens and c >= 1 and ksmm_kernel_takes("gemv", pattern, tokens)
            and (not silu_mul or (a == 1 and b % 2 == 0)))


def ksmm_gemv(x: torch.Tensor, factor: torch.Tensor, out: torch.Tensor | None = None, *,
              norm_weight: torch.Tensor | None = None, eps: float = 0.0, accumulate: bool = False,
              silu_mul: bool = False) -> torch.Tensor:
    """One factor of a decode projection with the fusions of ops.gemv (ksmm_gemv_reference): `norm_weight`
    [a·c·d] applies the factor to RMSNorm(x) (a chain's first factor); `accumulate` adds into `out` in place
    (the residual, a chain's last factor); `silu_mul` returns silu(gate) * up [T, a·b·d / 2] of the factor's
    [gate; up] outputs. On a GPU under the minfer backend the gemv kernel where ksmm_gemv_fuses (one token with
    no fusion but `accumulate`: the rows kernel, where it takes the pattern), else the reference."""
    if factor.dim() != 4 or x.dim() != 2 or x.shape[1] != factor.shape[0] * factor.shape[2] * factor.shape[3]:
        raise FormatError(f"ksmm_gemv takes x [T, a·c·d] and a 4-D (a, b, c, d) factor, got x {tuple(x.shape)} "
                          f"and factor {tuple(factor.shape)}")
    a, b, _, d = factor.shape
    tokens = x.shape[0]
    if accumulate and out is None:
        raise FormatError("ksmm_gemv(accumulate=True) adds into `out`: pass the tensor to add into")
    if silu_mul and (a * b * d % 2 or accumulate):
        raise FormatError(f"ksmm_gemv(silu_mul=True) needs [gate; up] outputs, an even a·b·d (got {a * b * d}), "
                          "and no accumulate")
    outputs = a * b * d // 2 if silu_mul else a * b * d
    if out is None:
        out = x.new_empty(tokens, outputs)
    elif out.shape != (tokens, outputs):
        raise FormatError(f"ksmm_gemv: out must be [{tokens}, {outputs}], got {tuple(out.shape)}")
    kernel = (use_kernels(x) and factor.dtype in KSMM_DTYPES
              and ksmm_gemv_fuses(tuple(factor.shape), tokens, silu_mul))
    if kernel:
        torch.ops.minfer.ksmm_gemv(x.contiguous(), factor, out, norm_weight, eps, accumulate, silu_mul)
    else:
        out.copy_(ksmm_gemv_reference(x, factor, norm_weight, eps, out if accumulate else None, silu_mul))
    return out


def ksmm(x: torch.Tensor, factor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out [T, a·b·d] = x [T, a·c·d] times the factor's matrix transposed (ksmm_reference): on a GPU
    under the minfer backend one kernel for fp16/bf16 (ksmm_path: a bandwidth path up to KSMM_ROWS_MAX_TOKENS
    tokens, the tensor cores past them, wgmma for d = 1 from KSMM_WGMMA_MIN_TOKENS); the reference otherwise."""
    a, b, c, d = factor.shape if factor.dim() == 4 else (0, 0, 0, 0)
    if (d == 1 and x.dim() == 2 and ksmm_wgmma_batch(x.shape[0]) and ksmm_wgmma_takes(x) and ksmm_wgmma_shape(b, c)
            and factor.dtype == x.dtype and factor.is_contiguous() and factor.data_ptr() % 16 == 0):
        return ksmm_wgmma(x, factor.view(a, b, c), out=out)
    return _ksmm(x, factor, out, None)


def ksmm_tuned(x: torch.Tensor, factor: torch.Tensor, out: torch.Tensor | None = None, *,
               path: str = "auto") -> torch.Tensor:
    """ksmm with the kernel pinned (KSMM_PATHS), for tests and benchmarks; a kernel that cannot run the
    pattern or the batch refuses it with one line."""
    if path not in KSMM_PATHS:
        raise FormatError(f"unknown KS kernel path {path!r}; choose one of {', '.join(KSMM_PATHS)}")
    return _ksmm(x, factor, out, KSMM_PATHS[path])


def _ksmm(x: torch.Tensor, factor: torch.Tensor, out: torch.Tensor | None, path: int | None) -> torch.Tensor:
    if factor.dim() != 4 or x.dim() != 2 or x.shape[1] != factor.shape[0] * factor.shape[2] * factor.shape[3]:
        raise FormatError(f"ksmm takes x [T, a·c·d] and a 4-D (a, b, c, d) factor, got x {tuple(x.shape)} and "
                          f"factor {tuple(factor.shape)}")
    a, b, _, d = factor.shape
    if out is None:
        out = x.new_empty(x.shape[0], a * b * d)
    if use_kernels(x) and factor.dtype in KSMM_DTYPES:
        if path is None:
            torch.ops.minfer.ksmm(x, factor, out)
        else:
            torch.ops.minfer.ksmm_tuned(x, factor, out, path)
    else:
        out.copy_(ksmm_reference(x, factor))
    return out


def to_batch_major(x: torch.Tensor, c: int, d: int) -> torch.Tensor:
    """x [T, a·c·d] in a factor (a, ·, c, d)'s natural input order -> its batch-major order: input (i, k, l) moves
    from (i·c + k)·d + l to (i·d + l)·c + k, so that each (i, l)'s c inputs are contiguous."""
    tokens = x.shape[0]
    return x.reshape(tokens, -1, c, d).transpose(2, 3).reshape(tokens, -1)


def from_batch_major(x: torch.Tensor, c: int, d: int) -> torch.Tensor:
    """The inverse of to_batch_major."""
    tokens = x.shape[0]
    return x.reshape(tokens, -1, d, c).transpose(2, 3).reshape(tokens, -1)


def transpose_blocks_reference(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """x with each of its consecutive [rows, cols] blocks (in x's flat order) transposed to [cols, rows]."""
    return x.reshape(-1, rows, cols).transpose(1, 2).reshape(x.shape)


@fake_impl("minfer::ksmm_transpose_blocks")
def _transpose_blocks_fake(x, rows, cols, out):
    return None


def transpose_blocks(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """transpose_blocks_reference into a new tensor: to_batch_major(x, c, d) is transpose_blocks(x, c, d) and
    from_batch_major(x, c, d) is transpose_blocks(x, d, c). One pass of the ksmm_transpose_blocks kernel for
    float16 / bfloat16 on minfer's kernels (contiguous x), the reference elsewhere."""
    if rows < 1 or cols < 1 or x.numel() % (rows * cols):
        raise FormatError(f"transpose_blocks: blocks of {rows} x {cols} do not tile {x.numel()} elements")
    if use_kernels(x) and x.dtype in KSMM_DTYPES and x.numel() > 0:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        torch.ops.minfer.ksmm_transpose_blocks(x.contiguous(), rows, cols, out)
        return out
    return transpose_blocks_reference(x, rows, cols).contiguous()


def ksmm_groups(factor: torch.Tensor) -> torch.Tensor:
    """The (a, b, c, d) factor as the wgmma kernel's groups [a·d, b, c]: group i·d + l is W[i, :, :, l], its k's
    contiguous (a copy when d > 1, a view of the factor when d == 1)."""
    a, b, c, d = factor.shape
    return factor.permute(0, 3, 1, 2).reshape(a * d, b, c).contiguous()


def ksmm_wgmma_reference(x: torch.Tensor, groups: torch.Tensor, d: int = 1, next_c: int = 1,
                         next_d: int = 1) -> torch.Tensor:
    """The wgmma kernel's product (kernels/ksmm/ksmm.h, launch_ksmm_wgmma) in fp32 (float64 stays float64),
    rounded to x's dtype: y_g = x_g groups[g]^T for x [T, G·c] whose columns g·c .. g·c + c - 1 are x_g, written
    in the factor's natural order (g = i·d + l, output r at (i·b + r)·d + l), then, with next_d > 1, in the
    batch-major order of a next factor with that (c, d) (to_batch_major)."""
    count, b, c = groups.shape
    tokens = x.shape[0]
    compute = torch.promote_types(x.dtype, torch.float32)
    y = torch.einsum("ngk,grk->ngr", x.reshape(tokens, count, c).to(compute), groups.to(compute))
    y = from_batch_major(y.reshape(tokens, count * b), b, d)
    if next_d > 1:
        y = to_batch_major(y, next_c, next_d)
    return y.to(x.dtype)


@fake_impl("minfer::ksmm_wgmma")
def _ksmm_wgmma_fake(x, groups, out, d, next_c, next_d, tile_n=0):
    return None


def ksmm_wgmma_takes(x: torch.Tensor) -> bool:
    """Whether the wgmma kernel runs on x: minfer's kernels on an sm_90 GPU, fp16/bf16 x contiguous and 16-byte
    aligned (the groups must be too, in x's dtype, with b and c that pass ksmm_wgmma_shape)."""
    return (use_kernels(x) and x.dtype in KSMM_DTYPES and x.is_contiguous() and x.data_ptr() % 16 == 0
            and is_sm90(x.get_device()))


def ksmm_wgmma_planned(x: torch.Tensor, groups: torch.Tensor, d: int, next_c: int, next_d: int) -> torch.Tensor:
    """ksmm_wgmma's kernel without its Python checks, for a KS chain's cached plan (KSWeight.prefill_steps), which
    asked ksmm_wgmma_takes and ksmm_wgmma_shape once: x and groups are what the kernel takes (its binding still
    checks shapes and dtypes)."""
    out = x.new_empty(x.shape[0], groups.shape[0] * groups.shape[1])
    torch.ops.minfer.ksmm_wgmma(x, groups, out, d, next_c, next_d, 0)
    return out


def ksmm_wgmma(x: torch.Tensor, groups: torch.Tensor, d: int = 1, next_c: int = 1, next_d: int = 1,
               out: torch.Tensor | None = None, *, tile_n: int = 0) -> torch.Tensor:
    """A factor as groups of GEMMs (ksmm_wgmma_reference): x [T, G·c] (a d > 1 factor's input in its batch-major
    order, to_batch_major), groups [G, b, c] (ksmm_groups), out [T, G·b] in the factor's natural order, or with
    next_d > 1 in the next factor's batch-major order. The sm_90a wgmma kernel where ksmm_wgmma_takes (tile_n:
    one of KSMM_WGMMA_TILES, for benchmarks), the reference elsewhere."""
    if groups.dim() != 3 or x.dim() != 2 or x.shape[1] != groups.shape[0] * groups.shape[2]:
        raise FormatError(f"ksmm_wgmma takes x [T, G·c] and groups [G, b, c], got x {tuple(x.shape)} and groups "
                          f"{tuple(groups.shape)}")
    count, b, _ = groups.shape
    if d < 1 or count % d or next_d < 1 or (next_d > 1 and (next_c < 1 or count * b % (next_c * next_d))):
        raise FormatError(f"ksmm_wgmma: d = {d} must divide the {count} groups and the next factor's (c, d) = "
                          f"({next_c}, {next_d}) must chain with {count * b} outputs")
    if tile_n not in KSMM_WGMMA_TILES:
        raise FormatError(f"ksmm_wgmma: tile_n is one of {KSMM_WGMMA_TILES}, got {tile_n}")
    if out is None:
        out = x.new_empty(x.shape[0], count * b)
    elif out.shape != (x.shape[0], count * b):
        raise FormatError(f"ksmm_wgmma: out must be [{x.shape[0]}, {count * b}], got {tuple(out.shape)}")
    kernel = (ksmm_wgmma_takes(x) and ksmm_wgmma_shape(b, groups.shape[2]) and groups.dtype == x.dtype
              and groups.is_contiguous() and groups.data_ptr() % 16 == 0)
    if kernel and x.shape[0] > 0:
        torch.ops.minfer.ksmm_wgmma(x, groups, out, d, next_c, next_d, tile_n)
    else:
        out.copy_(ksmm_wgmma_reference(x, groups, d, next_c, next_d))
    return out


def ksmm_wgmma_chain_reference(x: torch.Tensor, groups: Sequence[torch.Tensor], plan: Sequence[int]) -> torch.Tensor:
    """ksmm_wgmma_chain's product: per factor i, with plan[5i .. 5i + 4] = (d, next_c, next_d, gather_c,
    gather_d), x moved into the batch-major order of (gather_c, gather_d) where gather_d != 0 (to_batch_major),
    then ksmm_wgmma_reference, each factor's output rounded to x's dtype."""
    for index, weights in enumerate(groups):
        d, next_c, next_d, gather_c, gather_d = plan[5 * index:5 * index + 5]
        if gather_d:
            x = to_batch_major(x, gather_c, gather_d)
        x = ksmm_wgmma_reference(x, weights, d, next_c, next_d)
    return x


@fake_impl("minfer::ksmm_wgmma_chain")
def _ksmm_wgmma_chain_fake(x, groups, plan):
    return x.new_empty(x.shape[0], groups[-1].shape[0] * groups[-1].shape[1])


def ksmm_wgmma_chain(x: torch.Tensor, groups: Sequence[torch.Tensor], plan: Sequence[int]) -> torch.Tensor:
    """A KS chain whose factors all run the wgmma kernel, as one op (ksmm_wgmma_chain_reference): factor i is
    ksmm_wgmma on groups[i] with plan[5i .. 5i + 4] = (d, next_c, next_d, gather_c, gather_d), x first gathered
    into the batch-major order of (gather_c, gather_d) where gather_d != 0; returns the last factor's output
    [T, G·b]. One dispatch for the chain, for a prefill's host time (KSWeight.prefill_steps caches its arguments).
    The kernel where ksmm_wgmma_takes(x) for a non-empty batch (the groups must then be what the kernel takes, as
    the format's plan checked once; the binding refuses others in one line), the reference elsewhere."""
    if len(plan) != 5 * len(groups) or not groups:
        raise FormatError(f"ksmm_wgmma_chain: plan holds (d, next_c, next_d, gather_c, gather_d) per factor, "
                          f"{5 * len(groups)} integers for {len(groups)} groups (at least one), got {len(plan)}")
    if x.shape[0] > 0 and ksmm_wgmma_takes(x):
        return torch.ops.minfer.ksmm_wgmma_chain(x, groups, plan)
    return ksmm_wgmma_chain_reference(x, groups, plan)
