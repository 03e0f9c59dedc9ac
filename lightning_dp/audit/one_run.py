"""Privacy auditing with one training run: epsilon lower bounds from canary guesses.

The game of Steinke, Nasr & Jagielski (NeurIPS 2023): canaries included with probability 1/2, guessed after
ONE run. :func:`steinke_epsilon` gives their strict (eps, delta) bound, :func:`fdp_epsilon` the f-DP bound of
Mahloujifar et al. (2024) within a :class:`TradeoffFamily`, :func:`one_run_audit` tests fixed candidates with
Bonferroni, and :func:`epsilon_ceiling` is the most any outcome can give. What the numbers mean, the ceilings
and the tests: docs/audit.md, "One-run audit of DP-SGD".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["METHODS", "REFUTING_METHODS", "AccountedFamily", "GaussianFamily", "GuessCandidate", "OneRunCeiling",
           "OneRunResult", "TradeoffFamily", "check_methods", "count_correct_guesses", "default_guess_candidates",
           "epsilon_ceiling", "fdp_consistent", "fdp_epsilon", "gdp_epsilon", "one_run_audit", "steinke_epsilon",
           "steinke_p_value", "tradeoff_from_profile"]

InverseBlowUp = Callable[[float], float]


# --------------------------------------------------------------------------------------- the guesses
def _check_counts(m: int, r: int, v: int) -> None:
    for name, value in (("m", m), ("r", r), ("v", v)):
        if isinstance(value, bool) or int(value) != value:
            raise ValueError(f"{name}={value!r} must be an integer")
    if not 0 <= v <= r <= m or m < 1:
        raise ValueError(f"need 0 <= v <= r <= m and m >= 1 (correct guesses v, guesses r, canaries m); got "
                         f"m={m}, r={r}, v={v}")


def count_correct_guesses(scores, included, *, positives: int, negatives: int = 0) -> tuple[int, int]:
    """``(r, v)``: guesses made and correct ones when the ``positives`` highest scores are guessed included and
    the ``negatives`` lowest excluded.

    Ties are ordered by canary index (a rule that does not look at the inclusion bits, so the guesses stay a
    function of the scores only).

    Example:
        >>> count_correct_guesses([0.9, 0.1, 0.8, 0.2], [True, False, False, True], positives=1, negatives=1)
        (2, 2)
    """
    s = np.asarray(scores, dtype=np.float64).ravel()
    inc = np.asarray(included, dtype=bool).ravel()
    if s.shape != inc.shape or s.size == 0:
        raise ValueError(f"scores ({s.size}) and included ({inc.size}) must be non-empty and of equal length")
    if not np.isfinite(s).all():
        raise ValueError("scores must be finite (a NaN or inf score has no rank)")
    positives, negatives = int(positives), int(negatives)
    if positives < 0 or negatives < 0 or positives + negatives > s.size:
        raise ValueError(f"positives={positives} and negatives={negatives} must be >= 0 with a sum of at most the "
                         f"{s.size} canaries")
    order = np.argsort(-s, kind="stable")  # highest first, ties by index
    top, bottom = order[:positives], order[s.size - negatives:]
    return positives + negatives, int(inc[top].sum() + (~inc[bottom]).sum())


def default_guess_candidates(m: int) -> list[tuple[int, int]]:
    """``(k+, k-)`` pairs tested by default: 1, 2, 5, 10, 20 and 50 % of the canaries as positive guesses, each
    alone and with as many negative guesses."""
    out: list[tuple[int, int]] = []
    for fraction in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5):
        k = max(1, int(round(fraction * m)))
        for pair in ((k, 0), (k, k) if 2 * k <= m else (k, 0)):
            if pair not in out:
                out.append(pair)
    return out


# --------------------------------------------------------------------- Steinke, Nasr & Jagielski 2023
def steinke_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Probability of at least ``v`` correct of ``r`` guesses (out of ``m`` canaries) under (epsilon, delta)-DP.

    Steinke et al. 2023, Algorithm 3 (their Proposition 5.7 with delta > 0)::

        q     = e^eps / (1 + e^eps)
        beta  = P[Binomial(r, q) >= v]
        alpha = max_{1 <= i <= v}  P[v - i <= Binomial(r, q) < v] / i
        p     = min(1, beta + 2 m delta alpha)

    Example:
        >>> round(steinke_p_value(1000, 100, 50, 0.0, 0.0), 4)   # half right with no privacy loss: typical
        0.5398
    """
    _check_counts(m, r, v)
    if not epsilon >= 0:
        raise ValueError(f"epsilon={epsilon!r} must be >= 0")
    if not 0 <= delta <= 1:
        raise ValueError(f"delta={delta!r} must be in [0, 1]")
    from scipy.stats import binom

    q = 1.0 / (1.0 + math.exp(-epsilon)) if epsilon < 700 else 1.0
    beta = float(binom.sf(v - 1, r, q))
    alpha = 0.0
    if v > 0 and delta > 0:
        below = np.cumsum(binom.pmf(v - np.arange(1, v + 1), r, q))  # P[v - i <= B < v], i = 1..v
        alpha = float(np.max(below / np.arange(1, v + 1)))
    return min(1.0, beta + alpha * delta * 2 * m)


