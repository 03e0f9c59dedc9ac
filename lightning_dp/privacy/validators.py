"""Checks that a model can be trained with per-example privacy, and an opt-in fixer.

Layers that mix examples of a batch (batch normalization and its variants) make an
example's contribution depend on the other examples, so per-sample clipping no longer
bounds the sensitivity. As Opacus' validators do, all problems are collected and then
explained together.
"""

from __future__ import annotations

import math

from torch import nn

__all__ = ["MIXING_LAYERS", "find_mixing_layers", "replace_batchnorm", "describe_mixing_layers"]

#: Module types whose output for one example depends on the other examples of the batch.
MIXING_LAYERS: tuple[type[nn.modules.batchnorm._BatchNorm], ...] = (nn.modules.batchnorm._BatchNorm, nn.SyncBatchNorm)


def find_mixing_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every layer that mixes examples (trainable or not).

    InstanceNorm with ``track_running_stats=True`` is included: its running statistics
    are an aggregate over examples that is updated without noise.
    """
    found: list[tuple[str, nn.Module]] = []
    for name, mod in model.named_modules():
        if isinstance(mod, MIXING_LAYERS):
            found.append((name or type(mod).__name__, mod))
        elif isinstance(mod, nn.modules.instancenorm._InstanceNorm) and mod.track_running_stats:
            found.append((name or type(mod).__name__, mod))
    return found


def describe_mixing_layers(layers: list[tuple[str, nn.Module]]) -> str:
    names = ", ".join(f"{n} ({type(m).__name__})" for n, m in layers)
    return (
        f"the model has layers that mix the examples of a batch: {names}. Their output for one example depends "
        "on the other examples, so per-sample clipping does not bound an example's influence and the privacy "
        "guarantee would not hold. Replace BatchNorm by GroupNorm (or LayerNorm), e.g. "
        "nn.GroupNorm(num_groups=math.gcd(32, C), num_channels=C), or pass replace_batchnorm=True to let "
        "lightning-dp do it (the model then trains from new normalization layers).")


def replace_batchnorm(model: nn.Module, max_groups: int = 32) -> list[str]:
    """Replaces every BatchNorm{1,2,3}d / SyncBatchNorm by GroupNorm, in place.

    BatchNorm1d becomes ``GroupNorm(1, C)`` (it may see ``(B, C)`` inputs), the others
    ``GroupNorm(gcd(max_groups, C), C)`` as in Opacus' fixer.

    Returns the names of the replaced layers. Affine parameters start from GroupNorm's
    defaults (weight 1, bias 0).
    """
    replaced = []
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, MIXING_LAYERS):
                c = child.num_features
                # BatchNorm1d may see (B, C) inputs, where groups of one channel would normalize a single
                # value to zero: normalize over all channels instead (a LayerNorm)
                groups = 1 if isinstance(child, nn.BatchNorm1d) else math.gcd(max_groups, c)
                gn = nn.GroupNorm(groups, c, eps=child.eps, affine=child.affine)
                if child.weight is not None:
                    gn.to(device=child.weight.device, dtype=child.weight.dtype)
                setattr(mod, child_name, gn)
                replaced.append(f"{name}.{child_name}" if name else child_name)
    return replaced
