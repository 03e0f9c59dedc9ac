"""Noisy neighbours: the embedding layer is found (GPT-2's wte), the noise is added at its output with the caller's
generator (a manual forward with the same draws agrees), sigma = 0 gives the example itself, the draws do not depend
on the chunking, the hook and the mode are restored, and the sigma search finds an interior AUC peak on a tiny
overfitted GPT-2."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dp.audit.neighbours import (
    find_embedding,
    neighbour_losses,
    noisy_neighbour_scores,
    search_sigma,
)
from lightning_dp.audit.statistics import roc
from lightning_dp.models.language import per_example_token_loss

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny_lm(seed=0, dropout=0.1):
    from lightning_dp.models import GPT2, CausalLanguageModel

    torch.manual_seed(seed)
    return CausalLanguageModel(GPT2(vocab_size=30, max_positions=16, embed_dim=16, num_layers=1, num_heads=2,
                                    dropout=dropout))


def _ids(rows, seed=1):
    return torch.randint(30, (rows, 16), generator=torch.Generator().manual_seed(seed))


def test_find_embedding_finds_gpt2s_token_embedding_and_lists_candidates_for_a_wrong_name():
    lm = _tiny_lm()
    transformer = lm.network.model.transformer
    assert find_embedding(lm) is transformer.wte
    assert find_embedding(lm, "network.model.transformer.wpe") is transformer.wpe
    with pytest.raises(ValueError, match=r"embedding='network.wte' is no submodule.*network\.model\.transformer\.wte"):
        find_embedding(lm, "network.wte")

    class TwoTables(nn.Module):  # a position table registered before the token table: the token table's name wins
        def __init__(self):
            super().__init__()
            self.positions, self.embed_tokens = nn.Embedding(8, 4), nn.Embedding(10, 4)

    assert find_embedding(TwoTables()).num_embeddings == 10
    unnamed = nn.Sequential(nn.Embedding(5, 3), nn.Embedding(6, 3))
    assert find_embedding(unnamed) is unnamed[0]  # no known name: the first
    with pytest.raises(ValueError, match="no torch.nn.Embedding"):
        find_embedding(nn.Linear(2, 2))


def test_neighbours_are_the_models_loss_with_noise_added_at_the_embedding_output():
    """The j-th neighbour of batch b is g(wte(ids) + sigma rho) with rho the generator's draws in the order batch by
    batch, neighbour by neighbour, each of the shape of the embedding output (B, T, 16)."""
    lm = _tiny_lm()
    ids = _ids(5)
    batches, sigma, m = [ids[:3], ids[3:]], 0.3, 2
    got = neighbour_losses(lm, batches, sigma=sigma, num_neighbours=m, generator=torch.Generator().manual_seed(4))
    assert got.own.shape == (5,) and got.neighbours.shape == (5, m) and got.forward_passes == 5 * (m + 1)
    g = torch.Generator().manual_seed(4)
    gpt2 = lm.network.model.eval()
    want = np.zeros((5, m))
    with torch.no_grad():
        row = 0
        for batch in batches:
            for j in range(m):
                noisy = gpt2.transformer.wte(batch) + sigma * torch.randn(batch.shape[0], 16, 16, generator=g)
                logits = gpt2(inputs_embeds=noisy).logits
                want[row:row + batch.shape[0], j] = per_example_token_loss(logits, batch).numpy()
            row += batch.shape[0]
        own = per_example_token_loss(lm(ids), ids).numpy()
    np.testing.assert_allclose(got.neighbours, want, rtol=1e-5)
    np.testing.assert_allclose(got.own, own, rtol=1e-5)
    assert (np.abs(got.neighbours - got.own[:, None]) > 1e-3).all()  # the noise did change every loss
    np.testing.assert_allclose(got.scores, want.mean(1) - own, rtol=1e-4, atol=1e-6)


def test_sigma_zero_gives_the_example_itself():
    lm = _tiny_lm()
    got = neighbour_losses(lm, [_ids(4)], sigma=0.0, num_neighbours=3, generator=torch.Generator().manual_seed(0))
    np.testing.assert_allclose(got.neighbours, np.repeat(got.own[:, None], 3, 1), rtol=1e-5)


def test_the_draws_depend_on_the_seed_only_not_on_the_chunking():
    lm = _tiny_lm()
    batches = [_ids(3), _ids(2, seed=2)]

    def scores(seed, chunk):
        return noisy_neighbour_scores(lm, batches, sigma=0.2, num_neighbours=5, chunk=chunk,
                                      generator=torch.Generator().manual_seed(seed))

    reference = scores(0, None)  # all 5 neighbours of a batch in one forward pass
    for chunk in (1, 2, 5, 9):  # 2: passes of 2, 2 and 1 neighbours
        np.testing.assert_allclose(scores(0, chunk), reference, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(scores(0, None), reference)
    assert not np.allclose(scores(1, None), reference)


def test_the_hook_is_removed_the_mode_restored_and_the_global_rng_untouched_even_on_errors():
    lm = _tiny_lm()
    ids = _ids(4)
    wte = lm.network.model.transformer.wte
    lm.eval()
    with torch.no_grad():
        before = lm(ids)
    lm.train()
    state = torch.get_rng_state()
    neighbour_losses(lm, [ids], sigma=1.0, num_neighbours=2, generator=torch.Generator().manual_seed(0))
    assert torch.equal(torch.get_rng_state(), state)  # the noise comes from the generator only
    assert lm.training and len(wte._forward_hooks) == 0

    def failing(model, batch):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        neighbour_losses(lm, [ids], sigma=1.0, num_neighbours=2, generator=torch.Generator(), loss=failing)
    assert lm.training and len(wte._forward_hooks) == 0
    with torch.no_grad():
        assert torch.equal(lm.eval()(ids), before)


def test_classification_batches_and_a_named_embedding():
    """A bag-of-embeddings classifier scored on (ids, y) batches: both tensors are repeated per neighbour, and the
    noise at the named table's output changes the losses as a manual forward says."""

    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.table, self.head = nn.Embedding(20, 6), nn.Linear(6, 3)

        def forward(self, ids):
            return self.head(self.table(ids).mean(1))

    torch.manual_seed(0)
    model = Bag()
    ids, y = torch.randint(20, (4, 5)), torch.randint(3, (4,))
    got = neighbour_losses(model, [(ids, y)], sigma=0.5, num_neighbours=3, embedding="table",
                           generator=torch.Generator().manual_seed(2))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        want = np.stack([F.cross_entropy(model.head((model.table(ids) + 0.5 * torch.randn(4, 5, 6, generator=g))
                                                    .mean(1)), y, reduction="none").numpy() for _ in range(3)], 1)
    np.testing.assert_allclose(got.neighbours, want, rtol=1e-5)