def steinke_epsilon(m: int, r: int, v: int, *, delta: float = 0.0, confidence: float = 0.95,
                    tolerance: float = 1e-6) -> float:
    """The largest epsilon that ``v`` correct of ``r`` guesses reject at ``confidence`` (0 if none is rejected).

    The returned epsilon satisfies ``steinke_p_value(...) < 1 - confidence``: the run is not (eps, delta)-DP
    for any smaller eps, with probability at least ``confidence``. Bisection to ``tolerance`` from below.

    Example:
        >>> round(steinke_epsilon(1000, 100, 95, delta=0.0, confidence=0.95), 3)
        2.172
    """
    _check_counts(m, r, v)
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence!r} must be in (0, 1)")
    p = 1 - confidence
    if steinke_p_value(m, r, v, 0.0, delta) >= p:
        return 0.0
    low, high = 0.0, 1.0
    while steinke_p_value(m, r, v, high, delta) < p:
        low, high = high, 2 * high
        if high > 1e4:
            return math.inf
    while high - low > tolerance:
        mid = (low + high) / 2
        if steinke_p_value(m, r, v, mid, delta) < p:
            low = mid
        else:
            high = mid
    return low


# ---------------------------------------------------------------- Mahloujifar, Melis & Chaudhuri 2024
def fdp_consistent(inverse_blow_up: InverseBlowUp, m: int, r: int, v: int, *, confidence: float = 0.95,
                   alphabet: int = 2) -> bool:
    """Whether ``v`` correct of ``r`` guesses on ``m`` canaries are consistent with f-DP at level ``1 - confidence``.

    Mahloujifar, Melis & Chaudhuri 2024, the bound with abstentions ("cap" ``r``), for a game with
    ``alphabet`` possible secrets per canary (2 for membership). With ``tau = 1 - confidence``::

        alpha = tau (r / m) v / r,   beta = tau (r / m) (r - v) / r
        h_v = beta, r_v = alpha
        for i = v - 1 .. 0:  h_i = max(h_{i+1}, (alphabet - 1) B^-1(r_{i+1}))
                             r_i = r_{i+1} + i / (r - i) (h_i - h_{i+1})
        consistent  <=>  r_0 + h_0 <= r / m

    where ``B^-1(x) = f(1 - x)`` is the inverse blow-up function of the trade-off ``f``. False means the
    observation rejects f-DP: a mechanism that is f-DP produces it with probability below ``tau``.
    Follows Meta PrivacyGuard's ``FDPAnalysisNode.audit_rh_with_cap``.
    """
    _check_counts(m, r, v)
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence!r} must be in (0, 1)")
    if r == 0:
        return True
    tau = (1 - confidence) * r / m
    h, rr = tau * (r - v) / r, tau * v / r
    for i in range(v - 1, -1, -1):
        h_next = max(h, (alphabet - 1) * float(inverse_blow_up(min(rr, 1.0))))
        rr = rr + (i / (r - i)) * (h_next - h)
        h = h_next
        if rr + h > r / m:  # both only grow as i falls: rejected already
            return False
    return True


