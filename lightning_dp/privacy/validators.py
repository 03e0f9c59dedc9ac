"""Checks that a model can be trained with per-example privacy, and an opt-in fixer.

Layers that mix examples of a batch (batch normalization and its variants) make an
example's contribution depend on the other examples, so per-sample clipping no longer
bounds the sensitivity. As Opacus' validators do, all problems are collected and then
explained together.

A module that keeps per-example state from one training batch for the next (an RNN's hidden state stored on the
module, the classic truncated-BPTT loop) breaks the same bound across steps: :func:`find_carried_state` and
:func:`describe_carried_state` hold the rule and its explanation; DPSGD's batch probe observes the state
(:mod:`lightning_dp.callbacks.batch_probe`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from torch import nn

from lightning_dp.privacy.batch_dims import AmbiguousBatchDimError, batch_dim

__all__ = ["MIXING_LAYERS", "CarriedState", "describe_carried_state", "describe_mixing_layers",
           "describe_noise_broken_parametrizations", "find_carried_state", "find_mixing_layers",
           "find_noise_broken_parametrizations", "replace_batchnorm"]

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


def find_noise_broken_parametrizations(model: nn.Module) -> list[str]:
    """The names of trainable tensors parametrized by ``torch.nn.utils.parametrizations.orthogonal`` with the
    Householder map (torch's default for a real matrix that is not square).

    That map keeps each column's sign in its original's diagonal, which has no gradient and which torch casts to an
    integer: noise added to every trainable parameter (DP-SGD's, a federated round's) moves it off +-1, and at the
    first step torch zeroes the columns whose diagonal entry fell below 1 in magnitude (5 of 8 rows of an 8 x 16
    weight after noise of 1e-3) and scales those past 2: the weight is no longer orthogonal, and the pull-back's
    bound grows with it (docs/per_sample_gradients.md, "Parametrized layers")."""
    from torch.nn.utils import parametrize
    from torch.nn.utils.parametrizations import _Orthogonal, _OrthMaps

    found = []
    for name, module in model.named_modules():
        if not parametrize.is_parametrized(module):
            continue
        for tensor, plist in module.parametrizations.items():
            originals = [p for n, p in plist.named_parameters(recurse=False) if n.startswith("original")]
            if any(isinstance(m, _Orthogonal) and m.orthogonal_map == _OrthMaps.householder for m in plist) \
                    and any(p.requires_grad for p in originals):
                found.append(f"{name}.{tensor}" if name else tensor)
    return found


def describe_noise_broken_parametrizations(names: list[str]) -> str:
    return (f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} parametrized by orthogonal() with the "
            "Householder map (torch's default for a matrix that is not square), which keeps each column's sign in "
            "a diagonal without gradient: the noise of private training moves it, and torch then zeroes or scales "
            "columns, so the weight stops being orthogonal at the first step. Use "
            "torch.nn.utils.parametrizations.orthogonal(module, orthogonal_map='matrix_exp') (or 'cayley'): any "
            "shape, the same orthogonal weights, and a tight bound for the per-sample floor.")


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


#: ``(attribute, shape after the smallest probe batch, dimension that holds the examples)``
CarriedState = tuple[str, tuple[int, ...], int]


def find_carried_state(shapes: Mapping[str, Sequence[Sequence[tuple[int, ...]]]],
                       sizes: Sequence[int]) -> list[CarriedState]:
    """The attributes a training step left behind that hold the examples of its batch.

    Args:
        shapes: per attribute (``"self.hidden"``), per probe batch (in the order of ``sizes``), the shapes of the
            tensors the attribute held after the step (a tuple of tensors gives several).
        sizes: the number of examples of each probe batch.

    Returns:
        Every attribute one of whose tensors has a dimension that follows the number of examples
        (:func:`~lightning_dp.privacy.batch_dims.batch_dim`; two such dimensions count too), with that tensor's
        shape after the first probe batch and the dimension. Attributes seen after fewer than two probe batches, or
        holding a different number of tensors after each, are left out: nothing follows the batch in them.

    Example:
        >>> find_carried_state({"self.hidden": [[(2, 3, 8)], [(2, 5, 8)], [(2, 7, 8)]],
        ...                     "self.steps": [[()], [()], [()]]}, (3, 5, 7))
        [('self.hidden', (2, 3, 8), 1)]
    """
    found: list[CarriedState] = []
    for name, per_batch in shapes.items():
        if len(per_batch) != len(sizes) or len(sizes) < 2 or len({len(leaves) for leaves in per_batch}) != 1:
            continue
        for leaf in zip(*per_batch):
            try:
                dim = batch_dim(leaf, sizes)
            except AmbiguousBatchDimError:
                dim = next(d for d, n in enumerate(leaf[0]) if n == sizes[0])
            if dim is not None:
                found.append((name, tuple(leaf[0]), dim))
                break
    return found


def describe_carried_state(owner: str, carried: Sequence[CarriedState], examples: int) -> str:
    """Why per-example DP-SGD refuses state carried from one batch to the next, and the fix.

    Args:
        owner: the class whose ``training_step`` keeps the state (``"LightningLSTM"``).
        carried: what :func:`find_carried_state` found (and the next step was seen to read).
        examples: the number of examples of the batch the shapes were seen after.
    """
    names = "; ".join(f"{name} (holding a tensor of shape {shape} after a batch of {examples} examples, the examples "
                      f"along dimension {dim})" for name, shape, dim in carried)
    return (
        f"{owner}.training_step keeps state from one batch for the next: {names}. The next training step reads "
        "it (run again from the state a batch left, the batch's result changes). An example's gradient then "
        "depends on the examples of earlier batches, so one example influences later steps beyond its clipped "
        "contribution, and per-example DP-SGD does not bound that influence. Reset the state in every step: "
        "compute the initial state inside forward or training_step (e.g. hidden = model.init_hidden(batch_size) "
        "for each batch, as for independent sequences) instead of keeping it on the module; detaching it is not "
        "enough, it must not be carried.")
