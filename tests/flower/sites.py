"""A site's own data for the deployment tests: the seed's synthetic mixture, its training clients' ids prefixed with
the site's name (ids are unique across sites, as providers' or writers' ids are)."""

from __future__ import annotations

import dataclasses

from lightning_dp.datamodules import SyntheticLinearMixtureDataModule


class SiteMixture(SyntheticLinearMixtureDataModule):
    def __init__(self, *, site: str = "a", **kwargs) -> None:
        super().__init__(**kwargs)
        self.site = site

    def _build_clients(self):
        train, val, test = super()._build_clients()
        return [dataclasses.replace(c, client_id=f"{self.site}-{c.client_id}") for c in train], val, test
