"""Personalized FL with metric privacy: a preset of the federated round (:class:`~lightning_dp.federated.FederatedRound`).

Galli et al., "Group privacy for personalized federated learning" (Algorithms 1 and 2), thesis chapter 2: U
clients without replacement, IFCA choice among k hypotheses, local SGD, Euclidean Laplace releases charging n/nu to
each client's ledger, k-means at the server. A client's shuffles and noise depend on its index
(:meth:`~lightning_dp.federated.clients.RoundClients.shuffle_keys`), so resume and DDP equal the uninterrupted
single-process run. The algorithm, seeds and DDP: docs/federated.md, "One round, step by step".
"""

from __future__ import annotations

from typing import Literal

from torch import nn

from lightning_dp.federated.parts import EuclideanLaplace, KMeans, LocalSGD, NoServerPrivacy, UniformSelection
from lightning_dp.federated.round import FederatedRound
from lightning_dp.privacy.seeds import check_seed

__all__ = ["PersonalizedFederatedModule"]


class PersonalizedFederatedModule(FederatedRound):
    """IFCA-style personalized federated learning with Euclidean d-privacy (see the module docstring).

    The round of :class:`~lightning_dp.federated.FederatedRound` with these parts:
    :class:`~lightning_dp.federated.parts.UniformSelection` (``clients_per_round``, ``cap_policy``),
    :class:`~lightning_dp.federated.parts.LocalSGD` (``local_*``, ``client_engine``),
    :class:`~lightning_dp.federated.parts.EuclideanLaplace` (``noise_multiplier``, ``per_layer``,
    ``min_delta_norm``), :class:`~lightning_dp.federated.parts.KMeans` and no server privacy. It
    reproduces the runs of the implementation it replaced seed for seed
    (``tests/federated/test_reference_runs.py``; the stored runs were regenerated once, when client
    selection moved to the secret ``noise_seed``).

    Args:
        model: the network template; k hypotheses of its shape are trained.
        num_hypotheses: k.
        warm_start_rounds: as :class:`~lightning_dp.federated.FederatedRound` (IFCA's trained initialization:
            the first rounds' clients train a publicly assigned hypothesis instead of choosing; default 0).
        clients_per_round: U, sampled without replacement among the training clients.
        local_epochs: E.
        local_lr: s.
        local_batch_size: B_s.
        noise_multiplier: nu; 0 releases the clients' models unsanitized (non-private baseline).
        loss: ``"rmse"`` (regression; on class scores, the root Brier score),
            ``"cross_entropy"`` (logits of C classes) or ``"binary_cross_entropy"`` (one
            logit per example, labels in {0, 1}); see :func:`~lightning_dp.federated.local.masked_loss`.
        per_layer: sanitize each parameter tensor with its own epsilon (n_l, delta_l).
        client_privacy_cap: a client whose spend would exceed this declines to participate.
        cap_policy: ``"replace"`` (declined clients are replaced by eligible ones) or
            ``"skip"`` (the round runs with fewer clients).
        val_clients_per_check: evaluate a random sample of this many validation clients
            per check (default: all).
        test_every_check: as :class:`~lightning_dp.federated.FederatedRound`.
        client_engine: ``"dense"`` (all clients at once, hand-written gradients of a chain of Linear layers),
            ``"vmap"`` (all clients at once, any model), ``"loop"`` (one by one) or ``"auto"`` (as
            :class:`~lightning_dp.federated.parts.LocalSGD`).
        min_delta_norm: the noise is calibrated to ``max(||delta||, min_delta_norm)``: a client
            whose update is (numerically) zero still releases noise of mean norm
            ``nu * min_delta_norm``, for the same cost n/nu over a neighbourhood at least as
            large (see :func:`~lightning_dp.privacy.mechanisms.sanitize_update`).
        seed: as :class:`~lightning_dp.federated.FederatedRound`.
        noise_seed: as :class:`~lightning_dp.federated.FederatedRound`.
        log_nonprivate_metrics: as :class:`~lightning_dp.federated.FederatedRound`.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        num_hypotheses: int = 2,
        warm_start_rounds: int = 0,
        clients_per_round: int = 10,
        local_epochs: int = 1,
        local_lr: float = 0.1,
        local_batch_size: int = 10,
        noise_multiplier: float = 0.0,
        loss: Literal["rmse", "cross_entropy", "binary_cross_entropy"] = "rmse",
        per_layer: bool = False,
        client_privacy_cap: float | None = None,
        cap_policy: Literal["replace", "skip"] = "replace",
        val_clients_per_check: int | None = None,
        test_every_check: bool = False,
        client_engine: Literal["auto", "dense", "vmap", "loop"] = "auto",
        min_delta_norm: float = 1e-8,
        seed: int | None = None,
        noise_seed: int | None = None,
        log_nonprivate_metrics: bool = True,
    ) -> None:
        check_seed(seed)
        check_seed(noise_seed, "noise_seed")
        super().__init__(
            model, num_hypotheses=num_hypotheses, warm_start_rounds=warm_start_rounds,
            selection=UniformSelection(clients_per_round, cap_policy),
            update=LocalSGD(local_epochs, local_lr, local_batch_size, client_engine),
            sanitizer=EuclideanLaplace(noise_multiplier, per_layer, min_delta_norm),
            aggregator=KMeans(), server_privacy=NoServerPrivacy(), loss=loss, client_privacy_cap=client_privacy_cap,
            val_clients_per_check=val_clients_per_check, test_every_check=test_every_check, seed=seed, noise_seed=noise_seed,
            log_nonprivate_metrics=log_nonprivate_metrics)
        self.save_hyperparameters(ignore=["model", "noise_seed"])  # the noise seed is a secret

    # the preset's arguments, read where they live now
    @property
    def noise_multiplier(self) -> float:
        return self.sanitizer.noise_multiplier

    @property
    def per_layer(self) -> bool:
        return self.sanitizer.per_layer

    @property
    def clients_per_round(self) -> int:
        return self.selection.clients_per_round

    @property
    def engine(self) -> str:
        """The engine ``auto`` resolves to for this model on the CPU without a dense chain; the engine a fit ran
        (dense, or vmap on a GPU) is ``update.engine_used``."""
        return self.update.resolved_engine(self.spec.numel)

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if self.per_layer and self.noise_multiplier == 0:
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn("per_layer=True has no effect with noise_multiplier=0 (no sanitization)")
