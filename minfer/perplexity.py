"""Perplexity of a model on a text, through minfer's prefill path (the kernels on a GPU, the
references on the CPU): how much pruning costs, measured the way pruning papers report it.

The text is tokenized once, without BOS, and cut into non-overlapping windows of seq_len - 1
tokens; each window runs as BOS followed by its tokens, so it starts as a document does in
training, and every one of its tokens is predicted once (the first from BOS alone) from that
window only. A last piece shorter than a window is left out. Perplexity is exp of the mean
cross-entropy over all scored tokens, computed in fp32 from the logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from .errors import MinferError

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "stories.txt"
DEFAULT_SEQ_LEN = 512


@dataclass(frozen=True)
class Perplexity:
    perplexity: float
    mean_nll: float  # nats per scored token
    tokens: int  # scored tokens
    windows: int


def text_windows(ids: list[int], seq_len: int, bos_id: int, vocab_size: int) -> torch.Tensor:
    """[windows, seq_len] token ids: BOS, then the next seq_len - 1 text tokens, window after window;
    every id must lie in the model's vocabulary of `vocab_size`."""
    if seq_len < 2:
        raise MinferError(f"--seq-len must be at least 2 (BOS and one token to predict), got {seq_len}")
    per_window = seq_len - 1
    count = len(ids) // per_window
    if count == 0:
        raise MinferError(f"the text has {len(ids)} tokens, fewer than one window of {per_window} (--seq-len "
                          f"{seq_len} less BOS); pass a longer text or a smaller --seq-len")
    text = torch.tensor(ids[:count * per_window], dtype=torch.long).view(count, per_window)
    windows = torch.cat([torch.full((count, 1), bos_id, dtype=torch.long), text], dim=1)
    if windows.min() < 0 or windows.max() >= vocab_size:
        raise MinferError(f"the tokenizer yields token ids up to {int(windows.max())} but the model's vocabulary "
                          f"has {vocab_size}; pass the model's own tokenizer")
    return windows


@torch.inference_mode()
def perplexity(model: nn.Module, windows: torch.Tensor, progress: bool = False,
               label: str = "perplexity") -> Perplexity:
    """The perplexity of `model` over `windows` ([windows, seq_len] ids from text_windows), one
    window at a time as a prompt prefill, with a progress bar on stderr when `progress`."""
    count, seq_len = windows.shape
    device = model.norm.weight.device
    model.setup_caches(1, seq_len)
    positions = model.positions[:seq_len]
    total = torch.zeros((), dtype=torch.float64, device=device)
    for window in tqdm(windows.to(device), desc=label, unit="window", disable=not progress):
        logits = model(window[None], positions, kv_len=seq_len)[0, :-1]
        total += F.cross_entropy(logits.float(), window[1:], reduction="sum")
    tokens = count * (seq_len - 1)
    mean_nll = total.item() / tokens
    value = math.inf if mean_nll > 709.0 else math.exp(mean_nll)  # math.exp overflows past 709
    return Perplexity(value, mean_nll, tokens, count)
