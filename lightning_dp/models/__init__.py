"""The reference networks of the papers and the LightningModules that train them.

Networks (MNIST, digits, AG News, autoencoder, DLG's LeNet, GPT-2, the federated ones), the LightningModules
:class:`ImageClassifier`, :class:`Autoencoder` and :class:`CausalLanguageModel`, :class:`LoRA` adapters and
:class:`Parametrized` layers. The list, with the federated networks' parameter counts: docs/api/models.md.
"""

from lightning_dp.models.adapters import LoRA
from lightning_dp.models.autoencoder import Autoencoder
from lightning_dp.models.classifier import ImageClassifier
from lightning_dp.models.federated import (
           CIFARConvNet,
           FEMNISTConvNet,
           HospitalMLP,
           LinearRegression,
           LogisticRegression,
)
from lightning_dp.models.language import GPT2, CausalLanguageModel
from lightning_dp.models.networks import MLP, BagOfWordsMLP, ConvAutoencoder, DigitsConvNet, MNISTConvNet, SigmoidLeNet
from lightning_dp.models.parametrized import Parametrized

__all__ = ["GPT2", "MLP", "Autoencoder", "BagOfWordsMLP", "CIFARConvNet", "CausalLanguageModel", "ConvAutoencoder",
           "DigitsConvNet", "FEMNISTConvNet", "HospitalMLP", "ImageClassifier", "LinearRegression", "LogisticRegression", "LoRA",
           "MNISTConvNet", "Parametrized", "SigmoidLeNet"]
