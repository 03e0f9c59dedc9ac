"""The steps the figure and table scripts of examples/ share: the measured table is written to its TSV, then the
figure (or the summary) is drawn from that TSV, so that ``--replot`` / ``--from-tsv`` redraw a committed one without
measuring again.

Imported by the scripts after they put this folder on ``sys.path`` (the name ``examples`` may belong to an installed
package, so the folder is not imported as one).
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Callable, Iterator
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


def mean_std(values: Any, decimals: int = 3) -> str:
    """``mean ± sample std`` (``ddof=1``) of ``values``, both to ``decimals`` decimals: the cell of the per-run
    table scripts' summaries."""
    import numpy as np

    return f"{np.mean(values):.{decimals}f} ± {np.std(values, ddof=1):.{decimals}f}"


def finished_runs(uris: list[str], experiment: str, **search: Any) -> Iterator[tuple[Any, Any]]:
    """``(client, run)`` for every finished run of ``experiment`` in each MLflow store of ``uris`` (pooled: one store
    per process of a parallel experiment); exits naming the store that lacks the experiment."""
    import mlflow

    for uri in uris:
        client = mlflow.MlflowClient(uri)
        found = client.get_experiment_by_name(experiment)
        if found is None:
            raise SystemExit(f"no experiment {experiment!r} in {uri}")
        for run in client.search_runs([found.experiment_id], "attributes.status = 'FINISHED'", **search):
            yield client, run


def runs_table_main(argv: list[str] | None, *, description: str, experiment: str, columns: list[str],
                    read_runs: Callable[[list[str], str], list[list]], as_text: Callable[[list], list],
                    summarize: Callable[[list[dict]], str]) -> None:
    """A per-run table script's command line: ``read_runs(stores, experiment)``'s rows, each written by ``as_text``
    under ``columns`` (to ``--tsv`` if given), or the committed table of ``--from-tsv``; then ``summarize`` of the
    table (rows as dicts of strings, as read back from a TSV) printed."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tracking-uri", action="append", default=None, help="store(s) to read; repeat to pool")
    parser.add_argument("--experiment", default=experiment)
    parser.add_argument("--tsv", default=None, help="write the per-run table here")
    parser.add_argument("--from-tsv", default=None, help="summarize this table instead of reading runs")
    args = parser.parse_args(argv)
    if args.from_tsv:
        with open(args.from_tsv) as handle:
            table = list(csv.DictReader(handle, delimiter="\t"))
    else:
        from lightning_dp import tracking

        rows = read_runs(args.tracking_uri or [tracking.default_tracking_uri()], args.experiment)
        text = [columns] + [as_text(r) for r in rows]
        if args.tsv:
            with open(args.tsv, "w", newline="") as handle:
                csv.writer(handle, delimiter="\t", lineterminator="\n").writerows(text)
        table = [dict(zip(columns, map(str, r))) for r in text[1:]]
    print(summarize(table))