def test_bad_arguments_are_refused():
    lm = _tiny_lm()
    ids = _ids(2)
    common = {"num_neighbours": 2, "generator": torch.Generator()}
    with pytest.raises(ValueError, match="sigma=-1"):
        neighbour_losses(lm, [ids], sigma=-1, **common)
    with pytest.raises(ValueError, match="torch.Generator"):
        neighbour_losses(lm, [ids], sigma=0.1, num_neighbours=2, generator=0)
    with pytest.raises(ValueError, match="num_neighbours=0"):
        neighbour_losses(lm, [ids], sigma=0.1, num_neighbours=0, generator=torch.Generator())
    with pytest.raises(ValueError, match="chunk=0"):
        neighbour_losses(lm, [ids], sigma=0.1, chunk=0, **common)
    with pytest.raises(ValueError, match="no example"):
        neighbour_losses(lm, [], sigma=0.1, **common)

    class Twice(nn.Module):  # an embedding that runs twice per forward: which output to perturb is ambiguous
        def __init__(self):
            super().__init__()
            self.embed, self.out = nn.Embedding(30, 4), nn.Linear(4, 30)

        def forward(self, ids):
            return self.out(self.embed(ids) + self.embed(ids))

    with pytest.raises(ValueError, match="ran 2 times"):
        neighbour_losses(Twice(), [ids], sigma=0.1, **common)
    with pytest.raises(ValueError, match="low=1.0 must be below high=0.1"):
        search_sigma(lm, [ids], [ids], num_neighbours=2, generator_seed=0, low=1.0, high=0.1)
    with pytest.raises(ValueError, match="grid=2"):
        search_sigma(lm, [ids], [ids], num_neighbours=2, generator_seed=0, grid=2)


def test_search_sigma_finds_where_the_auc_peaks_on_an_overfitted_gpt2():
    """A tiny GPT-2 (no dropout) fitted with full-batch Adam (lr 1e-2, 150 steps) to 16 random sequences, the
    members; 16 other random sequences are the non-members. Tiny sigmas only add noise to the scores (AUC near 0.5);
    the memorized members' losses rise quickly under noise, so the AUC climbs to its peak inside (1e-4, 10). Huge
    sigmas swamp the embedding, the neighbours' loss no longer depends on the example and the score tends to a
    constant minus the loss: the loss attack, already perfect on this memorized set, so the curve stays on its peak
    up to ``high``, and ties keep the smaller sigma. Checked: an interior sigma, the largest AUC of every evaluated
    sigma (none larger at the ends, the low end far below), the smallest sigma reaching it, and the counted passes."""
    lm = _tiny_lm(seed=0, dropout=0.0)
    ids = torch.randint(30, (32, 16), generator=torch.Generator().manual_seed(0))
    members, nonmembers = ids[:16], ids[16:]
    optimizer = torch.optim.Adam(lm.parameters(), lr=1e-2)
    for _ in range(150):
        optimizer.zero_grad()
        per_example_token_loss(lm(members), members).mean().backward()
        optimizer.step()

    result = search_sigma(lm, [members[:8], members[8:]], iter([nonmembers]), num_neighbours=8, generator_seed=0,
                          low=1e-4, high=10.0, grid=9, iterations=8)
    sigmas = [s for s, _ in result.evaluated]
    aucs = dict(result.evaluated)
    assert len(sigmas) == 9 + 8 and sigmas == sorted(sigmas) and sigmas[0] == 1e-4 and sigmas[-1] == 10.0
    assert 1e-4 < result.sigma < 10.0 and (result.sigma, result.auc) in result.evaluated
    assert result.auc == max(aucs.values()) >= max(aucs[1e-4], aucs[10.0])
    assert result.auc >= aucs[1e-4] + 0.2 and result.auc >= 0.95
    assert result.sigma == min(s for s, a in result.evaluated if a == result.auc)
    assert result.forward_passes == 32 * (1 + 8 * len(sigmas))  # own losses once, 8 neighbours per sigma
    # the curve's AUC at the chosen sigma is reproduced with the same batches and noise streams (members: 41,
    # non-members: 42), the draws search_sigma makes at every sigma (common random numbers)
    from lightning_dp.privacy.noise import derive_generator

    scores_in = noisy_neighbour_scores(lm, [members[:8], members[8:]], sigma=result.sigma, num_neighbours=8,
                                       generator=derive_generator(0, 41))
    scores_out = noisy_neighbour_scores(lm, [nonmembers], sigma=result.sigma, num_neighbours=8,
                                        generator=derive_generator(0, 42))
    assert roc(scores_in, scores_out).auc == pytest.approx(result.auc, abs=1e-9)
    assert math.isfinite(result.seconds)
