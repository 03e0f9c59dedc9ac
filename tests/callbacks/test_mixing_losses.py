"""A loss that mixes the batch's examples is refused before the first step; steps that only look like it are not.

DPSGD's batch probe runs ``training_step`` on two batches of 7 training examples that share their first three,
from the same random state (:meth:`lightning_dp.privacy.grad_sample.GradSampleEngine.probe`, ``examples``): the
three's gradients at every layer's output must agree. An in-batch contrastive loss or mixup fails; random draws in
the step, dropout, random transforms of the dataset, padding to the batch's longest sequence, a mean over the
batch's non-ignored tokens and a branch on ``self.training`` pass.
"""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_dp.callbacks import DPSGD
from tests.helpers import BlobsData, Classifier, trainer


class InfoNCE(Classifier):
    """SimCLR-style: two noisy views of each example, each view's negatives the batch's other examples."""

    def training_step(self, batch, batch_idx):
        x, _ = batch
        z1 = F.normalize(self(x + 0.1 * torch.randn_like(x)), dim=1)
        z2 = F.normalize(self(x + 0.1 * torch.randn_like(x)), dim=1)
        return F.cross_entropy(z1 @ z2.T / 0.5, torch.arange(len(x)))


class Mixup(Classifier):
    """mixup across the batch: each example is blended with another example of it."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        lam, perm = 0.7, torch.randperm(len(x))
        logits = self(lam * x + (1 - lam) * x[perm])
        return lam * F.cross_entropy(logits, y) + (1 - lam) * F.cross_entropy(logits, y[perm])


class CentredCritic(Classifier):
    """A linear critic on batch-centred inputs, its loss linear in the score (a review's case): the gradient reaching
    the layer's output is each example's own, its input (x_i - mean(x)) is not. Seen at the layer's inputs."""

    def __init__(self):
        super().__init__(net=nn.Sequential(nn.Linear(6, 1)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return (self(x - x.mean(0)).squeeze(1) * ((y == 0).float() * 2 - 1)).mean()


class InfoNCEWithAux(InfoNCE):
    """The loss Lightning trains on is the dict's "loss", not its first scalar (a review's case: the check
    differentiated "align", which mixes nothing)."""

    def training_step(self, batch, batch_idx):
        x, _ = batch
        z1 = F.normalize(self(x + 0.1 * torch.randn_like(x)), dim=1)
        z2 = F.normalize(self(x + 0.1 * torch.randn_like(x)), dim=1)
        return {"align": (z1 * z2).sum(1).mean(), "loss": F.cross_entropy(z1 @ z2.T / 0.5, torch.arange(len(x)))}


@pytest.mark.parametrize("module", [InfoNCE, Mixup, CentredCritic, InfoNCEWithAux])
def test_a_loss_that_mixes_the_examples_is_refused_before_any_step(module):
    torch.manual_seed(0)  # mixup's permutation keeps the three common examples among themselves 6 times in 210
    model = module()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fit = trainer(max_steps=2, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)])
    with pytest.raises(MisconfigurationException, match=r"DPSGD cannot clip per example: the loss mixes the examples "
                                                        r"of the batch: what layer net\.0 \(Linear\)"):
        fit.fit(model, BlobsData())
    assert fit.global_step == 0
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


class Augmented(Classifier):
    """Random draws of every kind in the step: noise on the inputs, dropout, a random branch; a mean plus a sum."""

    def __init__(self):
        super().__init__(net=nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 3)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if torch.rand(()) < 0.5:
            x = x.flip(1)
        logits = self(x + 0.2 * torch.randn_like(x))
        return F.cross_entropy(logits, y) + 0.01 * F.cross_entropy(logits, y, reduction="sum")


class Noisy(Dataset):
    """Random per-example transforms in ``__getitem__`` (torch's generator, as a transform pipeline draws)."""

    def __init__(self, n: int = 60):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.3 * torch.randn(6), self.y[i]


def test_random_draws_dropout_and_random_transforms_are_not_refused():
    fit = trainer(max_steps=3, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)])
    fit.fit(Augmented(), DataLoader(Noisy(), batch_size=10))
    assert fit.global_step == 3


