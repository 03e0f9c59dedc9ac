"""The functional privacy core: no Lightning import, every formula in one place.

- :mod:`~lightning_dp.privacy.grad_sample`: per-sample gradient norms and clipped sums (one rule per layer type).
- :mod:`~lightning_dp.privacy.batch_dims`: which dimension of a tensor holds the batch, established by probing.
- :mod:`~lightning_dp.privacy.seeds`: secret seeds, and stripping them from what leaves the machine.
- :mod:`~lightning_dp.privacy.clipping`: flat L2 clipping factors.
- :mod:`~lightning_dp.privacy.noise`: the Gaussian mechanism and generator derivation.
- :mod:`~lightning_dp.privacy.mechanisms`: the Euclidean Laplace mechanism (d-privacy) and
  the sanitization of a client's model update.
- :mod:`~lightning_dp.privacy.ledger`: per-client d-privacy spend.
- :mod:`~lightning_dp.privacy.sampling`: Poisson batch sampling, sharded over ranks.
- :mod:`~lightning_dp.privacy.accounting`: accountants over Google's dp-accounting.
- :mod:`~lightning_dp.privacy.calibration`: noise calibration to a target epsilon.
- :mod:`~lightning_dp.privacy.delta`: the ``delta < 1/N`` rule, one warning for every accountant.
- :mod:`~lightning_dp.privacy.validators`: layers that mix examples, and a fixer.
"""

from lightning_dp.privacy.accounting import ACCOUNTANTS, Accountant, get_accountant
from lightning_dp.privacy.calibration import calibrate_noise_multiplier
from lightning_dp.privacy.clipping import clip_factors
from lightning_dp.privacy.delta import LargeDeltaWarning, check_delta_for_size
from lightning_dp.privacy.grad_sample import GradSampleEngine, PerSampleGradientError
from lightning_dp.privacy.ledger import PrivacyLedger
from lightning_dp.privacy.mechanisms import SanitizedUpdate, euclidean_laplace, sanitize_update
from lightning_dp.privacy.noise import derive_generator, gaussian_noise, noisy_mean
from lightning_dp.privacy.sampling import PoissonBatchSampler, poisson_dataloader
from lightning_dp.privacy.validators import find_mixing_layers, replace_batchnorm

__all__ = [
    "ACCOUNTANTS", "Accountant", "GradSampleEngine", "LargeDeltaWarning", "PerSampleGradientError",
    "PoissonBatchSampler", "PrivacyLedger", "SanitizedUpdate", "euclidean_laplace", "sanitize_update",
    "calibrate_noise_multiplier", "check_delta_for_size", "clip_factors", "derive_generator", "find_mixing_layers",
    "gaussian_noise", "get_accountant", "noisy_mean", "poisson_dataloader", "replace_batchnorm",
]
