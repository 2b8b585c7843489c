"""Sparsity: pruning the projections to a density (magnitude, wanda), factorizing them into KS chains, and
reporting the result."""

from .factorize import factorize_model  # its import registers the KS conversion for the CLI
from .prune import METHODS, calibration_tokens, prune_by_score_, prune_magnitude_, prune_model_, prune_to_structure_, \
    wanda_score
from .report import BlockReport, block_reports, format_report

__all__ = ["METHODS", "BlockReport", "block_reports", "calibration_tokens", "factorize_model", "format_report",
           "prune_by_score_", "prune_magnitude_", "prune_model_", "prune_to_structure_", "wanda_score"]
