"""CMS hospital charges (Medicare IPPS, FY2011): hospitals as clients of a federated regression.

Galli et al.'s hospital experiment (thesis ch. 2): each provider is a client, each of its rows (one per DRG) a
sample with features ``(service index, longitude, latitude)`` and target *Average Total Payments*. The official
CSV's quirks (padded headers, ``"$5,777.24"``, ZIP codes without leading zeros) are read as they are; ZIP codes
become coordinates offline (``zipcodes``). docs/data.md, "CMS hospital charges".
"""

from __future__ import annotations

import csv
import functools
import math
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Optional, Union

import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_dp import checks
from lightning_dp.datamodules.base import renamed
from lightning_dp.datamodules.federated import (
    ClientDataset,
    FederatedDataModule,
    split_clients,
)
from lightning_dp.datamodules.offline import (
    DataFormatError,
    DatasetUnavailableError,
    UrlOpener,
    dataset_unavailable,
    download_file,
    download_guard,
)

__all__ = [
    "CMS_COLUMNS",
    "DOWNLOAD_URLS",
    "FEATURE_NAMES",
    "HospitalChargesDataModule",
    "OFFICIAL_FILENAME",
    "PAPER_DRGS",
    "download_cms_file",
    "drg_code",
    "normalize_zip",
    "parse_money",
    "power_of_ten_scales",
    "read_cms_rows",
    "select_drgs",
    "zip_coordinates",
]

#: Name of the official file.
OFFICIAL_FILENAME = "Medicare_Provider_Charge_Inpatient_DRG100_FY2011.csv"
#: Where the official file is served (the CSV export of the data.cms.gov dataset
#: ``97k6-zzx3``), tried in order. CMS has been migrating data.cms.gov; if this
#: address stops serving the file, download it by hand and pass ``path=``.
DOWNLOAD_URLS: tuple[str, ...] = ("https://data.cms.gov/api/views/97k6-zzx3/rows.csv?accessType=DOWNLOAD",)
#: The 12 official column names, surrounding spaces stripped.
CMS_COLUMNS: tuple[str, ...] = (
    "DRG Definition",
    "Provider Id",
    "Provider Name",
    "Provider Street Address",
    "Provider City",
    "Provider State",
    "Provider Zip Code",
    "Hospital Referral Region Description",
    "Total Discharges",
    "Average Covered Charges",
    "Average Total Payments",
    "Average Medicare Payments",
)
REQUIRED_COLUMNS: tuple[str, ...] = ("DRG Definition", "Provider Id", "Provider Zip Code", "Average Total Payments")
TARGET_COLUMN = "Average Total Payments"
#: Names of the three input features, in order.
FEATURE_NAMES: tuple[str, str, str] = ("service_index", "longitude", "latitude")

#: The paper's four conditions, as DRG codes. UNVERIFIED RECONSTRUCTION: the seed
#: describes them only as the "four most treated conditions" of the full file, and
#: neither the paper's text nor the thesis was at hand to confirm the codes. These are
#: the four DRGs billed by the most providers (most rows) in the full official file, as
#: recalled, not recomputed (the full file is not available offline): 194 SIMPLE
#: PNEUMONIA & PLEURISY W CC, 690 KIDNEY & URINARY TRACT INFECTIONS W/O MCC, 292 HEART
#: FAILURE & SHOCK W CC, 392 ESOPHAGITIS, GASTROENT & MISC DIGEST DISORDERS W/O MCC.
#: With the full file, ``HospitalChargesDataModule.drg_frequencies(path)`` shows the real ranking;
#: pass ``drgs=[...]`` explicitly to reproduce a different reading of "most treated"
#: (e.g. by total discharges).
PAPER_DRGS: tuple[str, ...] = ("194", "690", "292", "392")

PathLike = Union[str, "os.PathLike[str]"]


# ----------------------------------------------------------------------------- parsing
def parse_money(text: str) -> float:
    """Parse an official money field (``"$5,777.24"``, with optional spaces) into a float.

    Raises:
        ValueError: If ``text`` is not a dollar amount.

    Example:
        >>> parse_money(" $32,963.07 ")
        32963.07
    """
    cleaned = str(text).strip().replace("$", "").replace(",", "").strip()
    try:
        value = float(cleaned)
    except ValueError:
        raise ValueError(f"not a dollar amount: {text!r} (expected e.g. '$5,777.24')") from None
    if not math.isfinite(value):
        raise ValueError(f"not a finite dollar amount: {text!r}")
    return value