class TradeoffFamily:
    """Trade-off functions indexed by a parameter in ``[low, high]``; larger means MORE private.

    Subclasses give ``inverse_blow_up(param)`` (``x -> f(1 - x)``), ``epsilon(param, delta)`` and a
    ``describe(param)`` for reports; the ordering must be monotone (if f_a-DP is rejected, so is every
    f_b with b > a).
    """

    low: float
    high: float
    name: str = "family"

    def inverse_blow_up(self, param: float) -> InverseBlowUp:  # pragma: no cover - interface
        raise NotImplementedError

    def epsilon(self, param: float, delta: float) -> float:  # pragma: no cover - interface
        raise NotImplementedError

    def describe(self, param: float) -> str:
        return f"{self.name}({param:.4g})"


def gdp_epsilon(mu: float, delta: float) -> float:
    """The epsilon of mu-GDP at ``delta`` (Dong, Roth & Su 2022, Corollary 2.13):
    ``delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)``, solved for eps (0 if already below)."""
    from scipy.optimize import brentq
    from scipy.stats import norm

    if not mu > 0:
        return 0.0
    if not 0 < delta < 1:
        raise ValueError(f"delta={delta!r} must be in (0, 1) to convert mu-GDP to (eps, delta)")

    def excess(eps: float) -> float:  # e^eps Phi(.) in log space: no overflow for large mu
        return float(norm.cdf(-eps / mu + mu / 2) - math.exp(min(eps + norm.logcdf(-eps / mu - mu / 2), 700.0))) \
            - delta

    if excess(0.0) <= 0:
        return 0.0
    high = max(1.0, mu * mu)
    while excess(high) > 0:
        high *= 2
    return float(brentq(excess, 0.0, high, xtol=1e-10))


class GaussianFamily(TradeoffFamily):
    """mu-GDP, parametrized by the noise ``1 / mu`` (larger = more private): ``B^-1(x) = Phi(Phi^-1(x) - mu)``."""

    name = "gaussian"

    def __init__(self, low: float = 0.01, high: float = 100.0) -> None:
        self.low, self.high = float(low), float(high)

    def inverse_blow_up(self, param: float) -> InverseBlowUp:
        from scipy.stats import norm

        mu = 1.0 / param
        return lambda x: float(norm.cdf(norm.ppf(min(max(x, 0.0), 1.0)) - mu))

    def epsilon(self, param: float, delta: float) -> float:
        return gdp_epsilon(1.0 / param, delta)

    def describe(self, param: float) -> str:
        return f"mu-GDP with mu = {1 / param:.4g}"


def tradeoff_from_profile(epsilons: np.ndarray, deltas: np.ndarray) -> Callable[[float], float]:
    """The trade-off function implied by a privacy profile ``delta(eps)`` on a grid of eps >= 0.

    A mechanism that is (eps_j, delta_j)-DP for every j satisfies
    ``f(a) >= max_j max(0, 1 - delta_j - e^eps_j a, e^-eps_j (1 - delta_j - a))`` (Dong, Roth & Su 2022,
    Proposition 2.12); on a finite grid this is a lower bound of the mechanism's f, i.e. a weaker claim,
    which can only make the audit more conservative.
    """
    eps = np.asarray(epsilons, dtype=np.float64)
    dl = np.asarray(deltas, dtype=np.float64)
    e_pos, e_neg, one_minus = np.exp(eps), np.exp(-eps), 1.0 - dl

    def f(a: float) -> float:
        return float(max(0.0, np.max(np.maximum(one_minus - e_pos * a, e_neg * (one_minus - a)))))

    return f


