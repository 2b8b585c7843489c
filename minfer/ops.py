"""JIT build of kernels/ and the torch.ops.minfer wrappers.

Each op has three parts kept side by side:
- `<op>_reference`: pure PyTorch, the CPU path and the test oracle;
- a fake (meta) implementation, so the op works under torch.compile and CUDA-graph capture;
- `<op>`: the wrapper the engine calls; it runs the CUDA kernel when the tensors live on a GPU
  and the "minfer" backend is active, and the reference otherwise.

`python -m minfer.ops --build` compiles every kernel (for sm_90a when no GPU is present).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from .errors import DeviceError, FormatError, KernelBuildError, MinferError

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"
EXTENSION_NAME = "minfer_kernels"
BACKENDS = ("minfer", "torch")

_state = {"build_folder": None, "backend": os.environ.get("MINFER_BACKEND", "minfer")}  # build_folder: set once loaded
_fake_impls: dict[str, object] = {}


def fake_impl(qualname: str):
    """Collect a fake (meta) implementation; it is registered once the library defines the op."""

    def register(fn):
        _fake_impls[qualname] = fn
        return fn

    return register


# ----------------------------------------------------------------------------------------------
# Build
# ----------------------------------------------------------------------------------------------


def build_dir() -> Path:
    """Where the extension is built: $MINFER_BUILD_DIR, else the user's cache dir, per torch version."""
    root = os.environ.get("MINFER_BUILD_DIR")
    if root is None:
        cache = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
        root = os.path.join(cache, "minfer", "build")
    tag = re.sub(r"[^A-Za-z0-9_.-]", "_", f"torch-{torch.__version__}-sm{target_arch_list()}")
    return Path(root) / tag


def target_arch_list() -> str:
    """TORCH_CUDA_ARCH_LIST if set, else the GPU present (Hopper gets 9.0a for wgmma), else 9.0a."""
    requested = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if requested:
        return requested
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}.{minor}" + ("a" if major == 9 else "")
    return "9.0a"


def kernel_sources() -> list[Path]:
    """kernels/*.cu with bindings.cpp, and each family folder's .cu and .cpp files (kernels/*/)."""
    return [KERNEL_DIR / "bindings.cpp", *sorted(KERNEL_DIR.glob("*.cu")), *sorted(KERNEL_DIR.glob("*/*.cu")),
            *sorted(KERNEL_DIR.glob("*/*.cpp"))]


def _ensure_cuda_home() -> None:
    """torch guesses CUDA_HOME from nvcc's folder, which misses the headers when nvcc is a bare
    copy in /usr/local/bin; point it at the toolkit that holds them."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    for candidate in ("/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)):
        if os.path.exists(os.path.join(candidate, "include", "cuda_runtime_api.h")):
            os.environ["CUDA_HOME"] = candidate
            return


def build(verbose: bool = False) -> Path:
    """Compile (or reuse) the extension and register torch.ops.minfer; returns the build folder."""
    if _state["build_folder"] is not None:  # every op wrapper gets here (use_kernels): ~600 times a prefill
        return _state["build_folder"]
    _ensure_cuda_home()
    from torch.utils import cpp_extension

    arch = target_arch_list()
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 2))
    log = out / "build.log"
    # torch 2.11 no longer passes its std::string ABI; a host compiler that defaults to the old one
    # builds a binding whose formatted TORCH_CHECK messages crash the process when they cross into libc10.
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    try:
        cpp_extension.load(
            name=EXTENSION_NAME,
            sources=[str(p) for p in kernel_sources()],
            extra_include_paths=[str(KERNEL_DIR)],
            extra_cflags=["-O3", "-std=c++17", abi],
            extra_cuda_cflags=["-O3", "-std=c++17", abi, "-lineinfo", "--expt-relaxed-constexpr"],
            build_directory=str(out),
            is_python_module=False,
            verbose=verbose,
        )
    except Exception as exc:  # the compiler's output is in the exception text
        log.write_text(str(exc))
        raise KernelBuildError(
            f"building the minfer kernels for {arch} failed; the compiler output is in {log}. "
            "Rerun `python -m minfer.ops --build --verbose` to see every command."
        ) from exc
    log.unlink(missing_ok=True)
    for qualname, fn in _fake_impls.items():
        torch.library.register_fake(qualname, fn)
    _state["build_folder"] = out
    return out


def set_backend(name: str) -> None:
    """'minfer' runs our CUDA kernels on GPU tensors; 'torch' forces the pure-PyTorch references."""
    if name not in BACKENDS:
        raise MinferError(f"unknown backend {name!r} (from --backend or $MINFER_BACKEND); choose one of {BACKENDS}")
    _state["backend"] = name


def backend() -> str:
    return _state["backend"]


def use_kernels(t: torch.Tensor) -> bool:
    """True when `t` is on a GPU and the minfer backend is active (builds the extension on first use)."""
    if not t.is_cuda or _state["backend"] != "minfer":
        return False
    build()
    return True


def require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise DeviceError(f"{what} needs a CUDA GPU and none is visible; run it on a GPU machine.")


# ----------------------------------------------------------------------------------------------
# Ops: reference, fake, wrapper
# ----------------------------------------------------------------------------------------------


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


@fake_impl("minfer::silu_mul")
def _silu_mul_fake(gate_up, out):
    return None


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up over the fused gate_up projection [..., 2I] -> [..., I]."""
    if out is None:
        out = gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    if use_kernels(gate_up):
        torch.ops.minfer.silu_mul(gate_up, out)
    else:
        out.copy_(silu_mul_reference(gate_up))
    return out


