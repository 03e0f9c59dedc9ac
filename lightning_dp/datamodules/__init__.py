"""LightningDataModules of the project and the readers of the official raw formats.

Public API:

- :class:`DigitsDataModule`: scikit-learn's bundled 8x8 digits, offline, the embedded default.
- :class:`MNISTDataModule`, :class:`FashionMNISTDataModule` (base :class:`MNISTFamilyDataModule`):
  official IDX files (optionally downloaded, md5-verified) or Hugging Face datasets.
- :class:`AGNewsDataModule`: AG News topics as mean GloVe vectors of the first 25 tokens
  (official CSVs or Hugging Face ``fancyzhx/ag_news``, plus ``glove.6B.50d.txt``).
- :func:`read_idx`, :func:`write_idx`, :class:`IDXFormatError`: the IDX file format.
- :func:`stratified_split`: seeded, stratified split with exact sizes.
- Federated (per-client data, :class:`FederatedDataModule`, :class:`ClientDataset`):
  :class:`SyntheticLinearMixtureDataModule`, :class:`HospitalChargesDataModule` (CMS inpatient charges),
  :class:`FEMNISTDataModule` (LEAF JSON or Hugging Face ``flwrlabs/femnist``).
- Populations too large to list (:class:`ClientPopulation`: sizes held, the drawn clients built when read):
  :class:`SyntheticPopulationDataModule` (1,000,000 generated clients, for the round at scale).
- Federated images partitioned by flwr-datasets (IID, pathological NIID(k), shards, Dirichlet):
  :class:`FederatedVisionDataModule` over MNIST, Fashion-MNIST (IDX) and CIFAR-10 (official python batches).
- Federated with a sensitive group (fairness): :class:`SyntheticFairnessDataModule`, :class:`FEMNISTFairnessDataModule`.
- Language: :class:`WikiText2DataModule` (official token files or Hugging Face, word level, fixed-length samples).
- :class:`DatasetUnavailableError` (a :class:`FileNotFoundError`): what every DataModule raises when its
  data is missing and cannot be downloaded; ``str(error)`` is the whole message (the files expected in
  ``data_dir`` and where to get them). A failed download leaves ``data_dir`` as it was.
- :class:`DataFormatError` (a :class:`ValueError`): a file that is there but not in its official format
  (``IDXFormatError``, ``LEAFFormatError``, ``CIFARFormatError`` for those readers).
- Former names (``FEMNIST``, ``HospitalCharges``, ...; :data:`~lightning_dp.datamodules.base.RENAMED`) still resolve,
  with a FutureWarning.
"""

from lightning_dp.datamodules.agnews import AGNewsDataModule
from lightning_dp.datamodules.base import SplitDataModule, renamed, stratified_split
from lightning_dp.datamodules.digits import DigitsDataModule
from lightning_dp.datamodules.fairness import FEMNISTFairnessDataModule, SyntheticFairnessDataModule
from lightning_dp.datamodules.federated import (
    ClientDataset,
    ClientPopulation,
    FederatedDataModule,
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
