"""The commands of ``lightning-dp``, one module each (:mod:`lightning_dp.cli` dispatches to them).

- ``fit``, ``validate``, ``test``: :mod:`~lightning_dp.commands.fit` (LightningCLI with MLflow tracking).
- ``grid``: :mod:`~lightning_dp.commands.grid` (the machinery in :mod:`lightning_dp.grid`).
- ``audit`` / ``audit dlg``: :mod:`~lightning_dp.commands.audit_dlg`; ``audit mia``: :mod:`~lightning_dp.commands.audit_mia`.
- ``epsilon``: :mod:`~lightning_dp.commands.epsilon`; ``compare``: :mod:`~lightning_dp.commands.compare`.
- What they share: short errors with "did you mean" (:mod:`~lightning_dp.commands.errors`, standard library only)
  and the jsonargparse parser that prints them (:mod:`~lightning_dp.commands.parser`).

Importing this package imports nothing of the commands (``lightning-dp --help`` answers without torch).
"""
