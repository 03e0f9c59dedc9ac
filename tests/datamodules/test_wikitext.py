"""WikiText2DataModule on fixture files in the official format (tests/datamodules), and the real files when present."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_dp.datamodules import WikiText2DataModule
from lightning_dp.datamodules.wikitext import build_vocabulary, tokenize_lines

REAL = Path(__file__).resolve().parents[3] / "shared" / "data" / "wikitext2"

TEXT = {
    "train": " \n = Valkyria Chronicles = \n \n the game began development in 2010 , carrying over a large portion of "
             "the work done on Valkyria Chronicles II . \n the game 's battle system , the <unk> system , was carried "
             "over directly from the first game . \n",
    "valid": " \n = Homarus gammarus = \n \n Homarus gammarus is a species of clawed lobster from the eastern "
             "Atlantic Ocean . \n it is closely related to the American lobster . \n",
    "test": " \n = Robert Boulter = \n \n Robert Boulter is an English film , television and theatre actor . \n",
}


def write_fixture(folder: Path, splits=("train", "valid", "test"), nested: bool = False) -> Path:
    target = folder / "wikitext-2" if nested else folder
    target.mkdir(parents=True, exist_ok=True)
    for split in splits:
        (target / f"wiki.{split}.tokens").write_text(TEXT[split] * 20, encoding="utf-8")
    return folder


def test_tokenize_and_vocabulary():
    words = tokenize_lines([" = A = ", "", " b a <unk> a "])
    assert words == ["=", "A", "=", "<eos>", "b", "a", "<unk>", "a", "<eos>"]
    assert build_vocabulary(words, 4) == ["<unk>", "<eos>", "=", "a"]  # ties broken alphabetically


@pytest.mark.parametrize("nested", [False, True])
def test_splits_blocks_and_vocabulary_from_the_training_file(tmp_path, nested):
    dm = WikiText2DataModule(str(write_fixture(tmp_path, nested=nested)), block_size=16, vocab_size=30, batch_size=4)
    dm.setup("fit")
    assert len(dm.vocabulary) == 30 and dm.vocabulary[:2] == ["<unk>", "<eos>"]
    assert "lobster" not in dm.vocabulary  # validation words do not leak into the vocabulary
    batch = next(iter(dm.train_dataloader()))
    assert batch.shape == (4, 16) and batch.dtype == torch.long and int(batch.max()) < 30
    words = tokenize_lines(TEXT["train"].splitlines()) * 20
    assert len(dm.train_dataset) == len(words) // 16
    assert dm.decode(dm.train_dataset[0]).split() == [w if w in dm.vocabulary else "<unk>" for w in words[:16]]
    assert len(dm.val_dataset) > 0 and len(dm.test_dataset) > 0


def test_validation_carved_from_the_training_file_when_only_valid_and_test_exist(tmp_path):
    write_fixture(tmp_path, splits=("valid", "test"))
    dm = WikiText2DataModule(str(tmp_path), block_size=8, vocab_size=50, train_file="valid", val_file=None,
                             val_fraction=0.25, seed=3)
    dm.setup("fit")
    total = len(tokenize_lines(TEXT["valid"].splitlines() * 20)) // 8
    assert len(dm.train_dataset) + len(dm.val_dataset) == total
    assert len(dm.val_dataset) == round(0.25 * total)
    again = WikiText2DataModule(str(tmp_path), block_size=8, vocab_size=50, train_file="valid", val_file=None,
                                val_fraction=0.25, seed=3)
    again.setup("fit")
    assert torch.equal(again.val_dataset.blocks, dm.val_dataset.blocks)  # seeded


def test_missing_files_say_what_is_expected_and_leave_nothing(tmp_path):
    dm = WikiText2DataModule(str(tmp_path / "wt"), block_size=8)
    with pytest.raises(FileNotFoundError, match=r"(?s)wiki.train.tokens.*download=True.*train_file='valid'"):
        dm.prepare_data()
    assert not (tmp_path / "wt").exists()


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_size=0), "block_size"), (dict(vocab_size=2), "vocab_size"),
    (dict(train_file="nope"), "train_file"), (dict(train_file="valid"), "also used"),
    (dict(val_file=None, val_fraction=1.5), "val_fraction"), (dict(source="web"), "source"),
])
def test_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WikiText2DataModule("x", **kwargs)


@pytest.mark.skipif(not (REAL / "wiki.valid.tokens").exists(), reason="real WikiText-2 files not present")
def test_real_validation_and_test_files():
    dm = WikiText2DataModule(str(REAL), train_file="valid", val_file=None, vocab_size=10_000)
    dm.setup("fit")
    assert len(dm.vocabulary) == 10_000
    assert 1500 < len(dm.train_dataset) + len(dm.val_dataset) < 2000  # ~217k tokens / 126


def test_a_vocabulary_from_another_file_and_no_test_split(tmp_path):
    """Fine-tuning a model pretrained on the public file: the vocabulary is the public file's, not the private
    training file's, and no split is read from a file the configuration does not name."""
    write_fixture(tmp_path, splits=("valid", "test"))
    dm = WikiText2DataModule(str(tmp_path), block_size=8, vocab_size=12, train_file="valid", val_file=None,
                             test_file=None, vocab_file="test")
    dm.setup("fit")
    public = WikiText2DataModule(str(tmp_path), block_size=8, vocab_size=12, train_file="test", val_file=None,
                                 test_file=None)
    public.setup("fit")
    assert dm.vocabulary == public.vocabulary and "lobster" not in dm.vocabulary
    assert dm.test_dataset is None
    with pytest.raises(ValueError, match="test_file=None.*has no test split"):
        dm.test_dataloader()
    with pytest.raises(ValueError, match="vocab_file"):
        WikiText2DataModule("x", vocab_file="nope")
