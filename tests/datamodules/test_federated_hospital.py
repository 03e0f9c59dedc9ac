"""HospitalChargesDataModule on generated CSV files in the official CMS layout (padded headers, "$" money)."""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

import pytest
import torch
from jsonargparse import ArgumentParser

from lightning_dp.datamodules import hospital
from lightning_dp.datamodules.hospital import (
    DOWNLOAD_URLS,
    OFFICIAL_FILENAME,
    PAPER_DRGS,
    HospitalChargesDataModule,
    download_cms_file,
    drg_code,
    normalize_zip,
    parse_money,
    power_of_ten_scales,
    read_cms_rows,
    select_drgs,
    zip_coordinates,
)

#: The official header line, byte for byte (note the padded names).
OFFICIAL_HEADER = (
    "DRG Definition,Provider Id,Provider Name,Provider Street Address,Provider City,Provider State,"
    "Provider Zip Code,Hospital Referral Region Description, Total Discharges , Average Covered Charges , "
    "Average Total Payments ,Average Medicare Payments"
)
DEFINITIONS = {
    "039": "039 - EXTRACRANIAL PROCEDURES W/O CC/MCC",
    "057": "057 - DEGENERATIVE NERVOUS SYSTEM DISORDERS W/O MCC",
    "064": "064 - INTRACRANIAL HEMORRHAGE OR CEREBRAL INFARCTION W MCC",
    "065": "065 - INTRACRANIAL HEMORRHAGE OR CEREBRAL INFARCTION W CC",
    "066": "066 - INTRACRANIAL HEMORRHAGE OR CEREBRAL INFARCTION W/O CC/MCC",
    "069": "069 - TRANSIENT ISCHEMIA",
    "194": "194 - SIMPLE PNEUMONIA & PLEURISY W CC",
    "292": "292 - HEART FAILURE & SHOCK W CC",
    "392": "392 - ESOPHAGITIS, GASTROENT & MISC DIGEST DISORDERS W/O MCC",
    "690": "690 - KIDNEY & URINARY TRACT INFECTIONS W/O MCC",
}
#: Real ZIP codes as the file writes them (integers: Boston's 02114 appears as "2114"), one unknown ZIP.
PROVIDER_ZIPS = ["36301", "35957", "2114", "10001", "94305", "99501", "96813", "60611", "77030", "98104",
                 "30322", "55905", "85006", "80045", "33136", "48109", "63110", "97239", "19104", "84132"]
UNKNOWN_ZIP = "99999"


def _money(value: float) -> str:
    return f"${value:,.2f}"


