"""The summary a private run prints when training ends: :func:`lightning_dp.protocol.format_summary` and
:func:`~lightning_dp.protocol.print_summary` (the run-level protocol's), importable from here too."""

from lightning_dp.protocol import format_summary, print_summary

__all__ = ["format_summary", "print_summary"]
