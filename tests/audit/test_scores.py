"""The loss attack's scores: per-example losses equal a naive per-example loop for classification and token batches,
a module's own per_example_loss wins, the mode is restored, and an overfitted model's members score higher."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.audit.scores import loss_scores, per_example_losses
from lightning_dp.audit.statistics import roc


def test_classification_losses_equal_a_per_example_loop_and_the_mode_is_restored():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.5), nn.Linear(8, 3))
    x, y = torch.randn(10, 5), torch.randint(3, (10,))
    model.train()
    got = per_example_losses(model, DataLoader(TensorDataset(x, y), batch_size=4))
    assert model.training  # restored
    model.eval()
    want = [float(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1])) for i in range(10)]  # eval: no dropout
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(loss_scores(model, DataLoader(TensorDataset(x, y), batch_size=3)), -got, rtol=1e-6)


class _TinyLM(nn.Module):
    def __init__(self, vocab=11):
        super().__init__()
        self.embed, self.out = nn.Embedding(vocab, 6), nn.Linear(6, vocab)

    def forward(self, ids):
        return self.out(torch.tanh(self.embed(ids)))


def test_token_batches_are_scored_by_their_mean_next_token_loss():
    torch.manual_seed(1)
    model = _TinyLM()
    ids = torch.randint(11, (5, 7))
    got = per_example_losses(model, [ids[:2], ids[2:]])
    for i in range(5):
        logits = model(ids[i:i + 1])[0]
        want = float(np.mean([float(F.cross_entropy(logits[t:t + 1], ids[i, t + 1:t + 2])) for t in range(6)]))
        assert got[i] == pytest.approx(want, rel=1e-5)


def test_a_modules_own_per_example_loss_wins_and_bad_batches_are_refused():
    class Custom(nn.Linear):
        def per_example_loss(self, batch):
            return batch.sum(1) * 0 + 7.0

    assert per_example_losses(Custom(2, 2), [torch.ones(3, 2)]).tolist() == [7.0, 7.0, 7.0]
    with pytest.raises(ValueError, match="per_example_loss"):
        per_example_losses(nn.Linear(2, 2), [{"x": torch.ones(2, 2)}])


def test_an_overfitted_models_members_have_higher_loss_scores():
    """An MLP fitted to 100 of scikit-learn's 8x8 digits for 300 full-batch Adam steps: its members' loss scores
    separate from 300 other digits' (AUC > 0.75; the members' training loss is near 0)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    members, others = slice(0, 100), slice(100, 400)
    for _ in range(300):
        opt.zero_grad()
        F.cross_entropy(model(x[members]), y[members]).backward()
        opt.step()
    scores_in = loss_scores(model, [(x[members], y[members])])
    scores_out = loss_scores(model, [(x[others], y[others])])
    assert roc(scores_in, scores_out).auc > 0.75


def test_the_projects_lightning_modules_are_scored_by_the_defaults():
    """ImageClassifier batches (x, y) and CausalLanguageModel batches of token ids: the defaults give the losses
    their validation steps average."""
    from lightning_dp.models import GPT2, MLP, CausalLanguageModel, ImageClassifier
    from lightning_dp.models.language import per_example_token_loss

    torch.manual_seed(2)
    classifier = ImageClassifier(MLP(in_features=4, hidden=(8,), num_classes=3), num_classes=3)
    x, y = torch.randn(6, 4), torch.randint(3, (6,))
    np.testing.assert_allclose(per_example_losses(classifier, [(x, y)]),
                               F.cross_entropy(classifier.eval()(x), y, reduction="none").detach().numpy(), rtol=1e-6)
    lm = CausalLanguageModel(GPT2(vocab_size=17, max_positions=8, embed_dim=16, num_layers=1, num_heads=2))
    ids = torch.randint(17, (3, 8))
    with torch.no_grad():
        want = per_example_token_loss(lm.eval()(ids), ids).numpy()
    np.testing.assert_allclose(per_example_losses(lm, [ids]), want, rtol=1e-5)