VOCAB = 30


class Padded(Dataset):
    """Token sequences of 2 to 9 tokens: the collate pads each batch to its longest, so that the two probe batches
    have other lengths (their layers' outputs are not compared; nothing is refused)."""

    def __init__(self, n: int = 40):
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(2, 10, (n,), generator=g)
        self.seqs = [torch.randint(1, VOCAB, (int(t),), generator=g) for t in lengths]

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        return self.seqs[i]


def pad(seqs):
    ids = nn.utils.rnn.pad_sequence(seqs, batch_first=True)
    return ids[:, :-1], torch.where(ids[:, 1:] == 0, -100, ids[:, 1:])


class TokenModel(Classifier):
    """Next-token prediction, mean over the batch's non-ignored tokens; a branch on ``self.training``."""

    def __init__(self):
        super().__init__(net=nn.Sequential(nn.Embedding(VOCAB, 8), nn.Tanh(), nn.Linear(8, VOCAB)))

    def forward(self, ids):
        h = self.net[1](self.net[0](ids))
        if not self.training:
            h = h * 0.0  # a branch eval mode takes: the probe runs the step as training does
        return self.net[2](h)

    def training_step(self, batch, batch_idx):
        ids, targets = batch
        return F.cross_entropy(self(ids).flatten(0, 1), targets.flatten(), ignore_index=-100)


@pytest.mark.parametrize("same_length", [False, True])
def test_padding_ignored_tokens_and_an_eval_branch_are_not_refused(same_length):
    data = Padded()
    if same_length:
        data.seqs = [torch.cat([s, torch.zeros(9 - len(s), dtype=s.dtype)]) for s in data.seqs]  # shapes agree
    fit = trainer(max_steps=3, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)])
    fit.fit(TokenModel(), DataLoader(data, batch_size=8, collate_fn=pad))
    assert fit.global_step == 3


def test_the_probe_puts_back_buffers_a_training_forward_moves():
    """A spectral norm's power iteration moves its vectors in place on every training forward: the two batches of
    the independence check must start from the same ones (else their gradients differ without any mixing), and the
    first step from those the module had."""
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    nn.utils.parametrizations.spectral_norm(net[0])
    model = Classifier(net=net)
    u = net[0].parametrizations.weight[0]._u
    before = u.clone()
    seen = {}

    class AfterProbe(L.Callback):  # after DPSGD's on_train_batch_start, where the probe runs
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.setdefault("u", net[0].parametrizations.weight[0]._u.clone())

    fit = trainer(max_steps=1, callbacks=[DPSGD(noise_multiplier=1.0, seed=0), AfterProbe()])
    fit.fit(model, BlobsData())
    assert torch.equal(seen["u"], before)
    assert not torch.equal(u, before)  # the step's own forward moved it


class Masked(Dataset):
    """BERT-style masking in ``__getitem__``: one random draw per token of sequences of different lengths, padded to
    a fixed length (a review's case: the dataset drew a data-dependent count of numbers, so the step's dropout masks
    differed between the probe batches; the step now starts from the random state the collation started from)."""

    def __init__(self, n: int = 40, length: int = 12):
        g = torch.Generator().manual_seed(0)
        self.length = length
        self.seqs = [torch.randint(2, VOCAB, (int(t),), generator=g) for t in torch.randint(3, length + 1, (n,),
                                                                                           generator=g)]

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        s = self.seqs[i]
        m = torch.rand(len(s)) < 0.3
        pad = self.length - len(s)
        return F.pad(torch.where(m, torch.ones_like(s), s), (0, pad)), F.pad(torch.where(m, s, -100), (0, pad),
                                                                            value=-100)


class MaskedModel(Classifier):
    def __init__(self):
        super().__init__(net=nn.Sequential(nn.Embedding(VOCAB, 16), nn.Tanh(), nn.Dropout(0.1),
                                           nn.Linear(16, VOCAB)))
        self.temperature = torch.tensor(2.0)  # annealed in place, used in the graph (a review's case: put back
        # in place before the probe differentiated the batch's result, it failed autograd's version check)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.temperature.mul_(0.999)
        per = F.cross_entropy(self(x).flatten(0, 1) / self.temperature, y.flatten(), ignore_index=-100,
                              reduction="none").view(len(x), -1)
        return per.sum(1).mean()


