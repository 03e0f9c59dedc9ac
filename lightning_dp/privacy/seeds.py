"""Secret seeds: where privacy noise comes from, and what must never leave the machine.

Whoever knows a secret seed regenerates the noise and subtracts it. Seeds are fresh from the OS
(:func:`fresh_seed`) unless fixed, never shared by two runs (:func:`derive_seed` for grids), kept in checkpoint
state under :data:`SECRET_KEY` and removed by :func:`strip_secrets` from everything uploaded. The rules:
docs/privacy.md, "Secrets".

Example:
    >>> strip_secrets({"accountant": {"history": []}, SECRET_KEY: {"seed": 1234}})
    {'accountant': {'history': []}}
    >>> derive_seed(7, 0) == derive_seed(7, 0) != derive_seed(7, 1)
    True
"""

from __future__ import annotations

import secrets
from typing import Any, Literal, overload

import numpy as np

__all__ = ["SECRET_KEY", "check_seed", "derive_seed", "fresh_seed", "strip_secrets"]

#: The key under which a component's state keeps what must stay on the machine.
SECRET_KEY = "secret"


@overload
def check_seed(value: Any, name: str = ..., *, optional: Literal[False]) -> int: ...
@overload
def check_seed(value: Any, name: str = ..., *, optional: bool = ...) -> int | None: ...
def check_seed(value: Any, name: str = "seed", *, optional: bool = True) -> int | None:
    """Validates a seed: a non-negative integer (or None when ``optional``: a fresh secret seed)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r} is not allowed: pass a non-negative integer"
                         + (", or None for a fresh secret seed" if optional else ""))
    return int(value)


def fresh_seed() -> int:
    """A new secret seed from the operating system's CSPRNG (63 bits)."""
    return secrets.randbits(63)


def derive_seed(seed: int, *counters: int) -> int:
    """A 63-bit seed derived from ``(seed, *counters)`` by NumPy's SeedSequence hashing.

    Distinct counters give statistically independent seeds (e.g. one per grid run), and
    the same ``(seed, counters)`` gives the same seed, which makes a grid reproducible
    from one grid seed.
    """
    state = np.random.SeedSequence([int(seed) % 2**128, *(int(c) for c in counters)]).generate_state(2, np.uint64)
    return int(state[0]) >> 1


def strip_secrets(obj: Any) -> Any:
    """A copy of a (nested) checkpoint or state without any :data:`SECRET_KEY` entry.

    Dicts, lists and tuples are rebuilt; everything else (tensors included) is shared,
    not copied.
    """
    if isinstance(obj, dict):
        pairs = [(k, strip_secrets(v)) for k, v in obj.items() if k != SECRET_KEY]
        try:
            return type(obj)(pairs)  # keeps OrderedDict (a model's state_dict) an OrderedDict
        except TypeError:
            return dict(pairs)
    if isinstance(obj, list):
        return [strip_secrets(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(strip_secrets(v) for v in obj)
    return obj
