"""The summary a private run prints when training ends (DPSGD and its subclasses, the federated round).

One format for every mechanism: a title line, then one ``label  value`` row per fact, printed
on global rank zero to stdout, before the run locations that ``lightning-dp`` prints.

Example:
    >>> print(format_summary("DPSGD: 30 private steps (3 epochs)",
    ...                      [("epsilon", "1.98 of target_epsilon 2 at delta 1e-05"), ("sample rate q", "0.1")]))
    DPSGD: 30 private steps (3 epochs)
      epsilon        1.98 of target_epsilon 2 at delta 1e-05
      sample rate q  0.1
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["format_summary", "print_summary"]


def format_summary(title: str, rows: Sequence[tuple[str, str]]) -> str:
    """The title, then the rows as aligned ``label  value`` lines indented by two spaces."""
    width = max((len(label) for label, _ in rows), default=0)
    return "\n".join([title, *(f"  {label:<{width}}  {value}" for label, value in rows)])


def print_summary(trainer: Any, title: str, rows: Sequence[tuple[str, str]]) -> None:
    """Print :func:`format_summary` on global rank zero (one copy under DDP), after the progress bar's last frame.

    Called from ``on_fit_end``. Lightning's Rich progress bar draws its final frame when it stops, in its
    ``teardown`` hook, after ``on_fit_end``: in a log file that frame (with its metrics cut to the width) came
    after the summary. The bar's own ``teardown`` is called here first (idempotent: it stops a display that
    is running, and Lightning's later call finds it stopped), so that the summary is the run's last word.
    """
    if not trainer.is_global_zero:
        return
    bar = getattr(trainer, "progress_bar_callback", None)
    if bar is not None and getattr(trainer, "lightning_module", None) is not None:
        bar.teardown(trainer, trainer.lightning_module, "fit")
    print(format_summary(title, rows), flush=True)
