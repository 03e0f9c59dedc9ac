"""Attacks used as audits of what a private component releases.

The package exports the entry points (``__all__``, 22 names); the helpers stay in their modules (image metrics
:mod:`lightning_dp.audit.metrics`, flat parameter vectors :mod:`lightning_dp.audit._common`, the stages of LiRA and
of noisy neighbours, the one-run bounds).

DLG (torch only):
    run_dlg_audit: Deep Leakage from Gradients against a client's release at several noise levels.
    client_release, observed_gradient, dlg_attack: the three stages (client, attacker's estimate, attack).
    EuclideanLaplaceSanitizer, GaussianSanitizer, Unsanitized: what a client may release, the federated round's
        sanitizer parts behind PartRelease (any callable ``(start, trained, generator) -> released`` works);
        make_sanitizer_factory.

Membership inference: the attacks of ``lightning-dp audit mia`` as registered parts (:class:`MembershipAttack`,
:func:`register_attack`; :mod:`lightning_dp.audit.attacks`), scores (:mod:`lightning_dp.audit.scores`, the loss attack on any module with a
per-example loss), shadow models (:mod:`lightning_dp.audit.lira`, LiRA), noisy neighbours
(:mod:`lightning_dp.audit.neighbours`) and statistics (:mod:`lightning_dp.audit.statistics`: ROC, AUC, TPR at
low FPR and empirical epsilon lower bounds with Clopper-Pearson confidence).

One-run audits of DP-SGD: canaries (:mod:`lightning_dp.audit.canaries`), the bounds of Steinke et al. and the
f-DP analysis (:mod:`lightning_dp.audit.one_run`) with their ceiling (``epsilon_ceiling``: the largest bound m
canaries can give), in a run via :class:`lightning_dp.callbacks.OneRunAudit`;
:mod:`lightning_dp.callbacks.faults` holds a deliberately broken DPSGD that audits must catch.

The command ``lightning-dp audit`` (:mod:`lightning_dp.commands.audit_dlg`) runs an audit from a
YAML config and records it in MLflow; see docs/audit.md.
"""

from lightning_dp.audit.attacks import MembershipAttack, register_attack
from lightning_dp.audit.dlg import dlg_attack
from lightning_dp.audit.dlg_audit import AuditResult, run_dlg_audit
from lightning_dp.audit.lira import lira_scores
from lightning_dp.audit.neighbours import noisy_neighbour_scores
from lightning_dp.audit.one_run import epsilon_ceiling, one_run_audit
from lightning_dp.audit.release import client_release, observed_gradient
from lightning_dp.audit.sanitizers import (
    EuclideanLaplaceSanitizer,
    GaussianSanitizer,
    PartRelease,
    Unsanitized,
    make_sanitizer_factory,
)
from lightning_dp.audit.scores import loss_scores, per_example_losses
from lightning_dp.audit.statistics import empirical_epsilon, roc, tpr_at_fpr, two_stage_epsilon

__all__ = [
    "AuditResult",
    "EuclideanLaplaceSanitizer",
    "GaussianSanitizer",
    "MembershipAttack",
    "PartRelease",
    "Unsanitized",
    "client_release",
    "dlg_attack",
    "empirical_epsilon",
    "epsilon_ceiling",
    "lira_scores",
    "loss_scores",
    "make_sanitizer_factory",
    "noisy_neighbour_scores",
    "observed_gradient",
    "one_run_audit",
    "per_example_losses",
    "register_attack",
    "roc",
    "run_dlg_audit",
    "tpr_at_fpr",
    "two_stage_epsilon",
]


def __getattr__(name: str) -> type:
    if name == "NoSanitizer":  # the release's former name
        from lightning_dp.audit.sanitizers import _renamed

        return _renamed("lightning_dp.audit")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
