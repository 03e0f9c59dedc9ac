"""The federated round's checkpoint state: ``checkpoint["federated"]``, split into what may be uploaded and what
stays local (its ``"secret"`` dict).

Training progress (the rounds, the previous released step), the public seed, the parts' state and the clients'
ledgers are saved beside the model's weights, not in them, so that restoring the best weights does not rewind the
round. When the selection is secret, the ledgers (who took part) and the clients' parts' state go to the secret dict
with the noise seed (:class:`~lightning_dp.protocol.RunProtocol`); a public checkpoint is then stripped of them, and
training on from it is refused.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_dp.privacy.seeds import SECRET_KEY

__all__ = ["VERSION", "load_state", "refuse_missing_ledgers", "save_state"]

#: the version of the layout of checkpoint["federated"]
VERSION = 4


def save_state(rnd: Any, checkpoint: dict[str, Any]) -> None:
    """Write ``checkpoint["federated"]`` of the round ``rnd``."""
    parts = {kind: part.state_dict() for kind, part in rnd.parts().items()}
    secret: dict[str, Any] = rnd.protocol.state_dict()
    state = {"seed": rnd.seed, "rounds": int(rnd.rounds), "previous_step": rnd.previous_step.detach().cpu().clone(),
             "split_scored": bool(rnd.aggregator.scored), "version": VERSION}
    if rnd.selection_is_secret():
        # the ledgers show who took part (participations per client), which the client-level accountant's
        # amplification needs kept secret: local checkpoints only, like the noise seed; the server's accountant
        # (its history is a function of the rounds) stays public
        secret["ledger"] = rnd.ledger.state_dict()
        secret["parts"] = {kind: s for kind, s in parts.items() if kind != "server_privacy"}
        state["parts"] = {"server_privacy": parts["server_privacy"]}
    else:
        state["ledger"], state["parts"] = rnd.ledger.state_dict(), parts
    state[SECRET_KEY] = secret
    checkpoint["federated"] = state


def load_state(rnd: Any, state: dict[str, Any]) -> None:
    """Restore the round ``rnd`` from ``checkpoint["federated"]``."""
    secret = state.get(SECRET_KEY, {})
    ledger = state.get("ledger", secret.get("ledger"))
    step = rnd.private_step
    # a public checkpoint of a run whose selection is secret has no ledgers: training on from it (resume, or
    # load_from_checkpoint then fit) is refused when training starts (on_train_start); testing is fine
    step.ledgers_missing = ledger is None and (rnd.sanitizer.accountable or rnd.update.accountable)
    if step.ledgers_missing and rnd._trainer is not None and rnd.trainer.state.fn == "fit":
        refuse_missing_ledgers(rnd)  # a resume (ckpt_path): before Lightning restores anything else
    if ledger is not None:
        rnd.ledger.load_state_dict(ledger)
    rnd.seed = int(state["seed"])
    rnd.rounds.fill_(int(state["rounds"]))
    rnd.aggregator.scored = bool(state.get("split_scored", False))
    if state.get("previous_step") is not None:
        rnd.previous_step.copy_(state["previous_step"])
    parts = {**secret.get("parts", {}), **state.get("parts", {})}
    for kind, part in rnd.parts().items():
        part.load_state_dict(parts.get(kind, {}))
    # a public checkpoint, or one from before version 3 (its noise from the logged seed): a fresh secret seed
    rnd.protocol.load_state_dict(secret)


def refuse_missing_ledgers(rnd: Any) -> None:
    """Raise: the round was loaded from a public checkpoint without the clients' ledgers."""
    raise MisconfigurationException(
        f"{type(rnd).__name__}: the checkpoint holds no per-client ledger: it is a public checkpoint (the "
        "uploaded model/final.ckpt) of a run whose client selection is secret, stripped of who took part. "
        "Training on from it would restart the clients' privacy ledgers at zero while the rounds and the "
        "server's accountant continue. Resume from the run's local checkpoint (ModelCheckpoint's file), or start "
        "a new run from fresh weights.")
