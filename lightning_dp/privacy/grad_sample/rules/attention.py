"""``nn.MultiheadAttention`` (batch first or not, self- or cross-attention, ``kdim``/``vdim``, masks, dropout).

The projections run through ``F.linear`` (``out_proj``'s own forward never runs), so the rule claims the whole
module and watches those calls (:class:`_LinearTap`); the forward stays PyTorch's. ``add_bias_kv=True`` is
refused. How: docs/per_sample_gradients.md, "How the rules work".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dp.privacy.grad_sample.contributions import Dense, Factored, add_terms, position_terms, term_norms
from lightning_dp.privacy.grad_sample.registry import LayerRule, PerSampleGradientError, join_graph, register_rule

__all__ = ["MultiheadAttentionRule"]

def _error(text: str):
    return PerSampleGradientError(text)


def _locate(t: Tensor | None, params: dict[str, nn.Parameter]) -> tuple[str, int] | None:
    """(parameter name, first row) when ``t`` is one of ``params`` or a row block of one, else None."""
    if t is None:
        return None
    for name, p in params.items():
        if t is p:
            return name, 0
        if t._base is p and t.dim() == p.dim() and t.stride() == p.stride():
            offset = t.storage_offset() - p.storage_offset()
            if offset % p.stride(0) == 0:
                return name, offset // p.stride(0)
    return None


class _LinearTap:
    """Wraps ``F.linear`` while one ``nn.MultiheadAttention`` forward runs; records the calls on watched weights.

    Why a patch of ``torch.nn.functional.linear`` and not a ``TorchFunctionMode``: a mode
    sees ``F.multi_head_attention_forward`` as one call and is switched off while handling
    it, so the ``F.linear`` calls inside stay invisible. The functional looks ``linear`` up
    in its module's globals at call time, so replacing that name for the duration of the
    forward (and restoring it, even on error) intercepts exactly those calls.
    """

    def __init__(self, params: dict[str, nn.Parameter], calls: list[dict[str, Any]], anchor: Tensor) -> None:
        self.params, self.calls, self.anchor = params, calls, anchor
        self.original: Callable[..., Tensor] | None = None

    def __enter__(self) -> _LinearTap:
        original = self.original = F.linear

        def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
            out = original(x, weight, bias)
            where = _locate(weight, self.params)
            if where is None:
                return out
            if not out.requires_grad:
                out = join_graph(out, self.anchor)
            call = {"input": x.detach(), "weight": where, "bias": _locate(bias, self.params), "grad": None}

            def save(grad: Tensor, call: dict = call) -> None:
                call["grad"] = grad if call["grad"] is None else call["grad"] + grad

            out.register_hook(save)
            self.calls.append(call)
            return out

        F.linear = linear  # type: ignore[assignment]  # same signature as torch's, other parameter names
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.original is not None:
            F.linear = self.original


@register_rule(nn.MultiheadAttention)
class MultiheadAttentionRule(LayerRule):
    """Projections of ``nn.MultiheadAttention`` recorded at their ``F.linear`` calls."""

    claims_subtree = True

    def check(self, module, trainable):
        if any(n in trainable for n in ("bias_k", "bias_v")):
            raise _error("nn.MultiheadAttention(add_bias_kv=True) appends trainable key/value biases outside any "
                         "projection; their per-sample gradients are not supported: use add_bias_kv=False or freeze "
                         "bias_k and bias_v (requires_grad=False)")

    def check_dims(self, module, inputs, outputs, broadcast):
        if broadcast:
            raise _error("nn.MultiheadAttention on inputs shared by all examples (learned latents or queries without "
                         "a batch dimension) is not supported: expand them to the batch before the call "
                         "(lat.expand(B, -1, -1)) or freeze the layer")
        expected = 0 if module.batch_first else 1
        if inputs[0] != expected:
            raise _error(f"nn.MultiheadAttention(batch_first={module.batch_first}) sees the batch at dimension "
                         f"{inputs[0]} of its query, not {expected}")

    @contextlib.contextmanager
    def forward_context(self, module: nn.Module, extra: dict[str, Any]) -> Iterator[None]:
        params = {n: p for n, p in module.named_parameters()}
        extra["linear_calls"] = []
        anchor = torch.zeros((), requires_grad=True)
        # The engine freezes the weights while the module runs; in eval mode PyTorch would then take the fused
        # fast path (torch._native_multi_head_attention), which calls no F.linear: switch it off meanwhile.
        fastpath = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            with _LinearTap(params, extra["linear_calls"], anchor):
                yield
        finally:
            torch.backends.mha.set_fastpath_enabled(fastpath)

    def contributions(self, layer, records, batch_size):
        blocks: dict[str, list[tuple[int, Tensor, Tensor]]] = {}  # weight name -> (first row, go, x) per call
        biases: dict[str, list[tuple[int, Tensor, tuple[Tensor, Tensor]]]] = {}
        for r in records:
            if not r.extra["linear_calls"]:
                raise _error("nn.MultiheadAttention ran without its F.linear projections (a fused path this rule "
                             "does not see); its per-sample gradients are unknown")
            for call in r.extra["linear_calls"]:
                if call["grad"] is None:
                    continue
                # recorded by the rule itself, in the forward's dtype: cast as the engine casts its records
                x = self._per_example(call["input"], batch_size).to(layer.compute_dtype)
                go = self._per_example(call["grad"], batch_size).to(layer.compute_dtype) * r.scale
                name, row = call["weight"]
                blocks.setdefault(name, []).append((row, go, x))
                if call["bias"] is not None:
                    bname, brow = call["bias"]
                    biases.setdefault(bname, []).append((brow, go.sum(1), position_terms(term_norms(go))))
        out = {}
        for name, p in layer.trainable.items():
            if p.dim() == 2:
                parts = blocks.get(name)
                if not parts:
                    continue
                lefts = []
                for row, go, _ in parts:  # each call's gradient occupies its rows of the parameter
                    if row == 0 and go.shape[-1] == p.shape[0]:
                        lefts.append(go)
                        continue
                    left = go.new_zeros(*go.shape[:2], p.shape[0])
                    left[..., row:row + go.shape[-1]] = go
                    lefts.append(left)
                left = torch.cat(lefts, 1) if len(lefts) > 1 else lefts[0]
                right = torch.cat([x for _, _, x in parts], 1) if len(parts) > 1 else parts[0][2]
                out[name] = Factored(left, right, p.shape, instantiate_limit=layer.instantiate_limit)
            else:
                parts = biases.get(name)
                if not parts:
                    continue
                total = parts[0][1].new_zeros(batch_size, p.shape[0])
                terms = None  # each call's positions' terms (docs/per_sample_gradients.md, "Floating point")
                for row, g, t in parts:
                    total[:, row:row + g.shape[-1]] += g
                    terms = add_terms(terms, t)
                out[name] = Dense(total, terms=terms)
        return out

    @staticmethod
    def _per_example(t: Tensor, batch_size: int) -> Tensor:
        """``(L, N, F)`` or ``(L * N, F)`` inside ``F.multi_head_attention_forward`` -> ``(N, L, F)``."""
        if t.dim() == 3:
            return t.transpose(0, 1)
        if t.dim() == 2:
            return t.reshape(-1, batch_size, t.shape[-1]).transpose(0, 1)
        raise _error(f"unexpected projection input of shape {tuple(t.shape)} inside nn.MultiheadAttention")
