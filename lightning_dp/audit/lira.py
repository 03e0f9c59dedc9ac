"""The likelihood-ratio attack (LiRA) with shadow models (Carlini et al., "Membership inference attacks from first
principles", IEEE S&P 2022).

K shadows are trained on random halves (:func:`inclusion_masks`, :func:`train_shadow_models`); per example, the
shadows' statistics IN and OUT are fitted with Gaussians and the target's statistic is scored online, offline or
with a fixed variance (:func:`lira_scores`, :func:`lira_from_losses`); higher = member. The variants and an
example: docs/audit.md, "Shadow models: LiRA".
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike

if TYPE_CHECKING:
    from torch.utils.data import Dataset

__all__ = ["ShadowResult", "default_trainer_kwargs", "inclusion_masks", "lira_from_losses", "lira_scores", "logit_confidence",
           "train_shadow_models"]

#: The smallest std of a fitted Gaussian: with few shadows (or identical statistics) the sample std can be 0.
DEFAULT_MIN_STD = 1e-6
#: Statistics :func:`lira_from_losses` can derive from cross-entropy losses.
STATISTICS = ("logit", "loss")
# Streams of lightning_dp.privacy.noise.derive_generator for shadow k: its initialization and its data order.
_INIT_STREAM, _DATA_STREAM = 31, 32


# --------------------------------------------------------------------------- functional core


def logit_confidence(losses) -> np.ndarray:
    """The logit-scaled confidence ``phi = log(p / (1 - p))`` of a cross-entropy loss ``l = -log p``.

    Carlini et al. (S&P 2022), "logit scaling": the confidence p of the true label is far from Gaussian across
    shadow models (it piles up near 1), its logit is close to Gaussian. From the loss, ``log p = -l`` and
    ``log(1 - p) = log(1 - exp(-l)) = log(-expm1(-l))``, so

        phi = -l - log(-expm1(-l)),

    which is exact to float64 rounding for tiny losses (phi ~ -log l as l -> 0, where ``1 - p`` would round to 0)
    and for huge ones (phi ~ -l). A loss of exactly 0 (p rounded to 1, common for float32 losses of memorized
    examples) is raised to the smallest normal float64 (phi ~ 708), as the reference code adds 1e-45 to p and 1 - p.

    Args:
        losses: cross-entropy losses, finite and >= 0 (any shape).

    Returns:
        float64 array of the same shape.

    Example:
        >>> round(float(logit_confidence(np.log(4.0))), 6), round(float(np.log(0.25 / 0.75)), 6)  # p = 1/4
        (-1.098612, -1.098612)
    """
    array = np.asarray(losses, dtype=np.float64)
    if not np.isfinite(array).all() or (array < 0).any():
        bad = array[~(np.isfinite(array) & (array >= 0))]
        raise ValueError(f"losses must be finite cross-entropies >= 0 (-log of a probability), got {bad.ravel()[:5]}"
                         "; pass the per-example cross-entropy of the true label (lightning_dp.audit.scores)")
    array = np.maximum(array, np.finfo(np.float64).tiny)
    return -array - np.log(-np.expm1(-array))


def inclusion_masks(num_examples: int, num_shadows: int, *, seed: int) -> np.ndarray:
    """Which examples each shadow model trains on: a ``(num_shadows, num_examples)`` boolean array.

    Every example is IN (True) for exactly half of the shadows: as in the LiRA reference code (Carlini et al. 2022,
    ``train.py``: ``keep = uniform(K, N).argsort(0) < K / 2``), each example's column is a uniformly random
    permutation of the shadows, whose first K/2 are IN. Each shadow then trains on about half of the data.

    Args:
        num_examples: N >= 1.
        num_shadows: K, even and >= 2.
        seed: seeds ``numpy.random.Generator`` (``default_rng(seed)``); the same seed gives the same masks.

    Example:
        >>> masks = inclusion_masks(5, 4, seed=0)
        >>> masks.shape, masks.sum(0).tolist()
        ((4, 5), [2, 2, 2, 2, 2])
    """
    if isinstance(num_examples, bool) or not isinstance(num_examples, numbers.Integral) or num_examples < 1:
        raise ValueError(f"num_examples={num_examples!r} must be an integer >= 1: pass the size of the data set the "
                         "shadows are drawn from")
    if (isinstance(num_shadows, bool) or not isinstance(num_shadows, numbers.Integral) or num_shadows < 2
            or num_shadows % 2):
        raise ValueError(f"num_shadows={num_shadows!r} must be an even integer >= 2 (every example is IN for exactly "
                         "half of the shadows); pass an even count, e.g. num_shadows=16 (the paper: 64 or more for "
                         "the online attack with per-example variances)")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(f"seed={seed!r} must be an integer >= 0 (numpy.random.default_rng's seed); pass e.g. seed=0")
    rng = np.random.default_rng(int(seed))
    order = rng.random((int(num_shadows), int(num_examples))).argsort(0)
    return order < int(num_shadows) // 2


def _check_stats(target_stats, shadow_stats, masks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    target = np.asarray(target_stats, dtype=np.float64)
    shadow = np.asarray(shadow_stats, dtype=np.float64)
    keep = np.asarray(masks)
    if target.ndim != 1 or target.size == 0:
        raise ValueError(f"target_stats must be a 1-D array (one statistic per example), got shape {target.shape}")
    n = target.size
    if shadow.ndim != 2 or shadow.shape[1] != n:
        raise ValueError(f"shadow_stats must have shape (K, N) = (num_shadows, {n}), got {shadow.shape}; row k holds "
                         "every example's statistic under shadow k")
    if keep.shape != shadow.shape:
        raise ValueError(f"masks must have the shape of shadow_stats {shadow.shape}, got {keep.shape}; pass the "
                         "masks the shadows were trained with (inclusion_masks)")
    if keep.dtype != np.bool_:
        if not np.isin(keep, (0, 1)).all():
            raise ValueError("masks must be boolean (True: the shadow trained on the example), got values other than "
                             "0 and 1")
        keep = keep.astype(bool)
    for name, values in (("target_stats", target), ("shadow_stats", shadow)):
        if not np.isfinite(values).all():
            raise ValueError(f"{name} has NaN or inf values; statistics must be finite (logit_confidence keeps "
                             "them finite for any finite loss)")
    return target, shadow, keep


def _gaussian_fit(shadow: np.ndarray, side: np.ndarray, *, fixed_variance: bool,
                  min_std: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-example mean and std of the shadow statistics where ``side`` is True (columns with no entry: mean NaN)."""
    count = side.sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(side, shadow, 0.0).sum(0) / count
    squares = np.where(side, (shadow - np.where(count > 0, mean, 0.0)) ** 2, 0.0)
    if fixed_variance:  # pooled within-example variance: one degree of freedom per example's own mean
        dof = int(np.maximum(count - 1, 0).sum())
        std = np.full(mean.shape, math.sqrt(squares.sum() / dof) if dof else 0.0)
    else:
        with np.errstate(invalid="ignore", divide="ignore"):
            std = np.sqrt(squares.sum(0) / count)
    return mean, np.maximum(std, min_std)


