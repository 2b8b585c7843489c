"""Attention backends, by name: a model picks one when its caches are set up
(`Transformer.setup_caches(attention=...)`). A new backend is one module here whose class is
registered below."""

from __future__ import annotations

from ..errors import MinferError
from .base import AttentionBackend, AttentionPass
from .blocksparse import BlockSparseAttention
from .dense import DenseAttention

ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    cls.name: cls for cls in (DenseAttention, BlockSparseAttention)
}


def attention_class(name: str) -> type[AttentionBackend]:
    if name not in ATTENTION_BACKENDS:
        raise MinferError(f"unknown attention backend {name!r}; choose one of: {', '.join(sorted(ATTENTION_BACKENDS))}")
    return ATTENTION_BACKENDS[name]


__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionPass", "BlockSparseAttention", "DenseAttention",
           "attention_class"]
