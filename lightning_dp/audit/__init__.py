"""Attacks used as audits of what a private component releases.

DLG against a client's release (:func:`run_dlg_audit`, the sanitizers), membership inference (the attacks of
``lightning-dp audit mia``: loss scores, LiRA, noisy neighbours, and their statistics) and one-run audits of
DP-SGD (canaries and bounds, in a run via :class:`lightning_dp.callbacks.OneRunAudit`). The package exports the
entry points (``__all__``); the helpers stay in their modules. See docs/audit.md.
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
