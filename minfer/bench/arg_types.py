"""argparse types shared by the benchmark CLIs (apps/benchmark.py, python -m minfer.bench.macko_suite)."""

from __future__ import annotations

import argparse
import re

_SHAPE = re.compile(r"(\d+)x(\d+)", re.ASCII)


def csv_list(text: str) -> list[str]:
    """Comma-separated names; an empty list or an empty item (",", "a,,b") is an error, not "all"."""
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list with no empty items, got {text!r}")
    return items


def positive_int(text: str) -> int:
    """An integer of at least 1 (counts of replays, tokens, ...)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def density_list(text: str) -> list[float]:
    """Comma-separated densities in (0, 1], 1.0 meaning dense."""
    try:
        densities = [float(item) for item in csv_list(text)]
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"densities must be numbers in (0, 1], got {text!r}") from None
    if not densities or not all(0.0 < d <= 1.0 for d in densities):
        raise argparse.ArgumentTypeError(f"densities must be numbers in (0, 1], got {text!r}")
    return densities


def matrix_shape_list(text: str) -> list[tuple[int, int]]:
    """Comma-separated NxK matrix shapes (rows x columns), e.g. 4096x11008,32000x4096."""
    shapes = []
    for item in text.split(","):
        match = _SHAPE.fullmatch(item.strip())
        if not (match and int(match[1]) > 0 and int(match[2]) > 0):
            raise argparse.ArgumentTypeError(f"shapes must be NxK with positive N and K, got {item!r}")
        shapes.append((int(match[1]), int(match[2])))
    return shapes


def token_count_list(text: str) -> list[int]:
    """Comma-separated token counts, each at least 1."""
    return [positive_int(item) for item in csv_list(text)]
