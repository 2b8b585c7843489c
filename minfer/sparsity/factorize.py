"""Dense to KS chains: the best two-factor approximation of a matrix for a chainable pattern pair, longer
chains two factors at a time (docs/FORMATS.md, "Chains and their order"), and the relative Frobenius
error it leaves per layer and in total."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn
from tqdm.auto import tqdm

from ..errors import FormatError
from ..formats.ksmm import KSWeight, Pattern, check_chain


class Projection(NamedTuple):
    factors: list[torch.Tensor]  # in application order, float32
    error: float  # ||W - chain||_F (absolute)


def pair_product(first: Pattern, second: Pattern) -> Pattern:
    """The pattern of K_second K_first (first applied first), or FormatError when the pair does not chain:
    a_second | a_first, d_first | d_second, and r = a_second·c_second / a_first = b_first·d_first / d_second
    an integer (the pair's rank)."""
    a2, b2, c2, d2 = first
    a1, b1, c1, d1 = second
    rank_in, rank_out = a1 * c1, b2 * d2
    if a2 % a1 or d1 % d2 or rank_in % a2 or rank_out % d1 or rank_in // a2 != rank_out // d1:
        raise FormatError(f"the KS patterns {first} and {second} are not a chainable pair (they need a2 % a1 == 0, "
                          f"d1 % d2 == 0 and a1·c1/a2 == b2·d2/d1 an integer, (a2, b2, c2, d2) the one applied first)")
    return (a1, b1 * d1 // d2, a2 * c2 // a1, d2)


def project_pair(weight: torch.Tensor, first: Pattern, second: Pattern) -> tuple[torch.Tensor, torch.Tensor]:
    """The factors (first, second) minimizing ||W - K_second K_first||_F: the matrix splits into
    a1·d2 independent problems, each into d1'·a2' blocks of b1 x c2 whose rank-r truncated SVD is kept,
    sqrt(S) going to each factor."""
    pair_product(first, second)
    a2, b2, c2, d2 = first
    a1, b1, c1, d1 = second
    sub_a, sub_d = a2 // a1, d1 // d2  # the sub-problems' patterns: (sub_a, b2, c2, 1) then (1, b1, c1, sub_d)
    rank = c1 // sub_a
    rows, cols = weight.shape
    w = weight.to(torch.float32).reshape(a1, rows // (a1 * d2), d2, a1, cols // (a1 * d2), d2)
    sub = torch.einsum("ipliql->ilpq", w)  # (a1, d2, b1·sub_d, sub_a·c2): the diagonal blocks
    blocks = sub.reshape(a1, d2, b1, sub_d, sub_a, c2).permute(0, 1, 3, 4, 2, 5)  # (.., sub_d, sub_a, b1, c2)
    u, s, vh = torch.linalg.svd(blocks, full_matrices=False)
    kept = min(rank, s.shape[-1])
    root = s[..., :kept].sqrt()
    left = torch.zeros(*blocks.shape[:-2], b1, rank, dtype=torch.float32, device=weight.device)
    right = torch.zeros(*blocks.shape[:-2], rank, c2, dtype=torch.float32, device=weight.device)
    left[..., :kept] = u[..., :kept] * root[..., None, :]
    right[..., :kept, :] = root[..., :, None] * vh[..., :kept, :]
    # left[i, l2, l', i', j, t] = K_second[i, j, i'·r + t, l'·d2 + l2]
    second_factor = left.permute(0, 4, 3, 5, 2, 1).reshape(a1, b1, sub_a * rank, sub_d * d2)
    # right[i, l2, l', i', t, k] = K_first[i·sub_a + i', t·sub_d + l', k, l2]
    first_factor = right.permute(0, 3, 4, 2, 5, 1).reshape(a1 * sub_a, rank * sub_d, c2, d2)
    return first_factor, second_factor


def project_chain(weight: torch.Tensor, patterns: Sequence[Pattern]) -> Projection:
    """The chain of `patterns` (application order) approximating `weight`: the last factor is split off the
    product of the others by project_pair, then that product is factorized the same way."""
    patterns = [tuple(p) for p in patterns]
    check_chain(patterns, tuple(weight.shape))
    target = weight.to(torch.float32)
    if len(patterns) == 1:
        a, b, c, d = patterns[0]
        factors = [torch.einsum("ijlikl->ijkl", target.reshape(a, b, d, a, c, d)).contiguous()]
    else:
        rest = patterns[0]
        for pattern in patterns[1:-1]:
            rest = pair_product(rest, pattern)
        first, last = project_pair(target, rest, patterns[-1])
        inner = project_chain(KSWeight.from_factors([first]).to_dense(), patterns[:-1]).factors
        factors = [*inner, last]
    error = float(torch.linalg.norm(target - KSWeight.from_factors(factors).to_dense()))
    return Projection(factors, error)


# --ks-patterns presets: the fraction of each projection's parameters a Monarch pair keeps.
PRESETS = {"monarch-50": 0.5, "monarch-25": 0.25}
MONARCH_BLOCKS = (4, 2, 1)  # the block counts a and d tried, first the largest dividing the size
SPEC_HELP = ("a preset (" + ", ".join(PRESETS) + ": a Monarch pair (a, r·d, K/a, 1)·(1, N/d, r·a, d) with a = d = 4 "
             "where they divide, its rank r set for about 50%% or 25%% of each projection's parameters), or "
             "explicit chains per projection shape: 'NxK:a,b,c,d/a,b,c,d;NxK:...', patterns in application order "
             "(the first reads the input), e.g. '40x40:4,8,10,1/1,10,16,4'")


def monarch_chain(shape: tuple[int, int], fraction: float) -> list[Pattern]:
    """The Monarch pair for an (N, K) matrix keeping about `fraction` of its parameters: r·(d·K + a·N) of them,
    r a multiple of 8 when it is at least 64."""
    rows, cols = shape
    a = next(blocks for blocks in MONARCH_BLOCKS if cols % blocks == 0)
    d = next(blocks for blocks in MONARCH_BLOCKS if rows % blocks == 0)
    rank = int(fraction * rows * cols / (d * cols + a * rows))
    rank = rank - rank % 8 if rank >= 64 else rank  # kernel tiles like multiples of 8
    rank = max(1, min(rank, rows // d, cols // a))
    return [(a, rank * d, cols // a, 1), (1, rows // d, rank * a, d)]


def parse_patterns(text: str) -> str | dict[tuple[int, int], list[Pattern]]:
    """A --ks-patterns value: a preset's name, or {(N, K): chain}; FormatError (one line) when malformed."""
    text = text.strip()
    if text in PRESETS:
        return text
    chains: dict[tuple[int, int], list[Pattern]] = {}
    for entry in filter(None, (part.strip() for part in text.split(";"))):
        shape_text, sep, chain_text = entry.partition(":")
        try:
            shape = tuple(int(v) for v in shape_text.lower().split("x"))
            chain = [tuple(int(v) for v in pattern.split(",")) for pattern in chain_text.split("/")]
        except ValueError:
            shape, chain = (), []
        if not sep or len(shape) != 2 or any(len(p) != 4 for p in chain):
            raise FormatError(f"--ks-patterns entry {entry!r} is not 'NxK:a,b,c,d/a,b,c,d' nor a preset "
                              f"({', '.join(PRESETS)})")
        check_chain(chain, shape)
        chains[shape] = chain
    if not chains:
        raise FormatError(f"--ks-patterns {text!r} names no preset ({', '.join(PRESETS)}) and no chain")
    return chains


def chain_for(spec: str | dict[tuple[int, int], list[Pattern]], shape: tuple[int, int]) -> list[Pattern]:
    """The chain `spec` (parse_patterns's value) gives a projection of `shape`."""
    if isinstance(spec, str):
        return monarch_chain(shape, PRESETS[spec])
    if shape not in spec:
        raise FormatError(f"--ks-patterns gives no chain for the {shape[0]}x{shape[1]} projections; add an entry "
                          f"'{shape[0]}x{shape[1]}:a,b,c,d/...'")
    return spec[shape]


class LayerError(NamedTuple):
    layer: str  # "layers.3": the projections whose names start with it
    relative: float  # ||W - chain||_F / ||W||_F over the layer's projections


def factorize_model(model: nn.Module, spec: str | dict[tuple[int, int], list[Pattern]],
                    progress: bool = False) -> tuple[list[LayerError], float]:
    """Replace every projection by its best KS chain (on the weights' device). Returns the relative Frobenius
    error of each layer and of all projections together."""
    projections = list(model.projections())
    for _, linear in projections:  # every shape resolved before the first SVD
        chain_for(spec, linear.fmt.shape)
    errors: dict[str, list[float]] = {}  # layer -> [squared error, squared norm]
    for name, linear in tqdm(projections, desc="factorizing to ksmm", unit="matrix", disable=not progress):
        weight = linear.fmt.to_dense()
        projection = project_chain(weight, chain_for(spec, linear.fmt.shape))
        linear.set_format(KSWeight.from_factors([f.to(weight.dtype) for f in projection.factors]))
        sums = errors.setdefault(".".join(name.split(".")[:2]), [0.0, 0.0])
        sums[0] += projection.error ** 2
        sums[1] += float(torch.linalg.norm(weight.float())) ** 2
    layers = [LayerError(layer, (err / max(norm, 1e-30)) ** 0.5) for layer, (err, norm) in errors.items()]
    total = (sum(e for e, _ in errors.values()) / max(sum(n for _, n in errors.values()), 1e-30)) ** 0.5
    return layers, total


def random_chains(model: nn.Module, spec: str | dict[tuple[int, int], list[Pattern]], seed: int = 0) -> None:
    """Replace every projection by random KS factors of its chain (benchmarks on random weights)."""
    generator = torch.Generator().manual_seed(seed)
    for _, linear in model.projections():
        dtype, device = linear.fmt.dtype, next(linear.fmt.buffers()).device
        linear.set_format(KSWeight.random(chain_for(spec, linear.fmt.shape), dtype, device, generator))
