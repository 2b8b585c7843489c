"""Static KV cache: one preallocated K and V buffer per layer, [B, Hkv, max_seq_len, head_dim].

Preallocation keeps every decode step at fixed addresses and shapes, which CUDA graphs need.
What an attention kernel needs besides the cache (a workspace) belongs to the model's attention
backend (minfer.attention).
"""

from __future__ import annotations

import torch
from torch import nn


class KVCache(nn.Module):
    def __init__(self, batch_size: int, num_kv_heads: int, max_seq_len: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @property
    def max_seq_len(self) -> int:
        return self.k_cache.shape[2]


def kv_cache_bytes(num_layers: int, batch_size: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                   dtype: torch.dtype) -> int:
    """Bytes the K and V caches of all layers take (for memory estimates before allocating)."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * batch_size * num_kv_heads * max_seq_len * head_dim * element