def test_draws_of_the_dataset_and_a_tensor_changed_in_place_are_not_refused():
    model = MaskedModel()
    fit = trainer(max_steps=2, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)])
    fit.fit(model, DataLoader(Masked(), batch_size=8))
    assert fit.global_step == 2
    assert torch.allclose(model.temperature, torch.tensor(2.0 * 0.999 ** 2))  # the probe's changes undone


class PackedRNN(Classifier):
    """An LSTM on a PackedSequence of unequal lengths: the packed tensors (tokens sorted by length, the order) are
    not per example, and are not compared."""

    def __init__(self):
        super().__init__(net=nn.Sequential(nn.Embedding(VOCAB, 8, padding_idx=0), nn.LSTM(8, 8, batch_first=True),
                                           nn.Linear(8, 3)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        lengths = (x != 0).sum(1).clamp(min=1)
        packed = nn.utils.rnn.pack_padded_sequence(self.net[0](x), lengths, batch_first=True, enforce_sorted=False)
        _, (h, _) = self.net[1](packed)
        return F.cross_entropy(self.net[2](h[-1]), y % 3)


def test_a_packed_sequence_is_not_refused():
    fit = trainer(max_steps=2, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)])
    data = Padded()
    data.seqs = [torch.cat([s, torch.zeros(9 - len(s), dtype=s.dtype)]) for s in data.seqs]
    fit.fit(PackedRNN(), DataLoader([(s, s[0]) for s in data.seqs], batch_size=8))
    assert fit.global_step == 2


class TokenMeanPlusAux(TokenModel):
    """A mean over the batch's non-ignored tokens plus a second term (a z-loss): two batch-level factors, so the
    common examples' gradients are no longer proportional. Refused, with that cause named."""

    def training_step(self, batch, batch_idx):
        ids, targets = batch
        logits = self(ids)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100) + \
            1e-2 * (logits.logsumexp(-1) ** 2).mean()


def test_a_token_mean_with_another_term_is_refused_with_its_cause():
    data = Padded()
    data.seqs = [torch.cat([s, torch.zeros(9 - len(s), dtype=s.dtype)]) for s in data.seqs]
    fit = trainer(max_steps=2, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)])
    with pytest.raises(MisconfigurationException, match=r"a batch-level scalar in one of several terms of the loss "
                                                        r"\(a mean over the batch's non-ignored tokens plus another"):
        fit.fit(TokenMeanPlusAux(), DataLoader(data, batch_size=8, collate_fn=pad))


def sorted_pad(seqs):
    """Pads the batch and sorts it by length, longest first (pack_padded_sequence(enforce_sorted=True) needs it):
    the collation moves the examples, so the check has no common rows to compare and is skipped."""
    seqs = sorted(seqs, key=len, reverse=True)
    lengths = torch.tensor([len(s) for s in seqs])
    ids = nn.utils.rnn.pad_sequence(seqs, batch_first=True)
    return ids, lengths


class SortedRNN(Classifier):
    def __init__(self):
        super().__init__(net=nn.Sequential(nn.Embedding(VOCAB, 8, padding_idx=0), nn.GRU(8, 8, batch_first=True),
                                           nn.Linear(8, 3)))

    def training_step(self, batch, batch_idx):
        ids, lengths = batch
        packed = nn.utils.rnn.pack_padded_sequence(self.net[0](ids), lengths, batch_first=True)
        _, h = self.net[1](packed)
        return F.cross_entropy(self.net[2](h[-1]), ids[:, 0] % 3)


def test_a_collation_that_sorts_the_batch_is_not_refused():
    fit = trainer(max_steps=2, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)])
    fit.fit(SortedRNN(), DataLoader(Padded(), batch_size=8, collate_fn=sorted_pad))
    assert fit.global_step == 2


