"""What each name a run writes to the record is: one table for metrics, params, tags and artifacts.

Every name is :attr:`Kind.RELEASE`, :attr:`Kind.PUBLIC` or :attr:`Kind.NONPRIVATE` (under ``nonprivate/``);
:func:`classify` returns None for an undeclared one, and tests/test_neighbouring_records.py fails on it. The
kinds and the table read family by family: docs/privacy.md, "Threat model".

Example:
    >>> classify("privacy/epsilon"), classify("nonprivate/train_loss"), classify("val/acc")
    (<Kind.PUBLIC: 'public'>, <Kind.NONPRIVATE: 'nonprivate'>, <Kind.RELEASE: 'release'>)
    >>> classify("my_train_loss") is None
    True
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from fnmatch import fnmatchcase
from typing import NamedTuple

__all__ = ["Declaration", "Kind", "RECORD", "RoundNames", "classify", "declaration", "declare", "undeclared"]


class Kind(str, enum.Enum):
    """What a recorded item is (module docstring)."""

    RELEASE = "release"
    PUBLIC = "public"
    NONPRIVATE = "nonprivate"


class Declaration(NamedTuple):
    """One row of the table: a name pattern, its kind, where it is written ("metric", "param", "tag",
    "artifact", or "*"), and why it is that kind.

    ``owners``: class names of which one must be in the run (a callback or the module, or one of their base
    classes) for a METRIC of this row to be admitted (a user's module cannot write ``round/x`` into a DP-SGD run);
    empty: no condition. ``evaluating``: a metric of this row is admitted only while the trainer validates or
    tests (``val/*``: the released model on held-out data, never a statistic of a training batch)."""

    pattern: str
    kind: Kind
    where: str
    why: str
    owners: tuple[str, ...] = ()
    evaluating: bool = False


#: The components whose metrics the privacy/* metric rows are: one of them must be in the run.
_PRIVATE = ("DPSGD", "FederatedRound")

#: The table, first match wins. Each row says why; docs/privacy.md renders the threat model from it.
RECORD: list[Declaration] = [
    # --- exact statistics of private data
    Declaration("nonprivate/*", Kind.NONPRIVATE, "*", "exact statistics of the training data, covered by no "
                "accountant; off with log_nonprivate_metrics=False"),
    # --- accounted releases and their post-processing
    Declaration("privacy/max_grad_norm", Kind.RELEASE, "metric", "an adaptive clipping threshold: moved by a noisy "
                "count (QuantileClipping, CentralGaussian(adaptive=True)) or the sanitized dot products of OSO, "
                "accounted with the gradient", _PRIVATE),
    Declaration("privacy/unclipped_fraction_estimate", Kind.RELEASE, "metric", "the noisy count of unclipped "
                "updates (Andrew et al.), accounted", _PRIVATE),
    Declaration("privacy/update_set_diameter", Kind.RELEASE, "metric", "the diameter of the set the round's "
                "updates lie in, at the server's threshold: a function of the released adaptive threshold",
                ("FederatedRound",)),
    Declaration("train/lr", Kind.RELEASE, "metric", "OSO's learning rate, from the sanitized dot products",
                ("OnlineSensitivityClip",)),
    Declaration("val/*", Kind.RELEASE, "metric", "the released model evaluated on held-out data (post-processing)",
                evaluating=True),
    Declaration("test/*", Kind.RELEASE, "metric", "the released model evaluated on held-out data (post-processing)",
                evaluating=True),
    Declaration("summary.val_*", Kind.RELEASE, "tag", "the last val/* metrics"),
    Declaration("summary.test_*", Kind.RELEASE, "tag", "the last test/* metrics"),
    Declaration("model/*", Kind.RELEASE, "artifact", "the released model, stripped of every secret "
                "(tracking.public_checkpoint)"),
    Declaration("round/*", Kind.RELEASE, "metric", "statistics of sanitized client releases (post-processing), or "
                "counts of a selection no accountant amplifies; under central DP the round writes these under "
                "nonprivate/ instead", ("FederatedRound",)),
    Declaration("federated/parameters.png", Kind.RELEASE, "artifact", "sanitized releases of a public selection"),
    Declaration("best_checkpoint/*", Kind.RELEASE, "param", "the best checkpoint by a validation metric (a release)"),
    Declaration("lr-*", Kind.RELEASE, "metric", "a LearningRateMonitor's learning rate: a schedule of the "
                "configuration, or OSO's rate from the sanitized dot products (a scheduler that monitors a metric "
                "must monitor a release: lightning_dp.gate.check_monitors)", ("LearningRateMonitor",)),
    Declaration("grid.md", Kind.RELEASE, "artifact", "a grid's report: its runs' releases and accounted spends"),
    Declaration("grid_bars.png", Kind.RELEASE, "artifact", "a grid's bars of its runs' released metrics"),
    Declaration("privacy_utility.*", Kind.RELEASE, "artifact", "a grid's (or lightning-dp compare's) task metric "
                "against epsilon: its runs' released metrics and accounted spends"),
    Declaration("pdpfl/public_clients", Kind.RELEASE, "metric", "PFA's public group among the participants, from "
                "the budgets the clients reveal (direct split) or from their released updates' norms (indirect)",
                ("FederatedRound",)),
    Declaration("pdpfl/split_accuracy", Kind.PUBLIC, "metric", "a simulation diagnostic of PFA's split against "
                "the clients' budget groups: the budgets are configuration of the simulation (each client's "
                "privacy preference), not training data", ("FederatedRound",)),
    # --- the accounted spend, as metrics (each written by a privacy component)
    *(Declaration(f"privacy/{name}", Kind.PUBLIC, "metric", "the accounted spend: a function of the configuration, "
                  "the number of steps and a public (or post-processed) ledger", _PRIVATE)
      for name in ("epsilon", "steps", "epsilon_replace_one", "epsilon_disjoint_pair", "sample_rate",
                   "client_epsilon_median",
                   "client_epsilon_max", "record_epsilon_median", "record_epsilon_max", "cost_per_participation")),
    # --- accounted spend and configuration
    Declaration("privacy/*", Kind.PUBLIC, "param", "the mechanism's configuration"),
    Declaration("privacy/*", Kind.PUBLIC, "artifact", "plots and tables of the accounted spend (privacy/epsilon.png, "
                "the ledgers of a public selection)"),
    Declaration("summary.epsilon", Kind.PUBLIC, "tag", "the final accounted spend"),
    Declaration("summary.budget_used", Kind.PUBLIC, "tag", "the final spend over the target"),
    Declaration("summary.client_epsilon_max", Kind.PUBLIC, "tag", "the final privacy/client_epsilon_max"),
    Declaration("grid/*", Kind.PUBLIC, "*", "the grid's composition of its runs' spends"),
    Declaration("grid.*", Kind.PUBLIC, "*", "the grid's configuration and choices"),
    Declaration("epoch", Kind.PUBLIC, "metric", "Lightning's epoch counter"),
    Declaration("v_num", Kind.PUBLIC, "metric", "the progress bar's logger version"),
    *(Declaration(name, Kind.RELEASE, "metric", "the federated round's progress bar: short names of the round's own "
                  "metrics, shown only when those are recorded", ("FederatedRound",))
      for name in ("round", "clients", "client_eps_med", "client_eps_max", "eps", "record_eps_max")),
    Declaration("versions/*", Kind.PUBLIC, "param", "library versions and the lightning-dp commit"),
    Declaration("config.yaml", Kind.PUBLIC, "artifact", "the run's configuration, secrets redacted"),
    Declaration("mlflow.*", Kind.PUBLIC, "tag", "MLflow's own tags"),
    Declaration("lightning_dp.*", Kind.PUBLIC, "tag", "versions and provenance"),
    Declaration("audit/*", Kind.RELEASE, "metric", "a one-run audit's results (scores of the released model or of "
                "the released gradients on its canaries)", ("OneRunAudit",)),
    Declaration("audit/*", Kind.RELEASE, "*", "an audit's configuration and results (scores of the released model or of "
                "the released gradients on canaries: post-processing), written by the auditor, who "
                "holds the data: canaries built from training inputs (mislabeled copies, inputs at the training "
                "data's mean and std), DLG's original images and MIA's membership bits are in it. An audit record "
                "is the auditor's, not a release: do not share it beyond whoever may see the data"),
]


def declare(pattern: str, kind: Kind | str, where: str = "*", why: str = "", *, owners: tuple[str, ...] = (),
            evaluating: bool = False) -> None:
    """Add a row to the table (before the built-in rows: a component's own declaration wins)."""
    RECORD.insert(0, Declaration(pattern, Kind(kind), where, why, tuple(owners), bool(evaluating)))


def declaration(name: str, where: str = "*") -> Declaration | None:
    """The row that declares ``name`` written as ``where``, or None."""
    for row in RECORD:
        if (row.where == "*" or where == "*" or row.where == where) and fnmatchcase(name, row.pattern):
            return row
    return None


def classify(name: str, where: str = "*") -> Kind | None:
    """The kind of ``name`` written as ``where`` (``"metric"``, ``"param"``, ``"tag"``, ``"artifact"``), or
    None when the table does not declare it (the conditions of a row, ``owners`` and ``evaluating``, are the
    gate's: :func:`lightning_dp.gate.admit`)."""
    row = declaration(name, where)
    return None if row is None else row.kind


def undeclared(names: Iterable[str], where: str = "*") -> list[str]:
    """The names the table does not declare, sorted."""
    return sorted({n for n in names if classify(n, where) is None})


class RoundNames(NamedTuple):
    """Where a federated round records its statistics, from two public facts of its parts (the round's half of this
    table's naming rules; the round reads them, it does not write its own).

    Example:
        >>> central = RoundNames(selection_secret=True, releases_sanitized=False)
        >>> central.stat("participants"), central.ledger("client_epsilon_max"), central.records_releases
        ('nonprivate/participants', 'nonprivate/client_epsilon_max', False)
        >>> RoundNames(False, True).stat("update_norm_mean", of_releases=True)
        'round/update_norm_mean'
    """

    #: an accountant amplifies by the secret client selection: who took part, how many, and the per-client ledgers
    #: (each client's participations) are ``nonprivate/``
    selection_secret: bool
    #: every release is itself private (a local sanitizer or local DP-SGD with a ledger): statistics of the releases
    #: are post-processing; otherwise they are exact statistics of the clients' data
    releases_sanitized: bool

    def stat(self, name: str, *, of_releases: bool = False) -> str:
        """``round/<name>``, or ``nonprivate/<name>`` for a per-participant count under a secret selection and for
        a statistic of unsanitized releases (``of_releases``)."""
        private = self.selection_secret or (of_releases and not self.releases_sanitized)
        return f"{'nonprivate' if private else 'round'}/{name}"

    def ledger(self, name: str) -> str:
        """``privacy/<name>`` of a per-client ledger, ``nonprivate/<name>`` under a secret selection."""
        return f"{'nonprivate' if self.selection_secret else 'privacy'}/{name}"

    @property
    def records_releases(self) -> bool:
        """Whether the releases themselves may go to the record (sanitized, of a public selection)."""
        return self.releases_sanitized and not self.selection_secret
