"""The run-level privacy protocol: what makes a run private beside its mechanism, in one place.

DPSGD, the federated round (every preset, and so the Flower ``ServerApp``) each own one :class:`RunProtocol` and call
it from their hooks: the record's gate, the refusal of uploads that carry secrets, the secret seed, the check of
logged names, the final spend and the summary; a non-finite input is the functional core's
(:mod:`lightning_dp.privacy.finite`). docs/architecture.md, "One protocol per run", has the table and the path of one
step through it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_dp import gate
from lightning_dp.privacy.seeds import SECRET_KEY, check_seed, fresh_seed

__all__ = ["RunProtocol", "SECRET_KEY", "format_summary", "print_summary", "validation_rows"]


class RunProtocol:
    """The run-level protocol of one private component (module docstring).

    Args:
        owner: the component the gate names and reads (``log_nonprivate_metrics``): DPSGD, FederatedRound, ...
        seed: the secret seed, given (it wins over a checkpoint's); None: a checkpoint's, else a fresh one.
        seed_name: the seed's name in messages and in the checkpoint's secret dict (``"seed"``, ``"noise_seed"``).
        draw_now: draw the fresh seed at construction (a component used outside ``fit``, as a Flower node's round),
            not in :meth:`setup`.
        warn_fresh: a resume without a secret seed is a warning (True) or an info line (False).

    Example:
        >>> protocol = RunProtocol(object(), seed=7)
        >>> protocol.seed, protocol.given, protocol.state_dict()
        (7, True, {'seed': 7})
    """

    def __init__(self, owner: Any, *, seed: int | None = None, seed_name: str = "seed", draw_now: bool = False,
                 warn_fresh: bool = False) -> None:
        self.owner = owner
        self.seed_name = seed_name
        self.requested: int | None = check_seed(seed, seed_name)
        self._seed: int | None = self.requested if self.requested is not None else fresh_seed() if draw_now else None
        self._warn_fresh = bool(warn_fresh)
        self._summary: tuple[str, Sequence[tuple[str, str]]] | None = None

    # ------------------------------------------------------------------ the secret seed
    @property
    def given(self) -> bool:
        """Whether the seed was given (constructor or :meth:`give_seed`): it then wins over a checkpoint's."""
        return self.requested is not None

    @property
    def seed(self) -> int:
        """The secret seed (drawn in :meth:`setup` unless given, restored or drawn at construction)."""
        if self._seed is None:
            raise RuntimeError(f"{type(self.owner).__name__}: the secret {self.seed_name} is drawn when fitting starts "
                               "(setup); it is not known before")
        return self._seed

    @property
    def seed_or_none(self) -> int | None:
        return self._seed

    def give_seed(self, seed: int) -> int:
        """A seed given before ``fit`` (``lightning-dp grid`` gives every run its own): it wins over a checkpoint's."""
        self.requested = self._seed = check_seed(seed, self.seed_name, optional=False)
        return self.requested

    # ------------------------------------------------------------------ hooks
    def cover(self, trainer: Any) -> None:
        """The gate over whatever logger a hook added since (idempotent: wraps only what is new)."""
        gate.install(trainer, self.owner)

    def setup(self, trainer: Any, *, refuse_uploads: bool = True) -> None:
        """From ``setup("fit")``: refuse uploads of secret-carrying checkpoints, install the gate, fix the seed (drawn
        unless known, the same on every process)."""
        if refuse_uploads:
            from lightning_dp.tracking import refuse_checkpoint_uploads

            refuse_checkpoint_uploads(trainer, type(self.owner).__name__)
        gate.install(trainer, self.owner)  # everything the run writes from now on passes the record's gate
        seed = self._seed if self._seed is not None else fresh_seed()
        self._seed = int(trainer.strategy.broadcast(seed, src=0))  # default seeds are drawn per process: rank 0's

    def start(self, trainer: Any) -> None:
        """From ``on_train_start``: the gate again (loggers and the progress bar added since setup) and no monitor
        that selects on a private statistic."""
        gate.install(trainer, self.owner)
        gate.check_monitors(trainer)

    def check_names(self, trainer: Any, names: Mapping[str, str], *, source: str) -> None:
        """Refuse, in one error before the first private step, every undeclared metric name the component learned
        its module logs (DPSGD's batch probe of ``training_step``)."""
        gate.check_metric_names(trainer, names, source=source)

    def shown(self, trainer: Any, name: str) -> bool:
        """Whether the gate admits the metric ``name``: a printed summary shows a fact only where the record may
        hold it."""
        return gate.admit(trainer, name, "metric")

    def teardown(self, trainer: Any) -> None:
        """From ``teardown("fit")``: the component leaves the gate (the last one removes it)."""
        gate.uninstall(trainer, self.owner)

    # ------------------------------------------------------------------ the end of a run
    def write_final(self, trainer: Any, metrics: Mapping[str, float], step: int) -> None:
        """Write the final spend ``metrics`` of optimizer step ``step`` (Lightning writes the metrics of step n at
        n - 1; a later write of the same step is the one MLflow keeps) on global rank zero, and put them where the
        run's summary reads them (``callback_metrics``, which would otherwise hold the last value Lightning logged)."""
        if metrics and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(dict(metrics), step=step - 1)
        for name, value in metrics.items():
            trainer.callback_metrics[name] = torch.tensor(value, dtype=torch.float64)

    def end(self, title: str | Callable[[], str], rows: Callable[[], Sequence[tuple[str, str]]]) -> None:
        """From ``on_train_end``: the summary is due; :meth:`print_summary` prints it when fitting ends."""
        self._summary = (title, rows)  # type: ignore[assignment]  # both evaluated when printed

    def print_summary(self, trainer: Any) -> None:
        """From ``on_fit_end``, after Lightning closed the progress bar: the summary is the run's last word."""
        if self._summary is None:
            return
        title, rows = self._summary
        self._summary = None
        rows_shown = [*rows(), *validation_rows(trainer.callback_metrics)]  # type: ignore[operator]
        print_summary(trainer, title() if callable(title) else title, rows_shown)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The secret part of a checkpoint (the caller stores it under ``SECRET_KEY``: local checkpoints only)."""
        return {self.seed_name: self._seed}

    def load_state_dict(self, secret: Mapping[str, Any] | None, *, legacy: int | None = None) -> None:
        """Restore the seed of a checkpoint's secret dict (``legacy``: where an older checkpoint kept it), unless one
        was given; a checkpoint without one (a public checkpoint, stripped of its secrets) continues from a fresh
        secret seed, and says so."""
        seed = (secret or {}).get(self.seed_name, legacy)
        name = type(self.owner).__name__
        if self.requested is not None:
            # runs branched from one checkpoint (a grid) must not continue the same noise
            if seed is not None and int(seed) != self.requested:
                rank_zero_info(f"{name}: resuming with the {self.seed_name.replace('_', ' ')} given to it, not the "
                               "checkpoint's: the run "
                               "draws new noise (its accounting continues from the checkpoint's history).")
        elif seed is None:
            if self._seed is None:
                self._seed = fresh_seed()
            say = rank_zero_warn if self._warn_fresh else rank_zero_info
            say(f"{name}: the checkpoint holds no secret {self.seed_name.replace('_', ' ')} (a public checkpoint, stripped of its "
                "secrets, or one written before lightning-dp kept it apart from the logged seed); the resumed run "
                "draws its noise from a fresh secret seed. Its accounting continues from the checkpoint's history.")
        else:
            self._seed = int(seed)


def validation_rows(metrics: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The summary's rows of the last validation (releases: the model evaluated on held-out data), where it ran.

    Example:
        >>> validation_rows({"val/acc": 0.875, "privacy/epsilon": 2.9})
        [('val/acc', '0.875 (last validation)')]
    """
    return [(name, f"{float(metrics[name]):.4g} (last validation)") for name in ("val/loss", "val/acc")
            if name in metrics]


def format_summary(title: str, rows: Sequence[tuple[str, str]]) -> str:
    """The title, then the rows as aligned ``label  value`` lines indented by two spaces.

    Example:
        >>> print(format_summary("DPSGD: 30 private steps (3 epochs)",
        ...                      [("epsilon", "1.98 of target_epsilon 2 at delta 1e-05"), ("sample rate q", "0.1")]))
        DPSGD: 30 private steps (3 epochs)
          epsilon        1.98 of target_epsilon 2 at delta 1e-05
          sample rate q  0.1
    """
    width = max((len(label) for label, _ in rows), default=0)
    return "\n".join([title, *(f"  {label:<{width}}  {value}" for label, value in rows)])


def print_summary(trainer: Any, title: str, rows: Sequence[tuple[str, str]]) -> None:
    """Print :func:`format_summary` on global rank zero (one copy under DDP), after the progress bar's last frame.

    Called from ``on_fit_end``. Lightning's Rich progress bar draws its final frame when it stops, in its
    ``teardown`` hook, after ``on_fit_end``: in a log file that frame (with its metrics cut to the width) came
    after the summary. The bar's own ``teardown`` is called here first (idempotent: it stops a display that
    is running, and Lightning's later call finds it stopped), so that the summary is the run's last word.
    """
    if not trainer.is_global_zero:
        return
    bar = getattr(trainer, "progress_bar_callback", None)
    if bar is not None and getattr(trainer, "lightning_module", None) is not None:
        bar.teardown(trainer, trainer.lightning_module, "fit")
    print(format_summary(title, rows), flush=True)