def drg_code(definition: Union[str, int]) -> str:
    """The three-digit DRG code of a definition (``"039 - EXTRACRANIAL ..."``), a code or an integer.

    Example:
        >>> drg_code("039 - EXTRACRANIAL PROCEDURES W/O CC/MCC"), drg_code(39), drg_code("39")
        ('039', '039', '039')
    """
    if isinstance(definition, bool):
        raise ValueError(f"not a DRG: {definition!r}")
    head = str(definition).strip().split("-", 1)[0].strip() if not isinstance(definition, int) else str(definition)
    if not head.isdigit() or len(head) > 3:
        raise ValueError(f"not a DRG code or definition: {definition!r} (expected e.g. '039' or '039 - ...')")
    return head.zfill(3)


def normalize_zip(text: Union[str, int]) -> str:
    """Five-digit ZIP code: strips spaces and a ``-NNNN`` suffix, restores dropped leading zeros.

    Example:
        >>> normalize_zip("2114"), normalize_zip(" 36301 "), normalize_zip("36301-1234")
        ('02114', '36301', '36301')
    """
    return str(text).strip().split("-", 1)[0].strip().zfill(5)


def read_cms_rows(path: PathLike) -> list[dict[str, str]]:
    """Read the official CSV into rows keyed by the stripped column names, values stripped.

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        ValueError: If a required column (``DRG Definition``, ``Provider Id``,
            ``Provider Zip Code``, ``Average Total Payments``) is missing.
    """
    path = Path(path)
    with open(path, newline="", encoding="utf-8-sig") as handle:
        reader = csv.reader(handle)
        try:
            header = [name.strip() for name in next(reader)]
        except StopIteration:
            raise DataFormatError(f"{path}: empty file, expected the official CMS inpatient CSV") from None
        missing = [name for name in REQUIRED_COLUMNS if name not in header]
        if missing:
            raise DataFormatError(
                f"{path}: missing column(s) {missing}; found {header}. Expected the official layout of "
                f"{OFFICIAL_FILENAME} (columns {list(CMS_COLUMNS)})"
            )
        return [dict(zip(header, (value.strip() for value in row))) for row in reader if any(row)]


@functools.lru_cache(maxsize=1)
def _zip_table() -> dict[str, tuple[float, float]]:
    try:
        import zipcodes
    except ImportError as err:  # a core dependency; only a broken install gets here
        raise ImportError(
            "HospitalChargesDataModule needs the `zipcodes` package (offline ZIP -> coordinates table); "
            "install it with `pip install zipcodes`"
        ) from err
    table = {}
    for record in zipcodes.list_all():
        try:
            table[record["zip_code"]] = (float(record["lat"]), float(record["long"]))
        except (KeyError, TypeError, ValueError):
            continue
    return table


def zip_coordinates(zips: Iterable[str]) -> dict[str, tuple[float, float]]:
    """Latitude and longitude (degrees) of five-digit US ZIP codes, offline.

    Uses the table embedded in the ``zipcodes`` package (GeoNames coordinates); no
    network access.

    Args:
        zips: Five-digit ZIP codes (see :func:`normalize_zip`).

    Returns:
        ``{zip: (latitude, longitude)}`` for the known ZIP codes; unknown ones are left out.

    Example:
        >>> zip_coordinates(["36301", "00000"])
        {'36301': (31.1481, -85.3718)}
    """
    table = _zip_table()
    return {code: table[code] for code in zips if code in table}


