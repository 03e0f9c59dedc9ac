"""The record's one gate: everything a private run writes passes here first.

A privacy component (:class:`~lightning_dp.callbacks.DPSGD` and its subclasses,
:class:`~lightning_dp.federated.FederatedRound`) installs the gate on its trainer in ``setup``
(:func:`install`). From then on, every write to the record goes through :func:`admit`:

- metrics and params through every logger of the trainer (MLflow, CSV, TensorBoard, ...: the gate
  wraps their ``log_metrics`` and ``log_hyperparams``), whoever logs them (``self.log`` in the
  user's module, our callbacks, Lightning itself);
- tags and artifacts through :mod:`lightning_dp.tracking`'s helpers (``set_tags``, ``log_figure``,
  ``log_text``, ``log_artifact``, ``log_public_checkpoint``, ``log_params``), the only way
  lightning-dp writes them.

:func:`admit` reads the table of :mod:`lightning_dp.privacy.record`:

- a release or public item is written;
- a ``nonprivate/`` item is written only if every installed component has
  ``log_nonprivate_metrics=True``, else dropped;
- a metric, tag or artifact the table does not declare is REFUSED (:class:`UndeclaredRecordError`),
  except a metric written while the trainer validates or tests, which evaluates the released model
  on held-out data (post-processing) whatever its name. The classic case is a user's
  ``self.log("train_loss", loss)`` in ``training_step``: the exact loss of a private batch, which no
  accountant covers. Log it as ``nonprivate/train_loss``, or declare the name
  (:func:`lightning_dp.privacy.record.declare`) if it is something else;
- params are the run's configuration: written, unless the table says a name is a ``nonprivate/``
  statistic.

A run without a privacy component claims nothing and is not gated.

Example:
    >>> from lightning.pytorch import Trainer
    >>> trainer = Trainer(logger=False)
    >>> admit(trainer, "my_loss", "metric")  # no privacy component installed a gate: not gated
    True
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from lightning_dp.privacy.record import Kind, classify

__all__ = ["UndeclaredRecordError", "admit", "admit_metrics", "install", "installed", "uninstall"]

_ATTRIBUTE = "_lightning_dp_gate"


class UndeclaredRecordError(ValueError):
    """A private run was about to write an item the record's table does not declare."""


class _Gate:
    def __init__(self) -> None:
        self.components: list[Any] = []
        self.restore: list[Any] = []

    @property
    def nonprivate(self) -> bool:
        return all(bool(getattr(c, "log_nonprivate_metrics", True)) for c in self.components)

    def describe(self) -> str:
        return ", ".join(type(c).__name__ for c in self.components)


def installed(trainer: Any) -> _Gate | None:
    """The trainer's gate, or None when no privacy component installed one."""
    return getattr(trainer, _ATTRIBUTE, None)


def _evaluating(trainer: Any) -> bool:
    return bool(getattr(trainer, "validating", False) or getattr(trainer, "testing", False)
                or getattr(trainer, "sanity_checking", False))


def admit(trainer: Any, name: str, where: str) -> bool:
    """Whether ``name`` (a ``"metric"``, ``"param"``, ``"tag"`` or ``"artifact"``) may be written to the record.

    Returns:
        True: write it. False: a ``nonprivate/`` item while some component has ``log_nonprivate_metrics=False``.

    Raises:
        UndeclaredRecordError: An undeclared metric (outside validation and testing), tag or artifact.
    """
    gate = installed(trainer)
    if gate is None:
        return True
    kind = classify(name, where)
    if kind is Kind.NONPRIVATE:
        return gate.nonprivate
    if kind is not None or where == "param" or (where == "metric" and _evaluating(trainer)):
        return True
    hint = (f"log it as 'nonprivate/{name.replace('/', '_')}' (switched off by log_nonprivate_metrics=False) if it "
            "is a statistic of the training data, or " if where in ("metric", "artifact") else "")
    raise UndeclaredRecordError(
        f"{gate.describe()}: the run was about to write the {where} {name!r} to the record, which the record's table "
        "(lightning_dp.privacy.record) does not declare: every item of a private run must be a DP release (or "
        "computed from released values only), public configuration, or a nonprivate/ statistic. Written during "
        f"training it may be an exact statistic of private data that no accountant covers. Fix: {hint}declare it "
        f"before the run: lightning_dp.privacy.record.declare({name!r}, 'release' | 'public' | 'nonprivate', "
        f"{where!r}, why).")


def admit_metrics(trainer: Any, metrics: Mapping[str, Any], where: str = "metric") -> dict[str, Any]:
    """The items of ``metrics`` that :func:`admit` lets through (it raises on an undeclared one)."""
    return {k: v for k, v in metrics.items() if admit(trainer, k, where)}


def _gated_metrics(trainer: Any, original: Any) -> Any:
    @functools.wraps(original)
    def log_metrics(metrics: Mapping[str, Any], step: int | None = None) -> Any:
        return original(admit_metrics(trainer, metrics), step)

    return log_metrics


def _gated_params(trainer: Any, original: Any) -> Any:
    @functools.wraps(original)
    def log_hyperparams(params: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(params, Mapping):
            params = admit_metrics(trainer, params, "param")
        return original(params, *args, **kwargs)

    return log_hyperparams


def install(trainer: Any, component: Any) -> None:
    """Put the gate on ``trainer`` for ``component`` (idempotent; call from the component's ``setup``): its loggers'
    ``log_metrics`` and ``log_hyperparams`` are wrapped until :func:`uninstall`."""
    gate = installed(trainer)
    if gate is None:
        gate = _Gate()
        for logger in trainer.loggers:
            for attr, wrap in (("log_metrics", _gated_metrics), ("log_hyperparams", _gated_params)):
                had = attr in logger.__dict__
                before = logger.__dict__.get(attr)
                setattr(logger, attr, wrap(trainer, getattr(logger, attr)))
                gate.restore.append((logger, attr, had, before))
        setattr(trainer, _ATTRIBUTE, gate)
    if not any(c is component for c in gate.components):
        gate.components.append(component)


def uninstall(trainer: Any, component: Any) -> None:
    """Take ``component`` off the gate (call from its ``teardown``); the last one removes the gate."""
    gate = installed(trainer)
    if gate is None:
        return
    gate.components = [c for c in gate.components if c is not component]
    if gate.components:
        return
    for logger, attr, had, before in reversed(gate.restore):
        if had:
            setattr(logger, attr, before)
        else:
            logger.__dict__.pop(attr, None)
    delattr(trainer, _ATTRIBUTE)
