"""Times one training step: non-private, lightning-dp's DP step, Opacus (hooks, ghost), torch.func; six models.

All methods run in ONE process on the same model shape and the same batch, interleaved
round by round so that machine noise hits every method alike; the report gives the
median step time and its ratio to the non-private step measured in the same process.
Peak memory is measured separately, one fresh subprocess per method: the peak resident
set size over 5 steps above the resident size after set-up (CPU, Linux ``VmHWM`` reset
through ``/proc/self/clear_refs``), or ``max_memory_allocated`` above the allocation after
set-up (CUDA).

Models (``--model``):

* ``mnist_cnn``: Papernot et al.'s strided MNIST CNN (``MNISTConvNet``, 26,010 parameters), batch 256 of
  1x28x28;
* ``thesis_cnn``: the thesis' MNIST CNN (``MNISTConvNet(layers="thesis")``, Table 3.5's layers at Table 3.1's
  551,322 parameters, ReLU), batch 256;
* ``stride1_cnn``: conv 16x8x8 stride 1, max-pool 2/1, conv 32x4x4, linear 9248->32->10, batch 256;
* ``resnet8_gn``: a ResNet-8 with GroupNorm for 3x32x32 inputs (3 stages of one basic block, 16/32/64 channels), batch 64;
* ``transformer``: token embedding (1,000 words), 2-layer ``nn.TransformerEncoder`` (d 128, 4 heads, ff 256,
  dropout 0.1, batch first), mean-pooled classifier; 32 sequences of 64 tokens;
* ``lstm``: token embedding (1,000 words, d 64), ``nn.LSTM`` (128 units), classifier of the last state; 64
  sequences of 64 tokens; ``gru``: the same with ``nn.GRU`` (not one of the eight rows of docs/benchmarks.md);
* ``gpt2``: a Hugging Face GPT-2 from a config (vocabulary 1,000, d 128, 2 layers, 4 heads, tied embeddings), next-token
  loss; 16 sequences of 64 tokens.
* ``digits_mlp``: the new user's model: an MLP on scikit-learn's 8x8 digits as one writes it (flatten, 64 -> 128 ->
  ReLU -> 10), batch 64.
* ``gpt2_lora``: the ``gpt2`` model with rank-8 LoRA adapters (``peft``) on every projection (``c_attn``, ``c_proj``,
  ``c_fc``), everything else frozen; 16 sequences of 64 tokens.

Opacus runs the same models with its own layers where it needs them (``DPMultiheadAttention`` in the transformer,
``DPLSTM`` for the LSTM, ``DPGRU`` for the GRU); a method that cannot run a model is reported as failed, with the
reason.

Usage:
    python benchmarks/bench_dp_step.py                                  # MNIST CNN, every method
    python benchmarks/bench_dp_step.py --model transformer --rounds 5 --methods nonprivate,lightning_dp,opacus_ghost
    python benchmarks/bench_dp_step.py --model mnist_cnn --device cuda --profile lightning_dp   # the operators' table
    python benchmarks/bench_dp_step.py --model digits_mlp --methods nonprivate,lightning_dp --count-ops  # + op counts
    python benchmarks/bench_dp_step.py --methods nonprivate,lightning_dp,lightning_dp_static   # batches of one shape
    python benchmarks/bench_dp_step.py --methods nonprivate,lightning_dp_static,lightning_dp_compiled  # + compiled pass
    python benchmarks/bench_dp_step.py --methods nonprivate,lightning_dp --parametrize weight_norm  # weight-normed layers

``lightning_dp_compiled`` is ``lightning_dp_static`` with the private pass (norms, clip factors, mask, clipped sums,
counts) as one ``torch.compile`` graph, as ``DPSGD(compile_step=True)`` runs it (compiled before the timing).

``handwritten`` and ``handwritten_compiled`` (the digits MLP only) are floors, not methods a user can run: the same
DP-SGD release (:func:`handwritten_release`, equal to lightning-dp's for the same noise: tests/test_benchmarks.py)
written out for an MLP of linear layers and ReLUs under a cross-entropy loss, with no engine, no hook and no check:
the forward, the pre-activations' gradients by hand, the norms, clip factors, clipped sums, the secret generator's
noise and the update. ``handwritten`` runs it as eager PyTorch operators (what any eager private step on this model
pays at least), ``handwritten_compiled`` as one ``torch.compile`` graph (forward, backward, norms, sums together;
the noise drawn eagerly, as the compiled private pass draws it).
    python benchmarks/bench_dp_step.py --model digits_mlp --methods nonprivate,lightning_dp,handwritten,handwritten_compiled
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_dp.models import MNISTConvNet  # noqa: E402
from lightning_dp.privacy import GradSampleEngine, clip_factors, derive_generator, noisy_mean  # noqa: E402

SIGMA, C = 1.0, 1.0
METHODS = ["nonprivate", "lightning_dp", "lightning_dp_static", "lightning_dp_compiled", "opacus_hooks", "opacus_ghost",
           "torch_func", "handwritten", "handwritten_compiled"]
#: what runs without --methods: not the compiled pass, whose compilation takes tens of seconds per model, nor the
#: hand-written floors, which exist for the digits MLP only
DEFAULT_METHODS = [m for m in METHODS if m not in ("lightning_dp_compiled", "handwritten", "handwritten_compiled")]

#: ``--parametrize``: every linear layer and convolution of the model parametrized (``weight_norm`` or ``spectral_norm``
#: from ``torch.nn.utils.parametrizations``), for the private and the plain step alike
PARAMETRIZE: str | None = None
PARAMETRIZATIONS = ("weight_norm", "spectral_norm")

#: ``lightning_dp_static``: the training set the batch is a Poisson sample of (MNIST's size), for the bound
STATIC_DATASET_SIZE = 60_000
VOCAB = 1000


# ------------------------------------------------------------------------------------------ models
class Stride1CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 16, 8, stride=1), nn.Tanh(), nn.MaxPool2d(2, 1),
                                 nn.Conv2d(16, 32, 4), nn.Tanh(), nn.Flatten(),
                                 nn.Linear(9248, 32), nn.Tanh(), nn.Linear(32, 10))

    def forward(self, x):
        return self.net(x)


class Block(nn.Module):
    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.c1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.n1 = nn.GroupNorm(min(16, c_out), c_out)
        self.c2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.n2 = nn.GroupNorm(min(16, c_out), c_out)
        self.skip = nn.Sequential() if stride == 1 and c_in == c_out else nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.GroupNorm(min(16, c_out), c_out))

    def forward(self, x):
        return torch.relu(self.n2(self.c2(torch.relu(self.n1(self.c1(x))))) + self.skip(x))


class ResNet8(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.GroupNorm(16, 16), nn.ReLU())
        self.stages = nn.Sequential(Block(16, 16, 1), Block(16, 32, 2), Block(32, 64, 2))
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc(self.stages(self.stem(x)).mean((2, 3)))


class TextTransformer(nn.Module):
    def __init__(self, opacus: bool = False):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 128)
        layer = nn.TransformerEncoderLayer(128, 4, 256, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        if opacus:
            from opacus.layers import DPMultiheadAttention

            for lay in self.encoder.layers:
                lay.self_attn = DPMultiheadAttention(128, 4, dropout=0.1, batch_first=True)
        self.fc = nn.Linear(128, 2)

    def forward(self, ids):
        return self.fc(self.encoder(self.emb(ids)).mean(1))


class TextLSTM(nn.Module):
    cell, opacus_cell = "LSTM", "DPLSTM"

    def __init__(self, opacus: bool = False):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 64)
        if opacus:
            import opacus.layers

            self.lstm = getattr(opacus.layers, self.opacus_cell)(64, 128, batch_first=True)
        else:
            self.lstm = getattr(nn, self.cell)(64, 128, batch_first=True)
        self.fc = nn.Linear(128, 2)

    def forward(self, ids):
        return self.fc(self.lstm(self.emb(ids))[0][:, -1])


class TextGRU(TextLSTM):
    """The LSTM classifier with an ``nn.GRU`` (Opacus: ``DPGRU``) in the LSTM's place."""

    cell, opacus_cell = "GRU", "DPGRU"


