"""Token sampling on the device: greedy, temperature, top-k and top-p, with no host sync.

Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks index i with
probability p_i. It needs one random draw and one argmax, no cumulative search and no `.item()`,
so it runs inside a CUDA graph (the torch.Generator is registered with the graph).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import ops
from .errors import MinferError


# Below this, sampling is greedy in effect; near 1e-38, logits / temperature overflows float32 into NaN.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k None (or 0) and top_p 1.0 mean no truncation."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf):  # NaN is refused too
            raise MinferError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE} (below that "
                              f"sampling is greedy in effect), got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            raise MinferError(f"top_k must be >= 1 (or 0/None to disable), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise MinferError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.seed < 2**64:  # what torch.Generator.manual_seed takes
            raise MinferError(f"seed must be in [0, 2**64 - 1], got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def kernel_key(self) -> tuple:
        """What the sampling computation depends on (the seed only sets the generator state)."""
        if self.greedy:
            return ("greedy",)
        return ("sample", self.temperature, self.top_k or None, self.top_p)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """fp32 logits / temperature with everything outside top-k and top-p set to -inf."""
    scores = logits.float() / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        values, indices = torch.topk(scores, params.top_k, dim=-1)
        scores = torch.full_like(scores, float("-inf")).scatter_(-1, indices, values)
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass; the first always stays.
        mass_before = torch.cumsum(probs, dim=-1) - probs
        sorted_scores = sorted_scores.masked_fill(mass_before >= params.top_p, float("-inf"))
        scores = torch.empty_like(scores).scatter_(-1, order, sorted_scores)
    return scores


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None, *,
           out: torch.Tensor | None = None, position: torch.Tensor | None = None,
           host_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] -> token ids [B] (int64), on the logits' device, without a host sync; into `out`
    when given, with the token hand-off of `ops.argmax` when `position` and `host_tokens` are given."""
    handoff = {"out": out, "position": position, "host_tokens": host_tokens}
    if params.greedy:
        return ops.argmax(logits, **handoff)
    probs = torch.softmax(filter_logits(logits, params), dim=-1)
    # A zero draw would turn an excluded token's 0/0 into NaN, which argmax would pick.
    race = torch.empty_like(probs).exponential_(1.0, generator=generator).clamp_min_(torch.finfo(torch.float32).tiny)
    return ops.argmax(probs / race, **handoff)
