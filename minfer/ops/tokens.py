"""Tokens in and out (kernels/tokens): the embedding lookup, and greedy argmax with the token hand-off
of a decode step."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import DeviceError, FormatError
from .runtime import fake_impl, use_kernels


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