GEMV_MAX_TOKENS = 8  # kernels/gemv.h: the tokens are the n = 8 side of the tensor-core tile


def linear_reference(x: torch.Tensor, w: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                     residual: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor:
    """x @ w.T with fp32 accumulation, in x's dtype: the oracle of gemv and hgemm.

    With `norm_weight` g, of RMSNorm(x) = g * x * rsqrt(mean(x^2) + eps) as the fused kernels compute
    it: g * x rounded to the dtype, the per-token scale applied to the fp32 product. With `residual`,
    residual + that, rounded once (the fused residual add). With `silu_mul`, w is [gate; up] and the
    result silu(gate) * up of the fp32 products, rounded once."""
    if norm_weight is None:
        y = x.float() @ w.float().t()
    else:
        scale = torch.rsqrt(x.float().square().mean(dim=-1, keepdim=True) + eps)
        y = ((x * norm_weight).float() @ w.float().t()) * scale
    if silu_mul:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)


@fake_impl("minfer::gemv")
def _gemv_fake(x, w, out, norm_weight=None, eps=0.0, accumulate=False, warps_per_block=0, unroll=0, silu_mul=False):
    return None


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *,
         norm_weight: torch.Tensor | None = None, eps: float = 0.0, accumulate: bool = False,
         silu_mul: bool = False, warps_per_block: int = 0, unroll: int = 0) -> torch.Tensor:
    """x @ w.T for decode: x [..., K] holding 1..8 tokens in all, w [N, K] -> [..., N], fp32 accumulation.

    Fusions of a Llama sublayer, so decode needs no norm or add kernel: `norm_weight` [K] multiplies
    RMSNorm(x) (eps as in the model) instead of x; `accumulate` adds the product into `out` in place
    (the residual stream) instead of overwriting it; `silu_mul` takes w as the MLP's [gate; up] [2I, K]
    and returns silu(gate) * up [..., I] (in the kernel's epilogue when a norm is fused too, as in the
    MLP; otherwise through the silu_mul kernel). `warps_per_block` (4, 8, 16) and `unroll`
    (2, 4, 8) override the kernel's launch configuration (0: the measured default for the shape);
    `minfer.bench.gemv_sweep` times them."""
    k = x.shape[-1]
    if w.dim() != 2 or w.shape[1] != k:
        raise FormatError(f"gemv needs w [N, {k}] for x [..., {k}], got w {tuple(w.shape)}")
    tokens = x.numel() // max(k, 1)
    if not 1 <= tokens <= GEMV_MAX_TOKENS:
        raise FormatError(f"gemv takes 1..{GEMV_MAX_TOKENS} tokens, got {tokens}; use a GEMM (hgemm, F.linear) for more")
    if accumulate and out is None:
        raise FormatError("gemv(accumulate=True) adds into `out`: pass the tensor to add into")
    if silu_mul and (w.shape[0] % 2 or accumulate):
        raise FormatError(f"gemv(silu_mul=True) needs w = [gate; up] with an even N (got {w.shape[0]}) and no accumulate")
    outputs = w.shape[0] // 2 if silu_mul else w.shape[0]
    if out is None:
        out = x.new_empty(*x.shape[:-1], outputs)
    elif out.shape[-1] != outputs or out.numel() != tokens * outputs:
        raise FormatError(f"gemv: out must be [..., {outputs}] for {tokens} tokens, got {tuple(out.shape)}")
    if use_kernels(x) and silu_mul and norm_weight is None:  # the kernel fuses silu only after a norm
        gate_up = gemv(x.reshape(tokens, k), w, warps_per_block=warps_per_block, unroll=unroll)
        torch.ops.minfer.silu_mul(gate_up, out.view(tokens, outputs))
    elif use_kernels(x):
        torch.ops.minfer.gemv(x.reshape(tokens, k), w, out.view(tokens, outputs), norm_weight, eps, accumulate,
                              warps_per_block, unroll, silu_mul)
    else:
        out.copy_(linear_reference(x, w, norm_weight, eps, out if accumulate else None, silu_mul))
    return out


HGEMM_KERNELS = ("auto", "sm80", "sm80_64x128", "sm80_128x128",
                 "sm90", "sm90_128x64", "sm90_128x128", "sm90_128x192", "sm90_128x256",
                 "sm90_128x128_c2", "sm90_128x192_c2", "sm90_128x256_c2")


@fake_impl("minfer::hgemm")
def _hgemm_fake(x, w, out):
    return None


@fake_impl("minfer::hgemm_kernel")
def _hgemm_kernel_fake(x, w, out, kernel):
    return None


def hgemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, kernel: str = "auto") -> torch.Tensor:
    """x @ w.T for prefill: x [..., K], w [N, K] (HF layout) -> [..., N], fp32 accumulation.

    `kernel` pins a path and tile for tests and benchmarks (HGEMM_KERNELS; kernels/hgemm.h);
    "auto" takes wgmma + TMA on sm_90a and mma.sync elsewhere.
    """
    k = x.shape[-1]
    if w.dim() != 2 or w.shape[1] != k:
        raise FormatError(f"hgemm needs w [N, {k}] for x [..., {k}], got w {tuple(w.shape)}")
    if kernel not in HGEMM_KERNELS:
        raise FormatError(f"unknown hgemm kernel {kernel!r}; choose one of {HGEMM_KERNELS}")
    n = w.shape[0]
    if out is None:
        out = x.new_empty(*x.shape[:-1], n)
    if use_kernels(x):
        if n % 8 or k % 8:
            raise FormatError(f"hgemm needs N and K to be multiples of 8, got N={n}, K={k}; pad the weight with zeros")
        dst = out if _rows_aligned(out) else torch.empty(out.shape, dtype=out.dtype, device=out.device)
        args = (_aligned_copy(x.reshape(-1, k)), _aligned_copy(w), dst.view(-1, n))
        if kernel == "auto":
            torch.ops.minfer.hgemm(*args)
        else:
            torch.ops.minfer.hgemm_kernel(*args, kernel)
        if dst is not out:
            out.copy_(dst)
    else:
        out.copy_(linear_reference(x, w))
    return out


def _rows_aligned(t: torch.Tensor) -> bool:
    """The HGEMM kernels move 16-byte pieces of contiguous rows."""
    return t.is_contiguous() and t.data_ptr() % 16 == 0


def _aligned_copy(t: torch.Tensor) -> torch.Tensor:
    return t if _rows_aligned(t) else t.clone(memory_format=torch.contiguous_format)


def argmax_reference(logits: torch.Tensor) -> torch.Tensor:
    return torch.argmax(logits.float(), dim=-1)


@fake_impl("minfer::argmax")
def _argmax_fake(logits, out, position=None, host_tokens=None):
    return None


