"""``nn.RNN``, ``nn.LSTM`` and ``nn.GRU``: any number of layers, bidirectional, batch first or not.

The fused kernel hides the gate pre-activations. In a recorded step the layer's forward therefore runs the
recurrence unrolled in plain tensor operations instead of the fused kernel (:class:`_Unrolled`), and the model's own
backward pass gives the pre-activations' gradients. Where the fused kernel runs anyway (packed sequences, autocast,
half precision, a compiled forward), the rule replays the recurrence after the backward pass (about one more
forward and backward) and pulls the recorded output gradients back through it; packed sequences are read from the
packing. Both run the same function (:func:`_unroll`), which runs an LSTM or GRU direction on an unpacked sequence
as one autograd node with its backward written out (:class:`_LSTMScan`, :class:`_GRUScan`) and anything else in
autograd's operators. Refused: inter-layer dropout in training,
``proj_size > 0``. Details: docs/per_sample_gradients.md, "How the rules work"."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence
from torch.autograd.function import once_differentiable
from torch.overrides import TorchFunctionMode

from lightning_dp.privacy.grad_sample.contributions import Dense, Factored, add_terms, position_terms, term_norms
from lightning_dp.privacy.grad_sample.registry import LayerRule, PerSampleGradientError, register_rule

__all__ = ["CellRule", "RecurrentRule"]


def _error(text: str):
    return PerSampleGradientError(text)


def _cell(mode: str, gi: Tensor, gh: Tensor | None, h: Tensor, c: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """One step of the recurrence (PyTorch's gate order) from the two pre-activations, or (``gh`` None: LSTM and
    RNN, which add them before any nonlinearity) from their sum ``gi``."""
    pre = gi if gh is None else gi + gh
    if mode == "LSTM":
        assert c is not None  # an LSTM step always carries its cell state
        i, f, g, o = pre.chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c
    if mode == "GRU":
        assert gh is not None  # the GRU's candidate gate multiplies gh by the reset gate: the two stay apart
        ir, iz, in_ = gi.chunk(3, -1)
        hr, hz, hn = gh.chunk(3, -1)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        n = torch.tanh(in_ + r * hn)
        return (1 - z) * n + z * h, None
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

    def check_dims(self, module, inputs, outputs, broadcast):
        # the recurrence runs along the time dimension: with the batch anywhere else it would run across examples,
        # which no per-example clipping bounds (an nn.LSTM(batch_first=False) fed (B, T, I) mixes the batch)
        expected = 0 if getattr(module, "batch_first", False) else 1
        if broadcast and module.num_layers * (2 if module.bidirectional else 1) > 1:
            # the engine gives the shared output's final states (layers * directions, 1, H) the batch at dimension 0,
            # where the replay reads them with the batch at dimension 1: one layer of one direction only
            raise _error(f"{type(module).__name__}(num_layers={module.num_layers}, bidirectional="
                         f"{module.bidirectional}) runs on a sequence shared by all examples, which is supported for "
                         "one unidirectional layer; expand the sequence to the batch first (seq.expand(B, -1, -1)), "
                         "or stack one-layer, one-direction layers")
        if not broadcast and inputs and inputs[0] is not None and inputs[0] != expected:
            raise _error(f"{type(module).__name__}(batch_first={getattr(module, 'batch_first', False)}) sees the "
                         f"batch at dimension {inputs[0]} of its input, not {expected}: its recurrence would run "
                         f"across examples. Pass batch_first={not getattr(module, 'batch_first', False)} or put the "
                         f"batch at dimension {expected}")

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
        sums: dict[tuple[int, ...], tuple[Tensor, Any]] = {}  # LSTM and RNN: bias_ih and bias_hh share their gradients
        for name, p in layer.trainable.items():
            parts = totals.get(name)
            if not parts:
                continue
            if name.startswith("weight"):
                left = torch.cat([a for a, _ in parts], 1) if len(parts) > 1 else parts[0][0]
                right = torch.cat([b for _, b in parts], 1) if len(parts) > 1 else parts[0][1]
                out[name] = Factored(left, right, p.shape, instantiate_limit=layer.instantiate_limit)
            else:
                key = tuple(id(a) for a, _ in parts)
                if key not in sums:
                    # the time steps' terms are the pre-activation gradients (docs/per_sample_gradients.md,
                    # "Floating point")
                    terms = None
                    for a, _ in parts:
                        terms = add_terms(terms, position_terms(term_norms(a)))
                    sums[key] = (sum(a.sum(1) for a, _ in parts), terms)
                total, terms = sums[key]
                out[name] = Dense(total, terms=terms)
        return out

    @contextlib.contextmanager
    def forward_context(self, module: nn.Module, extra: dict[str, Any]) -> Iterator[None]:
        # The recorded forward runs the recurrence unrolled (see _Unrolled) instead of the fused kernel
        with _Unrolled(self.mode(module), extra):
            yield

    @staticmethod
    def _replay(m, mode: str, r, batch_size: int) -> dict[str, tuple[Tensor, Tensor]]:
        """``{parameter name: (pre-activation gradients (B, T, G*H), inputs (B, T, ·))}`` of one call."""
        unrolled = r.extra.get("unrolled")
        # the forward ran unrolled: its backward left the pre-activations' gradients, per example unless the layer's
        # input is shared by all examples (its output is expanded to the batch after the layer: the gradients it
        # saw are summed over the batch), which the replay below handles from the expanded records
        if unrolled is not None and not r.broadcast and unrolled.batch == batch_size:
            return unrolled.found(r.scale)
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

        def weights(layer_index: int, d: int) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
            sfx = f"_l{layer_index}" + ("_reverse" if d else "")
            # in the records' dtype (at least float32, also under bf16-true weights)
            return tuple(getattr(m, n + sfx).detach().to(x.dtype) if m.bias or n.startswith("weight") else None
                         for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))  # type: ignore[return-value]

        with torch.enable_grad():
            outputs, pre, plan = _unroll(mode, x, h0, c0, weights, layers, dirs, valid)
            if packed:  # output leaves: the packed output (data, batch_sizes, sorted, unsorted), h_n, c_n
                g_data, g_states = r.grad_outputs[0], list(r.grad_outputs[4:])
                g_seq = None if g_data is None else pad_packed_sequence(
                    PackedSequence(g_data, _x_batch_sizes(r)), batch_first=True, total_length=x.shape[1])[0]
                given = [g_seq] + [g if g is None or order is None else g[order] for g in g_states]
            else:
                given = list(r.grad_outputs)
            cotangents = [g if g is not None else torch.zeros_like(o) for o, g in zip(outputs, given)]
            raw_grads = torch.autograd.grad(outputs, pre, cotangents, allow_unused=True)
        grads = [torch.zeros_like(t) if g is None else g for g, t in zip(raw_grads, pre)]
        return _found(plan, grads, back)


@register_rule(nn.RNNCell, nn.LSTMCell, nn.GRUCell)
class CellRule(RecurrentRule):
    """``nn.RNNCell``, ``nn.LSTMCell``, ``nn.GRUCell``: one step of a recurrence per call, each call one position of
    the cell's parameters (a decoder's loop calls it once a step). The gates' pre-activation gradients of a call come
    from its recorded input, state and output gradients through the step in plain operators (:func:`_cell`, the
    recurrent layers' own) and autograd; then the recurrent layers' factored form (``RecurrentRule.contributions``:
    the weights' factors over the calls, the biases' sums floored by the calls' terms). Before, the torch.func
    fallback replayed each example's call: exact, slower, and without a floor (docs/per_sample_gradients.md,
    "Floating point").

    ``nn.LSTMCell`` is refused: its cell state output also makes its hidden output inside the call, and in a loop
    that carries the state the output gradients the engine records for it are not those of its callers (a layer
    matrix case: norms 11 % off, the same through the torch.func fallback before this rule)."""

    def check(self, module, trainable):
        if isinstance(module, nn.LSTMCell):
            raise _error("nn.LSTMCell: its cell state output also computes its hidden output inside the call, and in a "
                         "loop that carries the state the engine's recorded output gradients of it are not its "
                         "callers' (per-sample norms 11 % off in a test): use nn.LSTM over the sequence (one call; "
                         "its state and gates as the recurrent rule handles them), or nn.GRUCell / nn.RNNCell")

    def check_dims(self, module, inputs, outputs, broadcast):
        if not broadcast and (inputs[0] != 0 or outputs[0] != 0):
            raise _error(f"sees the batch at dimension {inputs[0]}; {type(module).__name__} takes (batch, features) "
                         "inputs")

    #: a cell's input and outputs hold the batch (the recurrent layers' output-side probe is not needed)
    batch_from_output = False
    unbatched_outputs = False

    @staticmethod
    def mode(module: nn.Module) -> str:
        if isinstance(module, nn.GRUCell):
            return "GRU"
        return "RNN_TANH" if module.nonlinearity == "tanh" else "RNN_RELU"  # nn.LSTMCell: refused in check

    def forward_context(self, module: nn.Module, extra: dict[str, Any]) -> Any:
        return contextlib.nullcontext()  # the cell's own forward: nothing fused to unroll

    @staticmethod
    def _replay(m, mode: str, r, batch_size: int) -> dict[str, tuple[Tensor, Tensor]]:
        # (a bias's input is None: contributions reads only its pre-activation gradients)
        return _cell_call(m, mode, r, batch_size)  # type: ignore[return-value]


def _cell_call(m: nn.Module, mode: str, r, batch_size: int) -> dict[str, tuple[Tensor, Tensor | None]]:
    """``{parameter name: (pre-activation gradients (B, 1, G*H), input (B, 1, ·) or None)}`` of one call of an
    RNN or GRU cell."""
    x = r.input(0).detach()
    hx = r.args[1] if len(r.args) > 1 else r.kwargs.get("hx")
    h = (x.new_zeros(batch_size, m.hidden_size) if hx is None else hx).detach().to(x.dtype)

    # in the records' dtype (at least float32, also under bf16-true weights)
    def weight(name: str) -> Tensor | None:
        t = getattr(m, name, None)
        return None if t is None else t.detach().to(x.dtype)

    w_ih, w_hh = weight("weight_ih"), weight("weight_hh")
    assert w_ih is not None and w_hh is not None
    with torch.enable_grad():
        gi = torch.nn.functional.linear(x, w_ih, weight("bias_ih"))
        gh = torch.nn.functional.linear(h, w_hh, weight("bias_hh"))
        if mode == "GRU":  # the reset gate multiplies gh: the two pre-activations stay apart
            leaves = [gi.detach().requires_grad_(), gh.detach().requires_grad_()]
            out = _cell(mode, leaves[0], leaves[1], h, None)
        else:  # an RNN adds them before its nonlinearity: one gradient for both
            leaves = [(gi + gh).detach().requires_grad_()]
            out = _cell(mode, leaves[0], None, h, None)
        go = r.grad_outputs[0]
        raw = torch.autograd.grad(out[0], leaves, go if go is not None else torch.zeros_like(out[0]),
                                  allow_unused=True)
    grads = [(torch.zeros_like(t) if g is None else g)[:, None] for g, t in zip(raw, leaves)]
    d_ih, d_hh = (grads[0], grads[1]) if mode == "GRU" else (grads[0], grads[0])
    return {"weight_ih": (d_ih, x[:, None]), "weight_hh": (d_hh, h[:, None]), "bias_ih": (d_ih, None),
            "bias_hh": (d_hh, None)}


#: the fused recurrent operators (``torch._VF``) nn.RNN, nn.LSTM and nn.GRU call, by name -> their mode
_FUSED = {"lstm": "LSTM", "gru": "GRU", "rnn_tanh": "RNN_TANH", "rnn_relu": "RNN_RELU"}

#: a plan entry: (weight name, bias name, the input the weight multiplies (B, T, ·), where its pre-activation
#: gradients start in the list of pre-activations, and their count: 0 for one (B, T, G*H) tensor, T for one
#: (B, G*H) tensor per step)
_Plan = tuple[str, str, Tensor, int, int]


def _unroll(mode: str, x: Tensor, h0: Tensor, c0: Tensor | None,
            weights: Callable[[int, int], tuple[Tensor, Tensor, Tensor | None, Tensor | None]],
            layers: int, dirs: int, valid: Tensor | None) -> tuple[list[Tensor], list[Tensor], list[_Plan]]:
    """The recurrence in plain tensor operations: ``([output (B, T, D*H), h_n (B, L*D, H)(, c_n)], the
    pre-activations whose gradients make up the weights', the plan that maps them to parameters)``.

    ``x`` is batch first (B, T, I); ``h0`` and ``c0`` (B, L*D, H); ``valid`` (B, T) marks the steps of a padded
    batch of unequal lengths (None: all). One function for the replay after the backward and for the unrolled
    recorded forward, so that the two cannot differ.
    """
    lstm = mode == "LSTM"
    steps = x.shape[1]
    # LSTM and RNN add the two pre-activations (gi + gh) before any nonlinearity: their gradients are equal, so
    # the recurrent weight's is read from the input's (one tensor, not one per step); GRU's differ (r * hn)
    shared_pre = mode != "GRU"

    def tracked(t: Tensor) -> Tensor:  # a pre-activation whose gradient we ask for must be in the graph
        return t if t.requires_grad else t.detach().requires_grad_()

    pre: list[Tensor] = []  # every pre-activation whose gradient we need, flat
    plan: list[_Plan] = []
    finals_h: list[Tensor] = []
    finals_c: list[Any] = []  # cell states: LSTM only
    inp = x
    for layer_index in range(layers):
        outs = []
        for d in range(dirs):
            sfx = f"_l{layer_index}" + ("_reverse" if d else "")
            w_ih, w_hh, b_ih, b_hh = weights(layer_index, d)
            if shared_pre:  # both biases in gi: each step is then one addmm(gi_t, h, w_hh^T) (its gradient is gi's)
                bias = b_ih if b_hh is None else b_hh if b_ih is None else b_ih + b_hh
                gi = tracked(torch.nn.functional.linear(inp, w_ih, bias))  # (B, T, G*H)
                w_hh_t = w_hh.t()
            else:
                gi = tracked(torch.nn.functional.linear(inp, w_ih, b_ih))
            h = h0[:, layer_index * dirs + d]
            c = c0[:, layer_index * dirs + d] if c0 is not None else None  # c0: LSTM only
            if mode in ("LSTM", "GRU") and valid is None and steps and not torch.compiler.is_compiling():
                # the common case: the whole direction as one autograd node (_LSTMScan, _GRUScan: issue 53)
                if lstm:
                    assert c is not None
                    seq, h, c = _LSTMScan.apply(gi, h, c, w_hh, bool(d))
                    grads_of = [gi]  # both weights' pre-activation gradient (see shared_pre)
                else:
                    # the gradient of the zeros `probe` is the recurrent pre-activations' (gh, kept apart from gi:
                    # see shared_pre); a view of a scalar leaf, not a leaf itself: autograd would copy the gradient
                    # into .grad
                    probe = gi.new_zeros((), requires_grad=True).expand(gi.shape)
                    seq, h = _GRUScan.apply(gi, probe, h, w_hh, b_hh, bool(d))
                    grads_of = [gi, probe]
                outs.append(seq)
                finals_h.append(h)
                finals_c.append(c)
                prev = _states_before(seq.detach(), h0[:, layer_index * dirs + d].detach(), bool(d))
                plan.append(("weight_ih" + sfx, "bias_ih" + sfx, inp.detach(), len(pre), 0))
                plan.append(("weight_hh" + sfx, "bias_hh" + sfx, prev, len(pre) + len(grads_of) - 1, 0))
                pre.extend(grads_of)
                continue
            # one view per step, taken at once: the backward of unbind stacks the steps' gradients once,
            # where indexing gi[:, t] at every step gave each step's gradient as a zero-filled (B, T, G*H)
            # tensor added into gi's (T^2 traffic: 0.5 s of a 1 s profile of three LSTM steps, issue 53)
            gi_steps = gi.unbind(1)
            # filled in time order (reversed for the backward direction)
            hs: list[Any] = [None] * steps
            ghs: list[Any] = [None] * steps
            prevs: list[Any] = [None] * steps
            for t in (range(steps - 1, -1, -1) if d else range(steps)):
                prevs[t] = h.detach()
                if shared_pre:
                    h_new, c_new = _cell(mode, torch.addmm(gi_steps[t], h, w_hh_t), None, h, c)
                else:
                    ghs[t] = tracked(torch.nn.functional.linear(h, w_hh, b_hh))
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
            if shared_pre:  # the same pre-activation gradient as the input's (see shared_pre)
                plan.append(("weight_hh" + sfx, "bias_hh" + sfx, torch.stack(prevs, 1), len(pre) - 1, 0))
            else:
                plan.append(("weight_hh" + sfx, "bias_hh" + sfx, torch.stack(prevs, 1), len(pre), steps))
                pre.extend(ghs)
        inp = torch.cat(outs, -1) if dirs > 1 else outs[0]
    outputs = [inp, torch.stack(finals_h, 1)] + ([torch.stack(finals_c, 1)] if lstm else [])
    return outputs, pre, plan


def _states_before(seq: Tensor, h0: Tensor, reverse: bool) -> Tensor:
    """The hidden state before each step of one direction, batch first (B, T, H), from its outputs ``seq`` (B, T, H)
    and initial state ``h0`` (B, H): what the recurrent weight multiplies at each step."""
    start = h0.unsqueeze(1)
    return torch.cat([seq[:, 1:], start] if reverse else [start, seq[:, :-1]], 1)


class _LSTMScan(torch.autograd.Function):
    """One direction of one LSTM layer over all its steps, from the input pre-activations ``gi`` (B, T, 4H), both
    biases in them: ``(output (B, T, H), h_n (B, H), c_n (B, H))``; the backward gives the gradient of ``gi``, the
    gates' pre-activation gradients the per-sample gradients are made of (see :func:`_unroll`).

    Written by hand because the fused kernel (oneDNN's on a CPU) does not expose the gates' gradients, and the same
    recurrence in autograd's operators records about twenty nodes a step. Here a forward step is one matrix product
    and eight elementwise operators into buffers allocated once; the backward first forms, for all steps at once,
    what multiplies ``dc`` or ``dh`` into each gate's gradient (``g s_i'``, ``c_{t-1} s_f'``, ``i tanh'(g)``,
    ``tanh(c) s_o'``, and ``o tanh'(c)``: a few operators over the whole sequence, cheaper than the same arithmetic
    a step at a time, where each operator costs its dispatch), then runs one matrix product and four elementwise
    operators a step. PyTorch's gate order (i, f, g, o). Tests compare the outputs and all four gradients with
    autograd on the same recurrence (tests/privacy/test_grad_sample_edges.py); measured in docs/benchmarks.md.
    """

    @staticmethod
    def forward(ctx: Any, gi: Tensor, h0: Tensor, c0: Tensor, w_hh: Tensor, reverse: bool
                ) -> tuple[Tensor, Tensor, Tensor]:
        b, steps, g4 = gi.shape
        n = g4 // 4
        act = gi.new_empty(steps, b, g4)  # the gates' activations, time-major (one step's rows contiguous)
        cs = gi.new_empty(steps, b, n)  # the cell states
        tcs = gi.new_empty(steps, b, n)  # tanh of the cell states
        out = gi.new_empty(b, steps, n)
        w_t = w_hh.t()
        # every step's views taken at once (one call each instead of a dozen slicings a step)
        gates, sig_if, cell, sig_o = (act.unbind(0), act[..., :2 * n].unbind(0), act[..., 2 * n:3 * n].unbind(0),
                                      act[..., 3 * n:].unbind(0))
        in_gate, forget = act[..., :n].unbind(0), act[..., n:2 * n].unbind(0)
        inputs, c_steps, tc_steps, h_steps = gi.unbind(1), cs.unbind(0), tcs.unbind(0), out.unbind(1)
        h, c = h0, c0
        for t in (range(steps - 1, -1, -1) if reverse else range(steps)):
            torch.addmm(inputs[t], h, w_t, out=gates[t])
            sig_if[t].sigmoid_()
            cell[t].tanh_()
            sig_o[t].sigmoid_()
            c = torch.mul(forget[t], c, out=c_steps[t]).addcmul_(in_gate[t], cell[t])
            h = torch.mul(sig_o[t], torch.tanh(c, out=tc_steps[t]), out=h_steps[t])
        # the states before each step only where the recurrent weight's gradient is asked for (not in a recorded
        # step, whose weights are frozen): saving the output itself would refuse an in-place operation on it
        prev = _states_before(out, h0, reverse) if ctx.needs_input_grad[3] else None
        ctx.save_for_backward(act, cs, tcs, c0, w_hh, prev)
        ctx.reverse = reverse
        return out, h.clone(), c.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_out: Tensor, d_hn: Tensor, d_cn: Tensor) -> tuple[Tensor | None, ...]:
        act, cs, tcs, c0, w_hh, prev = ctx.saved_tensors
        steps, b, g4 = act.shape
        n = g4 // 4
        reverse = ctx.reverse
        # k: what multiplies dc (i, f, g) or dh (o) into each gate's pre-activation gradient
        k = torch.addcmul(act, act, act, value=-1.0)  # s (1 - s): the sigmoids' derivative
        g = act[..., 2 * n:3 * n]
        k[..., 2 * n:3 * n].sub_(g).add_(1.0)  # there g - g^2: - g + 1 makes tanh's derivative 1 - g^2
        k[..., :n].mul_(g)
        before = slice(1, None) if not reverse else slice(None, -1)  # the steps that have a previous cell state
        after = slice(None, -1) if not reverse else slice(1, None)
        k[before, :, n:2 * n].mul_(cs[after])
        k[0 if not reverse else -1, :, n:2 * n].mul_(c0)
        k[..., 2 * n:3 * n].mul_(act[..., :n])
        k[..., 3 * n:].mul_(tcs)
        o = act[..., 3 * n:]
        otd = torch.addcmul(o, o, tcs * tcs, value=-1.0)  # o tanh'(c): dh's share of dc
        d_pre = k.new_empty(b, steps, g4)  # batch first, as gi
        dh, dc = k.new_empty(b, n), k.new_empty(b, n)
        k_c, k_h = k[..., :3 * n].view(steps, b, 3, n).unbind(0), k[..., 3 * n:].unbind(0)
        f_steps, otd_steps, d_out_steps = act[..., n:2 * n].unbind(0), otd.unbind(0), d_out.unbind(1)
        pre_steps = d_pre.unbind(1)
        pre_c, pre_h = d_pre[..., :3 * n].view(b, steps, 3, n).unbind(1), d_pre[..., 3 * n:].unbind(1)
        dc_next = d_cn
        last = None
        for t in (range(steps) if reverse else range(steps - 1, -1, -1)):
            if last is None:
                torch.add(d_out_steps[t], d_hn, out=dh)
            else:
                torch.addmm(d_out_steps[t], last, w_hh, out=dh)
            torch.addcmul(dc_next, dh, otd_steps[t], out=dc)
            torch.mul(k_c[t], dc.unsqueeze(1), out=pre_c[t])
            torch.mul(k_h[t], dh, out=pre_h[t])
            dc_next = dc * f_steps[t]
            last = pre_steps[t]
        d_h0 = last @ w_hh if ctx.needs_input_grad[1] and last is not None else None
        d_c0 = dc_next if ctx.needs_input_grad[2] else None
        d_w = d_pre.reshape(-1, g4).t() @ prev.reshape(-1, n) if prev is not None else None
        return d_pre, d_h0, d_c0, d_w, None


class _GRUScan(torch.autograd.Function):
    """One direction of one GRU layer over all its steps (as :class:`_LSTMScan` for the LSTM), from the input
    pre-activations ``gi`` (B, T, 3H) with ``b_ih`` in them: ``(output (B, T, H), h_n (B, H))``. ``probe`` is a
    zero tensor shaped as ``gi`` that the forward does not read: its gradient is the recurrent pre-activations'
    (``gh = W_hh h + b_hh``), which the GRU keeps apart from ``gi``'s because the candidate gate multiplies ``gh_n``
    by the reset gate. A forward step is one matrix product and six elementwise operators; the backward forms each
    gate's factor for all steps at once (``dgi = dh' [K_r, K_z, K_n]``, ``dgh = dh' [K_r, K_z, K_n r]``), then
    runs one product and four elementwise operators a step. Tests: as the LSTM's."""

    @staticmethod
    def forward(ctx: Any, gi: Tensor, probe: Tensor, h0: Tensor, w_hh: Tensor, b_hh: Tensor | None, reverse: bool
                ) -> tuple[Tensor, Tensor]:
        b, steps, g3 = gi.shape
        n = g3 // 3
        gates = gi.new_empty(steps, b, g3)  # r, z (activations) and n, time-major
        gh_n = gi.new_empty(steps, b, n)  # W_hn h + b_hn, which the reset gate multiplies
        out = gi.new_empty(b, steps, n)
        gh = gi.new_empty(b, g3)
        diff = gi.new_empty(b, n)
        w_t = w_hh.t()
        rz_steps, r_steps, z_steps, n_steps = (gates[..., :2 * n].unbind(0), gates[..., :n].unbind(0),
                                               gates[..., n:2 * n].unbind(0), gates[..., 2 * n:].unbind(0))
        inputs, h_steps, ghn_steps = gi.unbind(1), out.unbind(1), gh_n.unbind(0)
        gh_rz, gh_last = gh[:, :2 * n], gh[:, 2 * n:]
        h = h0
        for t in (range(steps - 1, -1, -1) if reverse else range(steps)):
            if b_hh is None:
                torch.mm(h, w_t, out=gh)
            else:
                torch.addmm(b_hh, h, w_t, out=gh)
            x = inputs[t]
            torch.add(x[:, :2 * n], gh_rz, out=rz_steps[t]).sigmoid_()
            ghn_steps[t].copy_(gh_last)
            cand = torch.addcmul(x[:, 2 * n:], r_steps[t], gh_last, out=n_steps[t]).tanh_()
            torch.sub(h, cand, out=diff)
            h = torch.addcmul(cand, z_steps[t], diff, out=h_steps[t])
        # the states before each step: the update gate's factor (h - n), and the recurrent weight's gradient
        ctx.save_for_backward(gates, gh_n, _states_before(out, h0, reverse), w_hh)
        ctx.reverse, ctx.has_bias = reverse, b_hh is not None
        return out, h.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_out: Tensor, d_hn: Tensor) -> tuple[Tensor | None, ...]:
        gates, gh_n, prev, w_hh = ctx.saved_tensors  # prev: (B, T, H), the states before each step
        steps, b, g3 = gates.shape
        n = g3 // 3
        reverse = ctx.reverse
        r, z, cand = gates[..., :n], gates[..., n:2 * n], gates[..., 2 * n:]
        k = torch.empty_like(gates)  # dgi = dh' k, dh' the gradient of the step's new state
        k_r, k_z, k_n = k[..., :n], k[..., n:2 * n], k[..., 2 * n:]
        torch.mul(cand, cand, out=k_n).neg_().add_(1.0).mul_(1.0 - z)  # (1 - z)(1 - n^2)
        torch.addcmul(z, z, z, value=-1.0, out=k_z).mul_(prev.transpose(0, 1) - cand)  # z (1 - z)(h - n)
        torch.addcmul(r, r, r, value=-1.0, out=k_r).mul_(gh_n).mul_(k_n)  # r (1 - r) gh_n (1 - z)(1 - n^2)
        k_h = k.clone()  # dgh = dh' [k_r, k_z, k_n r]
        k_h[..., 2 * n:].mul_(r)
        d_gi = k.new_empty(b, steps, g3)
        d_gh = k.new_empty(b, steps, g3)
        k_steps, kh_steps = k.view(steps, b, 3, n).unbind(0), k_h.view(steps, b, 3, n).unbind(0)
        gi_steps, gh_steps = d_gi.view(b, steps, 3, n).unbind(1), d_gh.view(b, steps, 3, n).unbind(1)
        flat_gh, z_steps, d_out_steps = d_gh.unbind(1), z.unbind(0), d_out.unbind(1)
        buffers = (k.new_empty(b, n), k.new_empty(b, n))  # dh' of this step and of the one processed before
        dh = d_hn
        last = None
        for j, t in enumerate(range(steps) if reverse else range(steps - 1, -1, -1)):
            cur = buffers[j % 2]
            if last is None:
                torch.add(d_out_steps[t], d_hn, out=cur)
            else:  # the next step read this one's state through gh (W_hh) and through z h
                torch.addmm(d_out_steps[t], flat_gh[last], w_hh, out=cur).addcmul_(z_steps[last], dh)
            torch.mul(k_steps[t], cur.unsqueeze(1), out=gi_steps[t])
            torch.mul(kh_steps[t], cur.unsqueeze(1), out=gh_steps[t])
            dh, last = cur, t
        d_h0 = None
        if ctx.needs_input_grad[2] and last is not None:
            d_h0 = torch.addcmul(flat_gh[last] @ w_hh, z_steps[last], dh)
        d_w = d_gh.reshape(-1, g3).t() @ prev.reshape(-1, n) if ctx.needs_input_grad[3] else None
        d_b = d_gh.sum((0, 1)) if ctx.has_bias and ctx.needs_input_grad[4] else None
        return d_gi, d_gh, d_h0, d_w, d_b, None


def _found(plan: list[_Plan], grads: list[Tensor], back: Tensor | None) -> dict[str, tuple[Tensor, Tensor]]:
    """The plan's ``{parameter name: (pre-activation gradients (B, T, G*H), inputs (B, T, ·))}``; ``back`` puts
    rows sorted by a packing back in the batch's order."""
    found: dict[str, tuple[Tensor, Tensor]] = {}
    for wname, bname, right, start, per_step in plan:
        g = torch.stack(grads[start:start + per_step], 1) if per_step else grads[start]
        if back is not None:
            g, right = g[back], right[back]
        found[wname] = (g, right)
        found[bname] = (g, right)
    return found


class _UnrolledCall:
    """The pre-activations' gradients of one unrolled recorded forward, filled by tensor hooks in the backward.

    Holds no tensor of the graph (only the plan's detached inputs and the gradients), so that nothing kept here
    ties the graph to the engine's records in a reference cycle."""

    def __init__(self, plan: list[_Plan], pre: list[Tensor], batch: int) -> None:
        self.plan, self.batch = plan, batch
        self.like = [(t.shape, t.dtype, t.device) for t in pre]
        self.grads: list[Tensor | None] = [None] * len(pre)
        for i, t in enumerate(pre):
            t.register_hook(functools.partial(_UnrolledCall._store, self.grads, i))

    @staticmethod
    def _store(grads: list[Tensor | None], i: int, grad: Tensor) -> None:
        have = grads[i]
        grads[i] = grad if have is None else have + grad

    def found(self, scale: float | Tensor) -> dict[str, tuple[Tensor, Tensor]]:
        grads = [torch.zeros(shape, dtype=dtype, device=device) if g is None else g
                 for g, (shape, dtype, device) in zip(self.grads, self.like)]
        if not (isinstance(scale, float) and scale == 1.0):
            grads = [g * scale for g in grads]
        return _found(self.plan, grads, None)


class _Unrolled(TorchFunctionMode):
    """Active while a recorded nn.RNN/LSTM/GRU runs: its fused operator (``torch._VF.lstm`` ...) is replaced by the
    same recurrence unrolled in plain tensor operations (:func:`_unroll`), so that the model's own backward pass
    yields the gate pre-activations' gradients (caught by tensor hooks) and the replay after the backward is not
    needed. The fused kernel's forward and backward cost about what the replay costs (one thread, the benchmark's
    LSTM: 35 ms of a 98 ms private step), so this saves about one forward and backward of the layer.

    Only the common case is unrolled; the rest runs the fused kernel and is replayed after the backward: a packed
    input (the other overload), dtypes other than float32 and float64 (the fused kernel's rounding in half
    precision is not what a replay in it would give), autocast, Dynamo tracing the layer, inter-layer dropout in
    training (refused by the rule anyway). A layer on an input shared by all examples runs unrolled too but is
    replayed after the backward (its hooks see the batch's summed gradient, see ``_replay``). The output is the
    fused kernel's up to rounding (a different order of summation); gradients are exact for the computation that
    ran.
    """

    def __init__(self, mode: str, extra: dict[str, Any]) -> None:
        super().__init__()
        self.mode, self.extra = mode, extra

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _FUSED.get(getattr(func, "__name__", "")) != self.mode or kwargs or len(args) != 9 \
                or not isinstance(args[3], bool):  # the packed overload: (data, batch_sizes, hx, params, ...)
            return func(*args, **kwargs)
        x, hx, params, has_biases, layers, dropout, train, bidirectional, batch_first = args
        lstm = self.mode == "LSTM"
        h0, c0 = hx if lstm else (hx, None)
        tensors = [x, h0, *params] + ([c0] if lstm else [])
        if not torch.is_grad_enabled() or (dropout > 0 and train) or torch.compiler.is_compiling() \
                or x.dtype not in (torch.float32, torch.float64) or any(t.dtype != x.dtype for t in tensors) \
                or torch.is_autocast_enabled(x.device.type) or torch.is_autocast_enabled("cpu"):
            return func(*args, **kwargs)
        if "unrolled" in self.extra:
            raise PerSampleGradientError(f"{self.mode}'s fused operator ran twice in one call of the module; "
                                         "call the recurrent module once per fused operator")
        dirs = 2 if bidirectional else 1
        stride = 4 if has_biases else 2

        def weights(layer_index: int, d: int) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
            k = (layer_index * dirs + d) * stride
            w = params[k:k + stride]
            return (w[0], w[1], w[2], w[3]) if has_biases else (w[0], w[1], None, None)

        xb = x if batch_first else x.transpose(0, 1)
        outputs, pre, plan = _unroll(self.mode, xb, h0.transpose(0, 1), c0.transpose(0, 1) if lstm else None,
                                     weights, layers, dirs, None)
        self.extra["unrolled"] = _UnrolledCall(plan, pre, xb.shape[0])
        seq = outputs[0] if batch_first else outputs[0].transpose(0, 1).contiguous()
        states = [s.transpose(0, 1).contiguous() for s in outputs[1:]]  # (L*D, B, H), as the fused operator's
        return (seq, *states)


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
    #: Opacus' cells call no fused operator: nothing to unroll, the replay after the backward runs
    forward_context = LayerRule.forward_context

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
