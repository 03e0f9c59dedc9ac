"""The commands of ``lightning-dp``, one module each (:mod:`lightning_dp.cli` dispatches to them).

- ``fit``, ``validate``, ``test``: :mod:`~lightning_dp.commands.fit` (LightningCLI with MLflow tracking, defined in
  :mod:`lightning_dp.config.lightning_cli`).
- ``grid``: :mod:`~lightning_dp.commands.grid` (the machinery in :mod:`lightning_dp.grid`).
- ``audit`` / ``audit dlg``: :mod:`~lightning_dp.commands.audit_dlg`; ``audit mia``: :mod:`~lightning_dp.commands.audit_mia`.
- ``epsilon``: :mod:`~lightning_dp.commands.epsilon`; ``compare``: :mod:`~lightning_dp.commands.compare`.
- What they share, with the grid and the Flower apps (so it lives below them, in :mod:`lightning_dp.config`): short
  errors with "did you mean" (:mod:`~lightning_dp.config.errors`, standard library only) and the jsonargparse
  parser that prints them (:mod:`~lightning_dp.config.parser`); ``commands.errors`` and ``commands.parser`` still
  import them.

Layers: :mod:`lightning_dp.cli` imports the commands, a command may import :mod:`lightning_dp.grid`, the grid
imports no command; below them nothing imports any of the three (tests/test_architecture.py).

Importing this package imports nothing of the commands (``lightning-dp --help`` answers without torch).
"""