class Diagnosed(Classifier):
    """A diagnostic forward under no_grad on the batch reordered (a review's case): no gradient comes from it, and
    its inputs are not compared."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        with torch.no_grad():
            self.log("nonprivate/sorted_logit_mean", self(x[torch.argsort(y, stable=True)]).mean())
        return loss


class DroppedTokens(TokenModel):
    """Dropout on (B, T, d) with padding to the batch's longest sequence (a review's case: the mask's layout follows
    the batch's longest sequence). Dropout modules are off for the check, and batches of other shapes not compared."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.1)

    def forward(self, ids):
        return self.net[2](self.drop(self.net[1](self.net[0](ids))))


class StackedPacked(Classifier):
    """Two one-layer LSTMs with nn.Dropout between them on a PackedSequence: what the refusal of LSTM(dropout=p)
    advises (a review's case: the packed tokens are sorted by length, so which dropout draws an example gets
    depends on the others' lengths)."""

    def __init__(self):
        super().__init__(net=nn.ModuleList([nn.Embedding(VOCAB, 8, padding_idx=0), nn.LSTM(8, 8, batch_first=True),
                                            nn.Dropout(0.3), nn.LSTM(8, 8, batch_first=True), nn.Linear(8, 3)]))

    def training_step(self, batch, batch_idx):
        x, y = batch
        embed, first, drop, second, out = self.net
        lengths = (x != 0).sum(1).clamp(min=1)
        packed = nn.utils.rnn.pack_padded_sequence(embed(x), lengths, batch_first=True, enforce_sorted=False)
        h, _ = first(packed)
        _, (h, _) = second(h._replace(data=drop(h.data)))
        return F.cross_entropy(out(h[-1]), y % 3)


class OwnGenerators(Dataset):
    """Per-example noise from generators of the dataset's own (NumPy's default_rng, a torch.Generator) and of the
    module (a review's case: the probe reset only the global ones)."""

    def __init__(self, n: int = 40):
        self.data = Noisy(n)
        self.rng, self.gen = np.random.default_rng(0), torch.Generator().manual_seed(0)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        x, y = self.data.x[i], self.data.y[i]
        noise = torch.as_tensor(self.rng.normal(size=tuple(x.shape)), dtype=x.dtype)
        return x + 0.1 * noise + 0.1 * torch.randn(x.shape, generator=self.gen), y


class OwnGenerator(Classifier):
    def __init__(self):
        super().__init__()
        self.gen = torch.Generator().manual_seed(1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x + 0.1 * torch.randn(x.shape, generator=self.gen)), y)


class Scheduled(Classifier):
    """A step counter of its own feeding a public schedule (a review's case: the probe did not put Python numbers
    back, so the two probe batches ran at other points of the schedule)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.calls += 1
        return F.cross_entropy(self(x * (1.0 + 0.5 / self.calls)), y)


@pytest.mark.parametrize("case", ["no_grad", "dropout_padded", "dropout_packed", "own_generators", "counter"])
def test_what_a_review_found_refused_is_not(case):
    data = Padded()
    fixed = [torch.cat([s, torch.zeros(9 - len(s), dtype=s.dtype)]) for s in data.seqs]
    model, loader = {
        "no_grad": lambda: (Diagnosed(), DataLoader(Noisy(), batch_size=8)),
        "dropout_padded": lambda: (DroppedTokens(), DataLoader(data, batch_size=8, collate_fn=pad)),
        "dropout_packed": lambda: (StackedPacked(), DataLoader([(s, s[0]) for s in fixed], batch_size=8)),
        "own_generators": lambda: (OwnGenerator(), DataLoader(OwnGenerators(), batch_size=8)),
        "counter": lambda: (Scheduled(), DataLoader(Noisy(), batch_size=8)),
    }[case]()
    states = [g.bit_generator.state if isinstance(g, np.random.Generator) else g.get_state()
              for g in ([loader.dataset.rng, loader.dataset.gen, model.gen] if case == "own_generators" else [])]
    fit = trainer(max_steps=2, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)], num_sanity_val_steps=0)
    if case == "own_generators":  # the probe leaves them as they were: compared before the first step
        seen = {}

        class AfterProbe(L.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                seen.setdefault("model", model.gen.get_state())

        fit.callbacks.append(AfterProbe())
    fit.fit(model, loader)
    assert fit.global_step == 2
    if case == "counter":
        assert model.calls == 2
    if case == "own_generators":
        assert torch.equal(seen["model"], states[2])


def test_the_refusal_says_what_changed():
    with pytest.raises(MisconfigurationException, match=r"what layer net\.0 \(Linear\) \(inputs\) received changed"):
        trainer(max_steps=1, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)]).fit(CentredCritic(), BlobsData())


# ------------------------------------------------------------------ a third review's cases
class Table:
    """Slots and a __getattr__ that raises KeyError: the generators' walk reads no attribute through it."""

    __slots__ = ("_t",)

    def __init__(self):
        object.__setattr__(self, "_t", {"scale": 2.0})

    def __getattr__(self, key):
        return self._t[key]


