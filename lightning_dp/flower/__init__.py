"""From simulation to a real deployment: the federated round as a Flower ``ServerApp`` and ``ClientApp``.

The same YAML that ``lightning-dp fit`` runs as a simulation runs on Flower's Deployment Engine
(a SuperLink, one SuperNode per site, each a process or a machine):

- :mod:`lightning_dp.flower.app` writes the Flower app directory of a config
  (``lightning-dp flower-app --config run.yaml --out app/``): its ``pyproject.toml`` names the
  two components below and carries the config, which every SuperNode and the SuperLink receive
  (so it may hold no secret: a ``noise_seed`` in it is refused).
- :mod:`lightning_dp.flower.server` (the ``ServerApp``): builds the round and its Trainer from
  the config (MLflow tracking as in ``lightning-dp fit``), asks every node which training clients
  it serves, then trains: each round selects clients from the server's secret seed, sends the
  public hypotheses to the nodes of the selected clients, and aggregates their releases with its
  server privacy, accountant and ledgers, exactly as the simulation does. Validation checks
  ask the nodes of the validation clients for sums of their losses, choices and correct
  predictions (:meth:`~lightning_dp.federated.FederatedRound.evaluation_sums`).
- :mod:`lightning_dp.flower.client` (the ``ClientApp``): builds the config's DataModule from its
  own data, serves the training clients at positions ``partition-id`` (mod ``num-partitions``) of
  a client list every site shares, or, with ``site="NAME"``, all the clients of its own data (its
  ``--node-config``), and computes their choice, local training and release with
  :meth:`~lightning_dp.federated.FederatedRound.train_clients`, its noise from its own secret
  (``--node-config noise-seed=...``, else fresh from the operating system).

What each side sees (docs/federated.md, "From simulation to deployment"): the nodes see the
config, the public hypotheses and previous step, the round number, the public seed, the
server's current clipping threshold and which of their own clients were selected; the server
sees each selected client's release, its privacy cost, its number of examples only for an
aggregator that weights by it, its unclipped bit when it clipped at the server's adaptive
threshold, its training loss only under central DP when the config logs ``nonprivate`` metrics,
and per node the sums of an evaluation of its validation clients. The server's noise seed (selection, central noise) never leaves the
server; a client's noise seed and data never leave its node.
"""

from lightning_dp.flower.app import write_app

__all__ = ["write_app"]