def write_cms_csv(path: Path, rows: list[tuple[str, str, str, float]]) -> Path:
    """Write ``(drg code, provider id, zip as written, average total payment)`` rows in the official layout."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as handle:
        handle.write(OFFICIAL_HEADER + "\n")
        writer = csv.writer(handle, lineterminator="\n")
        for code, provider, zip_code, payment in rows:
            writer.writerow([DEFINITIONS[code], provider, f"HOSPITAL {provider}", "1 MAIN STREET", "CITY", "ST",
                             zip_code, "ST - City", 17, _money(payment * 3.5), _money(payment),
                             _money(payment * 0.8)])
    return path


def _payment(provider_index: int, code: str) -> float:
    return 4000.0 + 1234.56 * provider_index + 10.0 * int(code)


def fixture_rows(codes=("039", "057", "064", "065", "066"), *, unknown_zip_rows: int = 2):
    """20 providers with known ZIPs billing ``codes`` (the first codes by more providers), plus unknown-ZIP rows."""
    rows = []
    for index, zip_code in enumerate(PROVIDER_ZIPS):
        provider = str(10001 + index)
        for rank, code in enumerate(codes):
            if index < len(PROVIDER_ZIPS) - rank:  # code number `rank` is billed by 20 - rank providers
                rows.append((code, provider, zip_code, _payment(index, code)))
    for extra in range(unknown_zip_rows):
        rows.append((codes[0], str(90001 + extra), UNKNOWN_ZIP, 5000.0))
    return rows


@pytest.fixture
def cms_file(tmp_path):
    return write_cms_csv(tmp_path / "cms" / OFFICIAL_FILENAME, fixture_rows())


# ---------------------------------------------------------------- parsing helpers
def test_parse_money_drg_code_and_zip():
    assert parse_money("$5,777.24") == 5777.24 and parse_money(" $32,963.07 ") == 32963.07
    assert parse_money("$1,234,567.00") == 1234567.0
    with pytest.raises(ValueError, match="not a dollar amount: 'N/A'"):
        parse_money("N/A")
    assert drg_code("039 - EXTRACRANIAL PROCEDURES W/O CC/MCC") == "039"
    assert drg_code(39) == drg_code("39") == drg_code(" 039 ") == "039"
    with pytest.raises(ValueError, match="not a DRG code"):
        drg_code("EXTRACRANIAL")
    assert normalize_zip("2114") == "02114" and normalize_zip(" 36301 ") == "36301"
    assert normalize_zip("601") == "00601" and normalize_zip("36301-1234") == "36301"


def test_read_cms_rows_strips_padded_headers_and_values(cms_file):
    rows = read_cms_rows(cms_file)
    assert list(rows[0]) == list(hospital.CMS_COLUMNS)
    assert rows[0]["Average Total Payments"] == _money(_payment(0, "039"))
    assert rows[0]["Average Total Payments"].startswith("$") and "," in rows[0]["Average Total Payments"]


def test_read_cms_rows_names_missing_columns(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("DRG Definition,Provider Id\n039 - X,10001\n")
    with pytest.raises(ValueError, match=r"missing column\(s\) \['Provider Zip Code', 'Average Total Payments'\]"):
        read_cms_rows(path)


def test_zip_coordinates_are_offline_and_skip_unknown_zips():
    found = zip_coordinates(["36301", "02114", UNKNOWN_ZIP])
    assert set(found) == {"36301", "02114"}
    latitude, longitude = found["36301"]  # Dothan, AL
    assert latitude == pytest.approx(31.2, abs=0.2) and longitude == pytest.approx(-85.4, abs=0.2)
    latitude, longitude = found["02114"]  # Boston, MA
    assert latitude == pytest.approx(42.36, abs=0.1) and longitude == pytest.approx(-71.07, abs=0.1)


def test_power_of_ten_scales():
    values = torch.tensor([[3.0, -157.8, 61.2, 0.0], [0.0, -70.0, 25.0, 0.0], [1.0, -80.0, 9.0, 0.0]])
    assert power_of_ten_scales(values).tolist() == [1.0, 100.0, 10.0, 1.0]
    assert float(power_of_ten_scales(torch.tensor([5777.24, 123456.0]))) == 100000.0
    assert float(power_of_ten_scales(torch.tensor([0.05]))) == 0.01


# ---------------------------------------------------------------- DRG selection
def test_select_drgs_default_logic():
    frequencies = {"039": 5, "057": 9, "064": 9, "065": 7, "066": 1, "194": 2, "690": 2, "292": 2, "392": 2}
    assert select_drgs(frequencies) == (list(PAPER_DRGS), "paper")  # all four present: the paper's, its order
    without_paper = {code: n for code, n in frequencies.items() if code != "392"}
    assert select_drgs(without_paper) == (["057", "064", "065", "039"], "most_frequent")  # ties by code
    assert select_drgs(frequencies, ["66", 39]) == (["066", "039"], "requested")
    with pytest.raises(ValueError, match=r"DRG\(s\) \['470'\] are not in the file"):
        select_drgs(frequencies, ["470"])


def test_default_drgs_are_the_most_frequent_when_the_papers_are_absent(cms_file):
    datamodule = HospitalChargesDataModule(path=cms_file)
    datamodule.setup()
    assert datamodule.drg_selection == "most_frequent"
    assert datamodule.selected_drgs == ["039", "057", "064", "065"]  # 066 has the fewest rows
    summary = datamodule.summary()
    assert summary["drgs"] == ["039", "057", "064", "065"]
    assert summary["drg_definitions"]["039"] == DEFINITIONS["039"]


def test_default_drgs_are_the_papers_when_present(tmp_path):
    # The paper's DRGs are billed by fewer providers than 039 and 057, and still win.
    path = write_cms_csv(tmp_path / "f.csv", fixture_rows(("039", "057", "194", "690", "292", "392")))
    datamodule = HospitalChargesDataModule(path=path)
    datamodule.setup()
    assert datamodule.drg_selection == "paper" and datamodule.selected_drgs == list(PAPER_DRGS)
    services = torch.cat([c.x[:, 0] for c in datamodule.train_clients + datamodule.val_clients])
    assert sorted(services.unique().tolist()) == [0.0, 1.0, 2.0, 3.0]


def test_requested_drgs_define_the_service_index(cms_file):
    datamodule = HospitalChargesDataModule(path=cms_file, drgs=["066", 39], scale=False)
    datamodule.setup()
    assert datamodule.selected_drgs == ["066", "039"] and datamodule.drg_selection == "requested"
    clients = {c.client_id: c for c in datamodule.train_clients + datamodule.val_clients}
    client = clients["10001"]  # provider 0 bills every DRG
    assert client.x[:, 0].tolist() == [0.0, 1.0]
    assert client.y.tolist() == pytest.approx([_payment(0, "066"), _payment(0, "039")], abs=0.01)
    with pytest.raises(ValueError, match=r"DRG\(s\) \['470'\] are not in the file"):
        HospitalChargesDataModule(path=cms_file, drgs=["470"]).setup()


# ---------------------------------------------------------------- clients, features, scaling, split
def test_providers_are_clients_with_features_and_targets(cms_file):
    datamodule = HospitalChargesDataModule(path=cms_file, scale=False)
    datamodule.setup()
    clients = {c.client_id: c for c in datamodule.train_clients + datamodule.val_clients}
    assert set(clients) == {str(10001 + i) for i in range(20)}  # the unknown-ZIP providers are gone
    boston = clients["10003"]  # ZIP written "2114" in the file
    latitude, longitude = zip_coordinates(["02114"])["02114"]
    assert boston.x.dtype == torch.float32 and boston.y.dtype == torch.float32
    assert boston.x.shape == (4, 3) and boston.y.shape == (4,)
    assert boston.x[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert torch.allclose(boston.x[:, 1], torch.tensor(longitude, dtype=torch.float32))
    assert torch.allclose(boston.x[:, 2], torch.tensor(latitude, dtype=torch.float32))
    expected = [_payment(2, code) for code in datamodule.selected_drgs]
    assert boston.y.tolist() == pytest.approx(expected, abs=0.01)
    # Provider 19 bills only the first DRG (the fixture's "rank" rule).
    assert len(clients["10020"]) == 1
    assert datamodule.feature_scales.tolist() == [1.0, 1.0, 1.0] and datamodule.target_scale == 1.0


def test_unknown_zip_rows_are_dropped_and_counted(cms_file):
    datamodule = HospitalChargesDataModule(path=cms_file)
    datamodule.setup()
    summary = datamodule.summary()
    assert summary["rows_dropped_unknown_zip"] == 2 and summary["unknown_zips"] == [UNKNOWN_ZIP]
    assert summary["rows_read"] == len(fixture_rows())
    kept = summary["train"]["samples"] + summary["val"]["samples"]
    assert kept == summary["rows_selected"] - 2


def test_scaling_by_powers_of_ten_from_the_training_clients(cms_file):
    raw = HospitalChargesDataModule(path=cms_file, scale=False, seed=5)
    scaled = HospitalChargesDataModule(path=cms_file, seed=5)
    raw.setup()
    scaled.setup()
    train_x = torch.cat([c.x for c in raw.train_clients]).double()
    train_y = torch.cat([c.y for c in raw.train_clients]).double()
    expected = [10.0 ** math.floor(math.log10(float(train_x[:, j].abs().max()))) for j in range(3)]
    assert scaled.feature_scales.tolist() == expected == [1.0, 100.0, 10.0]
    assert scaled.target_scale == 10.0 ** math.floor(math.log10(float(train_y.abs().max()))) == 10000.0
    for a, b in zip(raw.train_clients + raw.val_clients, scaled.train_clients + scaled.val_clients):
        assert a.client_id == b.client_id
        assert torch.allclose(b.x.double(), a.x.double() / scaled.feature_scales, atol=1e-6)
        assert torch.allclose(b.y.double() * scaled.target_scale, a.y.double(), atol=0.01)
    assert scaled.summary()["feature_scales"] == [1.0, 100.0, 10.0] and scaled.summary()["target_scale"] == 10000.0


def test_scales_ignore_the_validation_clients(tmp_path):
    rows = fixture_rows()
    datamodule = HospitalChargesDataModule(path=write_cms_csv(tmp_path / "a.csv", rows), seed=0)
    datamodule.setup()
    # Give one validation provider huge payments: the target scale must not move.
    victim = datamodule.val_clients[0].client_id
    inflated = [(c, p, z, pay * 1000 if p == victim else pay) for c, p, z, pay in rows]
    other = HospitalChargesDataModule(path=write_cms_csv(tmp_path / "b.csv", inflated), seed=0)
    other.setup()
    assert other.target_scale == datamodule.target_scale == 10000.0
    assert float(next(c for c in other.val_clients if c.client_id == victim).y.max()) > 100.0


def test_seventy_thirty_split_by_provider(cms_file):
    datamodule = HospitalChargesDataModule(path=cms_file, seed=1)
    datamodule.setup()
    train_ids = [c.client_id for c in datamodule.train_clients]
    val_ids = [c.client_id for c in datamodule.val_clients]
    assert (len(train_ids), len(val_ids)) == (14, 6) and not set(train_ids) & set(val_ids)
    assert datamodule.test_clients == []
    # Every row of a provider stays with its provider.
    summary = datamodule.summary()
    assert summary["train"]["samples"] + summary["val"]["samples"] == summary["rows_selected"] - 2
    again = HospitalChargesDataModule(path=cms_file, seed=1)
    again.setup()
    assert [c.client_id for c in again.train_clients] == train_ids
    other = HospitalChargesDataModule(path=cms_file, seed=2)
    other.setup()
    assert [c.client_id for c in other.train_clients] != train_ids
    half = HospitalChargesDataModule(path=cms_file, train_fraction=0.5)
    half.setup()
    assert (len(half.train_clients), len(half.val_clients)) == (10, 10)


# ---------------------------------------------------------------- files and download
def test_finds_the_file_in_data_dir(tmp_path):
    write_cms_csv(tmp_path / "official" / OFFICIAL_FILENAME, fixture_rows())
    write_cms_csv(tmp_path / "subset" / OFFICIAL_FILENAME.replace(".csv", "_subset.csv"), fixture_rows())
    for folder in ("official", "subset"):
        datamodule = HospitalChargesDataModule(data_dir=tmp_path / folder)
        datamodule.setup()
        assert len(datamodule.train_clients) == 14
    write_cms_csv(tmp_path / "subset" / OFFICIAL_FILENAME.replace(".csv", "_other.csv"), fixture_rows())
    with pytest.raises(ValueError, match="several candidate files"):
        HospitalChargesDataModule(data_dir=tmp_path / "subset").setup()


def test_missing_file_error_gives_the_fixes(tmp_path):
    datamodule = HospitalChargesDataModule(data_dir=tmp_path / "nothing")
    datamodule.prepare_data()  # download=False: does nothing
    with pytest.raises(FileNotFoundError, match="download=True.*path="):
        datamodule.setup()


def test_prepare_data_downloads_with_fallback(tmp_path, monkeypatch):
    source = write_cms_csv(tmp_path / "mirror" / "rows.csv", fixture_rows())
    broken = (tmp_path / "missing.csv").as_uri()
    monkeypatch.setattr(HospitalChargesDataModule, "urls", (broken, source.as_uri()))
    datamodule = HospitalChargesDataModule(data_dir=tmp_path / "data", download=True)
    datamodule.prepare_data()
    target = tmp_path / "data" / OFFICIAL_FILENAME
    assert target.read_bytes() == source.read_bytes()
    assert not list((tmp_path / "data").glob("*.part"))
    datamodule.setup()
    assert len(datamodule.train_clients) == 14
    datamodule.prepare_data()  # present: nothing to do


def test_download_uses_the_official_url_and_rejects_a_wrong_layout(tmp_path):
    payload = (tmp_path / "x.csv")
    write_cms_csv(payload, fixture_rows())
    requested = []

    def fake_urlopen(request, timeout):
        requested.append((request.full_url, request.get_header("User-agent"), timeout))
        return io.BytesIO(payload.read_bytes())

    path = download_cms_file(tmp_path / "d", urlopen=fake_urlopen, timeout=5.0)
    assert path == tmp_path / "d" / OFFICIAL_FILENAME and path.is_file()
    assert requested == [(DOWNLOAD_URLS[0], "lightning-dp", 5.0)]
    assert DOWNLOAD_URLS[0].startswith("https://data.cms.gov/")

    def html_urlopen(request, timeout):
        return io.BytesIO(b"<html><body>moved</body></html>\n")

    with pytest.raises(RuntimeError, match="missing column"):
        download_cms_file(tmp_path / "e", urlopen=html_urlopen)
    assert not (tmp_path / "e").exists()  # a failed download leaves nothing, not even the directory it made


# ---------------------------------------------------------------- arguments
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"train_fraction": 1.0}, "train_fraction must be a number in the open interval"),
        ({"drgs": "194"}, "drgs must be a list of DRGs"),
        ({"drgs": ["PNEUMONIA"]}, "not a DRG code"),
        ({"drgs": ["194", 194]}, "distinct DRGs"),
        ({"scale": "yes"}, "scale must be True or False"),
        ({"batch_size": 0}, "batch_size must be a positive integer"),
    ],
)
def test_constructor_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HospitalChargesDataModule(**kwargs)


def test_configurable_from_a_config(cms_file):
    parser = ArgumentParser()
    parser.add_class_arguments(HospitalChargesDataModule, "data")
    config = parser.parse_args([f"--data.path={cms_file}", "--data.drgs=['039', '057']"])
    datamodule = HospitalChargesDataModule(**config.data.as_dict())
    datamodule.setup()
    assert datamodule.selected_drgs == ["039", "057"]
