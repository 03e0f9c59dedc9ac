"""GPT2 (from a transformers config) and CausalLanguageModel, alone and under DPSGD."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from lightning_dp.callbacks import DPSGD  # noqa: E402
from lightning_dp.datamodules import WikiText2DataModule  # noqa: E402
from lightning_dp.models import GPT2, CausalLanguageModel  # noqa: E402
from lightning_dp.models.language import per_example_token_loss  # noqa: E402
from tests.datamodules.test_wikitext import write_fixture  # noqa: E402
from tests.helpers import ACCELERATORS, trainer  # noqa: E402


def test_gpt2_shapes_and_tied_embeddings():
    net = GPT2(vocab_size=40, max_positions=16, embed_dim=8, num_layers=1, num_heads=2)
    assert net(torch.randint(0, 40, (3, 10))).shape == (3, 10, 40)
    assert net.model.lm_head.weight is net.model.transformer.wte.weight


def test_per_example_token_loss_is_the_mean_over_each_samples_predictions():
    logits, ids = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    expected = torch.stack([F.cross_entropy(logits[i, :-1], ids[i, 1:]) for i in range(2)])
    torch.testing.assert_close(per_example_token_loss(logits, ids), expected)


@pytest.mark.parametrize("kwargs,match", [
    (dict(vocab_size=0), "vocab_size"), (dict(vocab_size=10, embed_dim=10, num_heads=3), "divisible"),
    (dict(vocab_size=10, dropout=1.0), "dropout"),
])
def test_gpt2_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPT2(**kwargs)


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_dpsgd_trains_gpt2_and_reports_perplexity_and_epsilon(tmp_path, accelerator):
    """The small GPT-2 with tied embeddings and wpe(arange(T)), under DP-SGD end to end."""
    dm = WikiText2DataModule(str(write_fixture(tmp_path)), block_size=12, vocab_size=40, batch_size=8)
    torch.manual_seed(0)
    model = CausalLanguageModel(GPT2(vocab_size=40, max_positions=16, embed_dim=16, num_layers=1, num_heads=2),
                                lr=3e-3)
    dp = DPSGD(noise_multiplier=0.8, max_grad_norm=1.0, seed=0)
    t = trainer(max_epochs=2, callbacks=[dp], limit_val_batches=2, accelerator=accelerator)
    t.fit(model, dm)
    assert dp.epsilon > 0 and t.global_step > 0
    ppl = float(t.callback_metrics["val/perplexity"])
    assert math.isfinite(ppl) and ppl == pytest.approx(math.exp(float(t.callback_metrics["val/loss"])), rel=1e-6)
    (result,) = t.test(model, dm, verbose=False)
    assert result["test/perplexity"] < 40 * 3  # no worse than a few times uniform guessing over 40 words
