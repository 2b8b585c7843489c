"""Fused decode ops against the torch code they replace: RMSNorm (+ residual add) and RoPE + KV
write against their references, decode attention against torch SDPA (GQA), same run, same inputs.

Decode-sized norm and RoPE inputs are a few KB, so their rotated copies sit in L2 as they do in the
engine; the attention caches are rotated past L2 (each copy is the whole live context).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import ops
from .kernel_suite import KernelCase, register

EPS = 1e-5
NORM_SHAPES = [(1, 4096), (1, 8192), (512, 4096)]  # decode Llama-7B/8B, decode 70B, a prefill chunk
# (tokens, Hq, Hkv, D): Llama-3-8B and Llama-2-7B decode, Llama-3-8B prefill chunk.
ROPE_SHAPES = [(1, 32, 8, 128), (1, 32, 32, 128), (512, 32, 8, 128)]
ROPE_CACHE_LEN = 4096
# (context, Hq, Hkv, D) at batch 1: Llama-3-8B and Llama-2-7B heads over 4k-32k, and TinyLlama's D 64.
ATTENTION_SHAPES = [(ctx, 32, hkv, 128) for hkv in (8, 32) for ctx in (1024, 4096, 8192, 16384, 32768)]
ATTENTION_SHAPES += [(4096, 32, 4, 64)]


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def rms_norm_case(rows: int, hidden: int, dtype: torch.dtype) -> KernelCase:
    def build(copies):
        xs = [torch.randn(rows, hidden, device="cuda").to(dtype) for _ in range(copies)]
        weight = torch.randn(hidden, device="cuda").to(dtype)
        out = torch.empty(rows, hidden, device="cuda", dtype=dtype)
        return (lambda i: ops.rms_norm(xs[i], weight, EPS, out=out)), (
            lambda i: ops.rms_norm_reference(xs[i], weight, EPS))

    nbytes = element_size(dtype) * (2 * rows * hidden + hidden)
    return KernelCase(op="rms_norm", shape=f"{rows}x{hidden}", dtype=dtype, bytes=nbytes, flops=4 * rows * hidden,
                      build=build, baseline="torch ops")


def add_rms_norm_case(rows: int, hidden: int, dtype: torch.dtype) -> KernelCase:
    def build(copies):
        xs = [torch.randn(rows, hidden, device="cuda").to(dtype) for _ in range(copies)]
        residuals = [torch.randn(rows, hidden, device="cuda").to(dtype) for _ in range(copies)]
        weight = torch.randn(hidden, device="cuda").to(dtype)
        out = torch.empty(rows, hidden, device="cuda", dtype=dtype)

        def baseline(i):
            residuals[i].add_(xs[i])
            return ops.rms_norm_reference(residuals[i], weight, EPS)

        return (lambda i: ops.add_rms_norm(residuals[i], xs[i], weight, EPS, out=out)), baseline

    nbytes = element_size(dtype) * (4 * rows * hidden + hidden)  # read residual, x, weight; write residual, out
    return KernelCase(op="add_rms_norm", shape=f"{rows}x{hidden}", dtype=dtype, bytes=nbytes,
                      flops=5 * rows * hidden, build=build, baseline="torch ops")


def rope_case(tokens: int, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> KernelCase:
    def build(copies):
        width = (q_heads + 2 * kv_heads) * head_dim
        qkvs = [torch.randn(1, tokens, width, device="cuda").to(dtype) for _ in range(copies)]
        views = [qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1) for qkv in qkvs]
        views = [tuple(t.view(1, tokens, -1, head_dim) for t in qkv) for qkv in views]
        angles = torch.rand(ROPE_CACHE_LEN, head_dim // 2, device="cuda") * 6.3
        cos, sin = angles.cos(), angles.sin()
        cache_shape = (1, kv_heads, ROPE_CACHE_LEN, head_dim)
        k_cache = torch.zeros(cache_shape, device="cuda", dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        positions = torch.arange(100, 100 + tokens, device="cuda")
        return (lambda i: ops.rope_write_kv(*views[i], cos, sin, positions, k_cache, v_cache)), (
            lambda i: ops.rope_write_kv_reference(*views[i], cos, sin, positions, k_cache, v_cache))

    size = element_size(dtype)
    # q read and written, k and v read, their cache rows written, cos and sin rows read, positions read.
    nbytes = size * tokens * head_dim * (2 * q_heads + 4 * kv_heads) + tokens * (4 * head_dim + 8)
    return KernelCase(op="rope_write_kv", shape=f"t{tokens} hq{q_heads} hkv{kv_heads} d{head_dim}", dtype=dtype,
                      bytes=nbytes, flops=3 * tokens * (q_heads + kv_heads) * head_dim, build=build,
                      baseline="torch ops")


def decode_attention_case(context: int, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                          num_splits: int | None = None) -> KernelCase:
    """The cache holds exactly `context` positions, all live; the baseline is SDPA on the same cache."""

    def build(copies):
        shape = (1, kv_heads, context, head_dim)
        k_caches = [torch.randn(shape, device="cuda").to(dtype) for _ in range(copies)]
        v_caches = [torch.randn(shape, device="cuda").to(dtype) for _ in range(copies)]
        q = torch.randn(1, q_heads, head_dim, device="cuda").to(dtype)
        position = torch.tensor([context - 1], device="cuda")
        workspace = ops.decode_attention_workspace(1, q_heads, kv_heads, head_dim, context, "cuda", num_splits)
        out = torch.empty_like(q)
        scale = head_dim**-0.5
        return (lambda i: ops.decode_attention(q, k_caches[i], v_caches[i], position, scale, out=out,
                                               workspace=workspace)), (
            lambda i: F.scaled_dot_product_attention(q[:, :, None], k_caches[i], v_caches[i], scale=scale,
                                                     enable_gqa=True))

    size = element_size(dtype)
    nbytes = size * (2 * kv_heads * context * head_dim + 2 * q_heads * head_dim)
    label = f"ctx{context} hq{q_heads} hkv{kv_heads} d{head_dim}" + (f" s{num_splits}" if num_splits else "")
    return KernelCase(op="decode_attention", shape=label, dtype=dtype, bytes=nbytes,
                      flops=4 * q_heads * context * head_dim, build=build, baseline="SDPA")


def attention_cases(dtype: torch.dtype) -> list[KernelCase]:
    if dtype not in (torch.float16, torch.bfloat16):
        return []  # float32 runs the reference: nothing of ours to time
    return [decode_attention_case(*shape, dtype) for shape in ATTENTION_SHAPES]


register("rms_norm", lambda dtype: [rms_norm_case(r, h, dtype) for r, h in NORM_SHAPES])
register("add_rms_norm", lambda dtype: [add_rms_norm_case(r, h, dtype) for r, h in NORM_SHAPES])
register("rope_write_kv", lambda dtype: [rope_case(*shape, dtype) for shape in ROPE_SHAPES])
register("decode_attention", attention_cases)