def argmax(logits: torch.Tensor, out: torch.Tensor | None = None, *, position: torch.Tensor | None = None,
           host_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Index of the largest logit along the last dim, int64 [...]: the first on ties, NaN counts as largest.

    The token hand-off of a decode step (one row): with `position` (int64 [1] on the logits' device)
    and `host_tokens` (int64, pinned host memory), also host_tokens[position + 1] = the token and
    position += 1, inside the kernel, so the host reads the token without a copy in the stream. It
    needs minfer's kernels on the GPU; on the CPU the same happens with torch ops."""
    if out is None:
        out = torch.empty(logits.shape[:-1], dtype=torch.int64, device=logits.device)
    if (position is None) != (host_tokens is None):
        raise FormatError("argmax: position and host_tokens go together (the token hand-off)")
    if use_kernels(logits):
        torch.ops.minfer.argmax(logits.reshape(-1, logits.shape[-1]), out.view(-1), position, host_tokens)
        return out
    if position is not None and logits.is_cuda:
        raise FormatError("argmax: the token hand-off to host memory needs minfer's kernels on a GPU")
    out.copy_(argmax_reference(logits))
    if position is not None:
        host_tokens[position + 1] = out.view(-1)[:1]
        position.add_(1)
    return out


def embedding_reference(table: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.embedding(tokens.to(table.device), table).to(tokens.device)


@fake_impl("minfer::embedding")
def _embedding_fake(table, tokens, out):
    return None


def embedding(table: torch.Tensor, tokens: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of `table` [V, D] for int64 `tokens` [...] -> [..., D] on the tokens' device.

    With minfer's kernels the table may sit in pinned host memory: the GPU reads the rows it needs
    over PCIe (one row per decode step), so the table costs no GPU memory. Without them (the torch
    backend, or a CPU run) table and tokens must share a device."""
    if out is None:
        out = torch.empty(*tokens.shape, table.shape[1], dtype=table.dtype, device=tokens.device)
    if use_kernels(tokens):
        torch.ops.minfer.embedding(table, tokens.reshape(-1), out.view(-1, table.shape[1]))
        return out
    if table.device != tokens.device:
        raise DeviceError(f"embedding: the table is on {table.device} and the tokens on {tokens.device}; only "
                          "minfer's GPU kernel reads a table in host memory (keep it on the GPU for the torch backend)")
    out.copy_(F.embedding(tokens, table))
    return out


MACKO_SPMM_MAX_TOKENS = 16  # kernels/macko.h: up to 16 tokens share one pass over the weights


def unpack_nibbles(deltas: torch.Tensor, stored: int) -> torch.Tensor:
    """The first `stored` nibbles of a packed MACKO deltas array (low nibble first), one per uint8."""
    return torch.stack((deltas & 15, deltas >> 4), dim=1).reshape(-1)[:stored]


def _macko_entry_columns(nibbles: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of every stored entry: entry k of a row sits one column after entry k-1 plus its
    own nibble (the first at its nibble). `starts` [rows + 1] are the rows' first entries (from 0)."""
    ends = torch.cat((starts.new_zeros(1), (nibbles.long() + 1).cumsum(0)))  # ends[k]: columns used by entries < k
    rows = starts.numel() - 1
    row_of = torch.repeat_interleave(torch.arange(rows, device=starts.device), starts.diff(), output_size=nibbles.numel())
    return row_of, ends[1:] - 1 - ends[starts[:-1]][row_of]


_MACKO_BLOCK_ENTRIES = 1 << 24  # entries the vectorized MACKO helpers handle at once (bounds the temporaries)


def _check_macko_extent(values: torch.Tensor, deltas: torch.Tensor, row_ptr: torch.Tensor) -> int:
    if row_ptr.numel() == 0:
        raise FormatError("row_ptr must hold rows + 1 offsets, got an empty tensor")
    stored = int(row_ptr[-1])
    if stored > values.numel() or 2 * deltas.numel() < stored:
        raise FormatError(f"row_ptr ends at {stored} entries but values holds {values.numel()} "
                          f"and deltas {2 * deltas.numel()}: the MACKO arrays are inconsistent")
    if int(row_ptr[0]) != 0 or bool((row_ptr.diff() < 0).any()):
        raise FormatError("row_ptr must start at 0 and never decrease: the MACKO arrays are inconsistent")
    return stored


def _row_blocks(starts: torch.Tensor, cols: int):
    """(first row, its block's bounds = starts[first:last + 1], first entry, end entry) for blocks of rows
    that together hold at most _MACKO_BLOCK_ENTRIES entries when valid (a row stores at most
    cols + cols // 15: its columns plus a pad per 16-column gap)."""
    block_rows = max(1, _MACKO_BLOCK_ENTRIES // (cols + cols // 15 + 1))
    for first in range(0, starts.numel() - 1, block_rows):
        bounds = starts[first:first + block_rows + 1]
        yield first, bounds, int(bounds[0]), int(bounds[-1])


def check_macko_arrays(values: torch.Tensor, deltas: torch.Tensor, row_ptr: torch.Tensor, cols: int) -> None:
    """Raise FormatError unless the arrays encode a matrix of `cols` columns: row_ptr from 0, never
    decreasing, within values and deltas, and every row's entries inside the columns. Loaders run it
    on every file's arrays, since the kernels trust them. In blocks of rows (bounded temporaries)."""
    kinds = (("values", values, "a float", values.is_floating_point()),
             ("deltas", deltas, "a uint8", deltas.dtype == torch.uint8),
             ("row_ptr", row_ptr, "an int32 or int64", row_ptr.dtype in (torch.int32, torch.int64)))
    for name, array, wanted, kind_ok in kinds:
        if array.dim() != 1 or not kind_ok:
            raise FormatError(f"MACKO {name} must be {wanted} 1-D tensor, got {array.dtype} of shape "
                              f"{tuple(array.shape)}")
    stored = _check_macko_extent(values, deltas, row_ptr)
    nibbles = unpack_nibbles(deltas, stored)
    for _, bounds, begin, end in _row_blocks(row_ptr.long(), cols):
        used = torch.cat((bounds.new_zeros(1), (nibbles[begin:end].long() + 1).cumsum(0)))
        spans = used[bounds[1:] - begin] - used[bounds[:-1] - begin]  # columns each row's entries reach
        if spans.numel() and int(spans.max()) > cols:
            raise FormatError(f"the MACKO arrays place an entry past column {cols - 1}; they do not encode "
                              f"a matrix with {cols} columns")


def _check_macko_columns(col_of: torch.Tensor, cols: int) -> None:
    if col_of.numel() and int(col_of.max()) >= cols:
        raise FormatError(f"the MACKO arrays place an entry past column {cols - 1}; they do not encode "
                          f"a matrix with {cols} columns")


def macko_decompress_reference(values: torch.Tensor, deltas: torch.Tensor, row_ptr: torch.Tensor,
                               cols: int) -> torch.Tensor:
    """The dense [rows, cols] matrix of a MACKO-16-4 triple (shared/FORMATS.md), vectorized."""
    stored = _check_macko_extent(values, deltas, row_ptr)
    row_of, col_of = _macko_entry_columns(unpack_nibbles(deltas, stored), row_ptr.long())
    _check_macko_columns(col_of, cols)
    dense = values.new_zeros(row_ptr.numel() - 1, cols)
    dense[row_of, col_of] = values[:stored]
    return dense


MACKO_WINDOW_COLS = 1024  # kernels/macko.h, kMackoWindowCols
MACKO_TILE_ROWS = 32  # kernels/macko.h, kMackoTileRows
MACKO_TENSOR_CORE_MAX_COLS = 1 << 23  # kernels/macko.h, kMackoTensorCoreMaxCols
_ORIGIN_BIAS = 15  # kernels/macko.h: a run's origin, -15 to 112, is stored plus this


def macko_window_table(values: torch.Tensor, deltas: torch.Tensor, row_ptr: torch.Tensor, cols: int) -> torch.Tensor:
    """The tensor-core SpMM's window table (kernels/macko.h), int32 [rows, windows - 1] on row_ptr's device.

    For each column window w = 1.. of MACKO_WINDOW_COLS columns, row r's run of that window starts at entry
    P = the row's first entry in or past the window, rounded up to a whole 8-entry chunk of the values array
    (at most the row's end), so that runs split no chunk. The entry is (P - the row's first entry) << 7 |
    (origin + 15), where origin = P's column - its nibble - the window's first column (-15 to 112; 0 when P
    is the row's end). Vectorized, in blocks of rows."""
    stored = _check_macko_extent(values, deltas, row_ptr)
    if cols > MACKO_TENSOR_CORE_MAX_COLS:
        raise FormatError(f"the tensor-core SpMM takes at most {MACKO_TENSOR_CORE_MAX_COLS} columns, got {cols}")
    rows = row_ptr.numel() - 1
    windows = max(1, -(-cols // MACKO_WINDOW_COLS))
    table = torch.full((rows, windows - 1), _ORIGIN_BIAS, dtype=torch.int32, device=row_ptr.device)
    if windows == 1 or stored == 0:
        return table
    starts = row_ptr.long()
    nibbles = unpack_nibbles(deltas, stored)
    window_starts = torch.arange(1, windows, device=row_ptr.device) * MACKO_WINDOW_COLS
    for first, bounds, begin, end in _row_blocks(starts, cols):
        if begin == end:
            continue
        row_starts, row_ends = bounds[:-1, None], bounds[1:, None]
        block_nibbles = nibbles[begin:end].long()
        row_of, col_of = _macko_entry_columns(block_nibbles, bounds - begin)
        _check_macko_columns(col_of, cols)
        # (row, window) keys are sorted (rows in order, columns rising): the first entry from window w on
        # is where key (row, w) would go
        keys = row_of * windows + col_of // MACKO_WINDOW_COLS
        block_rows_here = torch.arange(bounds.numel() - 1, device=keys.device)[:, None]
        inside = begin + torch.searchsorted(keys, block_rows_here * windows + window_starts // MACKO_WINDOW_COLS)
        run_start = torch.minimum((inside + 7) & ~7, row_ends)  # absolute: chunks are 8-entry aligned
        at = (run_start - begin).clamp(max=end - begin - 1)
        origin = torch.where(run_start < row_ends, col_of[at] - block_nibbles[at] - window_starts, 0)
        table[first:first + bounds.numel() - 1] = (((run_start - row_starts) << 7) | (origin + _ORIGIN_BIAS)).to(torch.int32)
    return table


def macko_spmv_reference(values: torch.Tensor, deltas: torch.Tensor, row_ptr: torch.Tensor, x: torch.Tensor,
                         residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                         eps: float = 0.0, silu_mul: bool = False) -> torch.Tensor:
    """x [T, K] @ W.T with W decompressed, in fp32, with the fusions of `linear_reference` (the norm,
    the residual add, silu(gate) * up): the CPU path and the oracle."""
    weight = macko_decompress_reference(values, deltas, row_ptr, x.shape[-1])
    return linear_reference(x, weight, norm_weight, eps, residual, silu_mul)


MACKO_FUSED_MAX_COLS = 16384  # kernels/macko.h, kMackoFusedMaxCols


@fake_impl("minfer::macko_spmv")
def _macko_spmv_fake(values, deltas, row_ptr, x, out, norm_weight, eps, steps, warps_per_block, x_in_smem, pipeline,
                     accumulate, silu_mul):
    return None


@fake_impl("minfer::macko_tensor_core_spmm")
def _macko_tensor_core_spmm_fake(values, deltas, row_ptr, window_table, x, out, partials, counters, k_splits,
                                 steps, accumulate):
    return None


@fake_impl("minfer::macko_decompress")
def _macko_decompress_fake(values, deltas, row_ptr, out):
    return None


MACKO_TENSOR_CORE_MIN_TOKENS = 9  # up to 8 tokens the CUDA-core SpMM is faster (docs/perf-notes.md, session 23)
MACKO_TENSOR_CORE_BLOCKS_PER_SM = 2  # kernels/macko_tensor_core_spmm.cu: two 512-thread blocks fit an SM


def macko_uses_tensor_cores(tokens: int) -> bool:
    """Whether macko_spmv runs `tokens` tokens on the tensor cores when given a window table."""
    return MACKO_TENSOR_CORE_MIN_TOKENS <= tokens <= MACKO_SPMM_MAX_TOKENS


def macko_k_splits(rows: int, cols: int, device: torch.device) -> int:
    """Shares of the column windows for the tensor-core SpMM, in equal shares of whole windows: about
    one block per block slot of the GPU (a 4096-row matrix has 128 tiles of rows: 2 shares on 132 SMs).
    The nearest share count, not the next larger one: each share adds partial sums, a merge and a spill
    product, and on an H100 4096 x 11008 took 56 us with 2 shares against 65 us with 3; matrices of at
    least one block per slot take 1 (12288 x 4096: 59 us against 64 us with 2; docs/perf-notes.md,
    session 23)."""
    windows = max(1, -(-cols // MACKO_WINDOW_COLS))
    tiles = max(1, -(-rows // MACKO_TILE_ROWS))
    slots = MACKO_TENSOR_CORE_BLOCKS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    wanted = max(1, min(windows, round(slots / tiles)))
    per_share = -(-windows // wanted)
    return -(-windows // per_share)


_macko_counters: dict[torch.device, list[torch.Tensor]] = {}


def _macko_tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The arrival counters of the k-split SpMM's tiles: zero at rest (every launch leaves them zero). A
    larger matrix gets a larger buffer; the smaller ones stay allocated, since CUDA graphs captured
    earlier keep their addresses."""
    buffers = _macko_counters.setdefault(device, [])
    if not buffers or buffers[-1].numel() < tiles:
        buffers.append(torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device))
    return buffers[-1]


def macko_tensor_core_spmm(values: torch.Tensor, deltas: torch.Tensor, row_ptr: torch.Tensor,
                           window_table: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None, *,
                           accumulate: bool = False, k_splits: int = 0, steps: int = 0) -> torch.Tensor:
    """out [T, N] (+)= x [T, K] @ W.T for up to 16 tokens on the tensor cores (kernels/macko.h), given the
    matrix's macko_window_table. `k_splits` shares of the column windows (0: macko_k_splits) run in
    parallel and are added in a fixed order; `steps` (1 or 2, 0: the tuned default) is a launch knob for
    benchmarks. Launches on one device share arrival counters, so calls
    from several streams at once are not supported."""
    if accumulate and out is None:
        raise FormatError("macko_tensor_core_spmm(accumulate=True) adds into `out`: pass the tensor to add into")
    rows = row_ptr.numel() - 1
    if out is None:
        out = x.new_empty(x.shape[0], rows)
    if not use_kernels(x):
        out.copy_(macko_spmv_reference(values, deltas, row_ptr, x, out if accumulate else None))
        return out
    if x.dim() != 2 or x.shape[0] > MACKO_SPMM_MAX_TOKENS:
        raise FormatError(f"macko_tensor_core_spmm takes x [T, K] with T <= {MACKO_SPMM_MAX_TOKENS}, got {tuple(x.shape)}")
    splits = k_splits or macko_k_splits(rows, x.shape[1], x.device)
    tiles = -(-rows // MACKO_TILE_ROWS)
    partials = (torch.empty(splits, MACKO_SPMM_MAX_TOKENS, tiles * MACKO_TILE_ROWS, dtype=torch.float32,
                            device=x.device) if splits > 1 else x.new_empty(0, dtype=torch.float32))
    torch.ops.minfer.macko_tensor_core_spmm(values, deltas, row_ptr, window_table, x, out, partials,
                                            _macko_tile_counters(x.device, tiles), splits, steps, accumulate)
    return out


def macko_spmv(values: torch.Tensor, deltas: torch.Tensor, row_ptr: torch.Tensor, x: torch.Tensor,
               out: torch.Tensor | None = None, *, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
               accumulate: bool = False, silu_mul: bool = False, window_table: torch.Tensor | None = None,
               steps: int = 0, warps_per_block: int = 0, x_in_smem: int = -1, pipeline: int = 1) -> torch.Tensor:
    """out [T, N] = x [T, K] @ W.T for a MACKO matrix W [N, K] (N = row_ptr.numel() - 1); with
    `accumulate`, out += x @ W.T in place (the residual add of a Llama sublayer); with `norm_weight`
    g [K], x is replaced by its RMSNorm times g (eps as in the model); with `silu_mul`, W is the MLP's
    [gate; up] and out [T, N / 2] = silu(gate) * up.

    One kernel pass reads the compressed weights once for up to 16 tokens (more tokens take more
    passes; prefill should decompress instead). The kernel fuses the norm and silu_mul for one token
    of up to MACKO_FUSED_MAX_COLS columns (decode); other inputs run the rms_norm kernel before and the
    silu_mul kernel after. With the matrix's `window_table` (macko_window_table), MACKO_TENSOR_CORE_MIN_TOKENS
    to 16 tokens run the tensor-core SpMM instead. `steps`, `warps_per_block`, `x_in_smem` are launch knobs for
    benchmarks, the
    defaults (0, 0, -1) pick the tuned configuration; `pipeline=0` runs the reference kernel's
    schedule (one step loaded then decoded, x gathered from global memory). The op's schema has no
    defaults (a defaulted argument segfaulted another op on the device), so this wrapper passes every
    knob.
    """
    if accumulate and out is None:
        raise FormatError("macko_spmv(accumulate=True) adds into `out`: pass the tensor to add into")
    if norm_weight is not None and norm_weight.shape != (x.shape[-1],):
        raise FormatError(f"macko_spmv: norm_weight must be [{x.shape[-1]}] for x {tuple(x.shape)}, "
                          f"got {tuple(norm_weight.shape)}")
    rows = row_ptr.numel() - 1
    if silu_mul and (rows % 2 or accumulate):
        raise FormatError(f"macko_spmv(silu_mul=True) needs W = [gate; up] with an even N (got {rows}) and no accumulate")
    if out is None:
        out = x.new_empty(x.shape[0], rows // 2 if silu_mul else rows)
    if use_kernels(x):
        tensor_cores = window_table is not None and macko_uses_tensor_cores(x.shape[0])
        fuses = (x.shape[0] == 1 and x.shape[1] <= MACKO_FUSED_MAX_COLS and pipeline != 0 and x_in_smem != 0
                 and not tensor_cores)
        if norm_weight is not None and not fuses:
            x, norm_weight = rms_norm(x, norm_weight, eps), None
        spmv_out = x.new_empty(x.shape[0], rows) if silu_mul and not fuses else out
        if tensor_cores:
            macko_tensor_core_spmm(values, deltas, row_ptr, window_table, x, spmv_out, accumulate=accumulate)
        else:
            torch.ops.minfer.macko_spmv(values, deltas, row_ptr, x, spmv_out, norm_weight, eps, steps,
                                        warps_per_block, x_in_smem, pipeline, accumulate, silu_mul and fuses)
        if spmv_out is not out:
            torch.ops.minfer.silu_mul(spmv_out, out)
    else:
        out.copy_(macko_spmv_reference(values, deltas, row_ptr, x, out if accumulate else None, norm_weight, eps,
                                       silu_mul))
    return out


def macko_decompress(values: torch.Tensor, deltas: torch.Tensor, row_ptr: torch.Tensor,
                     out: torch.Tensor | None = None, cols: int | None = None) -> torch.Tensor:
    """The dense [N, K] matrix of a MACKO triple, written into `out` (or a new [N, cols] tensor)."""
    if out is None:
        if cols is None:
            raise ValueError("macko_decompress needs `out` or `cols`")
        out = values.new_empty(row_ptr.numel() - 1, cols)
    if use_kernels(values):
        torch.ops.minfer.macko_decompress(values, deltas, row_ptr, out)
    else:
        out.copy_(macko_decompress_reference(values, deltas, row_ptr, out.shape[1]))
    return out


# ---- RMSNorm, with the residual add fused ----


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: variance in fp32 (or wider), the normalised value cast back to x's dtype,
    then multiplied by the weight."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    return weight * F.rms_norm(wide, (x.shape[-1],), eps=eps).to(x.dtype)  # torch's fused kernel on GPU


RMS_NORM_MAX_HIDDEN = {torch.float16: 16384, torch.bfloat16: 16384, torch.float32: 8192}  # kernels/rms_norm.h


def _check_rms_norm_row(x: torch.Tensor, weight: torch.Tensor) -> None:
    hidden = x.shape[-1]
    if weight.shape != (hidden,) or weight.dtype != x.dtype:
        raise MinferError(f"rms_norm needs a {x.dtype} weight of shape ({hidden},), got {weight.dtype} "
                          f"{tuple(weight.shape)}")
    if hidden > RMS_NORM_MAX_HIDDEN.get(x.dtype, 0) or (hidden > 8192 and hidden % 8):
        raise MinferError(f"the rms_norm kernel holds rows of up to {RMS_NORM_MAX_HIDDEN.get(x.dtype, 0)} "
                          f"{x.dtype} elements (8192 when not a multiple of 8), got {hidden}; "
                          "set_backend('torch') runs the reference")


@fake_impl("minfer::rms_norm")
def _rms_norm_fake(x, weight, eps, out):
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """rms_norm(x) * weight over the last dim, one pass over x (out may be x itself)."""
    if out is None:
        out = torch.empty_like(x)
    if use_kernels(x):
        _check_rms_norm_row(x, weight)
        torch.ops.minfer.rms_norm(x, weight, eps, out)
    else:
        out.copy_(rms_norm_reference(x, weight, eps))
    return out


@fake_impl("minfer::add_rms_norm")
def _add_rms_norm_fake(residual, x, weight, eps, out):
    return None


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """residual += x in place (rounded to its dtype, as `residual + x` is), then returns
    rms_norm(residual) * weight; one pass over residual and x."""
    if out is None:
        out = torch.empty_like(x)
    if use_kernels(x):
        _check_rms_norm_row(x, weight)
        torch.ops.minfer.add_rms_norm(residual, x, weight, eps, out)
    else:
        residual.add_(x)
        out.copy_(rms_norm_reference(residual, weight, eps))
    return out


# ---- RoPE fused with the KV-cache write ----


def rope_write_kv_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            input_pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """HF half-split RoPE (rotate_half) in fp32: q [B, T, Hq, D] rotated in place; rotated k and v
    [B, T, Hkv, D] stored into the [B, Hkv, S, D] caches at positions input_pos [T]."""
    c = cos[input_pos][:, None, :]  # [T, 1, D/2], broadcast over batch and heads
    s = sin[input_pos][:, None, :]
    cos_full, signed_sin = torch.cat((c, c), dim=-1), torch.cat((-s, s), dim=-1)

    def rotate(x):
        # x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1] folded into the sign of sin
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        return torch.addcmul(wide * cos_full, wide.roll(x.shape[-1] // 2, dims=-1), signed_sin)

    q.copy_(rotate(q))
    k_cache.index_copy_(2, input_pos, rotate(k).to(k.dtype).transpose(1, 2))
    v_cache.index_copy_(2, input_pos, v.transpose(1, 2))


@fake_impl("minfer::rope_write_kv")
def _rope_write_kv_fake(q, k, v, cos, sin, input_pos, k_cache, v_cache):
    return None


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  input_pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """RoPE on q in place and on k, then k and v written into the caches at input_pos, in one pass.

    q [B, T, Hq, D], k and v [B, T, Hkv, D] may be strided views (e.g. of the fused qkv output) with a
    contiguous last dim; cos and sin are fp32 [>= S, D/2] tables (Llama-3 scaling included), input_pos
    int64 [T] on the device, so the call is graph-capturable. k itself is left as it was. The kernel
    skips tokens whose position is outside the cache; the caller checks the context length.
    """
    if use_kernels(q):
        torch.ops.minfer.rope_write_kv(q, k, v, cos, sin, input_pos, k_cache, v_cache)
    else:
        rope_write_kv_reference(q, k, v, cos, sin, input_pos, k_cache, v_cache)


# ---- Decode attention: split-K flash-decoding with GQA ----

DECODE_ATTENTION_MAX_SPLITS = 256  # kernels/decode_attention.h: kDecodeAttnMaxSplits
DECODE_ATTENTION_SPLIT_ROWS = 64  # a split covers whole rounds of 4 warps x 16 positions


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               input_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence, q [B, Hq, D], over cache positions 0..input_pos[0] (clamped into
    the cache) of [B, Hkv, S, D] caches; query head h reads KV head h // (Hq / Hkv). Computed in fp32
    (or wider) without a host sync; positions past the live length are never used, even if NaN."""
    batch, q_heads, _ = q.shape
    kv_heads, max_seq_len = k_cache.shape[1], k_cache.shape[2]
    wide = torch.promote_types(q.dtype, torch.float32)
    last = input_pos.reshape(-1)[0].clamp(0, max_seq_len - 1)
    live = (torch.arange(max_seq_len, device=q.device) <= last)[:, None]  # [S, 1]
    k = torch.where(live, k_cache.to(wide), 0.0).repeat_interleave(q_heads // kv_heads, dim=1)
    v = torch.where(live, v_cache.to(wide), 0.0).repeat_interleave(q_heads // kv_heads, dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q.to(wide), k) * scale
    scores = scores.masked_fill(~live[:, 0], float("-inf"))
    return torch.einsum("bhs,bhsd->bhd", scores.softmax(dim=-1), v).to(q.dtype)


def decode_attention_splits(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device | str) -> int:
    """Splits per (batch, KV head) that give each SM one block; on the H100, 2x and 3x as many were
    slower at every context tried (more merge work, no more bandwidth)."""
    sms = torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    most_useful = -(-max_seq_len // DECODE_ATTENTION_SPLIT_ROWS)
    return max(1, min(sms // (batch * num_kv_heads), most_useful, DECODE_ATTENTION_MAX_SPLITS))


def _decode_attention_counter_floats(batch: int, num_kv_heads: int) -> int:
    return -(-batch * num_kv_heads // 4) * 4


def decode_attention_workspace(batch: int, num_heads: int, num_kv_heads: int, head_dim: int, max_seq_len: int,
                               device: torch.device | str, num_splits: int | None = None) -> torch.Tensor:
    """The zeroed fp32 buffer decode_attention keeps its per-split partials in; allocate it once per
    model (all layers can share it) and pass it to every call, so decode allocates nothing."""
    if num_splits is None:
        num_splits = decode_attention_splits(batch, num_kv_heads, max_seq_len, device)
    if not 1 <= num_splits <= DECODE_ATTENTION_MAX_SPLITS:
        raise MinferError(f"num_splits must be in 1..{DECODE_ATTENTION_MAX_SPLITS}, got {num_splits}")
    floats = _decode_attention_counter_floats(batch, num_kv_heads) + batch * num_heads * num_splits * (head_dim + 1)
    return torch.zeros(floats, dtype=torch.float32, device=device)


def _decode_attention_workspace_splits(workspace: torch.Tensor, batch: int, num_heads: int, num_kv_heads: int,
                                       head_dim: int) -> int:
    per_split = batch * num_heads * (head_dim + 1)
    splits, rest = divmod(workspace.numel() - _decode_attention_counter_floats(batch, num_kv_heads), per_split)
    if rest or not 1 <= splits <= DECODE_ATTENTION_MAX_SPLITS:
        raise MinferError(f"the decode_attention workspace ({workspace.numel()} floats) does not fit B={batch}, "
                          f"Hq={num_heads}, Hkv={num_kv_heads}, D={head_dim}; make it with decode_attention_workspace()")
    return splits


@fake_impl("minfer::decode_attention")
def _decode_attention_fake(q, k_cache, v_cache, input_pos, scale, out, workspace, num_splits, stages=0):
    return None


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, input_pos: torch.Tensor,
                     scale: float, out: torch.Tensor | None = None,
                     workspace: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [B, Hq, D] (one token per sequence) over cache positions 0..input_pos[0].

    input_pos is an int64 device tensor of one element, so a captured graph stays valid as the
    context grows. float16/bfloat16 with D 64 or 128 run the CUDA kernel, which reads each KV head
    once for all its query heads; float32 and other head dims run the reference (parity tests, tiny
    models). `workspace` comes from decode_attention_workspace(); without one, each call allocates.
    """
    if out is None:
        out = q.new_empty(q.shape)
    if use_kernels(q) and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in (64, 128):
        batch, num_heads, head_dim = q.shape
        num_kv_heads, max_seq_len = k_cache.shape[1], k_cache.shape[2]
        if num_heads % num_kv_heads or num_heads > 16 * num_kv_heads:
            raise MinferError(f"the decode_attention kernel takes 1..16 query heads per KV head, got Hq={num_heads}, "
                              f"Hkv={num_kv_heads}; set_backend('torch') runs the reference")
        if workspace is None:
            workspace = decode_attention_workspace(batch, num_heads, num_kv_heads, head_dim, max_seq_len, q.device)
        splits = _decode_attention_workspace_splits(workspace, batch, num_heads, num_kv_heads, head_dim)
        torch.ops.minfer.decode_attention(q, k_cache, v_cache, input_pos, scale, out, workspace, splits)
    else:
        out.copy_(decode_attention_reference(q, k_cache, v_cache, input_pos, scale))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m minfer.ops", description="Build minfer's CUDA kernels (JIT, ninja, cached)."
    )
    parser.add_argument("--build", action="store_true", help="compile every kernel and report where")
    parser.add_argument("--verbose", action="store_true", help="print each compiler command")
    args = parser.parse_args(argv)
    if not args.build:
        parser.print_help()
        return 0
    try:
        out = build(verbose=args.verbose)
    except KernelBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"minfer kernels built for {target_arch_list()} in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
