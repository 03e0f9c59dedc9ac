"""The federated DataModules on the real samples of ``shared/data``, when at hand (skipped otherwise).

Looks in ``$LIGHTNING_DP_SHARED_DATA``, default ``<repo>/../shared/data``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lightning_dp.datamodules.femnist import FEMNISTDataModule
from lightning_dp.datamodules.hospital import HospitalChargesDataModule

_DEFAULT_SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
SHARED_DATA = Path(os.environ.get("LIGHTNING_DP_SHARED_DATA", _DEFAULT_SHARED_DATA))
CMS_FILE = SHARED_DATA / "cms_inpatient" / "Medicare_Provider_Charge_Inpatient_DRG100_FY2011_subset.csv"
FEMNIST_DIR = SHARED_DATA / "femnist"


@pytest.mark.skipif(not CMS_FILE.is_file(), reason=f"the CMS inpatient subset is not at {CMS_FILE}")
def test_real_cms_subset():
    datamodule = HospitalChargesDataModule(data_dir=CMS_FILE.parent)
    datamodule.setup()
    summary = datamodule.summary()
    assert summary["rows_read"] == 7869
    # The subset holds DRGs 039, 057, 064, 065, 066, 069, not the paper's: the four most frequent are used.
    assert summary["drg_selection"] == "most_frequent" and summary["drgs"] == ["065", "064", "066", "057"]
    assert summary["rows_selected"] == 2269 + 1659 + 1641 + 1201
    assert summary["rows_dropped_unknown_zip"] <= 10  # the ZIP table knows (almost) every provider's ZIP
    providers = summary["train"]["clients"] + summary["val"]["clients"]
    assert summary["train"]["clients"] == pytest.approx(0.7 * providers, abs=1)
    assert summary["train"]["samples_max"] == 4
    assert summary["feature_scales"] == [1.0, 100.0, 10.0] and summary["target_scale"] == 10000.0
    x = torch.cat([c.x for c in datamodule.train_clients])
    y = torch.cat([c.y for c in datamodule.train_clients])
    # Continental US, Alaska, Hawaii and Puerto Rico, in the scaled units (degrees / 100, / 10).
    assert float(x[:, 1].min()) > -1.8 and float(x[:, 1].max()) < -0.6
    assert float(x[:, 2].min()) > 1.7 and float(x[:, 2].max()) < 7.2
    assert 0.1 < float(y.min()) and float(y.max()) < 10.0


@pytest.mark.skipif(not (FEMNIST_DIR / "train").is_dir(), reason=f"the LEAF FEMNIST sample is not in {FEMNIST_DIR}")
def test_real_femnist_sample():
    datamodule = FEMNISTDataModule(data_dir=FEMNIST_DIR)
    datamodule.setup()
    summary = datamodule.summary()
    assert summary["writers_available"] == 105
    assert summary["train"]["clients"] + summary["val"]["clients"] == 105
    assert summary["train"]["samples"] + summary["val"]["samples"] == 14708
    assert summary["test"]["clients"] == 105  # every writer of train/ also has test samples
    assert 0.3 < sum(datamodule.rotated.values()) / 105 < 0.7
    client = datamodule.train_clients[0]
    assert client.x.shape[1:] == (1, 28, 28) and client.x.dtype == torch.float32
    # Inverted to a black background: most pixels are (close to) 0.
    assert float(client.x.min()) >= 0.0 and float(client.x.max()) <= 1.0
    assert float((client.x < 0.1).float().mean()) > 0.7
    labels = torch.cat([c.y for c in datamodule.train_clients])
    assert int(labels.min()) >= 0 and int(labels.max()) <= 61 and labels.unique().numel() > 50
