"""Causal language models: a small GPT-2 built from a ``transformers`` config, and its LightningModule.

No weights are downloaded: :class:`GPT2` instantiates ``transformers.GPT2LMHeadModel`` from a
``GPT2Config`` of the given size (random initialization), with the vocabulary of the
DataModule (:class:`~lightning_dp.datamodules.WikiText2DataModule`). Its token embedding
and output layer are tied, and its positions come from ``wpe(arange(T))``, a table shared
by all examples: both are handled by the per-sample gradient engine (tied parameters with
cross terms; shared inputs expanded to the batch), so ``DPSGD`` trains it as it is.

``pip install lightning-dp[lm]`` installs ``transformers``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torchmetrics import MeanMetric

from lightning_dp.optim import build_optimizer, check_optimizer_choice

__all__ = ["CausalLanguageModel", "GPT2", "load_weights", "per_example_token_loss"]


class GPT2(nn.Module):
    """GPT-2 (Radford et al. 2019) from a ``transformers`` config: ``ids (B, T) -> logits (B, T, V)``.

    Args:
        vocab_size: V, the DataModule's vocabulary size.
        max_positions: the longest sequence (``n_positions``).
        embed_dim: ``n_embd``.
        num_layers: ``n_layer``.
        num_heads: ``n_head``.
        dropout: residual, embedding and attention dropout (``resid_pdrop``, ``embd_pdrop``,
            ``attn_pdrop``).
        checkpoint: weights to start from: a Lightning checkpoint of a :class:`CausalLanguageModel` that trained a
            GPT2 of the same size (its ``network.`` weights), or a plain state dict of this module
            (:func:`load_weights`). None: random initialization. Public pretraining followed by private
            fine-tuning (``examples/lm/``) starts here.
    """

    def __init__(self, vocab_size: int, max_positions: int = 128, embed_dim: int = 128, num_layers: int = 2,
                 num_heads: int = 2, dropout: float = 0.1, checkpoint: Optional[str] = None) -> None:
        super().__init__()
        from lightning_dp.extras import require

        transformers = require("transformers", "lm", "GPT2")
        GPT2Config, GPT2LMHeadModel = transformers.GPT2Config, transformers.GPT2LMHeadModel
        for name, value in (("vocab_size", vocab_size), ("max_positions", max_positions), ("embed_dim", embed_dim),
                            ("num_layers", num_layers), ("num_heads", num_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPT2: {name}={value!r} must be a positive integer")
        if embed_dim % num_heads:
            raise ValueError(f"GPT2: embed_dim={embed_dim} must be divisible by num_heads={num_heads}")
        if not 0 <= dropout < 1:
            raise ValueError(f"GPT2: dropout={dropout!r} must be in [0, 1)")
        config = GPT2Config(vocab_size=vocab_size, n_positions=max_positions, n_embd=embed_dim, n_layer=num_layers,
                            n_head=num_heads, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                            bos_token_id=1, eos_token_id=1, tie_word_embeddings=True)
        self.vocab_size, self.max_positions = vocab_size, max_positions
        self.model = GPT2LMHeadModel(config)
        if checkpoint is not None:
            load_weights(self, checkpoint)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits


def load_weights(network: nn.Module, path: str, prefix: str = "network.") -> None:
    """Loads ``network``'s weights from ``path``: a Lightning checkpoint of a module that holds the network as
    ``network`` (the keys under ``prefix``), or a plain state dict of ``network``. Every weight must match.

    Raises:
        MissingFileError: (a :class:`FileNotFoundError`) no file at ``path``; the message names the absolute path,
            the pretraining command that writes it and the fix.
        ValueError: weights missing or of other shapes (a checkpoint of another size or vocabulary), with the
            names.
    """
    from lightning_dp.checks import existing_file

    null = str(path) in ("None", "null")
    file = existing_file("checkpoint", path, owner=type(network).__name__, produced_by=(
        "the public pretraining of examples/lm/ (lightning-dp fit --config examples/lm/gpt2_public_pretrain.yaml, "
        "from the same working directory)"), hint=(
        "run it first, or set checkpoint to the file's path, or to null for random weights"
        + (" (in YAML: on the command line jsonargparse reads null as the string 'None' here)" if null else "")))
    state = torch.load(file, map_location="cpu", weights_only=True)
    weights = state.get("state_dict", state) if isinstance(state, dict) else state
    if any(k.startswith(prefix) for k in weights):
        weights = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
    own = network.state_dict()
    missing = sorted(set(own) - set(weights))
    shapes = sorted(k for k in set(own) & set(weights) if tuple(own[k].shape) != tuple(weights[k].shape))
    if missing or shapes:
        detail = "; ".join(f"{k}: {tuple(weights[k].shape)} in the file, {tuple(own[k].shape)} here"
                           for k in shapes[:3])
        raise ValueError(f"checkpoint={path!r} does not fit {type(network).__name__}: "
                         + (f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}; " if missing else "")
                         + (f"other shapes ({detail})" if shapes else "")
                         + ". Build the network with the size and vocabulary the checkpoint was trained with.")
    network.load_state_dict({k: weights[k] for k in own}, strict=True)


def per_example_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of each sample, shape ``(B,)`` (predicting ``ids[:, 1:]``)."""
    b, t, v = logits.shape
    losses = F.cross_entropy(logits[:, :-1].reshape(-1, v), ids[:, 1:].reshape(-1), reduction="none")
    return losses.view(b, t - 1).mean(1)