class AccountedFamily(TradeoffFamily):
    """The run's accounted mechanism with every noise multiplier scaled by ``s`` (``s = 1`` is the claim).

    Args:
        history: the accountant's history, ``[(noise_multiplier, sample_rate, num_steps), ...]``
            (:attr:`lightning_dp.privacy.accounting.Accountant.history`).
        adjacency: ``"add_remove"`` (the one-run game adds or removes canaries).
        value_discretization_interval: the PLD grid of the curves the guesses are tested against (coarser than
            training's 1e-4: dp-accounting's delta(eps) loops over every loss in Python). The pessimistic
            discretization gives a larger delta(eps), i.e. a weaker claim, so a coarse grid can only make a
            rejection harder; the epsilon reported for the rejected member is dp-accounting's OPTIMISTIC
            estimate at interval 3e-5 (a lower bound of that member's epsilon, about 2 % below it).
        low, high: the range of scales searched; ``low`` bounds the cost (a tiny noise makes a huge PLD): a run
            that refutes even ``low`` is reported at the second grid point above it.
    """

    name = "accounted"

    def __init__(self, history: Sequence[tuple[float, float, int]], *, adjacency: str = "add_remove",
                 value_discretization_interval: float = 1e-2, low: float = 0.2, high: float = 20.0) -> None:
        if not history:
            raise ValueError("the accounted family needs a non-empty accountant history (did the run take a step?)")
        self.history = [(float(s), float(q), int(n)) for s, q, n in history]
        self.adjacency = adjacency
        self.interval = value_discretization_interval
        self.low, self.high = float(low), float(high)
        self._cache: dict[float, object] = {}
        self._epsilons: dict[tuple[float, float], float] = {}

    def _accountant(self, scale: float, interval: float | None = None, pessimistic: bool = True):
        from lightning_dp.privacy.accounting import PLDAccountant

        accountant = PLDAccountant(value_discretization_interval=interval or self.interval, adjacency=self.adjacency,
                                   pessimistic_estimate=pessimistic)
        for sigma, q, n in self.history:
            accountant.step(noise_multiplier=sigma * scale, sample_rate=q, num_steps=n)
        return accountant

    def inverse_blow_up(self, param: float) -> InverseBlowUp:
        cached = self._cache.get(param)
        if cached is not None:  # the bisections of several guess candidates share their first midpoints
            return cached  # type: ignore[return-value]
        grid = np.concatenate([np.linspace(0.0, 10.0, 501), np.linspace(10.0, 60.0, 101)[1:]])
        deltas = self._accountant(param).privacy_profile(grid)
        f = tradeoff_from_profile(grid, deltas)
        self._cache[param] = result = lambda x: f(1.0 - x)
        return result

    def epsilon(self, param: float, delta: float) -> float:
        # the reported number is a LOWER bound: dp-accounting's optimistic estimate at 3e-5, within about 2 % of the
        # truth where 1e-3 can be 3 times too low (the tests above use the coarse
        # pessimistic curve, the weaker claim); cached, since the candidates often end on the same member
        key = (param, delta)
        if key not in self._epsilons:
            self._epsilons[key] = float(self._accountant(param, 3e-5, pessimistic=False).get_epsilon(delta))
        return self._epsilons[key]

    def describe(self, param: float) -> str:
        return f"the accounted mechanism with noise x {param:.4g}"


#: the log-spaced family members the f-DP bounds search (shared by the bounds and the ceiling)
GRID_POINTS = 257


def _family_grid(family: TradeoffFamily, points: int) -> np.ndarray:
    return np.exp(np.linspace(math.log(family.low), math.log(family.high), points))


def _rejected_boundary(m: int, r: int, v: int, family: TradeoffFamily, grid: np.ndarray, *, confidence: float,
                       below: int | None = None) -> int | None:
    """The index in ``grid`` of the least private member that ``v`` correct of ``r`` guesses reject, or None when
    they reject none. With ``below``, only members below that index are searched (None: none of them is rejected),
    so a caller that already holds a boundary tests one member to know whether another outcome beats it.

    Bisection between "consistent" below and "rejected" above; ``grid[0]`` is never built (the weakest, costliest
    curve): when everything is rejected the result is index 1, a slightly smaller (still valid) bound.
    """

    def rejected(index: int) -> bool:
        return not fdp_consistent(family.inverse_blow_up(float(grid[index])), m, r, v, confidence=confidence)

    high = len(grid) - 1 if below is None else below - 1
    if high < 1 or not rejected(high):
        return None
    low = 0
    while high - low > 1:
        mid = (low + high) // 2
        if rejected(mid):
            high = mid
        else:
            low = mid
    return high


