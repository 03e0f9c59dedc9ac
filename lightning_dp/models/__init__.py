"""The reference networks of the papers and the LightningModules that train them.

Public API:
    MNISTConvNet: the standard DP-SGD CNN for 1x28x28 images (tanh or ReLU).
    DigitsConvNet: a small CNN for scikit-learn's 1x8x8 digits.
    MLP: a fully connected network on flattened inputs.
    BagOfWordsMLP: the MLP over averaged GloVe vectors of AG News (thesis ch. 3).
    ConvAutoencoder: a convolutional autoencoder for 1x28x28 images (thesis ch. 3).
    SigmoidLeNet: the twice-differentiable LeNet of Deep Leakage from Gradients (audits).
    ImageClassifier: cross-entropy LightningModule around any classification network.
    Autoencoder: mean-squared-error LightningModule around any reconstruction network.
    LinearRegression, HospitalMLP, FEMNISTConvNet: the federated models of the seed.
    LogisticRegression, CIFARConvNet: the DP-FedAvg models (MNIST, CIFAR-10).
    GPT2: a small GPT-2 from a transformers config (no download); CausalLanguageModel trains it.
    LoRA: low-rank adapters (peft) on any network; only the adapters train.
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

__all__ = ["GPT2", "MLP", "Autoencoder", "BagOfWordsMLP", "CIFARConvNet", "CausalLanguageModel", "ConvAutoencoder",
           "DigitsConvNet", "FEMNISTConvNet", "HospitalMLP", "ImageClassifier", "LinearRegression", "LogisticRegression", "LoRA",
           "MNISTConvNet", "SigmoidLeNet"]
