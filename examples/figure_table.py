"""The step every figure script of examples/ shares: the measured table is written to its TSV, then the figure is
drawn from that TSV, so that ``--replot`` redraws a committed figure without measuring again.

Imported by the scripts after they put this folder on ``sys.path`` (the name ``examples`` may belong to an installed
package, so the folder is not imported as one).
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path
from typing import Any


def table_then_figure(out: Path, stem: str, measure: Callable[[], list[list]], draw: Callable[[list[dict]], Any], *,
                      replot: bool, dpi: int) -> None:
    """Write ``measure()``'s rows (a header first) to ``out/<stem>.tsv`` unless ``replot``, then save
    ``draw(rows of the TSV as dicts)`` as ``out/<stem>.png``. The rows are measured before the file is opened, so a
    failed measurement leaves the committed table as it was."""
    out.mkdir(parents=True, exist_ok=True)
    tsv = out / f"{stem}.tsv"
    if not replot:
        rows = measure()
        with tsv.open("w", newline="") as handle:
            csv.writer(handle, delimiter="\t", lineterminator="\n").writerows(rows)
    with tsv.open() as handle:
        table = list(csv.DictReader(handle, delimiter="\t"))
    draw(table).savefig(out / f"{stem}.png", dpi=dpi)
    print(f"{'redrew' if replot else 'wrote'} {out / stem}.png from {tsv}")