def fdp_epsilon(m: int, r: int, v: int, family: TradeoffFamily, *, delta: float, confidence: float = 0.95,
                points: int = GRID_POINTS) -> tuple[float, float | None]:
    """``(epsilon, param)``: the epsilon at ``delta`` of the least private family member the guesses reject.

    Rejection is monotone in the parameter (a more private claim is easier to refute), so the rejected members
    are those above a boundary. Bisection over ``points`` log-spaced parameters between the family's ``low`` and
    ``high`` (a fixed grid: the bisections of several guess candidates share their first nodes, which matters
    when a member costs a PLD composition) finds it; the epsilon of the rejected end is returned (conservative).
    ``(0, None)`` when even the most private member (``high``) is consistent with the observation.
    """
    _check_counts(m, r, v)
    grid = _family_grid(family, points)
    index = _rejected_boundary(m, r, v, family, grid, confidence=confidence)
    if index is None:
        return 0.0, None
    return family.epsilon(float(grid[index]), delta), float(grid[index])


# --------------------------------------------------------------------------------------- the audit
METHODS = ("steinke", "fdp_gaussian", "fdp_accounted")
#: the methods whose bound can refute a run's claim: Steinke et al.'s strict (eps, delta) bound, and the f-DP test
#: against the run's own accounted curve (the mu-GDP bound is not a strict statement and refutes nothing alone)
REFUTING_METHODS = ("steinke", "fdp_accounted")


@dataclass(frozen=True)
class GuessCandidate:
    """One ``(k+, k-)`` choice: guesses ``r``, correct ``v`` and the bound each method gives it."""

    positives: int
    negatives: int
    guesses: int
    correct: int
    epsilon: dict[str, float]


@dataclass(frozen=True)
class OneRunCeiling:
    """The largest bounds an audit can report: the bounds of a perfect guesser (:func:`epsilon_ceiling`).

    Attributes:
        epsilon: per method, the largest bound any outcome can give (the perfect guesser's, over the candidates).
        params: per f-DP method, the least private family member a perfect guesser rejects (``None`` when it
            rejects none): for ``fdp_accounted`` the noise scale ``s``, so a claim (scale 1) can be refuted only if
            ``s <= 1``.
        canaries: m.
    """

    epsilon: dict[str, float]
    params: dict[str, float | None]
    canaries: int

    def claim_above(self, accounted_epsilon: float) -> dict[str, bool]:
        """Per method of :data:`REFUTING_METHODS` computed here: True when the claim is at or above the ceiling,
        i.e. no outcome of this audit can refute it and "not refuted" carries no information.

        Steinke et al.: the bound refutes when it exceeds the accounted epsilon, so a claim ``>=`` the ceiling is out
        of reach. The f-DP test against the accounted family refutes when it rejects the claimed curve (scale 1), so
        the claim is out of reach when even a perfect guesser rejects no curve at scale 1 or below (this compares
        curves, not the reported epsilons, which are dp-accounting's optimistic estimates).
        """
        out: dict[str, bool] = {}
        if "steinke" in self.epsilon:
            out["steinke"] = not accounted_epsilon < self.epsilon["steinke"]
        if "fdp_accounted" in self.epsilon:
            scale = self.params.get("fdp_accounted")
            out["fdp_accounted"] = scale is None or scale > 1.0
        return out


