"""Pruning of the projection matrices, one output row at a time: unstructured to a target density, or
to N:M structure (at most N nonzeros in every M consecutive columns, e.g. 2:4).

- `magnitude`: keep the largest |W_ij| of each row.
- `wanda` (Sun et al., 2023): keep the largest |W_ij| * ||X_j||_2 of each row, where ||X_j|| is
  the norm of input feature j over calibration tokens. Blocks are pruned in order and the
  calibration activations of block i come from blocks 0..i-1 already pruned; inside a block
  every projection sees the unpruned block's activations, as in the paper.

Only the 7 projections of each block are pruned (in minfer they are 4 matrices: q/k/v and
gate/up are fused, and pruning a fused matrix per output row is exactly per-row pruning of each
original). Embeddings and lm_head stay dense.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from ..attention import AttentionPass
from ..corpus import corpus_lines
from ..errors import MinferError
from ..formats import DenseWeight
from ..model import Linear

METHODS = ("magnitude", "wanda")


def check_density(density: float) -> None:
    if not 0.0 < density <= 1.0:
        raise MinferError(f"density must be in (0, 1], got {density}; e.g. --density 0.5 keeps half the weights")


def keep_per_row(cols: int, density: float) -> int:
    check_density(density)
    keep = round(density * cols)
    if keep == 0:
        raise MinferError(f"density {density} keeps round({density} * {cols}) = 0 weights of a {cols}-column row; "
                          f"pass more than {0.5 / cols:.2g}")
    return keep


def prune_by_score_(weight: torch.Tensor, score: torch.Tensor, density: float) -> torch.Tensor:
    """Zero, in place, the entries of each row of `weight` with the lowest scores, keeping
    round(density * cols) per row. Returns `weight`."""
    cols = weight.shape[1]
    drop = cols - keep_per_row(cols, density)
    if drop > 0:
        weight.scatter_(1, score.topk(drop, dim=1, largest=False).indices, 0)
    return weight


def prune_to_structure_(weight: torch.Tensor, score: torch.Tensor, structure: tuple[int, int]) -> torch.Tensor:
    """Zero, in place, the M - N lowest-scored entries of every M consecutive columns of `weight` (a last
    group of fewer columns keeps at most N). Returns `weight`."""
    keep, group = structure
    if not 0 < keep < group:
        raise MinferError(f"an N:M structure keeps 0 < N < M weights of every M, got {keep}:{group}")
    rows, cols = weight.shape
    pad = -cols % group
    # padding scores lowest, so a short last group drops its padding first
    grouped = torch.nn.functional.pad(score.float(), (0, pad), value=float("-inf")).view(rows, -1, group)
    drop = grouped.topk(group - keep, dim=-1, largest=False).indices
    drop = drop + group * torch.arange(grouped.shape[1], device=drop.device)[:, None]
    mask = torch.ones(rows, cols + pad, dtype=torch.bool, device=weight.device)
    mask.scatter_(1, drop.view(rows, -1), False)
    return weight.masked_fill_(~mask[:, :cols], 0)


def prune_magnitude_(weight: torch.Tensor, density: float) -> torch.Tensor:
    return prune_by_score_(weight, weight.abs(), density)


def wanda_score(weight: torch.Tensor, input_norm: torch.Tensor) -> torch.Tensor:
    """|W_ij| * ||X_j||_2, in fp32."""
    return weight.abs().float() * input_norm.float()[None, :]


def _dense_weight(linear: nn.Module, name: str) -> torch.Tensor:
    if not isinstance(linear.fmt, DenseWeight):
        raise MinferError(f"{name} is already stored as {linear.fmt.name}: pruning works on dense weights, so "
                          "start from the dense checkpoint (a compressed model is pruned already)")
    return linear.fmt.weight


Pruner = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (weight, score) -> weight pruned in place


@torch.no_grad()
def prune_model_(model: nn.Module, density: float | None, method: str = "magnitude",
                 calibration: torch.Tensor | None = None, batch_size: int = 1, progress: bool = True,
                 structure: tuple[int, int] | None = None) -> nn.Module:
    """Prune every projection of `model` in place to `density` per row, or with `structure` (N, M) to N of
    every M consecutive weights of a row (`density` is then None).

    `calibration` ([samples, seq_len] token ids, wanda only) is run through the model `batch_size`
    samples at a time; wanda sets up the model's caches for that shape.
    """
    if method not in METHODS:
        raise MinferError(f"unknown pruning method {method!r}; choose one of: {', '.join(METHODS)}")
    if structure is None:
        check_density(density)  # before any work
        prune: Pruner = partial(prune_by_score_, density=density)
    else:
        prune = partial(prune_to_structure_, structure=structure)
    if method == "magnitude":
        for name, linear in tqdm(list(model.projections()), desc="magnitude pruning", disable=not progress):
            weight = _dense_weight(linear, name)
            prune(weight, weight.abs())
        return model
    if calibration is None or calibration.dim() != 2:
        raise MinferError("wanda needs calibration token ids of shape [samples, seq_len]")
    _prune_wanda(model, prune, calibration, batch_size, progress)
    return model


def _prune_wanda(model: nn.Module, prune: Pruner, tokens: torch.Tensor, batch_size: int, progress: bool) -> None:
    device = model.norm.weight.device
    seq_len = tokens.shape[1]
    model.setup_caches(batch_size, seq_len)
    rope = (model.rope_cos, model.rope_sin)
    batches = tokens.to(device).split(batch_size)
    residuals = [model.embed_tokens(batch) for batch in batches]
    with model.attention.forward_pass(torch.arange(seq_len, device=device), seq_len, seq_len) as step:
        _prune_wanda_blocks(model, prune, residuals, step, rope, progress)


def _prune_wanda_blocks(model: nn.Module, prune: Pruner, residuals: list[torch.Tensor], step: AttentionPass,
                        rope: tuple[torch.Tensor, torch.Tensor], progress: bool) -> None:
    """Block by block: the input statistics of each projection, its pruning, then the block's outputs
    (from its pruned weights) as the next block's inputs."""
    device = model.norm.weight.device
    for i, layer in enumerate(tqdm(list(model.layers), desc="wanda pruning", unit="block", disable=not progress)):
        linears = {name: m for name, m in layer.named_modules() if isinstance(m, Linear)}
        squares = {name: torch.zeros(m.fmt.in_features, dtype=torch.float32, device=device)
                   for name, m in linears.items()}

        def accumulate(name):
            def hook(_, args, kwargs):
                x = args[0]
                norm = kwargs.get("norm")
                x = (norm(x) if norm is not None else x).float()  # what the projection multiplies
                squares[name].add_(x.square().reshape(-1, x.shape[-1]).sum(dim=0))
            return hook

        hooks = [m.register_forward_pre_hook(accumulate(name), with_kwargs=True) for name, m in linears.items()]
        try:
            for r in residuals:  # statistics of the unpruned block
                layer(r.clone(), step, rope)
        finally:
            for h in hooks:
                h.remove()
        for name, m in linears.items():
            weight = _dense_weight(m, f"layers.{i}.{name}")
            prune(weight, wanda_score(weight, squares[name].sqrt()))
        for r in residuals:  # the next block's inputs come from this block, pruned (updated in place)
            layer(r, step, rope)


def calibration_tokens(tokenizer, samples: int, seq_len: int, text_file: str | Path | None = None) -> torch.Tensor:
    """[samples, seq_len] token ids: consecutive windows of the text in `text_file`, or of the
    small corpus shipped in minfer/data/corpus when none is given (no dataset downloads)."""
    if samples < 1 or seq_len < 1:
        raise MinferError(f"wanda calibration needs at least 1 sample of at least 1 token, got --calib-samples "
                          f"{samples} and --calib-seq-len {seq_len}")
    if text_file is not None:
        from ..tokenizer import read_text_file

        text = read_text_file(text_file, "calibration text")
    else:
        text = "\n".join(corpus_lines())
    ids = tokenizer.encode(text, bos=False)
    if len(ids) < samples * seq_len:
        available = len(ids) // seq_len
        raise MinferError(f"the calibration text has {len(ids)} tokens: {available} samples of {seq_len}, "
                          f"fewer than the {samples} asked for; lower --calib-samples or --calib-seq-len, "
                          "or pass a longer --calib-text")
    return torch.tensor(ids[: samples * seq_len], dtype=torch.long).view(samples, seq_len)
