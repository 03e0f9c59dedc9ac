"""Argument checks, one home for each (issue 28): every component validates its arguments with these.

Each returns the value (converted: ``int``, ``float``) or raises a ``ValueError`` that names the argument, its
value and what is allowed, prefixed by the owner when given and followed by the fix when given
(``"MNISTDataModule: batch_size=0 is not allowed: batch_size must be a positive integer"``). A leaf module: it
imports nothing of the package, so the functional core may use it too.

Example:
    >>> positive_int("batch_size", 64)
    64
    >>> positive_int("batch_size", 0, owner="Digits", hint="pass e.g. batch_size=64")
    Traceback (most recent call last):
    ...
    ValueError: Digits: batch_size=0 is not allowed: batch_size must be a positive integer; pass e.g. batch_size=64
"""

from __future__ import annotations

import math
import numbers
import os
from pathlib import Path
from typing import Any, Optional, Union

import torch

__all__ = ["MissingFileError", "existing_file", "generator", "integer", "is_int", "is_real", "non_negative_int",
           "non_negative_real", "open_fraction", "positive_int", "positive_real", "probability"]


def _fail(name: str, value: Any, allowed: str, owner: Optional[str], hint: Optional[str]) -> ValueError:
    return ValueError(f"{owner + ': ' if owner else ''}{name}={value!r} is not allowed: {name} must be {allowed}"
                      f"{'; ' + hint if hint else ''}")


class MissingFileError(FileNotFoundError):
    """A file that an argument names does not exist: a user's error, not a bug. ``lightning-dp`` prints its message
    in a few lines and exits with status 2 (:func:`lightning_dp.config.errors.is_refusal`); a
    :class:`FileNotFoundError`, so ``except FileNotFoundError`` still catches it."""


def existing_file(name: str, path: Union[str, "os.PathLike[str]"], *, owner: Optional[str] = None,
                  produced_by: str = "", hint: str = "") -> Path:
    """``path`` (``~`` expanded) if it is a file; otherwise :class:`MissingFileError` naming the argument, the path
    resolved to an absolute one (a relative path is read from the working directory), what produces the file and
    the fix.

    >>> existing_file("checkpoint", "no/such.ckpt", owner="GPT2", produced_by="stage 1",
    ...               hint="run it first")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    lightning_dp.checks.MissingFileError: GPT2: checkpoint='no/such.ckpt': no such file .../no/such.ckpt ...
    """
    file = Path(path).expanduser()
    if file.is_file():
        return file
    where = file.resolve()
    relative = "" if file.is_absolute() else f" (relative to the working directory {Path.cwd()})"
    text = f"{owner + ': ' if owner else ''}{name}={str(path)!r}: no such file {where}{relative}"
    if produced_by:
        text += f"; it is written by {produced_by}"
    raise MissingFileError(text + (f"; {hint}" if hint else ""))


def is_int(value: Any) -> bool:
    """Whether ``value`` is an integer (``bool`` is not)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """Whether ``value`` is a real number (``bool`` is not)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def integer(name: str, value: Any, *, owner: Optional[str] = None, hint: Optional[str] = None) -> int:
    """``value`` as an ``int`` (``bool`` is refused)."""
    if not is_int(value):
        raise _fail(name, value, "an integer", owner, hint)
    return int(value)


def positive_int(name: str, value: Any, *, owner: Optional[str] = None, hint: Optional[str] = None) -> int:
    """``value`` as an ``int`` >= 1."""
    if not is_int(value) or value < 1:
        raise _fail(name, value, "a positive integer", owner, hint)
    return int(value)


def non_negative_int(name: str, value: Any, *, owner: Optional[str] = None, hint: Optional[str] = None) -> int:
    """``value`` as an ``int`` >= 0."""
    if not is_int(value) or value < 0:
        raise _fail(name, value, "a non-negative integer", owner, hint)
    return int(value)


def positive_real(name: str, value: Any, *, owner: Optional[str] = None, hint: Optional[str] = None) -> float:
    """``value`` as a finite ``float`` > 0."""
    if not is_real(value) or not (math.isfinite(value) and value > 0):
        raise _fail(name, value, "a finite number > 0", owner, hint)
    return float(value)


def non_negative_real(name: str, value: Any, *, owner: Optional[str] = None, hint: Optional[str] = None) -> float:
    """``value`` as a finite ``float`` >= 0."""
    if not is_real(value) or not (math.isfinite(value) and value >= 0):
        raise _fail(name, value, "a finite number >= 0", owner, hint)
    return float(value)


def open_fraction(name: str, value: Any, *, owner: Optional[str] = None, hint: Optional[str] = None) -> float:
    """``value`` as a ``float`` in the open interval (0, 1)."""
    if not is_real(value) or not 0.0 < float(value) < 1.0:
        raise _fail(name, value, "a number in the open interval (0, 1)", owner, hint)
    return float(value)


def probability(name: str, value: Any, *, owner: Optional[str] = None, hint: Optional[str] = None) -> float:
    """``value`` as a ``float`` in [0, 1]."""
    if not is_real(value) or not 0.0 <= float(value) <= 1.0:
        raise _fail(name, value, "a probability in [0, 1]", owner, hint)
    return float(value)


def generator(name: str, value: Any, *, required: bool = False, device: Any = None) -> torch.Generator:
    """``value`` if it is a ``torch.Generator``; ``None`` (unless ``required``) gives a fresh one seeded from OS
    entropy on ``device``, never the global RNG (DESIGN.md: every draw that protects privacy comes from a generator
    the component owns). A given generator must be on ``device``'s type when one is named."""
    if value is None and not required:
        fresh = torch.Generator(device=device if device is not None else "cpu")
        fresh.seed()
        return fresh
    if not isinstance(value, torch.Generator):
        raise ValueError(f"{name}={value!r} must be a torch.Generator{'' if required else ' (or None for a fresh one)'}"
                         "; pass e.g. lightning_dp.privacy.noise.derive_generator(seed, stream) or "
                         "torch.Generator().manual_seed(0)")
    if device is not None and torch.device(value.device).type != torch.device(device).type:
        raise ValueError(f"{name} is on device {value.device} but draws on {device}; create it with "
                         f"torch.Generator(device={str(device)!r})")
    return value