def _log_normal_pdf(x: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    return -0.5 * ((x - mean) / std) ** 2 - np.log(std) - 0.5 * math.log(2 * math.pi)


def _missing(count: np.ndarray, side: str, fix: str) -> ValueError:
    bad = np.flatnonzero(count == 0)
    return ValueError(f"{bad.size} example(s) (indices {bad[:10].tolist()}{'...' if bad.size > 10 else ''}) have no "
                      f"{side} shadow model, so their {side} Gaussian cannot be fitted; {fix}")


def lira_scores(target_stats: ArrayLike, shadow_stats: ArrayLike, masks: ArrayLike, *, online: bool = True, fixed_variance: bool = False,
                min_std: float = DEFAULT_MIN_STD) -> np.ndarray:
    """LiRA membership scores of the target model's statistics (higher = member).

    Carlini et al. (S&P 2022), Algorithm 1 (online) and its offline variant. For example n, the shadows with ``masks[k, n]`` True (IN)
    and False (OUT) give Gaussians fitted by mean and (population, ddof=0) std; with ``phi = target_stats[n]``:

    * ``online=True``: ``log N(phi; mu_in, s_in^2) - log N(phi; mu_out, s_out^2)``, the log likelihood ratio
      (Algorithm 1); every example needs at least one IN and one OUT shadow;
    * ``online=False``: ``-log(1 - Phi((phi - mu_out) / s_out))`` (scipy's ``log_ndtr``, stable in both tails), the
      minus log p-value of the one-sided test "phi is larger than the OUT models'"; a monotone transform of the
      paper's ``Phi((phi - mu_out) / s_out)``, hence the same ROC. Only OUT shadows are used.

    The reference code centres the Gaussians at the median of the shadows' statistics and, with a fixed variance,
    uses the std of ALL IN statistics (between-example spread included) for both sides; here the centres are means
    (the paper's Algorithm 1) and the fixed std of a side is the pooled within-example std,
    ``sqrt(sum_{(k, n) on that side} (phi_kn - mu_n)^2 / sum_n (count_n - 1))`` (0, hence ``min_std``, when no
    example has two shadows on that side, e.g. K = 2). Per-example stds divide by ``count_n`` as the reference code's
    ``np.std``; with one shadow on a side they are 0 and the score is dominated by ``min_std``: use
    ``fixed_variance=True`` with few shadows.

    Args:
        target_stats: ``(N,)`` statistics of the examples under the target model (:func:`logit_confidence` of its
            losses, or ``-loss``).
        shadow_stats: ``(K, N)`` the same statistic under each shadow model.
        masks: ``(K, N)`` booleans, True where shadow k trained on example n (:func:`inclusion_masks`).
        online: the two-sided likelihood ratio (True) or the offline one-sided test (False).
        fixed_variance: one std per side for all examples (recommended with fewer than about 64 shadows).
        min_std: floor of every fitted std (> 0), so that identical shadow statistics give finite scores.

    Returns:
        ``(N,)`` float64 scores.

    Raises:
        ValueError: for mismatched shapes, non-finite statistics, a bad ``min_std``, or an example without the IN
            (online) or OUT shadows its test needs.
    """
    target, shadow, keep = _check_stats(target_stats, shadow_stats, masks)
    if isinstance(min_std, bool) or not isinstance(min_std, numbers.Real) or not (0 < min_std < math.inf):
        raise ValueError(f"min_std={min_std!r} must be a finite number > 0; pass e.g. min_std={DEFAULT_MIN_STD}")
    out_count = (~keep).sum(0)
    if (out_count == 0).any():
        raise _missing(out_count, "OUT", "every example must be left out of some shadows: use inclusion_masks")
    mu_out, s_out = _gaussian_fit(shadow, ~keep, fixed_variance=fixed_variance, min_std=float(min_std))
    if not online:
        from scipy.special import log_ndtr

        return -log_ndtr(-(target - mu_out) / s_out)
    in_count = keep.sum(0)
    if (in_count == 0).any():
        raise _missing(in_count, "IN", "use inclusion_masks (every example IN for half of the shadows), or the "
                                       "offline attack (online=False), which needs OUT shadows only")
    mu_in, s_in = _gaussian_fit(shadow, keep, fixed_variance=fixed_variance, min_std=float(min_std))
    return _log_normal_pdf(target, mu_in, s_in) - _log_normal_pdf(target, mu_out, s_out)


def lira_from_losses(target_losses: ArrayLike, shadow_losses: ArrayLike, masks: ArrayLike, *, statistic: str = "logit", online: bool = True,
                     fixed_variance: bool = False, min_std: float = DEFAULT_MIN_STD) -> np.ndarray:
    """LiRA scores from per-example losses (:func:`lira_scores` of their statistics; higher = member).

    Args:
        target_losses: ``(N,)`` losses under the target model.
        shadow_losses: ``(K, N)`` losses under the shadows (:attr:`ShadowResult.losses`).
        masks: ``(K, N)`` the shadows' training sets (:func:`inclusion_masks`).
        statistic: ``"logit"``: :func:`logit_confidence` of a classification cross-entropy (Carlini et al.);
            ``"loss"``: ``-loss``, for a language model's mean token loss, whose per-token confidences
            ``exp(-loss_t)`` are already averaged in log space, so the mean log confidence is the statistic.
        online: as :func:`lira_scores`.
        fixed_variance: as :func:`lira_scores`.
        min_std: as :func:`lira_scores`.

    Example:
        >>> masks = inclusion_masks(3, 2, seed=0)
        >>> shadow = np.where(masks, 0.1, 2.0)
        >>> (lira_from_losses([0.1, 2.0, 0.1], shadow, masks, fixed_variance=True) > 0).tolist()
        [True, False, True]
    """
    if statistic not in STATISTICS:
        raise ValueError(f"statistic={statistic!r} must be one of {STATISTICS}: 'logit' for classification "
                         "cross-entropies, 'loss' for language models' mean token losses")
    if statistic == "logit":
        target, shadow = logit_confidence(target_losses), logit_confidence(shadow_losses)
    else:
        target = -np.asarray(target_losses, dtype=np.float64)
        shadow = -np.asarray(shadow_losses, dtype=np.float64)
    return lira_scores(target, shadow, masks, online=online, fixed_variance=fixed_variance, min_std=min_std)


# --------------------------------------------------------------------------- Lightning side: the shadow models


@dataclass(frozen=True)
class ShadowResult:
    """The shadows' per-example losses and their cost.

    Attributes:
        losses: ``(K, N)`` float64, row k every example's loss under shadow k (in the scored data set's order).
        seconds: wall time of training and scoring all shadows.
        forward_passes: example forward passes spent on scoring (K N: a batch of B examples counts B), comparable
            with :attr:`lightning_dp.audit.neighbours.NeighbourLosses.forward_passes`; training is not counted.
        training_passes: example forward passes of the shadows' training (epochs run x training set size, summed;
            each also costs a backward pass).
    """

    losses: np.ndarray
    seconds: float
    forward_passes: int
    training_passes: int = 0


def default_trainer_kwargs() -> dict[str, Any]:
    """The ``lightning.Trainer`` arguments of an attack's own trainings (shadows, an audit's target): no logger,
    checkpoints, progress bar or summary, one CPU device; callers override any of them."""
    return {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
            "enable_model_summary": False, "accelerator": "cpu", "devices": 1}


def train_shadow_models(make_model: Callable[[], Any], dataset: Dataset, masks: ArrayLike, *,
                        trainer_kwargs: Mapping[str, Any] | Callable[[int], Mapping[str, Any]],
                        batch_size: int, seed: int, collate_fn: Callable | None = None,
                        score_dataset: Dataset | None = None,
                        loss: Callable | None = None) -> ShadowResult:
    """Train one fresh model per row of ``masks`` on that row's examples, then score every example under each.

    Shadow k is ``make_model()`` (a LightningModule) initialized under ``torch.manual_seed`` of a seed derived from
    ``(seed, k)``, trained by ``lightning.Trainer(**trainer_kwargs)`` on ``Subset(dataset, masks[k].nonzero())``
    with a shuffling DataLoader whose generator is derived from ``(seed, k)``
    (:func:`lightning_dp.privacy.noise.derive_generator`), so a shadow depends only on ``(seed, k)`` and its
    training set. Initialization and training run inside ``torch.random.fork_rng``: the caller's global torch RNG
    state (CPU and CUDA) is unchanged afterwards. Then every example of ``score_dataset`` (default ``dataset``) is
    scored in order by :func:`lightning_dp.audit.scores.per_example_losses` (eval mode, no shuffling).

    Args:
        make_model: ``() -> LightningModule``, a fresh model per call.
        dataset: map-style data set of the N candidate examples (``masks`` columns).
        masks: ``(K, N)`` booleans (:func:`inclusion_masks`); every row needs at least one True.
        trainer_kwargs: ``lightning.Trainer`` arguments, set ``max_epochs`` or ``max_steps`` (Lightning's default is
            1000 epochs) and ``default_root_dir``; they override the defaults ``logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
            devices=1``. Or a callable ``k -> mapping``, called for every shadow: stateful callbacks (e.g.
            :class:`~lightning_dp.callbacks.DPSGD`, whose privacy spend is state) must be fresh per shadow.
        batch_size: training and scoring batch size.
        seed: the run seed (integer >= 0).
        collate_fn: the DataLoaders' ``collate_fn`` (default: PyTorch's).
        score_dataset: the examples to score (default ``dataset``), e.g. the same examples without augmentation.
        loss: ``(model, batch) -> (B,)`` per-example losses (default:
            :func:`lightning_dp.audit.scores.default_per_example_loss`).

    Returns:
        :class:`ShadowResult` with the ``(K, len(score_dataset))`` losses.
    """
    import torch
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader, Subset

    from lightning_dp.audit.scores import per_example_losses
    from lightning_dp.privacy.noise import derive_generator

    if not callable(make_model):
        raise ValueError(f"make_model={make_model!r} must be a callable returning a fresh LightningModule, e.g. "
                         "lambda: ImageClassifier(MLP(...), num_classes=2)")
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be an integer >= 1; pass e.g. batch_size=64")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ValueError(f"seed={seed!r} must be an integer >= 0; pass e.g. seed=0")
    if not (isinstance(trainer_kwargs, Mapping) or callable(trainer_kwargs)):
        raise ValueError(f"trainer_kwargs={trainer_kwargs!r} must be a mapping of lightning.Trainer arguments, e.g. "
                         "{'max_epochs': 10}, or a callable k -> such a mapping")
    keep = np.asarray(masks)
    n = len(dataset)
    if keep.ndim != 2 or keep.shape[1] != n or keep.dtype != np.bool_:
        raise ValueError(f"masks must be a boolean array of shape (K, len(dataset)) = (K, {n}), got "
                         f"{keep.dtype} {keep.shape}; pass inclusion_masks({n}, K, seed=...)")
    empty = np.flatnonzero(~keep.any(1))
    if empty.size:
        raise ValueError(f"shadow(s) {empty[:10].tolist()} would train on no example (their mask rows are all "
                         "False); use inclusion_masks, which gives each shadow about half of the data")
    scored = dataset if score_dataset is None else score_dataset
    start = time.perf_counter()
    rows: list[np.ndarray] = []
    trained = 0
    for k, row in enumerate(keep):
        with torch.random.fork_rng():
            torch.manual_seed(derive_generator(int(seed), _INIT_STREAM, k).initial_seed())
            model = make_model()
            loader = DataLoader(Subset(dataset, np.flatnonzero(row).tolist()), batch_size=int(batch_size),
                                shuffle=True, collate_fn=collate_fn,
                                generator=derive_generator(int(seed), _DATA_STREAM, k))
            chosen = trainer_kwargs(k) if callable(trainer_kwargs) else trainer_kwargs
            if not isinstance(chosen, Mapping):
                raise ValueError(f"trainer_kwargs({k}) returned {chosen!r}; it must return a mapping of "
                                 "lightning.Trainer arguments")
            trainer = Trainer(**{**default_trainer_kwargs(), **chosen})
            trainer.fit(model, train_dataloaders=loader)
            trained += trainer.current_epoch * int(row.sum())
            rows.append(per_example_losses(model, DataLoader(scored, batch_size=int(batch_size), shuffle=False,
                                                             collate_fn=collate_fn), loss=loss))
    losses = np.stack(rows)
    return ShadowResult(losses=losses, seconds=time.perf_counter() - start, forward_passes=int(losses.size),
                        training_passes=trained)