class GPT2LM(nn.Module):
    def __init__(self, opacus: bool = False):
        super().__init__()
        from lightning_dp.models import GPT2

        self.gpt = GPT2(vocab_size=VOCAB, max_positions=64, embed_dim=128, num_layers=2, num_heads=4, dropout=0.1)

    def forward(self, ids):
        return self.gpt(ids)


class DigitsMLP(nn.Module):
    def __init__(self, opacus: bool = False):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x):
        return self.net(x)


class GPT2LoRA(nn.Module):
    def __init__(self, opacus: bool = False):
        super().__init__()
        from lightning_dp.models import LoRA

        self.gpt = LoRA(GPT2LM().gpt, rank=8, alpha=16, target_modules=["c_attn", "c_proj", "c_fc"])

    def forward(self, ids):
        return self.gpt(ids)


def _images(shape, classes=10):
    def make(b, g):
        return torch.randn(b, *shape, generator=g), torch.randint(0, classes, (b,), generator=g)
    return make


def _tokens(t, classes=2):
    def make(b, g):
        return torch.randint(0, VOCAB, (b, t), generator=g), torch.randint(0, classes, (b,), generator=g)
    return make


def _lm_loss(logits, batch):
    ids = batch[0]
    b, t, v = logits.shape
    return F.cross_entropy(logits[:, :-1].reshape(-1, v), ids[:, 1:].reshape(-1), reduction="none").view(b, -1).mean(1)


