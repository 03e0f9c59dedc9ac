"""lightning-dp: differentially private and personalized federated learning for PyTorch Lightning."""

__version__ = "0.1.0"