class ListData(list):
    """A dataset that subclasses list, its __getitem__ user code (the walk called it with a slice: a crash)."""

    table = None

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x * (self.table.scale if self.table is not None else 1.0), y


class WithArrays(Dataset):
    """Each example's raw NumPy array kept in a list beside the stacked tensors (compared as arrays), with a NaN in
    every example's features (NaN equals NaN for the check: an InfoNCE over them is refused, not skipped)."""

    def __init__(self):
        self.data = Noisy()

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        x = self.data.x[i].clone()
        x[0] = float("nan")
        return x, self.data.y[i], x.numpy().copy()


def with_arrays(items):
    xs, ys, raw = zip(*items)
    return torch.stack(xs), torch.stack(ys), list(raw)


class NoiseLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.g = torch.Generator().manual_seed(0)

    def forward(self, x):
        return x + 0.1 * torch.randn(x.shape, generator=self.g) if self.training else x


class Odd(Classifier):
    """A noise layer with its own generator two submodules deep, a random.SystemRandom it holds (no state to read),
    an attribute rebound from a float to an array."""

    def __init__(self, mixing: bool = False):
        super().__init__(net=nn.Sequential(nn.Sequential(nn.Linear(6, 16), NoiseLayer(), nn.Tanh(),
                                                         nn.Linear(16, 3))))
        self.entropy = __import__("random").SystemRandom()
        self.last = 0.0
        self.mixing = mixing

    def training_step(self, batch, batch_idx):
        x, y = batch[0].nan_to_num(), batch[1]
        self.last = y.numpy()
        if self.mixing:
            z = F.normalize(self(x), dim=1)
            return F.cross_entropy(z @ z.T / 0.1, torch.arange(len(x)))
        return F.cross_entropy(self(x), y)


@pytest.mark.parametrize("data", ["list", "arrays"])
def test_odd_datasets_and_attributes_neither_crash_nor_are_refused(data):
    if data == "list":
        items = ListData([(x, y) for x, y in zip(Noisy().x, Noisy().y)])
        items.table = Table()
        loader = DataLoader(items, batch_size=8)
    else:
        loader = DataLoader(WithArrays(), batch_size=8, collate_fn=with_arrays)
    fit = trainer(max_steps=2, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)])
    fit.fit(Odd(), loader)
    assert fit.global_step == 2


def test_a_mixing_loss_over_features_with_nan_is_refused():
    fit = trainer(max_steps=2, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)])
    with pytest.raises(MisconfigurationException, match="the loss mixes the examples"):
        fit.fit(Odd(mixing=True), DataLoader(WithArrays(), batch_size=8, collate_fn=with_arrays))


def test_a_collation_that_sorts_the_batch_is_skipped_with_a_warning():
    fit = trainer(max_steps=1, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)])
    with pytest.warns(UserWarning, match=r"DPSGD could not check that SortedRNN's loss keeps the examples apart \(the "
                                         r"batch probe's two batches with the same first 3 examples hold them in "
                                         r"other rows: the collate function reorders the batch\)"):
        fit.fit(SortedRNN(), DataLoader(Padded(), batch_size=8, collate_fn=sorted_pad))


