"""Conversions that take more than `formats.convert`: a weight format whose step from dense projections has
flags and work of its own (KS chains are projected onto, not encoded). Each registers itself with
`register_conversion`; the sparsity CLI asks CONVERSIONS and never names a format."""

from __future__ import annotations

import argparse
from abc import ABC, abstractmethod
from typing import Callable

from torch import nn

from ..config import ModelConfig
from ..formats import WeightFormat


class Conversion(ABC):
    """How the CLI turns dense projections into `format`."""

    format: type[WeightFormat]

    def add_arguments(self, group: argparse._ArgumentGroup) -> None:
        """The conversion's own flags."""

    def check(self, args: argparse.Namespace, chosen: bool, stored: bool, config: ModelConfig) -> None:
        """Refuse its flags before anything loads: `chosen` says --sparse names this format, `stored` that
        the model loads compressed."""

    @abstractmethod
    def convert(self, model: nn.Module, args: argparse.Namespace, random_weights: bool, seed: int,
                note: Callable[[str], None]) -> None:
        """Put every projection of `model` in the format (random weights may get random factors)."""


CONVERSIONS: list[Conversion] = []


def register_conversion(cls: type[Conversion]) -> type[Conversion]:
    CONVERSIONS.append(cls())
    return cls


def conversion_for(fmt: type[WeightFormat]) -> Conversion | None:
    return next((conversion for conversion in CONVERSIONS if conversion.format is fmt), None)
