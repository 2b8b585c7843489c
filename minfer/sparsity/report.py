"""What pruning and compression did: density per block, bytes before and after."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass
class BlockReport:
    block: int
    nonzeros: int
    elements: int
    dense_bytes: int  # the block's projections stored dense
    stored_bytes: int  # in their current formats
    rows_larger_than_dense: int  # rows whose sparse encoding outweighs the dense row
    matrices_larger_than_dense: int

    @property
    def density(self) -> float:
        return self.nonzeros / max(self.elements, 1)


def block_reports(model: nn.Module) -> list[BlockReport]:
    """Each block's projections summed, from their formats' `stats()`."""
    reports: dict[int, BlockReport] = {}
    for name, linear in model.projections():
        stats = linear.fmt.stats()
        block = int(name.split(".")[1])
        report = reports.setdefault(block, BlockReport(block, 0, 0, 0, 0, 0, 0))
        report.nonzeros += stats.nonzeros
        report.elements += stats.elements
        report.dense_bytes += stats.dense_bytes
        report.stored_bytes += stats.stored_bytes
        report.rows_larger_than_dense += stats.rows_larger_than_dense
        report.matrices_larger_than_dense += stats.stored_bytes > stats.dense_bytes
    return [reports[b] for b in sorted(reports)]


def format_report(reports: list[BlockReport], model: nn.Module | None = None) -> str:
    """A table: per block density and MB dense vs stored, then totals (and the whole model's
    weight bytes per decode step when `model` is given)."""
    lines = [f"{'block':>5}  {'density':>7}  {'dense MB':>9}  {'stored MB':>9}  {'ratio':>6}  larger than dense"]
    for r in reports:
        larger = f"{r.rows_larger_than_dense} rows, {r.matrices_larger_than_dense} matrices" \
            if r.rows_larger_than_dense or r.matrices_larger_than_dense else "-"
        lines.append(f"{r.block:>5}  {r.density:>7.3f}  {r.dense_bytes / 1e6:>9.1f}  {r.stored_bytes / 1e6:>9.1f}  "
                     f"{r.stored_bytes / max(r.dense_bytes, 1):>6.3f}  {larger}")
    totals = report_summary(reports)
    dense, stored = totals["projection_bytes_dense"], totals["projection_bytes_stored"]
    lines.append(f"projections: density {totals['density']:.3f}, {dense / 1e9:.3f} GB dense -> "
                 f"{stored / 1e9:.3f} GB stored ({stored / max(dense, 1):.3f}x)")
    if model is not None:
        after = model.decode_weight_bytes()
        lines.append(f"model weights read per token: {(after - stored + dense) / 1e9:.3f} GB dense -> "
                     f"{after / 1e9:.3f} GB")
    return "\n".join(lines)


def report_summary(reports: list[BlockReport]) -> dict:
    """The report as plain data (generate.py --json): overall and per-block density and bytes."""
    dense = sum(r.dense_bytes for r in reports)
    stored = sum(r.stored_bytes for r in reports)
    return {
        "density": sum(r.nonzeros for r in reports) / max(sum(r.elements for r in reports), 1),
        "projection_bytes_dense": dense,
        "projection_bytes_stored": stored,
        "block_density": [r.density for r in reports],
        "rows_larger_than_dense": sum(r.rows_larger_than_dense for r in reports),
        "matrices_larger_than_dense": sum(r.matrices_larger_than_dense for r in reports),
    }
