"""The reference networks of the papers and a LightningModule to train them.

Public API:
    MNISTConvNet: the standard DP-SGD CNN for 1x28x28 images (tanh or ReLU).
    DigitsConvNet: a small CNN for scikit-learn's 1x8x8 digits.
    MLP: a fully connected network on flattened inputs.
    ImageClassifier: cross-entropy LightningModule around any of them.
    LinearRegression, HospitalMLP, FEMNISTConvNet: the federated models of the seed.
"""

from lightning_dp.models.classifier import ImageClassifier
from lightning_dp.models.federated import FEMNISTConvNet, HospitalMLP, LinearRegression
from lightning_dp.models.networks import MLP, DigitsConvNet, MNISTConvNet

__all__ = ["MLP", "DigitsConvNet", "FEMNISTConvNet", "HospitalMLP", "ImageClassifier", "LinearRegression",
           "MNISTConvNet"]