class CausalLanguageModel(LightningModule):
    """Next-token prediction on batches of token ids ``(B, T)``; DP-SGD ready.

    ``training_step`` returns the batch MEAN of the per-sample losses (each the mean over
    the sample's T - 1 predictions), as DP-SGD requires. Logged: ``val/loss`` and
    ``test/loss`` (mean token cross-entropy over the split, token-weighted) and
    ``val/perplexity``, ``test/perplexity`` (their exponential), and, unless
    ``log_nonprivate_metrics=False``, ``nonprivate/train_loss`` (exact, not covered by epsilon).

    Args:
        network: ``ids -> logits`` (e.g. :class:`GPT2`).
        lr: as :class:`~lightning_dp.models.ImageClassifier`.
        optimizer: as :class:`~lightning_dp.models.ImageClassifier` (``"sgd"``, ``"adam"`` or ``"adamwosm"``).
        momentum: as :class:`~lightning_dp.models.ImageClassifier`.
        log_nonprivate_metrics: log the exact training loss under ``nonprivate/``.
    """

    def __init__(self, network: nn.Module, lr: float = 1e-3, optimizer: str = "adam", momentum: float = 0.0,
                 log_nonprivate_metrics: bool = True) -> None:
        super().__init__()
        if not isinstance(network, nn.Module):
            raise TypeError(f"network={network!r} must be a torch.nn.Module, e.g. lightning_dp.models.GPT2")
        if not (isinstance(lr, (int, float)) and lr > 0):
            raise ValueError(f"lr={lr!r} must be a number > 0")
        check_optimizer_choice(optimizer, momentum)
        self.save_hyperparameters(ignore=["network"])
        self.network = network
        # token-mean losses of the evaluation splits (every sample has T - 1 predictions), synced over ranks
        self.val_loss, self.test_loss = MeanMetric(), MeanMetric()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.network(ids)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self(batch)
        if batch.shape[0] == 0:  # an empty Poisson batch: a zero loss still connected to the parameters
            return logits.sum() * 0.0
        loss = per_example_token_loss(logits, batch).mean()
        if self.hparams["log_nonprivate_metrics"]:  # exact statistic of the private batch: not covered by epsilon
            self.log("nonprivate/train_loss", loss, on_step=True, on_epoch=False, prog_bar=True,
                     batch_size=batch.shape[0])
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        if batch.shape[0]:
            self.val_loss.update(per_example_token_loss(self(batch), batch))

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        if batch.shape[0]:
            self.test_loss.update(per_example_token_loss(self(batch), batch))

    def _log_split(self, stage: str, metric: MeanMetric) -> None:
        if metric.update_count == 0:
            return
        loss = metric.compute().double()
        self.log(f"{stage}/loss", loss)
        self.log(f"{stage}/perplexity", loss.exp())
        metric.reset()

    def on_validation_epoch_end(self) -> None:
        self._log_split("val", self.val_loss)

    def on_test_epoch_end(self) -> None:
        self._log_split("test", self.test_loss)

    def configure_optimizers(self) -> Any:
        return build_optimizer(self.hparams["optimizer"], self.parameters(), lr=self.hparams["lr"],
                               momentum=self.hparams["momentum"])
