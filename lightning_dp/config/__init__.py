"""A ``lightning-dp`` config, parsed, refused in a few lines and built: the layer the commands, the grid and the
Flower apps share (docs/architecture.md, "Layers").

- :mod:`~lightning_dp.config.lightning_cli`: :class:`~lightning_dp.config.lightning_cli.LightningDPCLI`, LightningCLI
  with MLflow tracking; ``lightning-dp fit`` runs it, a grid builds every point with it, a Flower deployment
  builds its round with it.
- :mod:`~lightning_dp.config.errors`: short errors with "did you mean" (standard library only).
- :mod:`~lightning_dp.config.parser`: the jsonargparse parsers that print them, with a short help.
- :mod:`~lightning_dp.config.threads`: how many threads torch gets in a training command (the free cores of a
  shared machine; ``LIGHTNING_DP_THREADS`` or ``OMP_NUM_THREADS`` choose instead).

Importing this package imports none of them (``lightning-dp --help`` answers without torch). Their former homes
under :mod:`lightning_dp.commands` (``commands.fit``, ``commands.errors``, ``commands.parser``) still import.
"""