def _ce(logits, batch):
    return F.cross_entropy(logits, batch[1], reduction="none")


#: name -> (model factory taking opacus: bool, batch maker, default batch size, per-example loss)
MODELS = {
    "mnist_cnn": (lambda opacus=False: MNISTConvNet(), _images((1, 28, 28)), 256, _ce),
    "stride1_cnn": (lambda opacus=False: Stride1CNN(), _images((1, 28, 28)), 256, _ce),
    "thesis_cnn": (lambda opacus=False: MNISTConvNet(layers="thesis", activation="relu"), _images((1, 28, 28)), 256,
                   _ce),
    "resnet8_gn": (lambda opacus=False: ResNet8(), _images((3, 32, 32)), 64, _ce),
    "transformer": (TextTransformer, _tokens(64), 32, _ce),
    "lstm": (TextLSTM, _tokens(64), 64, _ce),
    "gru": (TextGRU, _tokens(64), 64, _ce),
    "gpt2": (GPT2LM, _tokens(64), 16, _lm_loss),
    "digits_mlp": (DigitsMLP, _images((1, 8, 8)), 64, _ce),
    "gpt2_lora": (GPT2LoRA, _tokens(64), 16, _lm_loss),
}


# ------------------------------------------------------------------------------------------ methods
def _profiled(step, device: str, steps: int, *, warmup: int):
    """torch.profiler over ``steps`` calls of ``step`` after ``warmup`` unprofiled ones (CPU, and CUDA on a GPU)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for _ in range(warmup):
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
    return prof


def profile(method: str, model_name: str, batch_size: int, device: str, steps: int = 5) -> None:
    """Prints torch.profiler's operators of ``steps`` steps of ``method`` (after 3 warm-up steps), by their own CPU
    time, and how many times the host waited for the device (``aten::_local_scalar_dense``: ``.item()``,
    ``float(t)``, ``bool(t)``; ``cudaStreamSynchronize``)."""
    events = _profiled(build(method, model_name, batch_size, device), device, steps, warmup=3).key_averages()
    print(f"{method} on {model_name}, batch {batch_size}, device {device}, {steps} steps")
    print(events.table(sort_by="self_cpu_time_total", row_limit=25))
    for name in ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaLaunchKernel", "cudaMemcpyAsync"):
        count = sum(e.count for e in events if e.key == name)
        print(f"{name:<28} {count / steps:8.1f} per step")


def count_ops(step, device: str, steps: int = 5) -> dict[str, float]:
    """What one call of ``step`` costs in operations, per step (mean over ``steps`` after 2 warm-up calls):

    * ``aten``: aten operator calls dispatched from outside any other aten operator (from Python, from autograd's
      backward nodes, from the optimizer): what each pays its dispatch for, the fixed cost of a small model's step;
    * ``aten_all``: every aten operator call, nested ones included (``to`` -> ``_to_copy`` -> ``copy_``);
    * ``kernels`` (CUDA only): kernel launches (``cudaLaunchKernel``, ``cuLaunchKernel``, ``cudaLaunchKernelExC``);
    * ``python``: Python function calls (cProfile's count: the Python around the operators).
    """
    import cProfile
    import pstats

    prof = _profiled(step, device, steps, warmup=2)
    top = nested = launches = 0
    for e in prof.events():
        if e.name.startswith("aten::"):
            nested += 1
            parent = e.cpu_parent
            while parent is not None and not parent.name.startswith("aten::"):
                parent = parent.cpu_parent
            top += parent is None
        elif e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"):
            launches += 1
    calls = cProfile.Profile()
    calls.enable()
    for _ in range(steps):
        step()
    calls.disable()
    counts = {"aten": top / steps, "aten_all": nested / steps, "python": pstats.Stats(calls).total_calls / steps}
    if device == "cuda":
        counts["kernels"] = launches / steps
    return counts


def _parametrized(model: nn.Module) -> nn.Module:
    """``model`` with :data:`PARAMETRIZE` applied to every ``nn.Linear`` and convolution (none if it is None)."""
    if PARAMETRIZE is None:
        return model
    from torch.nn.utils import parametrizations

    apply = getattr(parametrizations, PARAMETRIZE)
    for name, m in list(model.named_modules()):
        if type(m) in (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d) and m.weight.requires_grad:
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            setattr(parent, name.rpartition(".")[2], apply(m))
    return model


def _mlp_layers(model: nn.Module) -> list[nn.Linear]:
    """The linear layers of a ``net = nn.Sequential(Flatten, Linear, ReLU, ..., Linear)`` model, else ValueError."""
    net = getattr(model, "net", None)
    mods = list(net) if isinstance(net, nn.Sequential) else []
    ok = (len(mods) >= 2 and isinstance(mods[0], nn.Flatten) and isinstance(mods[-1], nn.Linear)
          and all(isinstance(m, nn.Linear if i % 2 else nn.ReLU) for i, m in enumerate(mods[1:], start=1)))
    if not ok or any(m.bias is None for m in mods[1::2]):
        raise ValueError("the hand-written floor covers an MLP written as net = nn.Sequential(nn.Flatten(), nn.Linear, "
                         "nn.ReLU(), ..., nn.Linear) with biases (the digits MLP); pick --model digits_mlp")
    return mods[1::2]


def handwritten_release(weights: list[Tensor], x: Tensor, y: Tensor, noise: Tensor, clip: float,
                        expected_batch_size: float) -> Tensor:
    """The DP-SGD release of an MLP (``weights``: W_1, b_1, ..., W_L, b_L; ReLU between the layers) under the mean
    cross-entropy, written out, flat: ``(sum_i min(1, C / (||g_i|| + 1e-6)) g_i + noise) / (q N)``.

    Per example, the gradient of its own loss at the logits is ``softmax - onehot``; going back through a layer it is
    multiplied by ``W`` and masked by the ReLU's (pre-activation > 0). Layer k's weight gradient is the outer product
    of that gradient and the layer's input, so its squared norm is ``||g||^2 (||a||^2 + 1)`` with the bias, and the
    clipped sum of a layer is one matrix product. No autograd: a function of tensors that ``torch.compile`` captures
    whole."""
    acts, pres = [x.flatten(1)], []
    n_layers = len(weights) // 2
    for k in range(n_layers):
        pre = torch.addmm(weights[2 * k + 1], acts[-1], weights[2 * k].t())
        if k < n_layers - 1:
            pres.append(pre)
            acts.append(torch.relu(pre))
        else:
            logits = pre
    g = torch.softmax(logits, 1) - F.one_hot(y, logits.shape[1]).to(logits.dtype)
    grads = [g]
    for k in range(n_layers - 1, 0, -1):
        g = (g @ weights[2 * k]) * (pres[k - 1] > 0)
        grads.insert(0, g)
    sq = sum(gk.square().sum(1) * (a.square().sum(1) + 1) for gk, a in zip(grads, acts))
    factors = (clip / (sq.sqrt() + 1e-6)).clamp(max=1.0)
    sums = []
    for gk, a in zip(grads, acts):
        scaled = gk * factors.unsqueeze(1)
        sums += [(scaled.t() @ a).reshape(-1), scaled.sum(0)]
    return (torch.cat(sums) + noise) / expected_batch_size


def build(method: str, model_name: str, batch_size: int, device: str):
    """Returns a zero-argument function running one full training step of ``method`` on ``model_name``."""
    make_model, make_batch, _, per_example = MODELS[model_name]
    torch.manual_seed(0)
    model = _parametrized(make_model(opacus=method.startswith("opacus"))).to(device).train()
    batch = tuple(t.to(device) for t in make_batch(batch_size, torch.Generator().manual_seed(0)))

    def loss_of(m, b):
        return per_example(m(b[0]), b).mean()

    if method == "nonprivate":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step():
            opt.zero_grad(set_to_none=True)
            loss_of(model, batch).backward()
            opt.step()
        return step

    if method in ("lightning_dp", "lightning_dp_static", "lightning_dp_compiled"):
        static = method != "lightning_dp"
        compiled = method == "lightning_dp_compiled"
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        # the engine DPSGD builds: work buffers kept as its rule keeps them
        from lightning_dp.callbacks.private_step import keeps_buffers

        engine = GradSampleEngine(model, keep_buffers=keeps_buffers(one_shape=static, device_type=device,
                                                                    compiled=compiled))
        big = tuple(t.to(device) for t in make_batch(7, torch.Generator().manual_seed(7)))
        probes = {n: tuple(t[:n] for t in big) for n in (3, 5, 7)}  # nested, as the engine requires

        def run(n):
            with torch.random.fork_rng(devices=[device] if device == "cuda" else []):
                return loss_of(model, probes[n])

        engine.probe(run)  # where the batch is (DPSGD probes once, when training starts)
        params = engine.parameters
        counter = iter(range(10**9))

        rows, data = batch_size, batch
        if static:
            # batches of one shape (DPSGD(max_batch_size="auto")): the batch is padded with blank rows to the bound
            # a Poisson batch of this expected size from STATIC_DATASET_SIZE exceeds with probability 1e-6 per step,
            # and the blank rows are masked out of the clipped sum
            from lightning_dp.privacy.sampling import suggest_max_batch_size

            rows = suggest_max_batch_size(STATIC_DATASET_SIZE, batch_size / STATIC_DATASET_SIZE)
            data = tuple(torch.cat([t, torch.zeros((rows - batch_size, *t.shape[1:]), dtype=t.dtype, device=device)])
                         for t in batch)
            sampled = torch.arange(rows, device=device) < batch_size

        if compiled:
            from lightning_dp.callbacks.clipping import FixedClip
            from lightning_dp.callbacks.private_step import compiled_pass

            fused, strategy = compiled_pass({}), FixedClip(C)
            scale, clip, real = (torch.tensor(float(rows), dtype=torch.float64, device=device),
                                 torch.tensor(C, dtype=torch.float64, device=device), torch.tensor(batch_size, device=device))

        def step():
            opt.zero_grad(set_to_none=True)
            with engine.record(batch_size=rows):
                loss_of(model, data).backward()
            if compiled:
                engine.check_inputs_unchanged()
                _, (sums,), _ = fused(engine, strategy, scale, clip, real)
            else:
                norms = engine.per_sample_norms()
                factors = clip_factors(norms, C)
                sums = engine.clipped_sum(torch.where(sampled, factors, torch.zeros_like(factors)) if static
                                          else factors)
            engine.clear()
            grads = noisy_mean(sums, noise_multiplier=SIGMA, max_grad_norm=C, expected_batch_size=batch_size,
                               generator=derive_generator(0, 2, next(counter), device=device))
            for p, gr in zip(params, grads):
                p.grad = gr
            opt.step()
        return step

    if method in ("handwritten", "handwritten_compiled"):
        if per_example is not _ce:
            raise ValueError("the hand-written floor is written for the cross-entropy loss (the digits MLP)")
        layers = _mlp_layers(model)
        params = [t for layer in layers for t in (layer.weight, layer.bias)]
        opt = torch.optim.SGD(params, lr=0.1)
        sizes = [p.numel() for p in params]
        release = torch.compile(handwritten_release, dynamic=False) if method == "handwritten_compiled" \
            else handwritten_release
        counter = iter(range(10**9))

        def step():
            opt.zero_grad(set_to_none=True)
            noise = torch.randn(sum(sizes), generator=derive_generator(0, 2, next(counter), device=device),
                                device=device).mul_(SIGMA * C)
            with torch.no_grad():
                flat = release([p.detach() for p in params], batch[0], batch[1], noise, C, float(batch_size))
            for p, chunk in zip(params, flat.split(sizes)):
                p.grad = chunk.view(p.shape)
            opt.step()
        return step

    if method in ("opacus_hooks", "opacus_ghost"):
        import warnings

        from opacus import PrivacyEngine
        from torch.utils.data import DataLoader, TensorDataset

        warnings.filterwarnings("ignore")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(TensorDataset(*(t.cpu() for t in batch)), batch_size=batch_size)
        engine = PrivacyEngine()
        if method == "opacus_ghost":
            class Loss(nn.Module):  # Opacus' ghost clipping takes a criterion with reduction="mean"
                reduction = "mean"

                def forward(self, out, target):
                    return per_example(out, (batch[0], target)).mean()

            model, opt, criterion, _ = engine.make_private(
                module=model, optimizer=opt, data_loader=loader, criterion=Loss(), noise_multiplier=SIGMA,
                max_grad_norm=C, poisson_sampling=False, grad_sample_mode="ghost")

            def step():
                opt.zero_grad(set_to_none=True)
                criterion(model(batch[0]), batch[1]).backward()
                opt.step()
        else:
            model, opt, _ = engine.make_private(module=model, optimizer=opt, data_loader=loader,
                                                noise_multiplier=SIGMA, max_grad_norm=C, poisson_sampling=False)

            def step():
                opt.zero_grad(set_to_none=True)
                loss_of(model, batch).backward()
                opt.step()
        return step

    if method == "torch_func":
        from torch.func import functional_call, grad, vmap

        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        names = [n for n, _ in model.named_parameters()]
        gen = torch.Generator(device=device).manual_seed(0)

        def loss_one(params, *example):
            one = tuple(t[None] for t in example)
            return per_example(functional_call(model, params, (one[0],)), one).mean()

        per_sample = vmap(grad(loss_one), in_dims=(None, *([0] * len(batch))), randomness="different")

        def step():
            params = {n: p.detach() for n, p in model.named_parameters()}
            gs = per_sample(params, *batch)
            norms = torch.stack([gs[n].reshape(batch_size, -1).norm(dim=1) for n in names]).norm(dim=0)
            f = clip_factors(norms, C)
            for n, p in model.named_parameters():
                s = torch.einsum("b,b...->...", f, gs[n])
                p.grad = (s + torch.randn(s.shape, generator=gen, device=device) * SIGMA * C) / batch_size
            opt.step()
        return step
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def breakdown(model_name: str, batch_size: int, device: str, rounds: int = 15, steps: int = 3) -> dict[str, float]:
    """Where lightning-dp's step spends its time, in ms (median of ``rounds``, the stages interleaved in every round):
    the plain step, the recorded forward and backward (hooks; no weight gradients), then per-sample norms, clipped
    sums, noise and the update, each the difference of two cumulative timings in the same process (small parts
    can come out slightly negative in the noise)."""
    make_model, make_batch, _, per_example = MODELS[model_name]
    torch.manual_seed(0)
    model = _parametrized(make_model()).to(device).train()
    batch = tuple(t.to(device) for t in make_batch(batch_size, torch.Generator().manual_seed(0)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss():
        return per_example(model(batch[0]), batch).mean()

    def clock(fn):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / steps * 1e3

    def plain():
        opt.zero_grad(set_to_none=True)
        loss().backward()
        opt.step()

    engine = GradSampleEngine(model)
    big = tuple(t.to(device) for t in make_batch(7, torch.Generator().manual_seed(7)))
    probes = {n: tuple(t[:n] for t in big) for n in (3, 5, 7)}

    def run(n):  # the same draws for the same n (dropout), as the probe requires
        with torch.random.fork_rng(devices=[device] if device == "cuda" else []):
            return per_example(model(probes[n][0]), probes[n]).mean()

    engine.probe(run)
    params = engine.parameters
    engine.remove()  # the plain step runs without hooks; they are put back below
    engine = GradSampleEngine(model)
    engine.probe(run)

    def recorded():
        with engine.record(batch_size=batch_size):
            loss().backward()

    def norms():
        recorded()
        engine.per_sample_norms()
        engine.clear()

    def sums():
        recorded()
        engine.clipped_sum(clip_factors(engine.per_sample_norms(), C))
        engine.clear()

    def full():
        recorded()
        s = engine.clipped_sum(clip_factors(engine.per_sample_norms(), C))
        engine.clear()
        grads = noisy_mean(s, noise_multiplier=SIGMA, max_grad_norm=C, expected_batch_size=batch_size,
                           generator=derive_generator(0, 2, 0, device=device))
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()

    stages = {"plain": plain, "recorded": recorded, "norms": norms, "sums": sums, "full": full}
    times: dict[str, list[float]] = {k: [] for k in stages}
    for fn in stages.values():
        fn()
        fn()
    for _ in range(rounds):
        for name, fn in stages.items():
            if name == "plain":
                engine.stop()  # hooks in place but not recording: the plain step pays two attribute checks per layer
            times[name].append(clock(fn))
    t = {k: statistics.median(v) for k, v in times.items()}
    engine.remove()
    return {"non-private step": t["plain"], "recorded forward + backward": t["recorded"],
            "per-sample norms": t["norms"] - t["recorded"], "clipped sums": t["sums"] - t["norms"],
            "noise, normalization, update": t["full"] - t["sums"], "lightning-dp step": t["full"]}


def layer_breakdown(model_name: str, batch_size: int, device: str, rounds: int = 9,
                    clock_fn=time.perf_counter) -> list[dict[str, object]]:
    """Per recorded layer of one step, in ms (median of ``rounds``, each part timed alone on that step's records,
    so cache-warm): ``plain``, the layer's backward for its trainable parameters alone (its forward run again on the
    recorded inputs outside the engine, then ``torch.autograd.grad`` of its outputs for its parameters: what the
    plain step's backward spends on that layer's weight gradients, as the input gradient, which both steps compute,
    is left out); ``private``, what lightning-dp's step spends on the layer's per-sample gradients instead (its rule's
    contributions from the records, their squared norms and one clipped sum). The difference is what the private
    step adds at that layer beyond the recorded forward and backward (see breakdown()). A fused recurrent kernel
    (oneDNN's LSTM) computes every gradient of its backward at once: its ``plain`` is the layer's whole backward."""
    from lightning_dp.privacy.grad_sample.engine import _LayerView

    make_model, make_batch, _, per_example = MODELS[model_name]
    torch.manual_seed(0)
    model = _parametrized(make_model()).to(device).train()
    batch = tuple(t.to(device) for t in make_batch(batch_size, torch.Generator().manual_seed(0)))
    engine = GradSampleEngine(model)
    big = tuple(t.to(device) for t in make_batch(7, torch.Generator().manual_seed(7)))
    probes = {n: tuple(t[:n] for t in big) for n in (3, 5, 7)}
    engine.probe(lambda n: per_example(model(probes[n][0]), probes[n]).mean())
    with engine.record(batch_size=batch_size):
        per_example(model(batch[0]), batch).mean().backward()
    b = engine.batch_size()
    factors = torch.rand(b, device=device)

    def clock(fn) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = clock_fn()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return (clock_fn() - t0) * 1e3

    rows = []
    for layer in engine.layers:
        if not layer.calls:
            continue
        records = engine._records(layer, b)
        view = _LayerView(engine, layer)

        def private(layer=layer, records=records, view=view):
            for c in layer.rule.contributions(view, records, b).values():
                c.sq_norms()
                c.weighted_sum(factors)

        params = list(layer.trainable.values())
        with view.replaying(), torch.enable_grad():
            outs = []
            for r in records:  # the module's own forward (fused kernels and all) on the recorded call
                out = layer.module(*r.call_args, **r.call_kwargs)
                outs += [o for o in torch.utils._pytree.tree_leaves(out)
                         if isinstance(o, Tensor) and o.requires_grad and o.is_floating_point()]
        grads = [torch.randn_like(o) for o in outs]

        def plain(outs=outs, grads=grads, params=params):
            torch.autograd.grad(outs, params, grads, retain_graph=True, allow_unused=True)

        for fn in (private, plain):
            fn()
        times: dict[str, list[float]] = {"private": [], "plain": []}
        for _ in range(rounds):
            times["private"].append(clock(private))
            times["plain"].append(clock(plain))
        rows.append({"layer": layer.name or "(model)", "type": type(layer.module).__name__,
                     "rule": type(layer.rule).__name__,
                     "plain": statistics.median(times["plain"]), "private": statistics.median(times["private"])})
    engine.clear()
    engine.remove()
    return rows


def _try_build(method, model_name, batch_size, device):
    try:
        fn = build(method, model_name, batch_size, device)
        fn()  # a first step: some methods only fail when they run
        return fn, None
    except Exception as err:  # noqa: BLE001  (report any failure of a method as a result)
        return None, f"{type(err).__name__}: {str(err).splitlines()[0][:150]}"


def time_all(methods, model_name, batch_size, rounds, steps, device, counts=None, clock=time.perf_counter):
    """Median seconds per step of every method (interleaved rounds); with a dict ``counts``, also each method's
    operation counts per step (:func:`count_ops`, measured after the timing, so the profiler does not slow it).
    ``clock``: ``time.perf_counter`` (wall) or ``time.thread_time`` (this thread's CPU time: one thread only)."""
    built = {m: _try_build(m, model_name, batch_size, device) for m in methods}
    fns = {m: fn for m, (fn, _) in built.items() if fn is not None}
    errors = {m: err for m, (_, err) in built.items() if err is not None}
    for fn in fns.values():  # warm-up
        for _ in range(2):
            fn()
    times: dict[str, list[float]] = {m: [] for m in fns}
    for _ in range(rounds):
        for m, fn in fns.items():
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = clock()
            for _ in range(steps):
                fn()
            if device == "cuda":
                torch.cuda.synchronize()
            times[m].append((clock() - t0) / steps)
    if counts is not None:
        for m, fn in fns.items():
            counts[m] = count_ops(fn, device)
    return {m: statistics.median(v) for m, v in times.items()}, errors


def _rss_peak_mib() -> float:
    """This process' peak resident set size (MiB) since the last :func:`_reset_rss_peak`."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rss_now_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _reset_rss_peak() -> None:
    # Linux: writing 5 to clear_refs resets VmHWM to the current RSS. (ru_maxrss is useless
    # here: a child inherits its parent's high-water mark through fork.)
    Path("/proc/self/clear_refs").write_text("5")


def measure_memory(method: str, model_name: str, batch_size: int, device: str) -> float:
    """MiB of peak memory above the state after set-up and one step, over 5 steps (run in a fresh process)."""
    fn = build(method, model_name, batch_size, device)
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    base = _rss_now_mib()
    _reset_rss_peak()
    for _ in range(5):
        fn()
    return _rss_peak_mib() - base


def peak_memory(method: str, model_name: str, batch_size: int, device: str) -> float | None:
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); import bench_dp_step as b; "
            f"b.PARAMETRIZE = {PARAMETRIZE!r}; "
            f"print(b.measure_memory({method!r}, {model_name!r}, {batch_size}, {device!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        return None
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mnist_cnn", choices=sorted(MODELS))
    parser.add_argument("--batch-size", type=int, help="default: the model's (see the module docstring)")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds (median is reported)")
    parser.add_argument("--steps", type=int, default=3, help="steps per method per round")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                        help=f"comma-separated, from {METHODS} (default: all but lightning_dp_compiled)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's, 2 on the CI machine)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: elapsed time; cpu: the CPU time of the thread that runs the steps (needs --threads "
                             "1 and --device cpu: on a machine shared with other work, the time the step computed "
                             "rather than the time it waited for a core)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--breakdown", action="store_true",
                        help="only: where lightning-dp's step spends its time (see breakdown())")
    parser.add_argument("--layers", action="store_true",
                        help="only: per recorded layer, the plain step's weight gradient against lightning-dp's "
                             "per-sample gradients, norms and clipped sum (see layer_breakdown())")
    parser.add_argument("--count-ops", action="store_true",
                        help="also count each method's operations per step: aten operator calls on the CPU (those "
                             "dispatched from outside another aten operator, and all), CUDA kernel launches on a "
                             "GPU, Python function calls (see count_ops())")
    parser.add_argument("--profile", metavar="METHOD",
                        help="only: torch.profiler's table of METHOD's step (the operators by their own CPU time, "
                             "and the host-device synchronizations)")
    parser.add_argument("--malloc", choices=("system", "keep"), default="system",
                        help="system: the C allocator as it is (what a Lightning script gets); keep: glibc keeps "
                             "freed memory for the next step, as the lightning-dp commands set it "
                             "(lightning_dp.config.allocator; docs/benchmarks.md, '... and the C allocator')")
    parser.add_argument("--parametrize", choices=PARAMETRIZATIONS,
                        help="every nn.Linear and convolution of the model parametrized by "
                             "torch.nn.utils.parametrizations.<this>, in every method (the plain step's too)")
    args = parser.parse_args(argv)
    global PARAMETRIZE
    PARAMETRIZE = args.parametrize
    if args.malloc == "keep":
        from lightning_dp.config.allocator import keep_freed_memory

        # and in the processes this one starts (peak memory, one fresh process per method)
        if not keep_freed_memory(children=True):
            parser.error("--malloc keep needs glibc (Linux)")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and (torch.get_num_threads() != 1 or args.device != "cpu"):
        parser.error("--clock cpu times the calling thread alone: pass --threads 1 and --device cpu")
    batch_size = args.batch_size or MODELS[args.model][2]
    if args.profile:
        profile(args.profile, args.model, batch_size, args.device)
        return
    if args.layers:
        clock_name = "thread CPU time" if args.clock == "cpu" else "wall clock"
        print(f"{args.model}, batch {batch_size}, device {args.device}, threads {torch.get_num_threads()}; per layer, ms "
              f"(median, {clock_name}): the plain step's weight gradients / lightning-dp's per-sample gradients, norms "
              "and clipped sum")
        rows = layer_breakdown(args.model, batch_size, args.device,
                               clock_fn=time.thread_time if args.clock == "cpu" else time.perf_counter)
        width = max(len(str(r["layer"])) for r in rows) + 2
        for r in rows:
            print(f"{str(r['layer']):<{width}} {str(r['type']):<18} {r['plain']:8.2f} {r['private']:8.2f}  "
                  f"+{r['private'] - r['plain']:.2f}  ({r['rule']})")
        total_plain, total_private = sum(r["plain"] for r in rows), sum(r["private"] for r in rows)
        print(f"{'all layers':<{width}} {'':<18} {total_plain:8.2f} {total_private:8.2f}  "
              f"+{total_private - total_plain:.2f}")
        return
    if args.breakdown:
        parts = breakdown(args.model, batch_size, args.device)
        print(f"{args.model}, batch {batch_size}, device {args.device}, threads {torch.get_num_threads()}")
        for name, ms in parts.items():
            print(f"{name:<32} {ms:8.2f} ms")
        return
    methods = args.methods.split(",")
    if "nonprivate" not in methods:
        methods.insert(0, "nonprivate")
    counts: dict[str, dict[str, float]] | None = {} if args.count_ops else None
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    times, errors = time_all(methods, args.model, batch_size, args.rounds, args.steps, args.device, counts, clock)
    memory = {} if args.no_memory else {m: peak_memory(m, args.model, batch_size, args.device) for m in times}
    base = times["nonprivate"]
    print(f"{args.model}{f' ({PARAMETRIZE})' if PARAMETRIZE else ''}, batch {batch_size}, device {args.device}, "
          f"torch {torch.__version__}, threads "
          f"{torch.get_num_threads()}, {args.rounds} rounds x {args.steps} steps, {args.clock} clock")
    keys = [k for k in ("aten", "aten_all", "kernels", "python") if counts and k in counts.get("nonprivate", {})]
    header = "".join(f" {k:>9}" for k in keys)
    print(f"{'method':<21} {'ms/step':>9} {'x non-private':>14} {'peak MiB':>9}{header}")
    for m in methods:
        if m in errors:
            print(f"{m:<21} failed: {errors[m]}")
            continue
        mem = f"{memory[m]:9.1f}" if memory.get(m) is not None else f"{'-':>9}"
        ops = "".join(f" {counts[m][k]:9.0f}" for k in keys) if counts else ""
        print(f"{m:<21} {times[m] * 1e3:9.2f} {times[m] / base:14.2f} {mem}{ops}")
    if keys:
        print("per step: aten = aten operator calls not nested in another (each pays its dispatch), aten_all = all "
              "of them" + (", kernels = CUDA kernel launches" if "kernels" in keys else "")
              + ", python = Python function calls")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "times_s": times, "errors": errors,
                                         "ratio": {m: t / base for m, t in times.items()},
                                         "peak_mib": memory, "batch_size": batch_size, "op_counts": counts},
                                        indent=2))


if __name__ == "__main__":
    main()
