"""The federated round's random streams: one number per stream of :func:`~lightning_dp.privacy.noise.derive_generator`.

One table, so that no two draws of the round share a stream (tests/privacy/test_noise.py reads it). Public streams
(the round's ``seed``, logged): ``_INIT``, ``_LOCAL``, ``_VAL``, ``_DIAGNOSTICS``. Secret streams (``noise_seed``,
through :func:`~lightning_dp.privacy.noise.derive_secret_generator`): ``_CLIENTS``, ``_NOISE``, ``_SERVER_NOISE``,
``_SERVER_COUNT``, ``_LOCAL_NOISE``.
"""

from __future__ import annotations

_CLIENTS, _LOCAL, _NOISE, _INIT, _VAL = 11, 12, 13, 14, 15
_SERVER_NOISE, _SERVER_COUNT, _DIAGNOSTICS, _LOCAL_NOISE = 16, 17, 18, 19
