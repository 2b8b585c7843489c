"""A model's projections to KS chains: the --ks-patterns presets and spec, the projection of every
projection (formats.ksmm.project_chain: the best two-factor approximation per chainable pair, longer chains
two factors at a time; docs/FORMATS.md) with its relative Frobenius error per layer and in total, and
random chains for benchmarks."""

from __future__ import annotations

import argparse
from typing import Callable, NamedTuple

import torch
from torch import nn
from tqdm.auto import tqdm

from ..config import ModelConfig
from ..errors import FormatError, MinferError
from ..formats.ksmm import KSWeight, Pattern, check_chain, project_chain
from ..model import Transformer
from .conversion import Conversion, register_conversion


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


@register_conversion
class KSConversion(Conversion):
    """--sparse ksmm --ks-patterns PRESET|SPEC: checkpoint weights are projected onto the chains (per-block
    SVD, the error reported), random weights get random factors."""

    format = KSWeight

    def add_arguments(self, group: argparse._ArgumentGroup) -> None:
        group.add_argument("--ks-patterns", default=None, metavar="PRESET|SPEC",
                           help=f"with --sparse {KSWeight.name}: the Kronecker-sparse chain of each projection, "
                                f"{SPEC_HELP}; checkpoint weights are projected onto it (per-block SVD, the error "
                                "reported), random weights get random factors")

    def check(self, args: argparse.Namespace, chosen: bool, stored: bool, config: ModelConfig) -> None:
        """--sparse ksmm and --ks-patterns go together, on dense weights and without --density, with a chain
        for every projection shape of `config`."""
        if args.ks_patterns is not None and not chosen:
            raise MinferError(f"--ks-patterns sets the chains of --sparse {KSWeight.name}; add --sparse "
                              f"{KSWeight.name}")
        if not chosen or stored:
            if args.ks_patterns is not None:
                raise MinferError("this model is stored compressed and loads with its projections as stored; drop "
                                  "--ks-patterns, or start from the dense checkpoint")
            return
        if args.ks_patterns is None:
            raise MinferError(f"--sparse {KSWeight.name} needs --ks-patterns PRESET|SPEC (e.g. --ks-patterns "
                              "monarch-50)")
        if args.density is not None:
            raise MinferError(f"--density prunes, --sparse {KSWeight.name} factorizes the dense projections: drop "
                              "--density")
        spec = parse_patterns(args.ks_patterns)
        with torch.device("meta"):  # the projections' shapes, nothing allocated
            shapes = {linear.fmt.shape for _, linear in Transformer(config).projections()}
        for shape in sorted(shapes):
            chain_for(spec, shape)

    def convert(self, model: nn.Module, args: argparse.Namespace, random_weights: bool, seed: int,
                note: Callable[[str], None]) -> None:
        if random_weights:
            random_chains(model, parse_patterns(args.ks_patterns), seed)
            note(f"random {KSWeight.name} factors ({args.ks_patterns})")
            return
        layers, total = factorize_model(model, parse_patterns(args.ks_patterns), progress=True)
        note("relative Frobenius error of the KS projection: "
             + ", ".join(f"{e.layer} {e.relative:.4f}" for e in layers) + f"; total {total:.4f}")
