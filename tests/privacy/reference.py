"""The independent reference for per-sample gradients: one autograd call per example."""

from __future__ import annotations

import torch


def per_example_gradients(model, losses):
    """``(unique trainable parameters, (B, P) gradients)``: row i is the gradient of ``losses[i]`` by autograd,
    flattened over the parameters in order (tied parameters once; unused ones contribute zeros)."""
    unique = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
    rows = []
    for i in range(losses.shape[0]):
        grads = torch.autograd.grad(losses[i], unique, retain_graph=True, allow_unused=True)
        rows.append(torch.cat([(g.to_dense() if g is not None and g.is_sparse else
                                g if g is not None else torch.zeros_like(p)).reshape(-1)
                               for g, p in zip(grads, unique)]))
    return unique, torch.stack(rows)
