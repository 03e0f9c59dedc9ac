"""LightningDataModules of the project and the readers of the official raw formats.

Image, text and language DataModules (official files, optionally downloaded, or Hugging Face), federated ones
(:class:`FederatedDataModule`, populations, partitioned images, fairness groups), the IDX reader, and
:class:`DatasetUnavailableError` / :class:`DataFormatError` for data that is missing or not in its official
format. The list: docs/data.md.
"""

from lightning_dp.datamodules.agnews import AGNewsDataModule
from lightning_dp.datamodules.base import SplitDataModule, renamed, stratified_split
from lightning_dp.datamodules.digits import DigitsDataModule
from lightning_dp.datamodules.fairness import FEMNISTFairnessDataModule, SyntheticFairnessDataModule
from lightning_dp.datamodules.federated import (
    CentralizedView,
    ClientDataset,
    ClientPopulation,
    FederatedDataModule,
    PooledClients,
    padded,
    split_clients,
)
from lightning_dp.datamodules.federated_vision import FederatedVisionDataModule
from lightning_dp.datamodules.femnist import FEMNISTDataModule, LEAFFormatError
from lightning_dp.datamodules.hospital import HospitalChargesDataModule
from lightning_dp.datamodules.idx import IDXFormatError, read_idx, write_idx
from lightning_dp.datamodules.mnist import FashionMNISTDataModule, MNISTDataModule, MNISTFamilyDataModule
from lightning_dp.datamodules.cifar import CIFARFormatError
from lightning_dp.datamodules.offline import ChecksumError, DataFormatError, DatasetUnavailableError, DownloadError
from lightning_dp.datamodules.population import SyntheticPopulationDataModule
from lightning_dp.datamodules.synthetic import SyntheticLinearMixtureDataModule
from lightning_dp.datamodules.wikitext import WikiText2DataModule

__all__ = [
    "AGNewsDataModule",
    "CIFARFormatError",
    "CentralizedView",
    "ChecksumError",
    "ClientDataset",
    "ClientPopulation",
    "DataFormatError",
    "DatasetUnavailableError",
    "DownloadError",
    "DigitsDataModule",
    "FEMNISTDataModule",
    "FEMNISTFairnessDataModule",
    "FederatedDataModule",
    "FederatedVisionDataModule",
    "HospitalChargesDataModule",
    "PooledClients",
    "SyntheticFairnessDataModule",
    "SyntheticLinearMixtureDataModule",
    "SyntheticPopulationDataModule",
    "WikiText2DataModule",
    "padded",
    "split_clients",
    "FashionMNISTDataModule",
    "IDXFormatError",
    "LEAFFormatError",
    "MNISTDataModule",
    "MNISTFamilyDataModule",
    "read_idx",
    "SplitDataModule",
    "stratified_split",
    "write_idx",
]


def __getattr__(name: str) -> type:  # the former names (datamodules.base.RENAMED), warned
    return renamed(__name__, name, globals())
