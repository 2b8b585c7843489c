"""Block-sparse attention: queries visit only the kept key tiles of a layout (layouts.py).

Prefill runs ops.blocksparse_attention over the layout's compact form, built once per prompt length and
device (layouts.compact_layout caches it). Decode runs the split-K decode kernel over the decode form of
the layout built once for the whole cache (`DecodeLayout.attend`): the kernel finds the kept tiles of the
query tile holding the position on the device (sink-window by arithmetic on the position, other layouts
from the lists), so a captured step stays valid as the context grows, and its splits share only those
tiles. Heads of one KV group whose kept tiles differ
(bigbird, per-head file layouts) read the union of the group's tiles once, each head masking the tiles
it does not keep. The layout decode uses is the one built for the whole cache; every named layout's blocks
depend on their position alone, so a prompt's prefill keeps the blocks the decode steps after it see.
"""

from __future__ import annotations

import torch

from .. import ops
from ..config import ModelConfig
from ..errors import MinferError
from ..kv_cache import KVCache
from .base import AttentionBackend, AttentionPass
from .layouts import CompactLayout, compact_layout, decode_layout, parse_layout


class BlockSparseAttention(AttentionBackend):
    name = "blocksparse"

    def __init__(self, config: ModelConfig, max_batch_size: int, max_seq_len: int, dtype: torch.dtype,
                 device: torch.device, layout: str = "causal", block_size: int = 64):
        super().__init__(config, max_batch_size, max_seq_len, dtype, device)
        self.layout = parse_layout(layout)
        self.block_size = block_size
        self.heads = config.num_heads
        self.device = device
        self.prefill_capturable = ops.kernels_run_on(device) and ops.blocksparse_kernel_supports(dtype,
                                                                                                config.head_dim)
        # Built here for the whole cache so a bad block size or a file layout too small fails at setup.
        self.decode_layout = decode_layout(self.compact(max_seq_len), config.num_kv_heads, self.layout)
        self.workspace = None
        if ops.kernels_run_on(device) and ops.decode_attention_supports(dtype, config.num_heads, config.num_kv_heads,
                                                                        config.head_dim):
            self.workspace = ops.decode_attention_workspace(max_batch_size, config.num_heads, config.num_kv_heads,
                                                            config.head_dim, self.decode_layout.most_kept_positions,
                                                            device)

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
        out = self.decode_layout.attend(q[:, 0], cache.k_cache, cache.v_cache, step.input_pos, self.scale,
                                        workspace=self.workspace)
        return out.unsqueeze(1)
