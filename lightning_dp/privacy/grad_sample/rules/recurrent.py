"""``nn.RNN``, ``nn.LSTM`` and ``nn.GRU``: any number of layers, bidirectional, batch first or not.

The fused kernel hides the gate pre-activations, so the rule replays the recurrence after the backward pass
(about one more forward and backward) and pulls the recorded output gradients back through it; packed sequences
are read from the packing. Refused: inter-layer dropout in training, ``proj_size > 0``. Details:
docs/per_sample_gradients.md, "How the rules work".
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from lightning_dp.privacy.grad_sample.contributions import Dense, Factored
from lightning_dp.privacy.grad_sample.registry import LayerRule, PerSampleGradientError, register_rule

__all__ = ["RecurrentRule"]


def _error(text: str):
    return PerSampleGradientError(text)


def _cell(mode: str, gi: Tensor, gh: Tensor, h: Tensor, c: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """One step of the recurrence from the two pre-activations (PyTorch's gate order)."""
    if mode == "LSTM":
        assert c is not None  # an LSTM step always carries its cell state
        i, f, g, o = (gi + gh).chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c
    if mode == "GRU":
        ir, iz, in_ = gi.chunk(3, -1)
        hr, hz, hn = gh.chunk(3, -1)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        n = torch.tanh(in_ + r * hn)
        return (1 - z) * n + z * h, None
    pre = gi + gh
    return (torch.tanh(pre) if mode == "RNN_TANH" else torch.relu(pre)), None


@register_rule(nn.RNN, nn.LSTM, nn.GRU)
class RecurrentRule(LayerRule):
    """Replay of the recurrence (see the module docstring)."""

    def check(self, module, trainable):
        if getattr(module, "proj_size", 0):
            raise _error("nn.LSTM(proj_size > 0) is not supported; use proj_size=0 and an nn.Linear after the LSTM")
        if module.dropout > 0:
            raise _error(f"{type(module).__name__}(dropout={module.dropout}) draws dropout masks between its layers "
                         "inside the fused kernel, which the per-sample replay cannot reproduce; stack one-layer "
                         f"{type(module).__name__}s with nn.Dropout between them, or set dropout=0")

    #: a packed input has no batch dimension (with enforce_sorted=True no input leaf has one): the final states do
    batch_from_output = True
    #: the packed output's gradient has no batch dimension either: the replay reads it through the packing
    unbatched_outputs = True

    @staticmethod
    def mode(module: nn.Module) -> str:
        """PyTorch's name of the recurrence: ``"LSTM"``, ``"GRU"``, ``"RNN_TANH"`` or ``"RNN_RELU"``."""
        return str(module.mode)

    def contributions(self, layer, records, batch_size):
        m = layer.module
        totals: dict[str, list] = {}
        for r in records:
            for name, (left, right) in self._replay(m, self.mode(m), r, batch_size).items():
                totals.setdefault(name, []).append((left, right))
        out = {}
        for name, p in layer.trainable.items():
            parts = totals.get(name)
            if not parts:
                continue
            if name.startswith("weight"):
                left = torch.cat([a for a, _ in parts], 1) if len(parts) > 1 else parts[0][0]
                right = torch.cat([b for _, b in parts], 1) if len(parts) > 1 else parts[0][1]
                out[name] = Factored(left, right, p.shape, instantiate_limit=layer.instantiate_limit)
            else:
                out[name] = Dense(sum(a.sum(1) for a, _ in parts))
        return out

    @staticmethod
    def _replay(m, mode: str, r, batch_size: int) -> dict[str, tuple[Tensor, Tensor]]:
        """``{parameter name: (pre-activation gradients (B, T, G*H), inputs (B, T, ·))}`` of one call."""
        x = r.input(0)
        hx = r.args[1] if len(r.args) > 1 else r.kwargs.get("hx", r.kwargs.get("state_init"))
        lstm = mode == "LSTM"
        dirs = 2 if m.bidirectional else 1
        layers, hidden = m.num_layers, m.hidden_size
        packed = isinstance(x, PackedSequence)
        order = back = valid = None  # packed: the sorted order, its inverse, the valid (example, step) pairs
        if packed:
            order, back = x.sorted_indices, x.unsorted_indices
            x, lengths = pad_packed_sequence(PackedSequence(x.data, x.batch_sizes), batch_first=True)
            valid = torch.arange(x.shape[1], device=x.device)[None, :] < lengths.to(x.device)[:, None]  # (B, T)
        x = x.detach()  # (B, T, I), batch first after the engine's normalization (packed: in the sorted order)
        if hx is None:
            h0 = x.new_zeros(batch_size, layers * dirs, hidden)
            c0 = h0 if lstm else None
        elif lstm:
            h0, c0 = hx  # each (B, layers * dirs, H)
        else:
            h0, c0 = hx, None
        if order is not None:  # the initial states are given in the batch's order
            h0 = h0[order]
            c0 = c0[order] if c0 is not None else None
        steps = x.shape[1]
        # LSTM and RNN add the two pre-activations (gi + gh) before any nonlinearity: their gradients are equal, so
        # the recurrent weight's is read from the input's (one tensor, not one per step); GRU's differ (r * hn)
        shared_pre = True if mode != "GRU" else None

        def tracked(t: Tensor) -> Tensor:  # a pre-activation whose gradient we ask for must be in the graph
            return t if t.requires_grad else t.detach().requires_grad_()

        pre: list[Tensor] = []  # every pre-activation whose gradient we need, flat
        # (weight, bias, the input it multiplies, where its pre-activations start in `pre`, and their count: one
        # (B, T, G*H) tensor (count 0), or one (B, G*H) per step)
        plan: list[tuple[str, str, Tensor, int, int]] = []  # ..., start and count of its entries in `pre`
        finals_h: list[Tensor] = []
        finals_c: list[Any] = []  # cell states: LSTM only
        inp = x
        with torch.enable_grad():
            for layer_index in range(layers):
                outs = []
                for d in range(dirs):
                    sfx = f"_l{layer_index}" + ("_reverse" if d else "")
                    # in the records' dtype (at least float32, also under bf16-true weights)
                    w_ih = getattr(m, "weight_ih" + sfx).detach().to(x.dtype)
                    w_hh = getattr(m, "weight_hh" + sfx).detach().to(x.dtype)
                    b_ih = getattr(m, "bias_ih" + sfx).detach().to(x.dtype) if m.bias else None
                    b_hh = getattr(m, "bias_hh" + sfx).detach().to(x.dtype) if m.bias else None
                    gi = tracked(torch.nn.functional.linear(inp, w_ih, b_ih))  # (B, T, G*H)
                    # one view per step, taken at once: the backward of unbind stacks the steps' gradients once,
                    # where indexing gi[:, t] at every step gave each step's gradient as a zero-filled (B, T, G*H)
                    # tensor added into gi's (T^2 traffic: 0.5 s of a 1 s profile of three LSTM steps, issue 53)
                    gi_steps = gi.unbind(1)
                    h = h0[:, layer_index * dirs + d]
                    c = c0[:, layer_index * dirs + d] if c0 is not None else None  # c0: LSTM only
                    # filled in time order (reversed for the backward direction)
                    hs: list[Any] = [None] * steps
                    ghs: list[Any] = [None] * steps
                    prevs: list[Any] = [None] * steps
                    for t in (range(steps - 1, -1, -1) if d else range(steps)):
                        prevs[t] = h.detach()
                        gh = torch.nn.functional.linear(h, w_hh, b_hh)
                        ghs[t] = tracked(gh) if shared_pre is None else gh
                        h_new, c_new = _cell(mode, gi_steps[t], ghs[t], h, c)
                        if valid is not None:  # a finished (or, reversed, not yet started) sequence keeps its state
                            keep = valid[:, t:t + 1]
                            h_new = torch.where(keep, h_new, h)
                            c_new = torch.where(keep, c_new, c) if c is not None and c_new is not None else c_new
                            hs[t] = torch.where(keep, h_new, torch.zeros_like(h_new))
                        else:
                            hs[t] = h_new
                        h, c = h_new, c_new
                    outs.append(torch.stack(hs, 1))
                    finals_h.append(h)
                    finals_c.append(c)
                    plan.append(("weight_ih" + sfx, "bias_ih" + sfx, inp.detach(), len(pre), 0))
                    pre.append(gi)
                    if shared_pre is None:
                        plan.append(("weight_hh" + sfx, "bias_hh" + sfx, torch.stack(prevs, 1), len(pre), steps))
                        pre.extend(ghs)
                    else:  # the same pre-activation gradient as the input's (see shared_pre)
                        plan.append(("weight_hh" + sfx, "bias_hh" + sfx, torch.stack(prevs, 1), len(pre) - 1, 0))
                inp = torch.cat(outs, -1) if dirs > 1 else outs[0]
            outputs = [inp, torch.stack(finals_h, 1)] + ([torch.stack(finals_c, 1)] if lstm else [])
            if packed:  # output leaves: the packed output (data, batch_sizes, sorted, unsorted), h_n, c_n
                g_data, g_states = r.grad_outputs[0], list(r.grad_outputs[4:])
                g_seq = None if g_data is None else pad_packed_sequence(
                    PackedSequence(g_data, _x_batch_sizes(r)), batch_first=True, total_length=steps)[0]
                given = [g_seq] + [g if g is None or order is None else g[order] for g in g_states]
            else:
                given = list(r.grad_outputs)
            cotangents = [g if g is not None else torch.zeros_like(o) for o, g in zip(outputs, given)]
            raw_grads = torch.autograd.grad(outputs, pre, cotangents, allow_unused=True)
        grads = [torch.zeros_like(t) if g is None else g for g, t in zip(raw_grads, pre)]
        found: dict[str, tuple[Tensor, Tensor]] = {}
        for wname, bname, right, start, per_step in plan:
            g = torch.stack(grads[start:start + per_step], 1) if per_step else grads[start]
            if back is not None:  # rows in the batch's order again
                g, right = g[back], right[back]
            found[wname] = (g, right)
            found[bname] = (g, right)
        return found


def _x_batch_sizes(r: Any) -> Tensor:
    """The ``batch_sizes`` of a record's packed input (the packing of its output too)."""
    return r.input(0).batch_sizes


@register_rule("opacus.layers.dp_rnn.DPRNNBase")  # by name: Opacus is not imported for this
class DPRecurrentRule(RecurrentRule):
    """Opacus' ``DPRNN``, ``DPGRU`` and ``DPLSTM``: the same recurrences as PyTorch's, written as cells of
    ``nn.Linear`` maps (``ih``, ``hh``) that run once per time step. Their parameters carry PyTorch's names too
    (Opacus' ``RenameParamsMixin``: ``weight_ih_l0`` ...), so the whole module is replayed as PyTorch's recurrent
    layers are, padded or packed: one rule for both, where per-step cells on a packed sequence see batches of
    shrinking size that no batch dimension describes."""

    claims_subtree = True

    @staticmethod
    def mode(module: nn.Module) -> str:
        name = type(module).__name__
        if "LSTM" in name:
            return "LSTM"
        if "GRU" in name:
            return "GRU"
        params: dict[str, Any] = getattr(module, "cell_params", {})
        return "RNN_RELU" if params.get("nonlinearity") == "relu" else "RNN_TANH"

    def check(self, module, trainable):
        if type(module).__name__ not in ("DPRNN", "DPGRU", "DPLSTM"):
            raise _error(f"{type(module).__name__} (a DPRNNBase with a custom cell) is not supported: use DPRNN, "
                         "DPGRU or DPLSTM, or nn.RNN/GRU/LSTM")
        super().check(module, trainable)
