"""Client sanitizers: what a client releases of its trained model, and what one release costs it.

``none``, ``euclidean_laplace`` (d-privacy), ``clip``, ``gaussian_ldp``, ``laplace_ldp`` and ``sector``
(thesis ch. 5). Under local DP a clipped update's sensitivity is the diameter of its clipping set; with k > 1
hypotheses the choice of the start adds :func:`choice_spread`. What each releases and costs: docs/federated.md,
"Local DP" and "The sector".
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_dp.federated.local import row_norms
from lightning_dp.federated.parts.registry import Combination, Part, register_part
from lightning_dp.privacy.accounting import check_delta
from lightning_dp.privacy.clipping import check_clip
from lightning_dp.privacy.ledger import GaussianLedger, PrivacyLedger
from lightning_dp.privacy.local_dp import (
    check_sector,
    clip_l1,
    clip_l2,
    gaussian_epsilon,
    laplace_noise,
    project_to_sector,
    sector_diameter,
)
from lightning_dp.privacy.mechanisms import SanitizedUpdate, check_metric_noise_multiplier, sanitize_update
from lightning_dp.privacy.noise import check_noise_multiplier, gaussian_noise

__all__ = ["ClientSanitizer", "ClipSanitizer", "EuclideanLaplace", "GaussianLocalDP", "LaplaceLocalDP", "NoSanitizer",
           "SectorSanitizer", "choice_spread"]


class ClientSanitizer(Part):
    """Turns a client's trained model into its release.

    ``sanitize`` returns the released parameter vector and the participation's cost, which
    the round charges to the client's ledger when :attr:`accountable` (a d-privacy ledger:
    costs add up over participations, :class:`~lightning_dp.privacy.ledger.PrivacyLedger`).
    """

    kind = "sanitizer"

    #: whether releases cost privacy that the round must charge to the clients' ledgers
    accountable = False

    def problems(self, parts: Combination) -> list[str]:
        if self.accountable and parts.aggregator.weights_by_counts:
            return [f"sanitizer {self.name!r} with {parts.aggregator.name} weighted=True: the weights are the "
                    "clients' example counts, released to the server unsanitized and not covered by the clients' "
                    "ledgers; use weighted=False"]
        return []
    #: what the ledger's numbers are, for plots and tables
    ledger_label = "client epsilon spent (d-privacy, per ||delta||-neighbourhood)"
    #: whether the client clips at a threshold the server may adapt (:meth:`follow_clip`); such a sanitizer
    #: reports :attr:`SanitizedUpdate.unclipped` for the server's noisy quantile estimate
    follows_clip = False

    def follow_clip(self, clip: float) -> None:
        """Clip at the server's threshold ``clip`` from now on (public: the server's adaptive estimate)."""
        raise NotImplementedError(f"sanitizer {self.name!r} does not clip at an adaptive threshold")

    def make_ledger(self) -> PrivacyLedger:
        """The per-client ledger the round charges :attr:`SanitizedUpdate.cost` to (additive by default)."""
        return PrivacyLedger()

    def participation_cost(self, numel: int, hypotheses: Tensor | None = None) -> float:
        """The largest cost of one participation for a model of ``numel`` parameters (inf: unprotected),
        in the ledger's unit, when the client starts from one of ``hypotheses`` (k, P) (public; None: a
        fixed start); used to decline clients before a round (``client_privacy_cap``)."""
        return math.inf

    def update_set(self, reference_given: bool) -> tuple[float, float] | None:
        """``(radius, diameter)`` of a set that every released update (release minus start) lies in, whatever
        the client's data, or None: server-side accounting under replacement may use it (public)."""
        return None

    @abc.abstractmethod
    def sanitize(self, trained: Tensor, start: Tensor, *, generator: torch.Generator, layer_sizes: list[int],
                 reference: Tensor | None = None, hypotheses: Tensor | None = None) -> SanitizedUpdate:
        """The release of a client that trained ``start`` into ``trained``.

        ``reference`` is public: the previous round's released change of the model the client
        started from (None in the first round); only direction-aware sanitizers use it.
        ``hypotheses`` (k, P), public, are the models the client chose ``start`` from on its data
        (None: ``start`` did not depend on the data); local DP sanitizers account for the choice.
        """
        raise NotImplementedError


    def sanitize_rows(self, trained: Tensor, start: Tensor, *, generator_of: Callable[[int], torch.Generator],
                      layer_sizes: list[int], references: list[Tensor | None], choice: Tensor,
                      hypotheses: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """The releases of m clients: ``(released (m, P), costs (m,) float64, unclipped (m,) float64)``, a bit
        NaN where the sanitizer reports none.

        Row ``c`` is :meth:`sanitize` of ``trained[c]`` from ``start[c]`` with the generator ``generator_of(c)``
        (the client's own secret stream) and the reference of its hypothesis ``references[choice[c]]``. A
        sanitizer that draws no noise overrides this with one pass over the rows (a generator per client costs
        ~10 us, more than a whole round of 100,000 small clients can afford).
        """
        released, costs, bits = [], [], []
        for c in range(len(trained)):
            out = self.sanitize(trained[c], start[c], layer_sizes=layer_sizes, generator=generator_of(c),
                                reference=references[int(choice[c])], hypotheses=hypotheses)
            released.append(out.released)
            costs.append(out.cost)
            bits.append(math.nan if out.unclipped is None else float(out.unclipped))
        if not released:
            return trained.new_zeros(trained.shape), torch.zeros(0, dtype=torch.float64), \
                torch.zeros(0, dtype=torch.float64)
        return torch.stack(released), torch.tensor(costs, dtype=torch.float64), torch.tensor(bits, dtype=torch.float64)

    def unchanged_releases(self, m: int) -> tuple[Tensor, Tensor] | None:
        """``(costs, unclipped bits)`` of m releases, as :meth:`sanitize_rows` returns them, when this sanitizer
        releases the trained models as they are (whatever they are); None (the default) when it changes them. The
        round may then never hold the releases (:meth:`~lightning_dp.federated.clients.RoundClients.fused_block`):
        a subclass that changes the releases of such a sanitizer returns None here."""
        return None


def choice_spread(hypotheses: Tensor | None, p: float = 2.0) -> float:
    """``max_ij ||h_i - h_j||_p``: how far apart the starting models a client chooses among are (0 for k <= 1).

    A release ``h_c + u`` with u in a set of radius R around 0 and c chosen on private data has
    sensitivity at most ``choice_spread + 2R`` (triangle inequality); the hypotheses are public.
    """
    if hypotheses is None or hypotheses.shape[0] <= 1:
        return 0.0
    h = hypotheses.detach().double().flatten(1)
    # exact differences, never the |a|^2 + |b|^2 - 2ab shortcut (it can round a distance down)
    return float(torch.cdist(h[None], h[None], p=p, compute_mode="donot_use_mm_for_euclid_dist").max())


#: the server recomputes an update as release - start in floating point: the set it lies in is padded by this factor
_ROUNDING = 1 + 1e-4


def _check_local_multiplier(noise_multiplier: Any, *, allow_zero: bool = False) -> float:
    """A local DP sanitizer's multiplier: the noise scale over the clipping norm C of the client's update."""
    meaning = "the local noise scale over the clipping norm C of the client's update"
    return check_noise_multiplier(noise_multiplier, allow_zero=allow_zero,
                                  meaning=meaning + (" (0: no local noise)" if allow_zero else ""),
                                  fix="Pass e.g. noise_multiplier=1.0.")


@register_part("sanitizer", "none")
class NoSanitizer(ClientSanitizer):
    """Releases the trained model as it is: no privacy from the client (e.g. under central DP, or a baseline)."""

    def sanitize(self, trained, start, *, generator, layer_sizes, reference=None, hypotheses=None):
        return SanitizedUpdate(released=trained, epsilon=math.inf, cost=math.inf)

    def sanitize_rows(self, trained, start, *, generator_of, layer_sizes, references, choice, hypotheses=None):
        costs, bits = self.unchanged_releases(len(trained))
        return trained, costs, bits

    def unchanged_releases(self, m: int) -> tuple[Tensor, Tensor]:
        return torch.full((m,), math.inf, dtype=torch.float64), torch.full((m,), math.nan, dtype=torch.float64)


@register_part("sanitizer", "euclidean_laplace")
class EuclideanLaplace(ClientSanitizer):
    """Metric privacy (Galli et al., "Group privacy for personalized FL"): ``released = trained + Laplace_d``.

    The noise is Euclidean Laplace with ``epsilon = n / (nu ||delta||)``, ``delta`` the update from
    the client's starting model, so its expected norm is ``nu ||delta||``; one release costs
    ``n / nu`` with respect to the client's ``||delta||``-neighbourhood, and a client's costs add
    up over participations (:func:`~lightning_dp.privacy.mechanisms.sanitize_update`). Not an
    (epsilon, delta)-DP guarantee (docs/privacy.md).

    Args:
        noise_multiplier: nu; 0 releases the models unsanitized (a baseline; nothing is charged).
        per_layer: every parameter tensor gets its own epsilon (n_l, delta_l); the same total cost.
        min_delta_norm: the noise is calibrated to ``max(||delta||, min_delta_norm)``.
    """

    def __init__(self, noise_multiplier: float = 1.0, per_layer: bool = False, min_delta_norm: float = 1e-8) -> None:
        self.noise_multiplier = check_metric_noise_multiplier(noise_multiplier)
        if not (float(min_delta_norm) >= 0 and math.isfinite(float(min_delta_norm))):
            raise ValueError(f"min_delta_norm={min_delta_norm!r} is not allowed: pass a finite number >= 0")
        self.per_layer = bool(per_layer)
        self.min_delta_norm = float(min_delta_norm)
        self.accountable = self.noise_multiplier > 0

    def hparams(self) -> dict[str, Any]:
        return {"noise_multiplier": self.noise_multiplier, "per_layer": self.per_layer}

    def participation_cost(self, numel: int, hypotheses: Tensor | None = None) -> float:
        return math.inf if self.noise_multiplier == 0 else numel / self.noise_multiplier

    def sanitize(self, trained, start, *, generator, layer_sizes, reference=None, hypotheses=None):
        return sanitize_update(trained, start, noise_multiplier=self.noise_multiplier, generator=generator,
                               per_layer_sizes=layer_sizes if self.per_layer else None,
                               min_delta_norm=self.min_delta_norm)


@register_part("sanitizer", "clip")
class ClipSanitizer(ClientSanitizer):
    """Releases ``start + clip_C(trained - start)`` (L2): bounded updates, no noise, no guarantee by itself.

    For central DP the server clips anyway (:class:`~lightning_dp.federated.parts.CentralGaussian`);
    clipping on the client bounds what a client can contribute to an aggregate it does not
    see (secure aggregation, a robustness baseline).
    """

    follows_clip = True

    def __init__(self, clip: float = 1.0) -> None:
        self.clip = check_clip(clip, name="clip")
        self.initial_clip = self.clip

    def hparams(self) -> dict[str, Any]:
        return {"sanitizer_clip": self.initial_clip}

    def follow_clip(self, clip: float) -> None:
        self.clip = check_clip(clip, name="clip")

    def update_set(self, reference_given):
        return self.clip * _ROUNDING, 2 * self.clip * _ROUNDING

    def sanitize(self, trained, start, *, generator, layer_sizes, reference=None, hypotheses=None):
        delta = trained - start
        return SanitizedUpdate(released=start + clip_l2(delta, self.clip), epsilon=math.inf, cost=math.inf,
                               unclipped=bool(delta.double().norm() <= self.clip))

    def sanitize_rows(self, trained, start, *, generator_of, layer_sizes, references, choice, hypotheses=None):
        deltas = trained - start
        norms = row_norms(deltas)
        released = start + clip_l2(deltas, self.clip, norms=norms)
        return released, torch.full((len(trained),), math.inf, dtype=torch.float64), (norms <= self.clip).double()

    def state_dict(self) -> dict[str, Any]:
        return {"clip": self.clip}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clip = float(state.get("clip", self.clip))


@register_part("sanitizer", "gaussian_ldp")
class GaussianLocalDP(ClientSanitizer):
    """Local DP with Gaussian noise: ``start + clip_C(Delta) + N(0, (z C)^2 I)``.

    Any two datasets of the client are neighbours, so one release is the Gaussian mechanism
    with L2 sensitivity ``2C`` (the ball's diameter), i.e. multiplier ``z / 2``; a client's
    releases compose exactly into one Gaussian mechanism (:class:`~lightning_dp.privacy.ledger.GaussianLedger`),
    whose epsilon at ``target_delta`` the round logs per client.

    Args:
        noise_multiplier: z, the noise std over C.
        clip: C.
        target_delta: the delta of every client's epsilon.
        accountant: ``"pld"`` or ``"rdp"``.
    """

    accountable = True
    ledger_label = "client epsilon (local DP, Gaussian, at target_delta)"

    def __init__(self, noise_multiplier: float = 1.0, clip: float = 1.0, target_delta: float = 1e-5,
                 accountant: str = "pld") -> None:
        self.noise_multiplier, self.clip = _check_local_multiplier(noise_multiplier), check_clip(clip, name="clip")
        self.target_delta, self.accountant = check_delta(target_delta, name="target_delta"), accountant
        self.make_ledger()  # validates the accountant

    def hparams(self) -> dict[str, Any]:
        return {"sanitizer_noise_multiplier": self.noise_multiplier, "sanitizer_clip": self.clip,
                "sanitizer_target_delta": self.target_delta, "sanitizer_accountant": self.accountant,
                "sanitizer_sensitivity": self.diameter()}

    def make_ledger(self) -> PrivacyLedger:
        return GaussianLedger(self.target_delta, self.accountant)

    def diameter(self, reference_given: bool = True) -> float:
        """The L2 diameter of the set clipping maps updates into (the sensitivity of a release from a fixed start)."""
        return 2 * self.clip

    def sensitivity(self, reference_given: bool, hypotheses: Tensor | None = None) -> float:
        """The L2 sensitivity of one release: :meth:`diameter` from a fixed start; with a choice among
        k > 1 ``hypotheses``, ``choice_spread + 2C`` (the sets of two hypotheses lie in balls of radius C
        around them; conservative even where they overlap)."""
        if hypotheses is None or hypotheses.shape[0] <= 1:
            return self.diameter(reference_given)
        return max(self.diameter(reference_given), choice_spread(hypotheses) + 2 * self.clip)

    def participation_cost(self, numel: int, hypotheses: Tensor | None = None) -> float:
        largest = max(self.sensitivity(False, hypotheses), self.sensitivity(True, hypotheses))
        return largest**2 / (self.noise_multiplier * self.clip) ** 2

    def _release(self, bounded: Tensor, start: Tensor, generator: torch.Generator, diameter: float) -> SanitizedUpdate:
        (noise,) = gaussian_noise([bounded.shape], self.noise_multiplier * self.clip, generator, dtype=bounded.dtype,
                                  device=bounded.device)
        multiplier = self.noise_multiplier * self.clip / diameter
        return SanitizedUpdate(released=start + bounded + noise, cost=multiplier**-2,
                               epsilon=gaussian_epsilon(multiplier, self.target_delta, self.accountant))

    def sanitize(self, trained, start, *, generator, layer_sizes, reference=None, hypotheses=None):
        return self._release(clip_l2(trained - start, self.clip), start, generator,
                             self.sensitivity(True, hypotheses))


@register_part("sanitizer", "laplace_ldp")
class LaplaceLocalDP(ClientSanitizer):
    """Local DP with Laplace noise: ``start + clip^{L1}_C(Delta) + Laplace(lambda C)`` per coordinate.

    The L1 ball of radius C has L1 diameter 2C, so one release is ``epsilon = 2 / lambda``
    pure DP (delta = 0); a client's releases add up (basic composition, tight for pure DP
    at delta = 0), in an additive ledger.

    Args:
        noise_multiplier: lambda, the Laplace scale over C.
        clip: C, the L1 clipping norm.
    """

    accountable = True
    ledger_label = "client epsilon (local DP, Laplace, pure: delta = 0)"

    def __init__(self, noise_multiplier: float = 1.0, clip: float = 1.0) -> None:
        self.noise_multiplier, self.clip = _check_local_multiplier(noise_multiplier), check_clip(clip, name="clip")

    def hparams(self) -> dict[str, Any]:
        return {"sanitizer_noise_multiplier": self.noise_multiplier, "sanitizer_clip": self.clip,
                "sanitizer_epsilon_per_release": self.participation_cost(0)}

    def sensitivity(self, reference_given: bool, hypotheses: Tensor | None = None) -> float:
        """The L1 sensitivity of one release: ``2C``, plus the L1 :func:`choice_spread` of k > 1 hypotheses."""
        return 2.0 * self.clip + choice_spread(hypotheses, p=1.0)

    def participation_cost(self, numel: int, hypotheses: Tensor | None = None) -> float:
        return self.sensitivity(True, hypotheses) / (self.noise_multiplier * self.clip)

    def sanitize(self, trained, start, *, generator, layer_sizes, reference=None, hypotheses=None):
        bounded = clip_l1(trained - start, self.clip)
        noise = laplace_noise(bounded.numel(), self.noise_multiplier * self.clip, generator, dtype=bounded.dtype,
                              device=bounded.device).view_as(bounded)
        cost = self.participation_cost(bounded.numel(), hypotheses)
        return SanitizedUpdate(released=start + bounded + noise, epsilon=cost, cost=cost)


@register_part("sanitizer", "sector")
class SectorSanitizer(GaussianLocalDP):
    """Upper, lower and angular clipping of the update (Galli, thesis ch. 5), with optional local Gaussian noise.

    The update is mapped into ``S(C, c, a) = {v : c <= ||v|| <= C, angle(v, r) <= a}`` around
    ``r``, the previous round's released change of the model the client started from (public:
    post-processing of an earlier release; none in the first round, where only the norms are
    clipped). With ``noise_multiplier = z > 0`` the release is local DP: ``N(0, (z C)^2 I)`` on
    an update of sensitivity ``D = diameter(S)`` (:func:`~lightning_dp.privacy.local_dp.sector_diameter`;
    ``2C`` without the angular constraint), i.e. multiplier ``z C / D`` per release, in a
    Gaussian ledger. With ``z = 0`` nothing is added and nothing is accounted here (server-side
    noise accounts for itself).

    Args:
        clip: C.
        lower_clip: c (0: no lower clipping).
        angle: a, in radians (pi: no angular clipping).
        noise_multiplier: z (0: no local noise).
        target_delta: as for :class:`GaussianLocalDP`.
        accountant: as for :class:`GaussianLocalDP`.
    """

    def __init__(self, clip: float = 1.0, lower_clip: float = 0.0, angle: float = math.pi,
                 noise_multiplier: float = 0.0, target_delta: float = 1e-5, accountant: str = "pld") -> None:
        self.clip, self.lower_clip, self.angle = check_sector(clip, lower_clip, angle)
        self.initial = (self.clip, self.lower_clip)
        self.noise_multiplier = _check_local_multiplier(noise_multiplier, allow_zero=True)
        self.target_delta, self.accountant = check_delta(target_delta, name="target_delta"), accountant
        self.accountable = self.noise_multiplier > 0
        # without local noise the server may adapt the thresholds (central DP: the clients' bits are noised there);
        # with local noise the bits would reach the server raw
        self.follows_clip = self.noise_multiplier == 0
        self.make_ledger()

    def hparams(self) -> dict[str, Any]:
        clip, lower = self.initial
        return {"sanitizer_clip": clip, "sanitizer_lower_clip": lower, "sanitizer_angle": self.angle,
                "sanitizer_noise_multiplier": self.noise_multiplier, "sanitizer_target_delta": self.target_delta,
                "sanitizer_accountant": self.accountant,
                "sanitizer_sensitivity": sector_diameter(clip, lower, self.angle)}

    def follow_clip(self, clip: float) -> None:
        """Upper threshold ``clip``, lower threshold scaled with it (``c / C`` as configured); the angle stays."""
        if not self.follows_clip:
            super().follow_clip(clip)
        initial_clip, initial_lower = self.initial
        self.clip = check_clip(clip, name="clip")
        self.lower_clip = initial_lower * self.clip / initial_clip

    def state_dict(self) -> dict[str, Any]:
        return {"clip": self.clip, "lower_clip": self.lower_clip}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clip = float(state.get("clip", self.clip))
        self.lower_clip = float(state.get("lower_clip", self.lower_clip))

    def make_ledger(self) -> PrivacyLedger:
        return GaussianLedger(self.target_delta, self.accountant) if self.noise_multiplier > 0 else PrivacyLedger()

    def diameter(self, reference_given: bool = True) -> float:
        return sector_diameter(self.clip, self.lower_clip, self.angle if reference_given else math.pi)

    def participation_cost(self, numel: int, hypotheses: Tensor | None = None) -> float:
        return super().participation_cost(numel, hypotheses) if self.noise_multiplier > 0 else math.inf

    def update_set(self, reference_given):
        if self.noise_multiplier > 0:
            return None  # local noise: the releases are not bounded
        return self.clip * _ROUNDING, self.diameter(reference_given) * _ROUNDING

    def sanitize(self, trained, start, *, generator, layer_sizes, reference=None, hypotheses=None):
        if reference is not None and not bool(torch.isfinite(reference).all() and reference.norm() > 0):
            reference = None  # no direction: norms only, and the sensitivity without the angular constraint
        delta = trained - start
        bounded = project_to_sector(delta, reference, self.clip, self.lower_clip, self.angle)
        if self.noise_multiplier == 0:
            return SanitizedUpdate(released=start + bounded, epsilon=math.inf, cost=math.inf,
                                   unclipped=bool(delta.double().norm() <= self.clip))
        # with k > 1 the reference (the chosen hypothesis' previous change) is chosen too; the bound
        # choice_spread + 2C holds whichever sector the client's choice selects
        return self._release(bounded, start, generator, self.sensitivity(reference is not None, hypotheses))
