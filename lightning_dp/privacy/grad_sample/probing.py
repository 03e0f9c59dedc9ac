"""Where every hooked layer holds the batch, established by probing (the engine's first step).

:class:`BatchDimProbe` is the part of :class:`~lightning_dp.privacy.grad_sample.engine.GradSampleEngine` that runs the
model on nested probe batches, reads which dimension follows the number of examples, accepts a layer on inputs
shared by all examples only as a checked broadcast, and refuses what cannot be clipped per example.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_dp.privacy.batch_dims import PROBE_SIZES, AmbiguousBatchDimError, batch_dim, tensor_leaves
from lightning_dp.privacy.grad_sample.registry import PerSampleGradientError

if TYPE_CHECKING:
    from lightning_dp.privacy.grad_sample.engine import _Layer

__all__ = ["INDEPENDENCE_PROBE", "BatchDimProbe"]

#: The two probe batches of :meth:`BatchDimProbe.probe`'s independence check: the indices of the examples of one
#: fixed sequence each holds. One size, so that every random draw of the step has one shape; the first
#: :data:`INDEPENDENT_COMMON` examples in both, the others different.
INDEPENDENCE_PROBE: tuple[tuple[int, ...], tuple[int, ...]] = ((0, 1, 2, 3, 4, 5, 6), (0, 1, 2, 7, 8, 9, 10))
INDEPENDENT_COMMON = 3


@dataclass(frozen=True)
class _Dims:
    """Where one layer's calls hold the batch: per input leaf (args then kwargs) and per output leaf."""

    inputs: tuple[int | None, ...]
    outputs: tuple[int | None, ...]
    input_ranks: tuple[int | None, ...]


def _differentiable_target(result: Any) -> Tensor | None:
    """What the probe's gradient checks differentiate: a mapping's ``"loss"`` entry when it has one (what Lightning
    trains on when ``training_step`` returns a dict), else the first 0-dim floating tensor of ``result`` that
    requires grad (the loss), else the sum of the first such tensor (per-example losses, logits); None when there
    is none."""
    if isinstance(result, Mapping) and isinstance(result.get("loss"), Tensor):
        result = result["loss"]
    leaves = [t for t in tensor_leaves(result) if t.is_floating_point() and t.requires_grad]
    scalar = next((t for t in leaves if t.dim() == 0), None)
    if scalar is not None:
        return scalar
    return leaves[0].sum() if leaves else None


