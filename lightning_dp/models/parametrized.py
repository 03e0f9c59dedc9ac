"""A network whose linear layers and convolutions are parametrized: weight normalization, spectral normalization or
orthogonal weights, from a config.

:class:`Parametrized` applies ``torch.nn.utils.parametrizations.<name>`` to the weights it targets (torch's own
parametrizations: nothing is written here but the choice of layers and the checks). The trainable parameters become
the parametrizations' originals (``...parametrizations.weight.original0``, ...); ``DPSGD`` clips and noises their
per-example gradients, chained through the parametrization (docs/per_sample_gradients.md, the parametrized row). In
Python, apply the parametrization to your own model directly; this wrapper is for YAML configs
(``examples/dpsgd_digits_weight_norm.yaml``).
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

__all__ = ["Parametrized", "PARAMETRIZATIONS"]

#: the parametrizations of ``torch.nn.utils.parametrizations`` :class:`Parametrized` applies, and what they do
PARAMETRIZATIONS = {
    "weight_norm": "w = g v / ||v|| per output unit (Salimans & Kingma 2016)",
    "spectral_norm": "w / sigma_max(w), sigma by one power iteration per training step (Miyato et al. 2018)",
    "orthogonal": "w with orthonormal rows or columns (Lezcano-Casado 2019), by the matrix exponential",
}

#: the layer types whose weight :class:`Parametrized` parametrizes (a rule chains them: no per-example replay)
LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


class Parametrized(nn.Module):
    """``network`` with ``parametrization`` on the weight of every linear layer and convolution (or of those named
    in ``target_modules``).

    Args:
        network: the network (its weights as initialized; the parametrization starts from them).
        parametrization: ``"weight_norm"``, ``"spectral_norm"`` or ``"orthogonal"``
            (``torch.nn.utils.parametrizations``).
        target_modules: suffixes of the names of the layers to parametrize (``["classifier.1"]``); None: every
            ``nn.Linear``, ``Conv{1,2,3}d`` and ``ConvTranspose{1,2,3}d`` whose weight is trainable.

    Raises:
        ValueError: an unknown parametrization, target modules that are not a list of names, name nothing, match
            nothing or match a layer of another type, or a network with no layer to parametrize.

    Example:
        >>> from lightning_dp.models import DigitsConvNet
        >>> net = Parametrized(DigitsConvNet(), "weight_norm")
        >>> sorted(n for n, _ in net.named_parameters())[:2]
        ['network.classifier.1.bias', 'network.classifier.1.parametrizations.weight.original0']
    """

    def __init__(self, network: nn.Module, parametrization: str = "weight_norm",
                 target_modules: Optional[list[str]] = None) -> None:
        super().__init__()
        from torch.nn.utils import parametrizations

        if not isinstance(network, nn.Module):
            raise TypeError(f"network={network!r} must be a torch.nn.Module, e.g. lightning_dp.models.DigitsConvNet")
        if parametrization not in PARAMETRIZATIONS:
            raise ValueError(
                f"Parametrized: parametrization={parametrization!r} is not one of {sorted(PARAMETRIZATIONS)} "
                "(torch.nn.utils.parametrizations). For another one, register it on your model with "
                "torch.nn.utils.parametrize.register_parametrization.")
        named = dict(network.named_modules())
        if target_modules is None:
            chosen = [n for n, m in named.items() if type(m) in LAYERS and m.weight.requires_grad]  # "": the network
            if not chosen:
                raise ValueError(f"Parametrized: {type(network).__name__} has no nn.Linear or convolution with a "
                                 "trainable weight to parametrize")
        else:
            if isinstance(target_modules, str) or not all(isinstance(t, str) for t in target_modules):
                raise ValueError(f"Parametrized: target_modules={target_modules!r} must be a list of names (suffixes "
                                 "of module names, e.g. ['classifier.1']), or None for every linear layer and "
                                 "convolution")
            if not target_modules:
                raise ValueError("Parametrized: target_modules=[] names no layer; give the names of the layers to "
                                 "parametrize, or None for every linear layer and convolution")
            chosen = []
            for target in target_modules:
                found = [n for n in named if n == target or n.endswith("." + target)]
                if not found:
                    raise ValueError(f"Parametrized: target_modules entry {target!r} matches no module of "
                                     f"{type(network).__name__}; its modules include {sorted(n for n in named if n)[:12]}")
                wrong = [f"{n} ({type(named[n]).__name__})" for n in found if not isinstance(named[n], LAYERS)]
                if wrong:
                    raise ValueError(f"Parametrized: target_modules entry {target!r} matches {wrong}, not a linear "
                                     "layer or convolution; name the nn.Linear / nn.ConvNd layers to parametrize")
                chosen += [n for n in found if n not in chosen]
        apply = getattr(parametrizations, parametrization)
        # orthogonal by the matrix exponential whatever the shape (torch's default for a matrix that is not square,
        # the Householder map, keeps each column's sign in a diagonal that private training's noise moves, and
        # DPSGD refuses it: lightning_dp.privacy.validators.find_noise_broken_parametrizations)
        options = {"orthogonal_map": "matrix_exp"} if parametrization == "orthogonal" else {}
        for name in chosen:
            apply(named[name], **options)  # in place: the module's class becomes its parametrized subclass
        self.network = network
        self.parametrization = parametrization
        #: the names of the parametrized layers in ``network``
        self.parametrized = chosen

    def forward(self, x: Tensor) -> Tensor:
        return self.network(x)
