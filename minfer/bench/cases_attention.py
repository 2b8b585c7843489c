"""Block-sparse attention kernels as registry cases, so `apps/profile.py --op attention` can run them under a
profiler and `--suite kernels` times them beside their SDPA baselines: decode over a 32k cache (GQA 32/8) with
the sink-window layout of the issue's must table, and prefill at 16k, dense causal and sink-window. The
attention suite (attention_suite.py) is the full study with FlexAttention and every layout.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import ops
from ..attention.layouts import build_layout, compact, decode_layout, parse_layout
from .attention_suite import (BLOCK_SIZE, DECODE_KV_HEADS, HEAD_DIM, HEADS, decode_inputs, decode_kv_bytes,
                              kept_pairs)
from .kernel_suite import KernelCase, register

DECODE_CONTEXT = 32768
DECODE_LAYOUT = "sink-window:sink=128,window=2048"
PREFILL_LENGTH = 16384
PREFILL_LAYOUTS = ("causal", "sink-window:sink=128,window=1024")


def decode_case(dtype: torch.dtype) -> KernelCase:
    seq_len, kv_heads = DECODE_CONTEXT, DECODE_KV_HEADS
    layout = decode_layout(compact(build_layout(DECODE_LAYOUT, HEADS, seq_len, BLOCK_SIZE), seq_len, BLOCK_SIZE),
                           kv_heads, parse_layout(DECODE_LAYOUT))
    element = torch.empty((), dtype=dtype).element_size()

    def build(copies):
        form = layout.to("cuda")
        q, k_caches, v_caches, out, position = decode_inputs(seq_len, copies, dtype)
        workspace = ops.decode_attention_workspace(1, HEADS, kv_heads, HEAD_DIM, form.most_kept_positions, "cuda")
        scale = HEAD_DIM**-0.5
        return (lambda i: form.attend(q, k_caches[i], v_caches[i], position, scale, out, workspace)), (
            lambda i: F.scaled_dot_product_attention(q[:, :, None], k_caches[i], v_caches[i], scale=scale,
                                                     enable_gqa=True))

    kv_bytes = decode_kv_bytes(layout, seq_len, kv_heads, element)
    return KernelCase(op="attention", shape=f"decode ctx{seq_len} hq{HEADS} hkv{kv_heads} {DECODE_LAYOUT}",
                      dtype=dtype, bytes=kv_bytes + 2 * HEADS * HEAD_DIM * element,
                      flops=4 * HEADS * HEAD_DIM * kv_bytes // (2 * HEAD_DIM * element * kv_heads),
                      build=build, baseline="SDPA dense")


def prefill_case(name: str, dtype: torch.dtype) -> KernelCase:
    seq_len = PREFILL_LENGTH
    layout = build_layout(name, HEADS, seq_len, BLOCK_SIZE)
    packed = compact(layout, seq_len, BLOCK_SIZE)

    def build(copies):
        form = packed.to("cuda")
        shape = (1, HEADS, seq_len, HEAD_DIM)
        inputs = [[torch.randn(shape, device="cuda").to(dtype) for _ in range(3)] for _ in range(copies)]
        out = torch.empty(shape, dtype=dtype, device="cuda")
        scale = 1 / math.sqrt(HEAD_DIM)
        return (lambda i: form.attend(*inputs[i], scale, out)), (
            lambda i: F.scaled_dot_product_attention(*inputs[i], is_causal=True, scale=scale))

    return KernelCase(op="attention", shape=f"prefill s{seq_len} h{HEADS} {name}", dtype=dtype,
                      bytes=4 * HEADS * seq_len * HEAD_DIM * torch.empty((), dtype=dtype).element_size(),
                      flops=4 * HEAD_DIM * kept_pairs(layout, seq_len, HEADS), build=build,
                      baseline="SDPA causal", bound="compute")


def attention_cases(dtype: torch.dtype) -> list[KernelCase]:
    if dtype not in (torch.float16, torch.bfloat16):
        return []  # float32 runs the references: nothing of ours to time
    return [decode_case(dtype)] + [prefill_case(name, dtype) for name in PREFILL_LAYOUTS]


register("attention", attention_cases)
