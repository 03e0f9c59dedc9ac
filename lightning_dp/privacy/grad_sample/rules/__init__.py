"""The built-in layer rules; importing this package registers them (one module per layer family)."""

from lightning_dp.privacy.grad_sample.rules import (  # noqa: F401  (registration by import)
    activations,
    attention,
    conv,
    embedding,
    functorch,
    linear,
    norms,
    parametrized,
    recurrent,
)
