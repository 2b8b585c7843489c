"""The attention-backend contract: how a model's layers attend over their KV caches.

A backend is chosen once per model, when `Transformer.setup_caches` sizes the caches, and owns what
its kernels need besides the caches (a workspace). Each forward pass opens `forward_pass`, which
prepares what every layer shares (a mask, a library setting) and yields it as an `AttentionPass`;
each layer then calls `decode` (one query token per sequence) or `prefill` (several).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..config import ModelConfig
from ..kv_cache import KVCache


@dataclass(frozen=True)
class AttentionPass:
    """What the layers of one forward pass share: the positions of its tokens (int64 [T] on the cache's
    device), the cache positions [0, kv_len) they may attend to, and the additive mask [T, kv_len]
    (0 where visible, -inf elsewhere) when the backend needs one."""

    input_pos: torch.Tensor
    kv_len: int
    mask: torch.Tensor | None = None


class AttentionBackend(ABC):
    """Attention of q [B, T, Hq, D] over a layer's KVCache ([B, Hkv, S, D]); query head h reads KV head
    h // (Hq / Hkv), as HF's repeat_kv does. Returns [B, T, Hq, D]."""

    name: ClassVar[str]
    # Whether `prefill` may run inside CUDA-graph capture (no host sync, no host-to-device copy): the
    # Generator captures the prefill only then.
    prefill_capturable: bool = True

    def __init__(self, config: ModelConfig, max_batch_size: int, max_seq_len: int, dtype: torch.dtype,
                 device: torch.device):
        self.scale = config.head_dim ** -0.5

    @classmethod
    def create(cls, config: ModelConfig, max_batch_size: int, max_seq_len: int, dtype: torch.dtype,
               device: torch.device, **options) -> AttentionBackend:
        """The backend for caches of this size, dtype and device, with the backend's own `options` (its
        __init__ keywords); a backend whose kernels take only some devices or shapes picks its
        implementation here."""
        return cls(config, max_batch_size, max_seq_len, dtype, device, **options)

    @contextlib.contextmanager
    def forward_pass(self, input_pos: torch.Tensor, tokens: int, kv_len: int) -> Iterator[AttentionPass]:
        """Opened once per forward pass around all layers: `tokens` tokens per sequence at positions
        input_pos attend to cache positions [0, kv_len)."""
        yield AttentionPass(input_pos, kv_len)

    @abstractmethod
    def prefill(self, q: torch.Tensor, cache: KVCache, step: AttentionPass) -> torch.Tensor:
        """Several query tokens per sequence, already written into the cache with their keys and values."""

    @abstractmethod
    def decode(self, q: torch.Tensor, cache: KVCache, step: AttentionPass) -> torch.Tensor:
        """One query token per sequence (graph-capturable: no host sync, nothing allocated that changes
        between steps)."""
