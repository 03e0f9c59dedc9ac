"""Low-rank adapters (LoRA, Hu et al. 2022) on any network, injected by Hugging Face ``peft``.

:class:`LoRA` wraps a network: ``peft`` turns every module whose name ends with one of ``target_modules`` into a
LoRA layer (``B`` initialized to zero) and every other parameter is frozen. The adapters are ordinary ``nn.Linear``
layers, so the per-sample gradient engine hooks only them. Needs ``pip install "lightning-dp[lm]"``. The formula,
why ``peft``, an example: docs/fine_tuning.md, "LoRA adapters".
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

__all__ = ["LoRA"]


def _hf_model(network: nn.Module) -> Any:
    """The ``transformers`` model inside ``network`` (itself, or its ``model`` attribute as in :class:`GPT2`)."""
    for candidate in (network, getattr(network, "model", None)):
        if candidate is not None and hasattr(candidate, "config") and hasattr(candidate.config, "model_type"):
            return candidate
    return None


class LoRA(nn.Module):
    """``network`` with LoRA adapters on its ``target_modules``; only the adapters are trainable.

    Args:
        network: the model to adapt, with its (pretrained) weights loaded.
        rank: ``r``, the rank of each adapter.
        alpha: the adapter output is scaled by ``alpha / rank``.
        dropout: dropout on the adapter's input.
        target_modules: suffixes of the names of the modules to adapt (``["c_attn", "c_proj", "c_fc"]`` for
            every linear map of a GPT-2 block). None: ``peft``'s default for a ``transformers`` model (GPT-2:
            ``["c_attn"]``); required for other networks.

    Raises:
        ImportError: without ``peft``.
        ValueError: a bad rank, alpha or dropout, no ``target_modules`` for a network peft has no default
            for, or target modules that match nothing.
    """

    def __init__(self, network: nn.Module, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0,
                 target_modules: Optional[list[str]] = None) -> None:
        super().__init__()
        from lightning_dp.extras import require

        peft = require("peft", "lm", "LoRA")
        LoraConfig, inject_adapter_in_model = peft.LoraConfig, peft.inject_adapter_in_model
        if not isinstance(network, nn.Module):
            raise TypeError(f"network={network!r} must be a torch.nn.Module, e.g. lightning_dp.models.GPT2")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"LoRA: rank={rank!r} must be a positive integer (typically 4 to 64)")
        if not (isinstance(alpha, (int, float)) and alpha > 0):
            raise ValueError(f"LoRA: alpha={alpha!r} must be a number > 0 (the adapter is scaled by alpha / rank)")
        if not (isinstance(dropout, (int, float)) and 0 <= dropout < 1):
            raise ValueError(f"LoRA: dropout={dropout!r} must be in [0, 1)")
        hf = _hf_model(network)
        if target_modules is None:
            from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults

            model_type = getattr(getattr(hf, "config", None), "model_type", None)
            if model_type not in defaults:
                raise ValueError(
                    f"LoRA: target_modules=None needs a transformers model peft knows (got {type(network).__name__}); "
                    "pass the names of the layers to adapt, e.g. target_modules=['c_attn', 'c_proj', 'c_fc'] "
                    "(GPT-2) or the names of your nn.Linear layers")
            target_modules = list(defaults[model_type])
        names = [name for name, _ in network.named_modules()]
        unmatched = [t for t in target_modules if not any(n == t or n.endswith("." + t) for n in names)]
        if unmatched:
            raise ValueError(f"LoRA: target_modules {unmatched} match no module of {type(network).__name__}; its "
                             f"modules include {sorted({n.rsplit('.', 1)[-1] for n in names if n})[:12]}")
        # transformers' Conv1D (GPT-2) stores its weight as (d_in, d_out): peft needs to know
        conv1d = any(type(m).__name__ == "Conv1D" for n, m in network.named_modules()
                     if any(n == t or n.endswith("." + t) for t in target_modules))
        # peft annotates lora_alpha as int; it only uses alpha / r (LoraConfig is Any here: imported by require)
        config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout,
                            target_modules=list(target_modules), fan_in_fan_out=conv1d, bias="none")
        self.network = inject_adapter_in_model(config, network)
        self.rank, self.alpha, self.target_modules = rank, float(alpha), list(target_modules)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.network(*args, **kwargs)

    def adapter_parameters(self) -> int:
        """The number of trainable (adapter) parameters."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)
