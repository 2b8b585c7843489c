"""MACKO SpMV/SpMM cases: Llama-2-7B projections pruned per row to a density, against cuBLAS dense.

Bytes are the MACKO format's own (values 2P + deltas P/2 + row_ptr) plus x and y, so "% copy BW"
says how close the kernel runs to the memory floor of the compressed matrix. The speedup is over
F.linear on the dense matrix (cuBLAS): the time saved by storing the matrix sparse. `macko_fused` times
the decode's projections as the engine runs them (norm, silu(gate) * up or residual add fused in) at
d = 0.5, against the same torch steps on the dense matrix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import ops
from ..formats.macko import compress
from ..sparsity.prune import prune_magnitude_
from .cases_gemv import FUSED_SHAPES, FUSION_BASELINES, fused_inputs, fused_io_bytes, torch_fused_projection
from .kernel_suite import KernelCase, register

# (N, K): fused qkv, o, fused gate_up, down, lm_head of Llama-2-7B.
LLAMA2_7B_SHAPES = [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008), (32000, 4096)]
DENSITIES = (0.1, 0.3, 0.5, 0.7, 0.9)
TOKEN_COUNTS = (1, 8, 16)  # 16: the tensor-core SpMM (ops.macko_uses_tensor_cores)
FUSED_DENSITY = 0.5  # issue #4's decode target


def pruned_matrix(n: int, k: int, density: float, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A random [n, k] matrix on the GPU with the round(density * k) largest |w| of each row kept."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    weight = (torch.randn(n, k, device="cuda", generator=generator) / k**0.5).to(dtype)
    return prune_magnitude_(weight, density)


def macko_bytes(values: torch.Tensor, row_ptr: torch.Tensor, n: int, k: int, tokens: int) -> int:
    """The fewest bytes one product moves: the compressed matrix once, x read and y written."""
    size = values.element_size()
    return values.numel() * size + values.numel() // 2 + row_ptr.numel() * 4 + size * tokens * (n + k)


def rotated(tensors: tuple[torch.Tensor, ...], copies: int) -> list[tuple[torch.Tensor, ...]]:
    """`copies` independent copies (so back-to-back calls read past L2); the first is the original."""
    return [tensors] + [tuple(t.clone() for t in tensors) for _ in range(copies - 1)]


def pruned_arrays(n: int, k: int, density: float, dtype: torch.dtype) -> tuple[tuple[torch.Tensor, ...], int]:
    """MACKO arrays of `pruned_matrix` and its nonzero count."""
    dense = pruned_matrix(n, k, density, dtype)
    return compress(dense), int(torch.count_nonzero(dense))


def macko_case(n: int, k: int, density: float, tokens: int, dtype: torch.dtype,
               pruned: tuple[tuple[torch.Tensor, ...], int]) -> KernelCase:
    arrays, nonzeros = pruned

    def build(copies):
        macko = rotated(arrays, copies)
        dense_copies = rotated((ops.macko_decompress(*arrays, cols=k),), copies)
        table = ops.macko_window_table(*arrays, k) if ops.macko_uses_tensor_cores(tokens) else None
        x = torch.randn(tokens, k, device="cuda", dtype=dtype)
        out = torch.empty(tokens, n, device="cuda", dtype=dtype)
        return ((lambda i: ops.macko_spmv(*macko[i], x, out=out, window_table=table)),
                (lambda i: F.linear(x, dense_copies[i][0])))

    return KernelCase(op="macko", shape=f"{n}x{k} d{density} t{tokens}", dtype=dtype,
                      bytes=macko_bytes(arrays[0], arrays[2], n, k, tokens),
                      flops=2 * nonzeros * tokens, build=build, baseline="F.linear dense")


def macko_cases(dtype: torch.dtype) -> list[KernelCase]:
    """The cases of every token count share one matrix per shape and density. Only the cases hold it
    (no module-level cache): once the suite drops them, the GPU memory is free for what runs next,
    such as the end-to-end suites' peak-memory measurements."""
    pruned = {(n, k, d): pruned_arrays(n, k, d, dtype) for d in DENSITIES for n, k in LLAMA2_7B_SHAPES}
    return [macko_case(n, k, d, t, dtype, pruned[n, k, d])
            for t in TOKEN_COUNTS for d in DENSITIES for n, k in LLAMA2_7B_SHAPES]


def fused_macko_case(n: int, k: int, fusion: str, dtype: torch.dtype, tokens: int = 1) -> KernelCase:
    """A decode step's projection as the engine runs it (the norm, silu(gate) * up or the residual add
    fused into the SpMV or SpMM), against the same torch steps on the dense matrix: what `macko` times
    plain."""
    arrays, nonzeros = pruned_arrays(n, k, FUSED_DENSITY, dtype)

    def build(copies):
        macko = rotated(arrays, copies)
        dense_copies = rotated((ops.macko_decompress(*arrays, cols=k),), copies)
        table = ops.macko_window_table(*arrays, k) if ops.macko_uses_tensor_cores(tokens) else None
        x, out, fused = fused_inputs(n, k, fusion, dtype, tokens)
        return ((lambda i: ops.macko_spmv(*macko[i], x, out=out, window_table=table, **fused)),
                (lambda i: torch_fused_projection(x, dense_copies[i][0], out, fused)))

    size = torch.finfo(dtype).bits // 8
    return KernelCase(op="macko_fused", shape=f"{n}x{k} d{FUSED_DENSITY} t{tokens} +{fusion}", dtype=dtype,
                      bytes=macko_bytes(arrays[0], arrays[2], n, k, 0) + fused_io_bytes(n, k, fusion, size, tokens),
                      flops=2 * nonzeros * tokens, build=build, baseline=f"{FUSION_BASELINES[fusion]}, dense")


# Batched decode and speculative verification add o and down into the residual for several tokens:
# 4 run on the CUDA-core SpMM, 16 on the tensor-core one.
SPMM_ADD_TOKENS = (4, 16)

register("macko", macko_cases, densities=DENSITIES)
# The decode's fused projections (lm_head stays dense in the model, so not its norm case).
register("macko_fused", lambda dtype: [fused_macko_case(n, k, fusion, dtype) for n, k, fusion in FUSED_SHAPES
                                       if (n, k) != (32000, 4096)]
         + [fused_macko_case(n, k, fusion, dtype, t) for t in SPMM_ADD_TOKENS for n, k, fusion in FUSED_SHAPES
            if fusion == "add"])
