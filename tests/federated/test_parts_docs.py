"""docs/federated.md's example part, run as written: registered by name, usable in a round."""

from __future__ import annotations

import re
from pathlib import Path

import lightning as L
import torch

from lightning_dp.datamodules import SyntheticLinearMixtureDataModule
from lightning_dp.federated import FederatedRound
from lightning_dp.federated.parts import LocalSGD, UniformSelection, registered_parts
from lightning_dp.models import LinearRegression

DOC = Path(__file__).resolve().parents[2] / "docs" / "federated.md"


def test_the_documented_median_aggregator():
    code = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(code) == 1
    namespace: dict = {}
    exec(compile(code[0], str(DOC), "exec"), namespace)  # noqa: S102  (our own documentation)
    assert registered_parts("aggregator")["median"] is namespace["CoordinateMedian"]
    m = FederatedRound(LinearRegression(), selection=UniformSelection(9), update=LocalSGD(lr=0.1),
                       aggregator="median", seed=0, noise_seed=1)
    releases = []
    original = m.aggregator.aggregate

    def spy(rel, hyps, weights=None):
        releases.append(rel.clone())
        return original(rel, hyps, weights)

    m.aggregator.aggregate = spy
    L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              max_epochs=2, num_sanity_val_steps=0, limit_val_batches=0).fit(m, SyntheticLinearMixtureDataModule(seed=0))
    assert len(releases) == 2
    assert torch.equal(m.hypotheses[0], releases[-1].median(dim=0).values)
