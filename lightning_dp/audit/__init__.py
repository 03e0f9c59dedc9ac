"""Attacks used as audits of what a private component releases.

Public API (:mod:`lightning_dp.audit.dlg`, torch only):
    run_dlg_audit: Deep Leakage from Gradients against a client's release at several noise levels.
    client_release, observed_gradient, dlg_attack: the three stages (client, attacker's estimate, attack).
    EuclideanLaplaceSanitizer, GaussianSanitizer, NoSanitizer: what a client may release, the federated round's
        sanitizer parts behind PartRelease (any callable ``(start, trained, generator) -> released`` works);
        make_sanitizer_factory, SANITIZERS.
    mse, psnr, image_grid: the comparison of reconstructions with the private images.

Membership inference: scores (:mod:`lightning_dp.audit.scores`, the loss attack on any module with a
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

from lightning_dp.audit._common import Sanitizer, flatten_parameters, parameter_sizes
from lightning_dp.audit.dlg import DLGResult, dlg_attack, gradient_matching_loss
from lightning_dp.audit.dlg_audit import AuditResult, AuditRow, run_dlg_audit
from lightning_dp.audit.lira import inclusion_masks, lira_from_losses, lira_scores, train_shadow_models
from lightning_dp.audit.metrics import image_grid, mse, psnr
from lightning_dp.audit.neighbours import find_embedding, neighbour_losses, noisy_neighbour_scores, search_sigma
from lightning_dp.audit.one_run import epsilon_ceiling, one_run_audit, steinke_epsilon
from lightning_dp.audit.release import ClientRelease, client_release, observed_gradient
from lightning_dp.audit.sanitizers import (
    SANITIZERS,
    EuclideanLaplaceSanitizer,
    GaussianSanitizer,
    NoSanitizer,
    PartRelease,
    make_sanitizer_factory,
)
from lightning_dp.audit.scores import loss_scores, per_example_losses
from lightning_dp.audit.statistics import empirical_epsilon, roc, tpr_at_fpr, two_stage_epsilon

__all__ = [
    "SANITIZERS",
    "AuditResult",
    "AuditRow",
    "ClientRelease",
    "DLGResult",
    "EuclideanLaplaceSanitizer",
    "GaussianSanitizer",
    "NoSanitizer",
    "PartRelease",
    "Sanitizer",
    "client_release",
    "dlg_attack",
    "empirical_epsilon",
    "epsilon_ceiling",
    "find_embedding",
    "inclusion_masks",
    "lira_from_losses",
    "lira_scores",
    "loss_scores",
    "neighbour_losses",
    "noisy_neighbour_scores",
    "one_run_audit",
    "per_example_losses",
    "roc",
    "search_sigma",
    "steinke_epsilon",
    "tpr_at_fpr",
    "train_shadow_models",
    "two_stage_epsilon",
    "flatten_parameters",
    "gradient_matching_loss",
    "image_grid",
    "make_sanitizer_factory",
    "mse",
    "observed_gradient",
    "parameter_sizes",
    "psnr",
    "run_dlg_audit",
]
