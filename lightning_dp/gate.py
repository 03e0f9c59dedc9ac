"""The record's one gate: everything a private run writes passes :func:`admit` first, which reads the table of
:mod:`lightning_dp.privacy.record` (a release or public item is written, a ``nonprivate/`` one follows the switch,
an undeclared one is refused). Installed by the run-level protocol (:mod:`lightning_dp.protocol`); what it wraps and
what it refuses: docs/privacy.md, "The gate: where the table is enforced". A run without a privacy component is not
gated:

    >>> from lightning.pytorch import Trainer
    >>> admit(Trainer(logger=False), "my_loss", "metric")
    True
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from lightning_dp.privacy.record import Declaration, Kind, declaration

__all__ = ["UndeclaredRecordError", "admit", "admit_metrics", "check_metric_names", "check_monitors", "install",
           "installed", "nonprivate_allowed", "uninstall"]

_ATTRIBUTE = "_lightning_dp_gate"


class UndeclaredRecordError(ValueError):
    """A private run was about to write an item the record's table does not declare."""


class _Gate:
    def __init__(self) -> None:
        self.components: list[Any] = []
        self.restore: list[Any] = []

    @property
    def nonprivate(self) -> bool:
        return nonprivate_allowed(self.components)

    def describe(self) -> str:
        return ", ".join(type(c).__name__ for c in self.components)


def nonprivate_allowed(components: Any) -> bool:
    """Whether ``nonprivate/`` items may be recorded: every component lets them in (``log_nonprivate_metrics``)."""
    return all(bool(getattr(c, "log_nonprivate_metrics", True)) for c in components)


def installed(trainer: Any) -> _Gate | None:
    """The trainer's gate, or None when no privacy component installed one."""
    return getattr(trainer, _ATTRIBUTE, None)


def _evaluating(trainer: Any) -> bool:
    return bool(getattr(trainer, "validating", False) or getattr(trainer, "testing", False)
                or getattr(trainer, "sanity_checking", False))


def _in_run(trainer: Any, owners: tuple[str, ...]) -> bool:
    """Whether a callback or the module of the run, or a callback's clipping strategy, is (a subclass of) one of the
    classes named ``owners``."""
    objects = [*getattr(trainer, "callbacks", []), getattr(trainer, "lightning_module", None)]
    objects += [getattr(obj, "clipping", None) for obj in objects]
    return any(cls.__name__ in owners for obj in objects if obj is not None for cls in type(obj).__mro__)


def _conditions_hold(trainer: Any, row: Declaration, where: str) -> bool:
    """A metric row's conditions: one of its owners is in the run, and it is written while evaluating if it must."""
    if where != "metric":
        return True
    if row.owners and not _in_run(trainer, row.owners):
        return False
    return not row.evaluating or _evaluating(trainer)


def admit(trainer: Any, name: str, where: str) -> bool:
    """Whether ``name`` (a ``"metric"``, ``"param"``, ``"tag"`` or ``"artifact"``) may be written to the record.

    Returns:
        True: write it. False: a ``nonprivate/`` item while some component has ``log_nonprivate_metrics=False``.

    Raises:
        UndeclaredRecordError: An undeclared metric (outside validation and testing), tag or artifact, or a metric
            whose row's conditions do not hold (``round/*`` without a federated round, ``val/*`` during training).
    """
    gate = installed(trainer)
    if gate is None:
        return True
    row = declaration(name, where)
    if row is not None and row.kind is Kind.NONPRIVATE:
        return gate.nonprivate
    refusal = _refusal(trainer, name, where, row, "was about to write", name)
    if refusal is not None:
        raise UndeclaredRecordError(f"{gate.describe()}: {refusal}")
    return True


def _refusal(trainer: Any, name: str, where: str, row: Declaration | None, verb: str, logged: str) -> str | None:
    """Why the gate refuses ``name`` written as ``where`` now (``row``: its declaration), with the fix: the text of
    :func:`admit`'s error after the components' names (``verb``: "was about to write", or "would write" for a name
    checked ahead; ``logged``: the name the code logs, of which ``name`` may be Lightning's ``_step``/``_epoch`` form:
    the one to rename). None: not refused (written, or a ``nonprivate/`` item the switch may drop)."""
    rename = f"nonprivate/{logged.replace('/', '_')}"
    if row is not None and row.kind is Kind.NONPRIVATE:
        return None
    if row is not None and not _conditions_hold(trainer, row, where):
        condition = ("only while the trainer validates or tests" if row.evaluating
                     else f"only in a run with {' or '.join(row.owners)}")
        return (
            f"the run {verb} the metric {name!r}, which the record's table "
            f"(lightning_dp.privacy.record) admits {condition} (its row {row.pattern!r}: {row.why}). Written here it "
            f"may be an exact statistic of private data. Fix: log it as {rename!r} if it "
            "is a statistic of the training data, or under a name of its own that you declare: "
            "lightning_dp.privacy.record.declare(name, 'release' | 'public' | 'nonprivate', 'metric', why).")
    if row is not None or where == "param" or (where == "metric" and _evaluating(trainer)):
        return None
    hint = (f"log it as {rename!r} (switched off by log_nonprivate_metrics=False) if it "
            "is a statistic of the training data, or " if where in ("metric", "artifact") else "")
    return (
        f"the run {verb} the {where} {name!r} to the record, which the record's table "
        "(lightning_dp.privacy.record) does not declare: every item of a private run must be a DP release (or "
        "computed from released values only), public configuration, or a nonprivate/ statistic. Written during "
        f"training it may be an exact statistic of private data that no accountant covers. Fix: {hint}declare it "
        f"before the run: lightning_dp.privacy.record.declare({name!r}, 'release' | 'public' | 'nonprivate', "
        f"{where!r}, why).")


