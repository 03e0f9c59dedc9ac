"""The commands of ``lightning-dp``, one module each (:mod:`lightning_dp.cli` dispatches to them).

``fit``/``validate``/``test`` (:mod:`~lightning_dp.commands.fit`), ``grid``, ``audit`` (``dlg``, ``mia``),
``epsilon``, ``compare``; what they share with the grid and the Flower apps lives below them, in
:mod:`lightning_dp.config`. Layers: the commands may import :mod:`lightning_dp.grid`, never the reverse
(docs/architecture.md). Importing this package imports nothing of the commands (``--help`` needs no torch).
"""