@dataclass(frozen=True)
class OneRunResult:
    """The bounds of a one-run audit (each the largest over the candidates, at the Bonferroni-corrected level),
    with the :class:`OneRunCeiling` of the same audit (same ``m``, candidates, level and methods)."""

    epsilon: dict[str, float]
    best: dict[str, GuessCandidate]
    candidates: list[GuessCandidate]
    canaries: int
    included: int
    delta: float
    confidence: float
    params: dict[str, float | None] = field(default_factory=dict)
    ceiling: OneRunCeiling | None = None

    def table(self) -> str:
        methods = list(self.epsilon)
        lines = ["| k+ | k- | guesses | correct | " + " | ".join(f"eps ({m})" for m in methods) + " |",
                 "|---|---|---|---|" + "---|" * len(methods)]
        for c in self.candidates:
            lines.append(f"| {c.positives} | {c.negatives} | {c.guesses} | {c.correct} | "
                         + " | ".join(f"{c.epsilon[m]:.3f}" for m in methods) + " |")
        if self.ceiling is not None:
            lines.append("| ceiling: every guess correct | | | | "
                         + " | ".join(f"{self.ceiling.epsilon[m]:.3f}" for m in methods) + " |")
        return "\n".join(lines)


def check_methods(methods: Sequence[str]) -> tuple[str, ...]:
    """``methods`` as a tuple, or ValueError unless it is a non-empty selection of :data:`METHODS`."""
    if not methods or any(name not in METHODS for name in methods):
        raise ValueError(f"methods={list(methods)!r}: choose from {list(METHODS)}")
    return tuple(methods)


