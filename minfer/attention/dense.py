"""Dense attention: every query attends to every visible cache position.

`DenseAttention` runs torch's SDPA for prefill and decode (the CPU path, the torch backend, and
shapes the kernel does not take); on a GPU under minfer's kernels, `create` picks
`SplitKDecodeAttention`, whose decode runs the split-K flash-decoding kernel.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import ops
from ..config import ModelConfig
from ..kv_cache import KVCache
from .base import AttentionBackend, AttentionPass

# Prefill attention (several query tokens, through torch's SDPA) skips the cuDNN backend: that one
# spends ~100 us of host time per call, which a short prompt's eager prefill waits on (llama2-7b,
# 17 tokens, H100: 15.9 -> 12.4 ms; 512 tokens unchanged at 13.5-13.8 ms). One-token attention on
# the torch backend runs inside a CUDA graph, where host time is free, and keeps torch's choice.
# forward_pass selects these backends around all layers.
PREFILL_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class DenseAttention(AttentionBackend):
    name = "dense"

    def __init__(self, config: ModelConfig, max_batch_size: int, max_seq_len: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__(config, max_batch_size, max_seq_len, dtype, device)
        self.mask_dtype = dtype
        self.positions = torch.arange(max_seq_len, device=device)

    @classmethod
    def create(cls, config: ModelConfig, max_batch_size: int, max_seq_len: int, dtype: torch.dtype,
               device: torch.device, **options) -> AttentionBackend:
        if ops.kernels_run_on(device) and ops.decode_attention_supports(dtype, config.num_heads, config.num_kv_heads,
                                                                        config.head_dim):
            return SplitKDecodeAttention(config, max_batch_size, max_seq_len, dtype, device, **options)
        return cls(config, max_batch_size, max_seq_len, dtype, device, **options)

    @contextlib.contextmanager
    def forward_pass(self, input_pos: torch.Tensor, tokens: int, kv_len: int) -> Iterator[AttentionPass]:
        """The mask is built once here rather than in every layer; T == kv_len means a prompt at
        positions 0..T-1, which needs none (plain causal attention). Several tokens run under
        PREFILL_SDPA_BACKENDS, entered once per pass (each entry costs ~13 us of host time)."""
        mask = None if tokens == kv_len else self._mask(input_pos, kv_len)
        with sdpa_kernel(PREFILL_SDPA_BACKENDS) if tokens > 1 else contextlib.nullcontext():
            yield AttentionPass(input_pos, kv_len, mask)

    def _mask(self, input_pos: torch.Tensor, kv_len: int) -> torch.Tensor:
        visible = self.positions[:kv_len] <= input_pos[:, None]
        return torch.where(visible, 0.0, float("-inf")).to(self.mask_dtype)

    def prefill(self, q: torch.Tensor, cache: KVCache, step: AttentionPass) -> torch.Tensor:
        k, v = cache.k_cache[:, :, :step.kv_len], cache.v_cache[:, :, :step.kv_len]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=step.mask, is_causal=step.mask is None, scale=self.scale,
            enable_gqa=q.shape[2] != k.shape[1],
        )
        return out.transpose(1, 2)

    def decode(self, q: torch.Tensor, cache: KVCache, step: AttentionPass) -> torch.Tensor:
        return self.prefill(q, cache, step)


class SplitKDecodeAttention(DenseAttention):
    """Decode on minfer's split-K flash-decoding kernel, which reads the live length from input_pos on
    the device (no mask, no kv_len), over a workspace allocated once for all layers; prefill as
    DenseAttention."""

    def __init__(self, config: ModelConfig, max_batch_size: int, max_seq_len: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__(config, max_batch_size, max_seq_len, dtype, device)
        self.workspace = ops.decode_attention_workspace(max_batch_size, config.num_heads, config.num_kv_heads,
                                                        config.head_dim, max_seq_len, device)

    @contextlib.contextmanager
    def forward_pass(self, input_pos: torch.Tensor, tokens: int, kv_len: int) -> Iterator[AttentionPass]:
        if tokens > 1:
            with super().forward_pass(input_pos, tokens, kv_len) as step:
                yield step
        else:
            yield AttentionPass(input_pos, kv_len)

    def decode(self, q: torch.Tensor, cache: KVCache, step: AttentionPass) -> torch.Tensor:
        out = ops.decode_attention(q[:, 0], cache.k_cache, cache.v_cache, step.input_pos, self.scale,
                                   workspace=self.workspace)
        return out.unsqueeze(1)
