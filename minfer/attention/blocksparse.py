"""Block-sparse attention: a prompt's queries visit only the kept key tiles of a layout (layouts.py).

Prefill runs ops.blocksparse_attention over the layout's compact form, built once per prompt length and
device (layouts.compact_layout caches it). Decode is dense for now: the block-sparse decode kernel is
not built yet, so one query token attends to every cached position through DenseAttention's path (the
split-K kernel on a GPU under minfer's kernels, SDPA otherwise), whose workspace this backend owns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..config import ModelConfig
from ..errors import MinferError
from ..kv_cache import KVCache
from .base import AttentionBackend, AttentionPass
from .dense import DenseAttention
from .layouts import CompactLayout, build_layout, compact_layout, parse_layout


class BlockSparseAttention(AttentionBackend):
    name = "blocksparse"

    def __init__(self, config: ModelConfig, max_batch_size: int, max_seq_len: int, dtype: torch.dtype,
                 device: torch.device, layout: str = "causal", block_size: int = 64):
        super().__init__(config, max_batch_size, max_seq_len, dtype, device)
        self.layout = parse_layout(layout)
        self.block_size = block_size
        self.heads = config.num_heads
        self.device = device
        # Built here for the whole cache so a bad block size or a file layout too small fails at setup.
        self.full_layout = build_layout(self.layout, self.heads, max_seq_len, block_size)
        self.dense = DenseAttention.create(config, max_batch_size, max_seq_len, dtype, device)

    @contextlib.contextmanager
    def forward_pass(self, input_pos: torch.Tensor, tokens: int, kv_len: int) -> Iterator[AttentionPass]:
        with self.dense.forward_pass(input_pos, tokens, kv_len) as step:
            yield step

    def compact(self, seq_len: int) -> CompactLayout:
        return compact_layout(self.layout, self.heads, seq_len, self.block_size, self.device)

    def prefill(self, q: torch.Tensor, cache: KVCache, step: AttentionPass) -> torch.Tensor:
        tokens = q.shape[1]
        if tokens != step.kv_len:
            raise MinferError(f"block-sparse prefill takes a prompt at positions 0..T-1 (T == kv_len), got "
                              f"{tokens} tokens over {step.kv_len} cache positions")
        out = torch.empty_like(q)
        k, v = cache.k_cache[:, :, :tokens], cache.v_cache[:, :, :tokens]
        self.compact(tokens).attend(q.transpose(1, 2), k, v, self.scale, out.transpose(1, 2))
        return out

    def decode(self, q: torch.Tensor, cache: KVCache, step: AttentionPass) -> torch.Tensor:
        return self.dense.decode(q, cache, step)