def _plan(m: int, *, confidence: float, candidates: Sequence[tuple[int, int]] | None, methods: Sequence[str],
          accounted: AccountedFamily | None) -> tuple[list[tuple[int, int]], float, dict[str, TradeoffFamily]]:
    """The checked candidates, their Bonferroni level and the f-DP families: shared by the bounds and the ceiling."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence!r} must be in (0, 1), e.g. 0.95")
    check_methods(methods)
    if "fdp_accounted" in methods and accounted is None:
        raise ValueError("method 'fdp_accounted' needs accounted=AccountedFamily(<the accountant's history>)")
    pairs = [(int(p), int(n)) for p, n in candidates] if candidates is not None else default_guess_candidates(m)
    if not pairs:
        raise ValueError("candidates must hold at least one (positives, negatives) pair")
    families: dict[str, TradeoffFamily] = {"fdp_gaussian": GaussianFamily()}
    if accounted is not None:
        families["fdp_accounted"] = accounted
    return pairs, 1 - (1 - confidence) / len(pairs), families


def _bound(name: str, m: int, r: int, v: int, *, delta: float, level: float,
           families: dict[str, TradeoffFamily]) -> tuple[float, float | None]:
    """``(epsilon, family member)`` of one method for ``v`` correct of ``r`` guesses at ``level``."""
    if name == "steinke":
        return steinke_epsilon(m, r, v, delta=delta, confidence=level), None
    return fdp_epsilon(m, r, v, families[name], delta=delta, confidence=level)


def epsilon_ceiling(m: int, *, delta: float, confidence: float = 0.95,
                    candidates: Sequence[tuple[int, int]] | None = None, methods: Sequence[str] = ("steinke",),
                    accounted: AccountedFamily | None = None) -> OneRunCeiling:
    """The largest bound :func:`one_run_audit` can report with ``m`` canaries: every guess correct.

    For each candidate ``(k+, k-)`` the perfect outcome is ``v = r = k+ + k-``; the ceiling of a method is the
    largest of its bounds over the candidates, computed by the same functions (:func:`steinke_epsilon`,
    :func:`fdp_epsilon`) at the same Bonferroni level. The bounds grow with the number of correct guesses, so every
    observed bound is at most the ceiling, whatever the scores and the coins (a perfect attack reaches it when the
    coins leave at least ``k+`` included and ``k-`` excluded canaries for the candidate that gives it). The ceiling
    depends only on public quantities (``m``, delta, the candidates, the confidence and, for ``fdp_accounted``, the
    accounted mechanism). A claim at or above it cannot be refuted by this audit (:meth:`OneRunCeiling.claim_above`);
    more canaries raise it.

    Args: as :func:`one_run_audit`, with ``m`` the number of canaries.

    Example:
        >>> round(epsilon_ceiling(1000, delta=1e-5).epsilon["steinke"], 2)   # 12 default candidates, 95 %
        5.09
    """
    if isinstance(m, bool) or int(m) != m or m < 1:
        raise ValueError(f"m={m!r} must be a positive integer (the number of canaries)")
    m = int(m)
    pairs, level, families = _plan(m, confidence=confidence, candidates=candidates, methods=methods,
                                   accounted=accounted)
    for k_pos, k_neg in pairs:
        if k_pos < 0 or k_neg < 0 or k_pos + k_neg > m:
            raise ValueError(f"candidate ({k_pos}, {k_neg}) must be non-negative with at most m={m} guesses")
    guesses = sorted({k_pos + k_neg for k_pos, k_neg in pairs}, reverse=True)  # the perfect outcomes, v = r
    epsilon: dict[str, float] = {}
    params: dict[str, float | None] = {}
    for name in methods:
        if name == "steinke":
            epsilon[name] = max(_bound(name, m, r, r, delta=delta, level=level, families=families)[0] for r in guesses)
            continue
        # what fdp_epsilon computes for each candidate, keeping the least private member rejected by any: once one
        # candidate holds a boundary, another needs only one test (does it reject the member just below?) unless it
        # beats it; the most guesses first, which usually give the boundary (each member below costs a PLD)
        family = families[name]
        grid = _family_grid(family, GRID_POINTS)
        best: int | None = None
        for r in guesses:
            index = _rejected_boundary(m, r, r, family, grid, confidence=level, below=best)
            if index is not None:
                best = index
        epsilon[name] = 0.0 if best is None else family.epsilon(float(grid[best]), delta)
        params[name] = None if best is None else float(grid[best])
    return OneRunCeiling(epsilon, params, m)


def one_run_audit(scores: ArrayLike, included: ArrayLike, *, delta: float, confidence: float = 0.95,
                  candidates: Sequence[tuple[int, int]] | None = None, methods: Sequence[str] = ("steinke",),
                  accounted: AccountedFamily | None = None) -> OneRunResult:
    """Epsilon lower bounds of a one-run audit from the canaries' scores (higher = more likely included).

    The result also holds the audit's :func:`epsilon_ceiling` (``result.ceiling``): the largest bound these ``m``
    canaries could give, which every bound here is at most.

    Args:
        scores: one membership score per canary.
        included: the canaries' inclusion bits (the audit's secret coin flips).
        delta: the delta of the audited guarantee (the run's target delta).
        confidence: every reported bound holds with this probability (Bonferroni over ``candidates``).
        candidates: the ``(k+, k-)`` guess counts, fixed in advance (default :func:`default_guess_candidates`).
        methods: any of ``"steinke"`` (the (eps, delta) bound), ``"fdp_gaussian"`` (f-DP, mu-GDP family) and
            ``"fdp_accounted"`` (f-DP, the run's own mechanism; needs ``accounted``).
        accounted: the :class:`AccountedFamily` of the run.
    """
    inc = np.asarray(included, dtype=bool).ravel()
    m = inc.size
    pairs, level, families = _plan(m, confidence=confidence, candidates=candidates, methods=methods,
                                   accounted=accounted)
    results: list[GuessCandidate] = []
    params: dict[str, float | None] = {}
    for k_pos, k_neg in pairs:
        r, v = count_correct_guesses(scores, inc, positives=k_pos, negatives=k_neg)
        eps: dict[str, float] = {}
        for name in methods:
            eps[name], param = _bound(name, m, r, v, delta=delta, level=level, families=families)
            if name != "steinke":
                params[f"{name}/{k_pos}/{k_neg}"] = param
        results.append(GuessCandidate(k_pos, k_neg, r, v, eps))
    best = {name: max(results, key=lambda c: c.epsilon[name]) for name in methods}
    ceiling = epsilon_ceiling(m, delta=delta, confidence=confidence, candidates=pairs, methods=methods,
                              accounted=accounted)
    return OneRunResult({name: best[name].epsilon[name] for name in methods}, best, results, m, int(inc.sum()),
                        float(delta), float(confidence), params, ceiling)
