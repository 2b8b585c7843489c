"""The small prose corpus shipped in minfer/data/corpus/: the bundled tokenizer's training text and wanda's
default calibration text."""

from __future__ import annotations

from pathlib import Path

CORPUS_DIR = Path(__file__).resolve().parent / "data" / "corpus"


def corpus_lines() -> list[str]:
    """Every non-empty line of data/corpus/*.txt, in file-name order."""
    lines = []
    for path in sorted(CORPUS_DIR.glob("*.txt")):
        lines += [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return lines
