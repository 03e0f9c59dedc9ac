"""The axes of a grid: ``--set KEY=V1,V2,...`` (with log/lin spaces), and each point's run name and arguments."""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from typing import Any

import yaml

__all__ = ["cli_value", "grid_points", "parse_set", "run_args", "run_name", "short_name"]

_SPACE = re.compile(r"^(log|lin)space:([^:]+):([^:]+):([0-9]+)$")


def _space(kind: str, start: float, stop: float, num: int) -> list[float]:
    """``num`` evenly spaced values from start to stop (of the exponent for ``log``), 6 significant digits."""
    if num < 1:
        raise ValueError("needs at least 1 point")
    points = [start + (stop - start) * i / (num - 1) for i in range(num)] if num > 1 else [start]
    return [float(f"{(10 ** p if kind == 'log' else p):.6g}") for p in points]


def parse_set(text: str) -> tuple[str, list[Any]]:
    """``"model.init_args.lr=0.1,0.2"`` -> ``("model.init_args.lr", [0.1, 0.2])`` (values parsed as YAML scalars).

    ``KEY=logspace:A:B:K`` gives K values ``10^a`` for ``a`` evenly spaced from A to B (the
    thesis' grids, e.g. ``logspace:-2.5:1.5:5`` = 0.00316, 0.0316, ..., 31.6), and
    ``KEY=linspace:A:B:K`` K values evenly spaced from A to B; both rounded to 6 significant digits.

    Raises:
        ValueError: If there is no ``=`` or no value, or a malformed space.
    """
    key, sep, values = text.partition("=")
    key = key.strip().lstrip("-")
    if not sep or not key or not values.strip():
        raise ValueError(f"--set {text!r}: expected KEY=V1,V2,... such as model.init_args.lr=0.05,0.1")
    space = _SPACE.match(values.strip())
    if space:
        try:
            return key, _space(space[1], float(space[2]), float(space[3]), int(space[4]))
        except ValueError as err:
            raise ValueError(f"--set {text!r}: {space[1]}space:START:STOP:NUM needs numbers and NUM >= 1 ({err}), "
                             "e.g. model.init_args.lr=logspace:-2.5:1.5:5") from None
    if values.strip().startswith(("logspace", "linspace")):
        raise ValueError(f"--set {text!r}: write logspace:START:STOP:NUM (colons), e.g. "
                         f"{key}=logspace:-2.5:1.5:5")
    parsed = [yaml.safe_load(v.strip()) for v in values.split(",")]
    if any(v is None for v in parsed):
        raise ValueError(f"--set {text!r}: empty value in the list; write every value, e.g. {key}=1,2,3")
    return key, parsed


def short_name(key: str) -> str:
    """``model.init_args.noise_multiplier`` -> ``noise_multiplier``."""
    return key.split(".")[-1]


def cli_value(value: Any) -> str:
    """A parsed YAML scalar back as command-line text (``True`` -> ``true``, ``None`` -> ``null``)."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return str(value)


def grid_points(sets: Sequence[tuple[str, list[Any]]]) -> list[dict[str, Any]]:
    """The points of the grid: the Cartesian product of the axes' values, as ``{key: value}`` in axis order."""
    keys = [k for k, _ in sets]
    return [dict(zip(keys, combo)) for combo in itertools.product(*(values for _, values in sets))]


def run_name(values: dict[str, Any]) -> str:
    return " ".join(f"{short_name(k)}={v}" for k, v in values.items())


def run_args(config: Sequence[str], values: dict[str, Any], extra: Sequence[str]) -> list[str]:
    args = [a for c in config for a in ("--config", c)]
    args += [f"--{k}={cli_value(v)}" for k, v in values.items()]
    return args + list(extra)