class BatchDimProbe:
    """The probing half of the engine (the engine's hooks record what the probe runs see)."""

    module: nn.Module
    layers: list[_Layer]
    _recording: bool
    _probing: bool
    _probed: bool
    _probe_half: bool
    _broadcasting: set[int]
    _captured: dict[int, list[list[tuple[int, Tensor]]]]
    _captured_inputs: dict[int, list[list[tuple[int, Tensor]]]]
    _inputs_rows: int
    _batch: int | None

    def probe(self, run: Callable[[int], Any], sizes: Sequence[int] = PROBE_SIZES,
              examples: Callable[[list[int]], Any] | None = None) -> None:
        """Establishes where every hooked layer's inputs and outputs hold the batch.

        Calls ``run(n)`` for every ``n`` in ``sizes``, possibly twice; each call must run the
        forward pass of a batch of ``n`` examples exactly as training does (autograd enabled;
        no backward pass is needed), return its result (the loss, the model's output), and be
        deterministic: the same examples and random draws for the same ``n``. The shapes
        seen by every layer then say which dimension follows the number of examples
        (:func:`~lightning_dp.privacy.batch_dims.batch_dim`); per-sample gradients are
        computed along it and every training step is checked against it.

        ``run(n)`` must use the first ``n`` examples of one fixed sequence (nested batches:
        the batch of 3 is the start of the batch of 5); the check of broadcast layers below
        compares what the common examples receive.

        A layer whose inputs have no batch dimension at all (a positional embedding of
        ``torch.arange(T)``, shared by every example) is then tried as a *broadcast* layer:
        its output is expanded to a batch of identical views during the forward, so that
        each example's gradient flows through its own slice. This is accepted only if
        (1) ``run`` returns the same result with and without the expansion, and (2) in a
        further run with the module in eval mode (no dropout), the gradient of the result
        that reaches slice ``b`` of the expanded output belongs to example ``b``: for the
        examples common to all probe batches it is the same in every batch up to one factor
        per batch (the loss's mean), and the examples only the largest batch holds receive
        some of it. An output that is indexed (``pos[0]``), reduced (``pos.mean(0)``) or
        computed once per example in a Python loop fails this and the layer is refused.

        ``examples(indices)``, when given, runs the same forward pass on the examples of
        those indices of the same fixed sequence, in the order given (``run(n)`` is
        ``examples(list(range(n)))``). The probe then also checks that no example's gradient
        depends on the other examples of its batch (:meth:`_check_independent`): it runs the
        two batches of :data:`INDEPENDENCE_PROBE` (one size, the first three examples in both),
        which ``examples`` must run from the same random state, with the dropout modules off;
        for the three common examples each layer's inputs must be the same in both, and the
        gradients of the result (a dict's ``"loss"``) with respect to each layer's outputs the
        same up to one factor per batch (a mean's, a weighted mean's). A loss that mixes the
        examples (an in-batch contrastive loss, logits centred on the batch mean, mixup) fails
        this. ``examples`` may return None to have the check skipped (DPSGD's does where the
        collated batches cannot be compared).

        Must be called before :meth:`per_sample_norms`, and again after the model's
        structure changes.

        Raises:
            PerSampleGradientError: If a layer's input has no batch dimension and cannot be
                broadcast, the batch is folded into another dimension (``(B*T, d)``), several
                dimensions follow the batch, a layer's calls disagree on where the batch is, or
                (with ``examples``) an example's gradient depends on the batch's other examples.

        Example:
            >>> from lightning_dp.privacy.grad_sample import GradSampleEngine
            >>> model = torch.nn.Linear(4, 2)
            >>> engine = GradSampleEngine(model)
            >>> x = torch.randn(10, 4)
            >>> engine.probe(lambda n: model(x[:n]))
            >>> engine.remove()
        """
        sizes = tuple(int(n) for n in sizes)
        if len(set(sizes)) != len(sizes) or len(sizes) < 2 or min(sizes) < 2:
            raise ValueError(f"sizes={sizes} must hold at least two distinct numbers of examples >= 2")
        if self._recording:
            raise PerSampleGradientError("probe() cannot run while a step is being recorded")
        for layer in self.layers:
            layer.broadcast = False
        self._probe_half = False
        plain = self._probe_round(run, sizes, set())
        candidates: list[_Layer] = []
        for layer in self.layers:
            layer.dims = self._establish(layer, sizes)
            if layer.dims is not None and all(d is None for d in (*layer.dims.inputs, *layer.dims.outputs)):
                candidates.append(layer)
        if candidates:
            ids = {id(layer) for layer in candidates}
            failure = ""
            try:
                expanded = self._probe_round(run, sizes, ids)
            except Exception as err:  # noqa: BLE001  (the expanded output does not fit the model: not a broadcast)
                expanded, failure = None, f" ({type(err).__name__}: {err})"
            # NaN where the plain run has NaN (a broken example among the probe's) is the same result
            same = plain is not None and expanded is not None and all(
                len(a) == len(b) and all(x.shape == y.shape
                                         and torch.allclose(x, y, rtol=1e-5, atol=1e-7, equal_nan=True)
                                         for x, y in zip(a, b)) for a, b in zip(plain, expanded))
            if not same:
                self._refuse_unbatched(candidates[0], sizes, (
                    "the model's result changes when its output is broadcast to the batch" + failure)
                    if plain is not None else "the probe function returned nothing to compare")
            for layer in candidates:
                layer.broadcast = True
                layer.dims = self._establish(layer, sizes)  # the expanded outputs now follow the batch
            grads = self._gradient_round(run, sizes, ids, ids)
            for layer in candidates:
                self._verify_broadcast(layer, sizes, grads.get(id(layer), []))
        for layer in self.layers:
            self._validate_dims(layer, sizes)
            layer.probe_calls = []
        if examples is not None:
            self._check_independent(examples)
        self._probed = True

    def _probe_round(self, run: Callable[[int], Any], sizes: tuple[int, ...],
                     broadcast: set[int]) -> list[list[Tensor]] | None:
        for layer in self.layers:
            layer.probe_calls = []
        results: list[list[Tensor]] | None = []
        self._probing, self._broadcasting = True, broadcast
        try:
            for n in sizes:
                for layer in self.layers:
                    layer.probe_calls.append([])
                self._batch = n
                with torch.enable_grad():
                    out = run(n)
                leaves = [t.detach() for t in tensor_leaves(out)]
                if not leaves or results is None:
                    results = None
                else:
                    results.append(leaves)
        finally:
            self._probing, self._broadcasting, self._batch = False, set(), None
        return results

    def _gradient_round(self, run: Callable[[int], Any], sizes: tuple[int, ...], broadcast: set[int],
                        captured_ids: set[int]) -> dict[int, list[list[list[tuple[int, Tensor]]] | None]]:
        """Runs the probes once more in eval mode (no dropout) with the ``broadcast`` layers expanded.

        Returns, per layer id in ``captured_ids`` (the broadcast layers among them), per probe size, per call, the
        gradient of the probe's result (:func:`_differentiable_target`) with respect to each (expanded) output leaf
        that requires grad, as ``(the leaf's index among the call's output leaves, gradient)``; None for a size whose
        result cannot be differentiated.
        """
        modes = [(m, m.training) for m in self.module.modules()]
        found: dict[int, list[list[list[tuple[int, Tensor]]] | None]] = {i: [] for i in captured_ids}
        self.module.eval()
        try:
            for n in sizes:
                self._captured = {i: [] for i in captured_ids}
                self._probing, self._broadcasting, self._batch = True, broadcast, n
                try:
                    with torch.enable_grad():
                        target = _differentiable_target(run(n))
                finally:
                    self._probing, self._broadcasting, self._batch = False, set(), None
                captured = [(i, j, k, t) for i, calls in self._captured.items() for j, leaves in enumerate(calls)
                            for k, (_, t) in enumerate(leaves)]
                if target is None:
                    for i in captured_ids:
                        found[i].append(None)
                    continue
                grads = torch.autograd.grad(target, [t for *_, t in captured], allow_unused=True) \
                    if captured else ()
                for i in captured_ids:
                    found[i].append([[(o, torch.zeros_like(t)) for o, t in leaves] for leaves in self._captured[i]])
                for (i, j, k, _), g in zip(captured, grads):
                    if g is not None:
                        found[i][-1][j][k] = (found[i][-1][j][k][0], g.detach())  # type: ignore[index]
        finally:
            self._captured = {}
            for m, mode in modes:
                m.training = mode
        return found

    def _common_rows(self, examples: Callable[[list[int]], Any], indices: list[int]) -> tuple[dict, dict] | None:
        """Runs ``examples(indices)`` as training does (the module's own mode) and returns, for the first
        :data:`INDEPENDENT_COMMON` examples (the examples first), per ``(layer, call, leaf)`` whose dimension of the
        examples is known: the layer's inputs, and the gradients of the result (:func:`_differentiable_target`) with
        respect to its outputs; None when the result cannot be differentiated."""
        layers = [layer for layer in self.layers if layer.dims is not None]
        for layer in self.layers:
            layer.probe_calls = [[]]
        self._captured = {id(layer): [] for layer in layers}
        self._captured_inputs = {id(layer): [] for layer in layers}
        self._inputs_rows = INDEPENDENT_COMMON
        self._probing, self._batch = True, len(indices)
        self._broadcasting = {id(layer) for layer in layers if layer.broadcast}
        # dropout modules off: which of their independent draws an example gets may depend on the batch's other
        # examples (the batch's longest sequence sets the mask's layout, a PackedSequence orders its tokens by
        # length), which is no dependence on their data; the rest of the model stays in its training mode
        dropouts = [m for m in self.module.modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.training]
        for m in dropouts:
            m.training = False
        try:
            with torch.enable_grad():
                target = _differentiable_target(examples(list(indices)))
            captured = [(i, j, k, t) for i, calls in self._captured.items() for j, leaves in enumerate(calls)
                        for k, t in leaves]
            inputs = {(i, j, k): rows for i, calls in self._captured_inputs.items() for j, leaves in enumerate(calls)
                      for k, rows in leaves}
        finally:
            self._probing, self._broadcasting, self._batch, self._captured = False, set(), None, {}
            self._captured_inputs, self._inputs_rows = {}, 0
            for layer in self.layers:
                layer.probe_calls = []
            for m in dropouts:
                m.training = True
        if target is None:
            return None
        dims = {id(layer): layer.dims.outputs for layer in layers}  # type: ignore[union-attr]
        captured = [c for c in captured if c[2] < len(dims[c[0]]) and dims[c[0]][c[2]] is not None]
        grads = torch.autograd.grad(target, [t for *_, t in captured], allow_unused=True) if captured else ()
        outputs: dict[tuple[int, int, int], Tensor] = {}
        for (i, j, k, t), g in zip(captured, grads):
            g = torch.zeros_like(t) if g is None else g.detach()
            outputs[(i, j, k)] = g.movedim(dims[i][k], 0)[:INDEPENDENT_COMMON]  # type: ignore[arg-type]
        return inputs, outputs

    def _check_independent(self, examples: Callable[[list[int]], Any]) -> None:
        """Refuses a step in which an example's gradient depends on the other examples of its batch.

        Per-sample clipping bounds one example's influence only if each row of the clipped sum is a function of
        that example alone (and of the shared parameters and public configuration). A layer's per-example gradient
        is built from its inputs and the gradient reaching its outputs, example by example. The two batches of
        :data:`INDEPENDENCE_PROBE` hold the same first examples and different later ones, and have one size: from
        the same random state (``examples`` starts the step from it: the probe's contract), every random draw
        (noise augmentation, a VAE's sampling) is the same for the common examples; dropout modules are off for
        these two runs (the layout of their draws may follow the batch's longest sequence or a PackedSequence's
        order: a dependence on the other examples' lengths, not their data). So each layer's inputs
        must be the same for them in both batches, and the gradients reaching its outputs the same up to one factor
        per batch (a mean over the batch's non-ignored tokens, a weighted mean: a batch-level scalar, a documented
        hole of its own). A leaf of another shape in the two batches (padding to the batch's longest sequence) is
        not compared.
        """
        first, second = ([int(i) for i in idx] for idx in INDEPENDENCE_PROBE)
        one, two = (self._common_rows(examples, idx) for idx in (first, second))
        if one is None or two is None:
            return  # nothing to differentiate: the broadcast check and the step's own checks say so where it matters
        failed: dict[int, set[str]] = {}  # the layers' ids: what differed

        def pairs(a: dict, b: dict) -> tuple[list[tuple[int, Tensor, Tensor]], bool]:
            """(layer id, rows of one, rows of two) where both have the leaf in one shape; whether any is half."""
            keys = [k for k in a if k in b and a[k].shape == b[k].shape]
            half = any(a[k].dtype in (torch.float16, torch.bfloat16) for k in keys)
            return [(k[0], a[k].double(), b[k].double()) for k in keys], half

        inputs, half_in = pairs(one[0], two[0])  # the same values
        grads, half_out = pairs(one[1], two[1])  # the same up to one factor per batch
        tol = 3e-2 if self._probe_half or half_in or half_out else 1e-3
        for layer_id, x, y in inputs:
            off = float((y - x).norm())
            if off > tol * max(float(x.norm()), float(y.norm())) and off > 1e-12:
                failed.setdefault(layer_id, set()).add("inputs")
        if grads:
            a = torch.cat([x.reshape(-1) for _, x, _ in grads])
            b = torch.cat([y.reshape(-1) for _, _, y in grads])
            floor = 1e-6 * max(float(a.norm()), float(b.norm()))  # a layer whose gradient is rounding noise
            aa = float(torch.dot(a, a))
            scale = float(torch.dot(b, a)) / aa if aa > 0 else 0.0
            for layer_id, x, y in grads:
                off = float((y - scale * x).norm())
                if off > floor and off > tol * max(float(y.norm()), abs(scale) * float(x.norm())):
                    failed.setdefault(layer_id, set()).add("output gradients")
        failing = [f"{layer.label} ({' and '.join(sorted(failed[id(layer)]))})" for layer in self.layers
                   if id(layer) in failed]  # in the model's order
        if failing:
            shown = ", ".join(failing[:3]) + (f" and {len(failing) - 3} more" if len(failing) > 3 else "")
            raise PerSampleGradientError(
                f"the loss mixes the examples of the batch: what {shown} received changed for the first "
                f"{INDEPENDENT_COMMON} examples of a batch when the batch's other examples were replaced (two probe "
                f"batches of {len(first)} examples, indices {first} and {second}, each step from the same random "
                "state, dropout modules off; a layer's inputs must stay the same, the gradients reaching its outputs "
                "the same up to one factor per batch). Per-sample clipping bounds an example's influence only if its "
                "gradient depends on that example alone: with an in-batch contrastive loss (negatives taken from the "
                "other examples), logits or features centred or normalized on the batch (h - h.mean(0)), mixup, or "
                "hard-example mining over the batch, one example moves every other example's clipped gradient; so "
                "does a batch-level scalar in one of several terms of the loss (a mean over the batch's non-ignored "
                "tokens plus another term). Use a sum or mean of per-example losses: negatives from a fixed public "
                "set or from the example's own views, per-example normalization (nn.LayerNorm, nn.GroupNorm), each "
                "example's own token mean. If the step draws random numbers whose count depends on the data "
                "(torch.randint(V, (int(mask.sum()),))), draw them in the batch's shape instead "
                "(torch.randint(V, mask.shape)), so that each example's draws do not depend on the others; and draw "
                "from torch's, Python's or NumPy's global generators or from a generator held by the dataset or the "
                "module (the probe sets them back for each batch), not from one it cannot find.")

    def _verify_broadcast(self, layer: _Layer, sizes: tuple[int, ...],
                          grads: list[list[list[tuple[int, Tensor]]] | None]) -> None:
        """Refuses a broadcast layer unless slice ``b`` of its expanded output carries example ``b``'s gradient.

        With nested probe batches, example ``b``'s gradient does not depend on the other
        examples (eval mode), so for the examples common to all sizes the gradients must
        agree between sizes up to one factor per size (a batch mean), and the examples
        only the largest batch holds must receive some gradient. Indexing (``pos[0]``),
        reducing (``pos.mean(0)``) or a per-example loop breaks one of the two.
        """
        def refuse(why: str) -> None:
            raise PerSampleGradientError(
                f"{layer.label} computes on inputs shared by all examples (no input dimension follows the number of "
                f"examples), and {why}. Its output is used as if it were per-batch, not broadcast to every example "
                "alike: it is indexed (out[0]), reduced over its first dimension (out.mean(0)), or the layer runs "
                "once per example in a Python loop (fc(x[i:i+1])). Per-sample gradients need each example's data in "
                "its own slice of one batch dimension: call the layer on the whole batch, index a shared table with a "
                "per-example tensor (pos = torch.arange(T).expand(B, T)), or freeze the layer (requires_grad=False).")

        if any(g is None for g in grads) or len(grads) != len(sizes):
            refuse("the probe's result (the first scalar tensor that requires grad, or the sum of the first "
                   "tensor that does) cannot be differentiated to check that its output is broadcast")
        counts = [len(calls) for calls in grads]  # type: ignore[arg-type]
        if len(set(counts)) != 1:
            refuse(f"it is called {counts} times for batches of {list(sizes)} examples")
        common = min(sizes)
        rows: list[Tensor] = []
        extra: Tensor | None = None
        for n, calls in zip(sizes, grads):
            leaves = [g for call in calls for _, g in call]  # type: ignore[union-attr]
            rows.append(torch.cat([g[:common].reshape(-1).double() for g in leaves]) if leaves else torch.zeros(0))
            if n == max(sizes):
                extra = torch.cat([g[common:].reshape(-1) for g in leaves]) if leaves else torch.zeros(0)
        ref = rows[0]
        # half precision anywhere in the model (autocast) rounds the gradients the slices receive
        low = self._probe_half or any(g.dtype not in (torch.float32, torch.float64)
                                      for call in grads[0] for _, g in call)  # type: ignore[union-attr]
        tol = 3e-2 if low else 1e-3
        if ref.numel() == 0 or not bool(ref.any()) or extra is None or not bool(extra.any()):
            refuse("the probe's result does not depend on the slices of its broadcast output that belong to the "
                   "examples beyond the first" if ref.numel() and bool(ref.any()) else
                   "the probe's result does not depend on its output, so that it is broadcast cannot be checked")
        for n, row in zip(sizes[1:], rows[1:]):
            scale = torch.dot(row, ref) / torch.dot(ref, ref)
            if float((row - scale * ref).norm()) > tol * float(row.norm()):
                refuse(f"the gradient its output slices receive for the first {common} examples changes when the "
                       f"batch grows from {sizes[0]} to {n} examples")

    def _establish(self, layer: _Layer, sizes: tuple[int, ...]) -> _Dims | None:
        runs = layer.probe_calls
        if any(not calls for calls in runs):
            return None  # not called in some probe (conditional computation): refused if called in training
        found: list[tuple[tuple, tuple, tuple]] = []
        for j in range(min(len(calls) for calls in runs)):
            ins = [calls[j][0] for calls in runs]
            outs = [calls[j][1] for calls in runs]
            if len({len(i) for i in ins}) != 1 or len({len(o) for o in outs}) != 1:
                raise PerSampleGradientError(f"{layer.label} is called with a different structure for different "
                                             "batch sizes; its batch dimension cannot be established.")
            try:
                in_dims = tuple(None if any(s is None for s in leaf) else batch_dim(leaf, sizes) for leaf in zip(*ins))
                out_dims = tuple(None if any(s is None for s in leaf) else batch_dim(leaf, sizes)
                                 for leaf in zip(*outs))
            except AmbiguousBatchDimError as err:
                raise PerSampleGradientError(f"{layer.label}: {err}. Per-sample gradients need each example's "
                                             "data in its own slice of one batch dimension.") from None
            found.append((in_dims, out_dims, tuple(None if s is None else len(s) for s in ins[0])))
        if any(f[:2] != found[0][:2] for f in found[1:]):
            raise PerSampleGradientError(
                f"{layer.label} is called several times per step with the batch at different dimensions "
                f"(inputs {[f[0] for f in found]}, outputs {[f[1] for f in found]}); use one layer per layout, or "
                "keep the batch first.")
        if any(f != found[0] for f in found[1:]):
            raise PerSampleGradientError(
                f"{layer.label} is called several times per step with inputs of different ranks "
                f"({[f[2] for f in found]}); the engine keeps one layout per layer: use one layer per input rank.")
        return _Dims(*found[0])

    def _refuse_unbatched(self, layer: _Layer, sizes: tuple[int, ...], why: str) -> None:
        seen = {n: next((s for s in calls[0][0] if s is not None), None) for n, calls in zip(sizes, layer.probe_calls)} \
            if layer.probe_calls and all(layer.probe_calls) else {}
        raise PerSampleGradientError(
            f"{layer.label} receives an input without a batch dimension (input shapes {seen} for batches of "
            f"{list(sizes)} examples: no dimension follows the number of examples). Either its parameters act on "
            f"something shared by all examples, such as a positional embedding of torch.arange(T) added to every "
            f"sequence, and {why}: index it with a per-example tensor (e.g. pos = torch.arange(T).expand(B, T)) or "
            "freeze it (requires_grad=False). Or the batch is folded into another dimension, as (B, T, d) -> "
            "(B*T, d) does, which would clip tokens instead of examples: keep the batch dimension, e.g. apply "
            "nn.Linear to (B, T, d).")

    def _validate_dims(self, layer: _Layer, sizes: tuple[int, ...]) -> None:
        dims = layer.dims
        if dims is None:
            return
        unbatched_inputs = all(d is None for d in dims.inputs) and not layer.rule.batch_from_output
        if not layer.broadcast and (unbatched_inputs or all(d is None for d in dims.outputs)):
            self._refuse_unbatched(layer, sizes, "its result is reduced over the batch, not broadcast")
        check = getattr(layer.rule, "check_dims", None)
        if check is not None:
            try:
                check(layer.module, dims.inputs, dims.outputs, layer.broadcast)
            except PerSampleGradientError as err:
                raise PerSampleGradientError(f"{layer.label}: {err}") from None