# ------------------------------------------------------------------ a fourth review's cases
class Deep(Classifier):
    """Hundreds of modules (a ResNet-101's count) besides the dataset's generator: each is walked with its own bound
    (a review's case: one shared bound ran out on the modules before the dataset, whose noise then differed)."""

    def __init__(self):
        super().__init__()
        self.idle = nn.Sequential(*(nn.Identity() for _ in range(500)))


def rank_collate(items):
    """Keeps the batch's order and adds each example's rank in the batch (a listwise loss would read it): a leaf
    that changes with the other examples, which matched by chance and read as a reordering (a review's case)."""
    xs, ys = zip(*items)
    x = torch.stack(xs)
    return x, torch.stack(ys), x[:, 1].argsort().argsort()


class RankedInfoNCE(InfoNCE):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch[:2], batch_idx)


class Meta:
    """Per-example metadata without an equality of its own: compared by identity, which says nothing."""

    def __init__(self, i):
        self.i = i


def sorted_with_meta(seqs):
    ids, lengths = sorted_pad(seqs)
    return ids, lengths, [Meta(int(n)) for n in lengths]


class SortedRNNMeta(SortedRNN):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch[:2], batch_idx)


def test_a_fourth_reviews_cases():
    fit = trainer(max_steps=1, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)])
    fit.fit(Deep(), DataLoader(OwnGenerators(), batch_size=8))  # the dataset's generators found and set back
    assert fit.global_step == 1

    torch.manual_seed(0)
    fit = trainer(max_steps=1, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)])
    with pytest.raises(MisconfigurationException, match="the loss mixes the examples"):  # checked, not skipped
        fit.fit(RankedInfoNCE(), DataLoader(list(zip(Noisy().x, Noisy().y)), batch_size=8, collate_fn=rank_collate))

    fit = trainer(max_steps=1, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)])
    with pytest.warns(UserWarning, match="the collate function reorders the batch"):  # skipped, not refused
        fit.fit(SortedRNNMeta(), DataLoader(Padded(), batch_size=8, collate_fn=sorted_with_meta))
    assert fit.global_step == 1


# ------------------------------------------------------------------ a fifth review's cases
class ModuleTransformed(Dataset):
    """A dataset whose transform is an nn.Module holding its own generator, not a submodule of the model (a
    review's case: the walk skipped every module but the model's own), and a large attribute before its NumPy
    generator (a review's case: depth first, the bound ran out in it; breadth first, the generator is found)."""

    def __init__(self):
        self.meta = {f"s{i}": [(f"p{i}_{j}", "tag") for j in range(40)] for i in range(40)}
        self.data = Noisy()
        self.transform = nn.Sequential(NoiseLayer())
        self.rng = np.random.default_rng(0)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        x = self.transform(self.data.x[i]) + torch.as_tensor(self.rng.normal(size=6), dtype=torch.float32)
        return x, self.data.y[i]


class Record:
    """A stored example record without an equality of its own: the same object on every access."""

    def __init__(self, x, y):
        self.x, self.y = x, y


class Records(Dataset):
    def __init__(self):
        self.items = [Record(x, y) for x, y in zip(Noisy().x, Noisy().y)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class RecordsClassifier(Classifier):
    def training_step(self, batch, batch_idx):
        return super().training_step((torch.stack([r.x for r in batch]), torch.stack([r.y for r in batch])), 0)


def test_a_fifth_reviews_cases():
    fit = trainer(max_steps=1, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)])
    fit.fit(Classifier(), DataLoader(ModuleTransformed(), batch_size=8))
    assert fit.global_step == 1

    fit = trainer(max_steps=1, callbacks=[DPSGD(noise_multiplier=1.0, seed=0)])
    with pytest.warns(UserWarning, match="the collate function reorders the batch"):  # the records by identity
        fit.fit(RecordsClassifier(), DataLoader(Records(), batch_size=8,
                                                collate_fn=lambda rs: sorted(rs, key=lambda r: float(r.x[0]))))
    assert fit.global_step == 1