def check_metric_names(trainer: Any, names: Mapping[str, str], *, source: str) -> None:
    """Refuse, in one error, every metric of ``names`` that :func:`admit` would refuse when the loggers write it
    during training: a component that learns what a run will log checks it before the run trains on private data or
    writes anything (DPSGD, with the names its batch probe saw ``training_step`` log, before the first private step;
    the gate at each write stays the backstop for what is logged elsewhere). ``names`` maps each name, as the loggers
    would receive it, to the name the code logs (``train_acc`` for Lightning's ``train_acc_step`` and
    ``train_acc_epoch``: the one the fix renames); ``source`` says who logs them. Nothing is checked in a run
    without a gate or without a logger: no metric is written there.

    Raises:
        UndeclaredRecordError: listing each refused name with :func:`admit`'s own reason and fix for it.
    """
    gate = installed(trainer)
    if gate is None or not list(getattr(trainer, "loggers", None) or []):
        return
    refused = [(name, logged, text) for name, logged in sorted(names.items())
               if (text := _refusal(trainer, name, "metric", declaration(name, "metric"), "would write", logged))
               is not None]
    if not refused:
        return
    lines = "\n".join(f"- {name!r}{'' if logged == name else f' (logged as {logged!r})'}: {text}"
                       for name, logged, text in refused)
    raise UndeclaredRecordError(
        f"{gate.describe()}: {source} logs {len(refused)} metric(s) that the record of this private run would refuse "
        "when written. Refused now, before the private step, each with its fix:\n" + lines)


def admit_metrics(trainer: Any, metrics: Mapping[str, Any], where: str = "metric") -> dict[str, Any]:
    """The items of ``metrics`` that :func:`admit` lets through (it raises on an undeclared one)."""
    return {k: v for k, v in metrics.items() if admit(trainer, k, where)}


def _shown(trainer: Any, name: str) -> bool:
    """Whether the progress bar may show ``name``: what the record may hold (an undeclared or refused name is left
    out of the bar rather than stopping the run: the logger's write is where it is refused). A release of the
    evaluation (``val/*``, ``test/*``) stays in the bar during training: its value is the last evaluation's, which
    the record holds (a training statistic under such a name is refused when written, and DPSGD refuses it before the
    first step)."""
    row = declaration(name, "metric")
    if row is not None and row.kind is Kind.RELEASE and row.evaluating:
        return True
    try:
        return admit(trainer, name, "metric")
    except UndeclaredRecordError:
        return False


def _gated_bar(trainer: Any, bar: Any, original: Any) -> Any:
    from lightning.pytorch.callbacks import RichProgressBar

    rich = isinstance(bar, RichProgressBar)

    @functools.wraps(original)
    def get_metrics(*args: Any, **kwargs: Any) -> Any:
        shown = {k: v for k, v in original(*args, **kwargs).items() if _shown(trainer, k)}
        if rich and isinstance(shown.get("v_num"), int):  # Rich formats every number as a metric: version 1 read
            shown["v_num"] = str(shown["v_num"])  # "v_num: 1.000"; TQDM shows the int as it is and pads a str
        return shown

    return get_metrics


def check_monitors(trainer: Any) -> None:
    """Refuse a callback (``ModelCheckpoint``, ``EarlyStopping``) or learning-rate scheduler that monitors a
    statistic of the training data: the model it selects, its logged score (``best_checkpoint/score``) and the
    learning rates it sets would carry that statistic into the record. Call when training starts (the schedulers
    are configured by then).

    Raises:
        UndeclaredRecordError: Naming the monitor and the fix (monitor a validation metric).
    """
    if installed(trainer) is None:
        return
    monitors = [(type(cb).__name__, cb.monitor) for cb in getattr(trainer, "callbacks", [])
                if isinstance(getattr(cb, "monitor", None), str) and cb.monitor]
    monitors += [("a learning-rate scheduler", config.monitor) for config in getattr(trainer, "lr_scheduler_configs", [])
                 if getattr(config, "monitor", None)]
    for who, name in monitors:
        row = declaration(name, "metric")
        if (row is not None and row.kind is Kind.NONPRIVATE) or (row is None and name.startswith("train")):
            raise UndeclaredRecordError(
                f"{who} monitors {name!r}, a statistic of the training data that no accountant covers: the model or "
                "learning rate it selects, and the score it logs, would carry it into the record of a private run. "
                "Monitor a metric of the released model on held-out data instead (e.g. val/loss).")


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


def _wrap(gate: _Gate, obj: Any, attr: str, wrapped: Any) -> None:
    had = attr in obj.__dict__
    gate.restore.append((obj, attr, had, obj.__dict__.get(attr)))
    setattr(obj, attr, wrapped)


def install(trainer: Any, component: Any) -> None:
    """Put the gate on ``trainer`` for ``component`` (idempotent; call from the component's ``setup``, and again when
    training starts, to cover loggers added in between): every logger's ``log_metrics`` and ``log_hyperparams``,
    and the progress bar's ``get_metrics``, are wrapped until :func:`uninstall`."""
    gate = installed(trainer)
    if gate is None:
        gate = _Gate()
        setattr(trainer, _ATTRIBUTE, gate)
    wrapped = {id(obj) for obj, *_ in gate.restore}
    for logger in trainer.loggers:
        if id(logger) not in wrapped:
            _wrap(gate, logger, "log_metrics", _gated_metrics(trainer, logger.log_metrics))
            _wrap(gate, logger, "log_hyperparams", _gated_params(trainer, logger.log_hyperparams))
    bar = getattr(trainer, "progress_bar_callback", None)
    if bar is not None and id(bar) not in wrapped:
        _wrap(gate, bar, "get_metrics", _gated_bar(trainer, bar, bar.get_metrics))
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
