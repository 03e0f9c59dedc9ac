"""Attacks used as audits of what a private component releases.

Public API (:mod:`lightning_dp.audit.dlg`, torch only):
    run_dlg_audit: Deep Leakage from Gradients against a client's release at several noise levels.
    client_release, observed_gradient, dlg_attack: the three stages (client, attacker's estimate, attack).
    EuclideanLaplaceSanitizer, GaussianSanitizer, NoSanitizer: what a client may release
        (any callable ``(start, trained, generator) -> released`` works); make_sanitizer_factory, SANITIZERS.
    mse, psnr, image_grid: the comparison of reconstructions with the private images.

Membership inference: scores (:mod:`lightning_dp.audit.scores`, the loss attack on any module with a
per-example loss) and statistics (:mod:`lightning_dp.audit.statistics`: ROC, AUC, TPR at low FPR and
empirical epsilon lower bounds with Clopper-Pearson confidence).

The command ``lightning-dp audit`` (:mod:`lightning_dp.audit.command`) runs an audit from a
YAML config and records it in MLflow; see docs/audit.md.
"""

from lightning_dp.audit.dlg import (
    SANITIZERS,
    AuditResult,
    AuditRow,
    ClientRelease,
    DLGResult,
    EuclideanLaplaceSanitizer,
    GaussianSanitizer,
    NoSanitizer,
    Sanitizer,
    client_release,
    dlg_attack,
    flatten_parameters,
    gradient_matching_loss,
    image_grid,
    make_sanitizer_factory,
    mse,
    observed_gradient,
    parameter_sizes,
    psnr,
    run_dlg_audit,
)

__all__ = [
    "SANITIZERS",
    "AuditResult",
    "AuditRow",
    "ClientRelease",
    "DLGResult",
    "EuclideanLaplaceSanitizer",
    "GaussianSanitizer",
    "NoSanitizer",
    "Sanitizer",
    "client_release",
    "dlg_attack",
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
