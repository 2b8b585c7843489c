"""argparse types shared by the benchmark CLIs (apps/benchmark.py, python -m minfer.bench.macko_suite)."""

from __future__ import annotations

import argparse


def csv_list(text: str) -> list[str]:
    return [item for item in text.split(",") if item]


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
    except ValueError:
        raise argparse.ArgumentTypeError(f"densities must be numbers in (0, 1], got {text!r}") from None
    if not densities or not all(0.0 < d <= 1.0 for d in densities):
        raise argparse.ArgumentTypeError(f"densities must be numbers in (0, 1], got {text!r}")
    return densities


def matrix_shape_list(text: str) -> list[tuple[int, int]]:
    """Comma-separated NxK matrix shapes (rows x columns), e.g. 4096x11008,32000x4096."""
    shapes = []
    for item in csv_list(text):
        rows, _, cols = item.partition("x")
        if not (rows.isdigit() and cols.isdigit() and int(rows) > 0 and int(cols) > 0):
            raise argparse.ArgumentTypeError(f"shapes must be NxK with positive N and K, got {item!r}")
        shapes.append((int(rows), int(cols)))
    if not shapes:
        raise argparse.ArgumentTypeError(f"no shape in {text!r}; pass NxK,...")
    return shapes
