"""From simulation to a real deployment: the federated round as a Flower ``ServerApp`` and ``ClientApp``.

The same YAML that ``lightning-dp fit`` simulates runs on Flower's Deployment Engine: :mod:`lightning_dp.flower.app`
writes the app directory (the config travels to every node, so it may hold no secret),
:mod:`lightning_dp.flower.server` selects, aggregates and accounts, :mod:`lightning_dp.flower.client` trains and
sanitizes its own clients. The server's noise seed never leaves the server; a client's noise seed and data never
leave its node. Running it, and what each side sees: docs/federated.md, "From simulation to deployment";
:mod:`lightning_dp.flower.keys` makes the TLS certificates and SuperNode keys of a consortium's deployment
(``lightning-dp flower-keys``; docs/federated.md, "A consortium's deployment").
"""

from lightning_dp.flower.app import write_app

__all__ = ["write_app"]