def select_drgs(
    frequencies: Mapping[str, int],
    requested: Optional[Sequence[Union[str, int]]] = None,
    *,
    paper: Sequence[str] = PAPER_DRGS,
    count: int = 4,
) -> tuple[list[str], str]:
    """Choose the DRG codes to use, and say how they were chosen.

    Args:
        frequencies: Rows per DRG code in the file.
        requested: DRGs asked for (codes, integers or definitions), in the order that
            defines the service index; ``None`` for the default.
        paper: The paper's DRG codes (:data:`PAPER_DRGS`).
        count: How many DRGs the default takes when the paper's are not all in the file.

    Returns:
        ``(codes, how)`` with ``how`` one of ``"requested"``, ``"paper"`` (all of
        ``paper`` are in the file: they are used, in that order) and
        ``"most_frequent"`` (the ``count`` codes with the most rows, ties by code).

    Raises:
        ValueError: If a requested DRG is not in the file, or is repeated.
    """
    ranking = sorted(frequencies, key=lambda code: (-frequencies[code], code))
    if requested is not None:
        codes = [drg_code(item) for item in requested]
        if not codes or len(set(codes)) != len(codes):
            raise ValueError(f"drgs must be a non-empty list of distinct DRGs, got {list(requested)}")
        absent = [code for code in codes if code not in frequencies]
        if absent:
            raise ValueError(
                f"DRG(s) {absent} are not in the file; its most frequent DRGs are {ranking[:10]}. "
                "Pass drgs from those, or None for the default"
            )
        return codes, "requested"
    if paper and all(code in frequencies for code in paper):
        return list(paper), "paper"
    return ranking[:count], "most_frequent"


def power_of_ten_scales(values: torch.Tensor) -> torch.Tensor:
    """Per-column scale ``10 ** floor(log10(max |value|))`` (1 for an all-zero column).

    Dividing by it brings every column's largest magnitude into ``[1, 10)`` while
    keeping zero, sign and ratios: a change of units, not a standardization (the paper
    argues against centring, which would distort the geometry the metric privacy
    acts on).

    Args:
        values: ``(N, F)`` tensor, or ``(N,)`` for one column.

    Returns:
        ``(F,)`` (or scalar) tensor of powers of ten, float64.

    Example:
        >>> power_of_ten_scales(torch.tensor([[3.0, -157.8, 61.2], [0.0, -70.0, 25.0]])).tolist()
        [1.0, 100.0, 10.0]
    """
    peak = values.detach().to(torch.float64).abs().amax(dim=0)
    exponent = torch.where(peak > 0, torch.floor(torch.log10(peak.clamp_min(1e-300))), torch.zeros_like(peak))
    return torch.pow(10.0, exponent)


# ----------------------------------------------------------------------------- download
def download_cms_file(
    directory: PathLike,
    *,
    urls: Sequence[str] = DOWNLOAD_URLS,
    urlopen: Optional[UrlOpener] = None,
    timeout: float = 120.0,
) -> Path:
    """Download the official CSV into ``directory/OFFICIAL_FILENAME``
    (:func:`~lightning_dp.datamodules.offline.download_file`, checked to have the official columns: CMS publishes
    no checksum for it).

    Args:
        directory: Destination directory, created if missing.
        urls: Addresses tried in order (``https://``, ``http://`` or ``file://``).
        urlopen: Function with the signature of :func:`urllib.request.urlopen`.
        timeout: Seconds before a connection attempt is abandoned.

    Returns:
        The path of the downloaded file.

    Raises:
        DownloadError: (a :class:`RuntimeError`) If no address served a file in the official
            layout; the message lists each address and why it failed.
    """
    return download_file(OFFICIAL_FILENAME, directory=directory, urls=urls, check=read_cms_rows, urlopen=urlopen,
                         timeout=timeout, advice="Download the FY2011 'Inpatient Prospective Payment System Provider "
                         "Summary for the Top 100 DRGs' CSV by hand and pass path=... (or put it in data_dir).")


