"""Sparsity: pruning the projections to a density (magnitude, wanda) and reporting the result."""

from .prune import METHODS, calibration_tokens, prune_by_score_, prune_magnitude_, prune_model_, wanda_score
from .report import BlockReport, block_reports, format_report

__all__ = ["METHODS", "BlockReport", "block_reports", "calibration_tokens", "format_report", "prune_by_score_",
           "prune_magnitude_", "prune_model_", "wanda_score"]
