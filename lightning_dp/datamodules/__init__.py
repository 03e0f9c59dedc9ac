"""LightningDataModules of the project and the readers of the official raw formats.

Public API:

- :class:`DigitsDataModule`: scikit-learn's bundled 8x8 digits, offline, the embedded default.
- :class:`MNISTDataModule`, :class:`FashionMNISTDataModule` (base :class:`MNISTFamilyDataModule`):
  official IDX files (optionally downloaded, md5-verified) or Hugging Face datasets.
- :func:`read_idx`, :func:`write_idx`, :class:`IDXFormatError`: the IDX file format.
- :func:`stratified_split`: seeded, stratified split with exact sizes.
"""

from lightning_dp.datamodules.base import SplitDataModule, stratified_split
from lightning_dp.datamodules.digits import DigitsDataModule
from lightning_dp.datamodules.idx import IDXFormatError, read_idx, write_idx
from lightning_dp.datamodules.mnist import FashionMNISTDataModule, MNISTDataModule, MNISTFamilyDataModule

__all__ = [
    "DigitsDataModule",
    "FashionMNISTDataModule",
    "IDXFormatError",
    "MNISTDataModule",
    "MNISTFamilyDataModule",
    "read_idx",
    "SplitDataModule",
    "stratified_split",
    "write_idx",
]