# ----------------------------------------------------------------------------- DataModule
class HospitalChargesDataModule(FederatedDataModule):
    """CMS FY2011 inpatient charges: one client per provider, regression of Average Total Payments.

    ``setup()`` reads the official CSV, keeps the rows of the chosen DRGs, turns each
    provider's ZIP code into latitude/longitude offline (:func:`zip_coordinates`),
    drops the rows whose ZIP code is unknown (counted in :meth:`summary`), groups the
    rows by ``Provider Id`` (one client per provider, client id = the provider id),
    and splits the providers (seeded, by provider, never by row) into
    ``train_fraction`` training and ``1 - train_fraction`` validation clients. There are
    no test clients.

    Users: the file identifies providers, not patients. A row is one provider's average over all its discharges of
    one DRG (a patient is in it only through that average, and a patient treated at several providers is in
    several providers' rows), so the finest unit the data offers is the provider (hospital): :meth:`concatenated`'s
    ``user_ids`` is the provider id of every row, and ``DPSGD(privacy_unit="user")`` over
    :class:`~lightning_dp.datamodules.CentralizedView` protects all of one provider's rows (at most one per DRG
    chosen: ``max_examples_per_user`` equal to the number of DRGs keeps every row).

    Each row is one sample: ``x = (service index, longitude, latitude)``, where the
    service index is the position of the row's DRG in :attr:`selected_drgs` (0, 1, ...),
    and ``y = Average Total Payments`` in dollars. With ``scale=True`` (default) every
    column is divided by a power of ten, ``10 ** floor(log10(max |value|))`` computed on
    the *training* clients only (:func:`power_of_ten_scales`): a change of units, no
    centring or standardization, as the paper argues. The scales are
    :attr:`feature_scales` (per feature) and :attr:`target_scale`; multiply a
    prediction by :attr:`target_scale` to get dollars.

    DRG choice (``drgs=None``): the paper's four conditions (:data:`PAPER_DRGS`, an
    unverified reconstruction, see there) when all four are in the file, otherwise the
    four DRGs with the most rows (ties by code), e.g. for a subset. Pass ``drgs`` to
    choose (codes such as ``"039"`` or ``39``, or full definitions); their order
    defines the service index.

    ``x`` is float32 of shape ``(n, 3)``, ``y`` float32 of shape ``(n,)``.

    Args:
        data_dir: Directory holding ``Medicare_Provider_Charge_Inpatient_DRG100_FY2011.csv``
            (or a single ``Medicare_Provider_Charge_Inpatient_DRG100_FY2011*.csv``, e.g. a
            subset); the download destination.
        path: The CSV file itself; overrides ``data_dir`` for reading.
        drgs: DRGs to use, or ``None`` for the default described above.
        train_fraction: Fraction of the providers used as training clients, in (0, 1);
            the rest are validation clients.
        scale: Divide features and target by their power-of-ten scales.
        download: Let ``prepare_data()`` download the official file from
            :data:`DOWNLOAD_URLS` when it is missing.
        batch_size: Samples per batch of the centralized loaders.
        num_workers: DataLoader worker processes.
        seed: Seed of the provider split and of the training-loader shuffling.

    Raises:
        ValueError: If an argument is outside its range.

    Example:
        >>> dm = HospitalChargesDataModule(data_dir="../shared/data/cms_inpatient")  # doctest: +SKIP
        >>> dm.setup()  # doctest: +SKIP
        >>> dm.selected_drgs, dm.drg_selection  # doctest: +SKIP
        (['065', '064', '066', '057'], 'most_frequent')
    """

    task = "regression"
    num_classes = None
    input_shape = (3,)
    feature_names: ClassVar[tuple[str, str, str]] = FEATURE_NAMES
    #: Download addresses, tried in order (a class attribute so that it can be changed).
    urls: ClassVar[tuple[str, ...]] = DOWNLOAD_URLS

    def __init__(
        self,
        *,
        data_dir: PathLike = "./data/cms_inpatient",
        path: Optional[PathLike] = None,
        drgs: Optional[Sequence[Union[str, int]]] = None,
        train_fraction: float = 0.7,
        scale: bool = True,
        download: bool = False,
        batch_size: int = 64,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed)
        owner = type(self).__name__
        checks.open_fraction("train_fraction", train_fraction, owner=owner)
        for flag_name, flag in (("scale", scale), ("download", download)):
            if not isinstance(flag, bool):
                raise ValueError(f"{owner}: {flag_name} must be True or False, got {flag!r}")
        if drgs is not None:
            if isinstance(drgs, (str, int)):
                raise ValueError(f"{owner}: drgs must be a list of DRGs, e.g. ['194', '690'], got {drgs!r}")
            try:
                codes = [drg_code(item) for item in drgs]
            except ValueError as err:
                raise ValueError(f"{owner}: drgs: {err}") from None
            if not codes or len(set(codes)) != len(codes):
                raise ValueError(f"{owner}: drgs must be a non-empty list of distinct DRGs, got {list(drgs)!r}")
        self.save_hyperparameters()
        self.data_dir = Path(data_dir).expanduser()
        self.path = Path(path).expanduser() if path is not None else None
        self.drgs = list(drgs) if drgs is not None else None
        self.train_fraction = float(train_fraction)
        self.scale = scale
        self.download = download
        # Filled by setup():
        self.selected_drgs: Optional[list[str]] = None
        self.drg_definitions: dict[str, str] = {}
        self.drg_selection: Optional[str] = None
        self.feature_scales: Optional[torch.Tensor] = None
        self.target_scale: Optional[float] = None
        self.rows_read = 0
        self.rows_selected = 0
        self.rows_dropped_unknown_zip = 0
        self.unknown_zips: list[str] = []

    # ----------------------------------------------------------------- files
    def find_file(self) -> Optional[Path]:
        """The CSV that ``setup()`` reads: ``path``, else the official file name in ``data_dir``,
        else the only ``Medicare_Provider_Charge_Inpatient_DRG100_FY2011*.csv`` there; ``None`` if absent.

        Raises:
            ValueError: If ``data_dir`` holds several candidate files and none has the official name.
        """
        if self.path is not None:
            return self.path if self.path.is_file() else None
        official = self.data_dir / OFFICIAL_FILENAME
        if official.is_file():
            return official
        stem = OFFICIAL_FILENAME[: -len(".csv")]
        candidates = sorted(self.data_dir.glob(f"{stem}*.csv")) if self.data_dir.is_dir() else []
        if len(candidates) > 1:
            raise ValueError(
                f"{type(self).__name__}: several candidate files in {self.data_dir}: "
                f"{[p.name for p in candidates]}; pass path= to choose one"
            )
        return candidates[0] if candidates else None

    @staticmethod
    def drg_frequencies(path: PathLike) -> dict[str, int]:
        """Rows per DRG code of a file, most frequent first (to check :data:`PAPER_DRGS` against the full file)."""
        counts = Counter(drg_code(row["DRG Definition"]) for row in read_cms_rows(path))
        return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))

    def unavailable(self, error: Optional[str] = None) -> DatasetUnavailableError:
        """The error of a missing CSV: its name and layout, where to get it, and ``error`` (the
        download's, one line) when a download failed."""
        folder, name = (self.path.parent, self.path.name) if self.path is not None else (self.data_dir,
                                                                                          OFFICIAL_FILENAME)
        if error is not None:
            fix = "download the CSV where there is internet, then put it in data_dir or pass path=<the CSV>."
        else:
            fix = "pass download=True to download it, or put the CSV in data_dir or pass path=<the CSV>."
        return dataset_unavailable(
            type(self).__name__, "the CMS FY2011 inpatient charges CSV", data_dir=folder, expected=[name],
            layout=f"the official CMS CSV with columns {', '.join(REQUIRED_COLUMNS)}, ...; a subset named "
                   f"{OFFICIAL_FILENAME[:-len('.csv')]}*.csv works too",
            sources=[f"{url} (data.cms.gov dataset 97k6-zzx3, the IPPS Provider Summary for the Top 100 DRGs, "
                     "FY2011)" for url in self.urls],
            error=error, fix=fix)

    def prepare_data(self) -> None:
        """Download only (``download=True`` and the file is missing); assigns no state.

        Raises:
            DatasetUnavailableError: If the download failed (``data_dir`` is left as it was).
        """
        if self.download and self.find_file() is None:
            with download_guard(self.data_dir, self.unavailable):
                download_cms_file(self.data_dir, urls=self.urls)

    # ----------------------------------------------------------------- setup
    def _build_clients(self) -> tuple[list[ClientDataset], list[ClientDataset], list[ClientDataset]]:
        owner = type(self).__name__
        source = self.find_file()
        if source is None:
            raise self.unavailable()
        rows = read_cms_rows(source)
        self.rows_read = len(rows)
        codes_of_rows = []
        for line, row in enumerate(rows, start=2):
            try:
                codes_of_rows.append(drg_code(row["DRG Definition"]))
            except ValueError as err:
                raise DataFormatError(f"{owner}: {source}, line {line}: {err}") from None
        frequencies = Counter(codes_of_rows)
        for code, row in zip(codes_of_rows, rows):
            self.drg_definitions.setdefault(code, row["DRG Definition"])
        try:
            selected, how = select_drgs(frequencies, self.drgs)
        except ValueError as err:
            raise ValueError(f"{owner}: {source}: {err}") from None
        if how == "most_frequent":
            rank_zero_info(
                f"{owner}: the paper's DRGs {list(PAPER_DRGS)} are not all in {source.name}; using its "
                f"{len(selected)} most frequent DRGs {selected}"
            )
        self.selected_drgs, self.drg_selection = selected, how
        service_index = {code: index for index, code in enumerate(selected)}

        chosen = [(code, row) for code, row in zip(codes_of_rows, rows) if code in service_index]
        self.rows_selected = len(chosen)
        coordinates = zip_coordinates({normalize_zip(row["Provider Zip Code"]) for _, row in chosen})
        per_provider: dict[str, list[tuple[float, float, float, float]]] = {}
        unknown = set()
        dropped = 0
        for code, row in chosen:
            zip5 = normalize_zip(row["Provider Zip Code"])
            if zip5 not in coordinates:
                dropped += 1
                unknown.add(zip5)
                continue
            latitude, longitude = coordinates[zip5]
            try:
                payment = parse_money(row[TARGET_COLUMN])
            except ValueError as err:
                raise ValueError(f"{owner}: {source}: provider {row['Provider Id']}: {err}") from None
            per_provider.setdefault(row["Provider Id"], []).append(
                (float(service_index[code]), longitude, latitude, payment)
            )
        self.rows_dropped_unknown_zip = dropped
        self.unknown_zips = sorted(unknown)

        clients = []
        for provider in sorted(per_provider, key=_provider_sort_key):
            samples = torch.tensor(sorted(per_provider[provider], key=lambda s: s[0]), dtype=torch.float64)
            clients.append((provider, samples[:, :3], samples[:, 3]))
        train, val = split_clients(clients, [self.train_fraction, 1.0 - self.train_fraction], seed=self.seed)
        if not train:
            raise ValueError(f"{owner}: {source}: no provider has a row of DRGs {selected} with a known ZIP code")
        if self.scale:
            feature_scales = power_of_ten_scales(torch.cat([x for _, x, _ in train]))
            target_scale = float(power_of_ten_scales(torch.cat([y for _, _, y in train])))
        else:
            feature_scales = torch.ones(3, dtype=torch.float64)
            target_scale = 1.0
        self.feature_scales, self.target_scale = feature_scales, target_scale

        def to_client(provider: str, x: torch.Tensor, y: torch.Tensor) -> ClientDataset:
            return ClientDataset(
                provider, (x / feature_scales).to(torch.float32), (y / target_scale).to(torch.float32)
            )

        return [to_client(*item) for item in train], [to_client(*item) for item in val], []

    def summary(self) -> dict[str, Any]:
        """:meth:`FederatedDataModule.summary` plus the DRGs, the row counts and the scales.

        Added keys: ``drgs`` (codes), ``drg_definitions``, ``drg_selection``
        (``"requested"``, ``"paper"`` or ``"most_frequent"``), ``rows_read``,
        ``rows_selected`` (rows of the chosen DRGs), ``rows_dropped_unknown_zip``,
        ``unknown_zips``, ``feature_names``, ``feature_scales``, ``target_scale``.
        """
        out = super().summary()
        out.update(
            drgs=list(self.selected_drgs or []),
            drg_definitions={code: self.drg_definitions[code] for code in self.selected_drgs or []},
            drg_selection=self.drg_selection,
            rows_read=self.rows_read,
            rows_selected=self.rows_selected,
            rows_dropped_unknown_zip=self.rows_dropped_unknown_zip,
            unknown_zips=list(self.unknown_zips),
            feature_names=list(FEATURE_NAMES),
            feature_scales=self.feature_scales.tolist() if self.feature_scales is not None else None,
            target_scale=self.target_scale,
        )
        return out


def _provider_sort_key(provider: str) -> tuple[int, Union[int, str]]:
    return (0, int(provider)) if provider.isdigit() else (1, provider)


def __getattr__(name: str) -> type:  # the former names (datamodules.base.RENAMED), warned
    return renamed(__name__, name, globals())
