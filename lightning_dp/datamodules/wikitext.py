"""WikiText-2 for causal language modelling, word level, cut into fixed-length samples.

Each line becomes its words and ``<eos>``; the vocabulary comes from the training file (or, under DP, a public
``vocab_file``); each file's token stream is cut into non-overlapping samples of ``block_size`` tokens, one sample
one example. ``train_file="valid"`` trains on the validation file where only it and the test file are at hand.
The files, the vocabulary and why it matters under DP: docs/data.md, "WikiText-2".
"""

from __future__ import annotations

import collections
import zipfile
from pathlib import Path
from typing import Any, Literal, Optional

import torch
from torch.utils.data import Dataset

from lightning_dp import checks
from lightning_dp.datamodules.base import SplitDataModule
from lightning_dp.datamodules.offline import (
    DatasetUnavailableError,
    dataset_unavailable,
    download_file,
    download_guard,
    import_datasets,
    load_hf_dataset,
    publish,
    staging_area,
)

__all__ = ["WikiText2DataModule", "TokenBlocks", "build_vocabulary", "tokenize_lines"]

URL = "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-2-v1.zip"


def _zip_check(path: Path) -> None:
    """A download check: the file is a zip archive (the official one has no published checksum)."""
    try:
        zipfile.ZipFile(path).close()
    except zipfile.BadZipFile as err:
        raise ValueError(f"not a zip archive ({err})") from err
HF_DATASET, HF_CONFIG = "Salesforce/wikitext", "wikitext-2-v1"
SPLITS = ("train", "valid", "test")
UNK, EOS = "<unk>", "<eos>"


def tokenize_lines(lines: list[str]) -> list[str]:
    """Words of every non-empty line, each line followed by ``<eos>``."""
    words: list[str] = []
    for line in lines:
        parts = line.split()
        if parts:
            words.extend(parts)
            words.append(EOS)
    return words


def build_vocabulary(words: list[str], size: int) -> list[str]:
    """``<unk>``, ``<eos>``, then the ``size - 2`` most frequent other words (ties alphabetical)."""
    counts = collections.Counter(w for w in words if w not in (UNK, EOS))
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return [UNK, EOS] + [w for w, _ in ranked[: max(size - 2, 0)]]


def _import_datasets() -> Any:
    return import_datasets("source='huggingface'", "source='files' with the official token files")


class TokenBlocks(Dataset):
    """Non-overlapping samples of ``block_size`` token ids: item ``i`` is a ``(block_size,)`` int64 tensor."""

    def __init__(self, ids: torch.Tensor, block_size: int) -> None:
        count = ids.numel() // block_size
        self.blocks = ids[: count * block_size].view(count, block_size)

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.blocks[index]


class WikiText2DataModule(SplitDataModule):
    """WikiText-2, word level, in samples of ``block_size`` tokens (see the module docstring).

    Batches are ``(B, block_size)`` int64 token ids.

    Args:
        data_dir: folder holding ``wiki.{train,valid,test}.tokens`` (directly or in ``wikitext-2/``).
        block_size: tokens per sample (the thesis' membership-inference samples: 126).
        vocab_size: words in the vocabulary, ``<unk>`` and ``<eos>`` included.
        train_file: official file of the training split: ``"train"``, or ``"valid"`` when only
            the validation and test files are available.
        val_file: official file of the validation split, or None to take ``val_fraction`` of
            the training samples (seeded) instead.
        val_fraction: fraction of training samples held out for validation when ``val_file``
            is None.
        test_file: official file of the test split, or None for no test split.
        vocab_file: official file the vocabulary is built from; None: the training file. Fine-tuning a model
            pretrained on another file (``examples/lm/``: pretrained on the public ``test`` file, fine-tuned
            privately on ``valid``) needs the pretraining run's vocabulary: its training file. A vocabulary built
            from the private training file would be a statistic of the private data (which words are frequent).
        source: ``"files"`` (``data_dir``) or ``"huggingface"``.
        download: with ``source="files"``, fetch the official zip into ``data_dir`` when files
            are missing.
        batch_size: samples per batch of every loader.
        num_workers: worker processes of the loaders; 0 loads in the main process.
        seed: seed of the training split's reshuffling and of the validation carve-out
            (``val_file=None``).

    Raises:
        ValueError: If an argument is outside its range.
        DatasetUnavailableError: (a :class:`FileNotFoundError`) At ``prepare_data``/``setup``, if a
            needed file is missing (the message lists the files expected and where to get them).

    Example:
        >>> dm = WikiText2DataModule("../shared/data/wikitext2", train_file="valid", val_file=None)  # doctest: +SKIP
        >>> dm.setup("fit")  # doctest: +SKIP
        >>> next(iter(dm.train_dataloader())).shape  # doctest: +SKIP
        torch.Size([8, 126])
    """

    name = "wikitext2"

    def __init__(
        self,
        data_dir: str = "data/wikitext2",
        block_size: int = 126,
        vocab_size: int = 10_000,
        train_file: Literal["train", "valid", "test"] = "train",
        val_file: Optional[Literal["train", "valid", "test"]] = "valid",
        val_fraction: float = 0.1,
        test_file: Optional[Literal["train", "valid", "test"]] = "test",
        vocab_file: Optional[Literal["train", "valid", "test"]] = None,
        source: Literal["files", "huggingface"] = "files",
        download: bool = False,
        batch_size: int = 8,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        checks.positive_int("block_size", block_size, owner=owner)
        checks.positive_int("batch_size", batch_size, owner=owner)
        checks.non_negative_int("num_workers", num_workers, owner=owner)
        checks.non_negative_int("seed", seed, owner=owner)
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 3:
            raise ValueError(f"{owner}: vocab_size={vocab_size!r} must be an integer >= 3 (<unk>, <eos> and words)")
        optional = ("val_file", "test_file", "vocab_file")
        for name, value in (("train_file", train_file), ("val_file", val_file), ("test_file", test_file),
                            ("vocab_file", vocab_file)):
            if value not in SPLITS and not (name in optional and value is None):
                raise ValueError(f"{owner}: {name}={value!r} is not one of {SPLITS}" +
                                 (" or None" if name in optional else ""))
        if val_file is None and not (isinstance(val_fraction, float) and 0 < val_fraction < 1):
            raise ValueError(f"{owner}: val_fraction={val_fraction!r} must be in (0, 1) when val_file is None")
        if train_file in (val_file, test_file):
            raise ValueError(f"{owner}: train_file={train_file!r} is also used for validation or testing; evaluate "
                             "on other files, or set val_file=None to hold out part of the training samples")
        if source not in ("files", "huggingface"):
            raise ValueError(f"{owner}: source={source!r} must be 'files' or 'huggingface'")
        self.save_hyperparameters()
        self.data_dir = Path(data_dir)
        self.block_size, self.vocab_size = block_size, vocab_size
        self.batch_size, self.num_workers, self.seed = batch_size, num_workers, seed
        self.vocabulary: list[str] = []

    # ------------------------------------------------------------------ files
    def _folder(self) -> Path:
        nested = self.data_dir / "wikitext-2"
        return nested if (nested / "wiki.test.tokens").exists() and not (self.data_dir / "wiki.test.tokens").exists() \
            else self.data_dir

    def _needed(self) -> list[str]:
        files = [self.hparams[k] for k in ("train_file", "val_file", "test_file", "vocab_file")
                 if self.hparams.get(k) is not None]
        return sorted(set(files), key=SPLITS.index)

    def _missing(self) -> list[Path]:
        folder = self._folder()
        return [folder / f"wiki.{s}.tokens" for s in self._needed() if not (folder / f"wiki.{s}.tokens").exists()]

    def prepare_data(self) -> None:
        """Download the official zip when asked and files are missing (once, on rank zero).

        The zip is extracted into a temporary folder inside ``data_dir``; only the token
        files that ``data_dir`` lacks are then moved into place, and a failed attempt leaves
        ``data_dir`` as it was.

        Raises:
            DatasetUnavailableError: (a :class:`FileNotFoundError`) If files are missing and
                ``download=False``, or the download failed.
        """
        if self.hparams["source"] != "files" or not self._missing():
            return
        if not self.hparams["download"]:
            raise self.unavailable()
        with download_guard(self.data_dir, self.unavailable), staging_area(self.data_dir) as staging:
            path = download_file(URL.rsplit("/", 1)[-1], directory=staging, urls=[URL], check=_zip_check)
            with zipfile.ZipFile(path) as archive:
                archive.extractall(staging)
            for split in SPLITS:
                src = staging / "wikitext-2" / f"wiki.{split}.tokens"
                if src.exists():
                    publish(src, self.data_dir / src.name)

    def unavailable(self, error: Optional[str] = None) -> DatasetUnavailableError:
        """The error of missing files: the token files this configuration reads, where to get them, and
        ``error`` (the download's, one line) when a download failed."""
        owner = type(self).__name__
        needed = [f"wiki.{split}.tokens" for split in self._needed()]
        only_two = "with only the validation and test files at hand, set train_file='valid' and val_file=None"
        if self.hparams["source"] == "huggingface":
            return dataset_unavailable(
                owner, "WikiText-2", data_dir=self.data_dir,
                expected=[f"the Hugging Face cache of {HF_DATASET} ({HF_CONFIG}), in the library's default cache"],
                sources=[f"https://huggingface.co/datasets/{HF_DATASET}"], error=error,
                fix=f"offline, use source='files' with {', '.join(needed)} in data_dir (from {URL}); {only_two}.")
        get = ("copy the files into data_dir" if error is not None or self.hparams["download"]
               else "pass download=True (needs internet), or copy the files into data_dir")
        return dataset_unavailable(
            owner, "WikiText-2", data_dir=self.data_dir, expected=needed,
            missing=[path.name for path in self._missing()],
            layout="the official word-level token files, in data_dir or its wikitext-2/ folder",
            sources=[f"{URL} (its wikitext-2/ folder)", f"Hugging Face dataset {HF_DATASET}, {HF_CONFIG} "
                     "(source='huggingface')"],
            error=error, fix=f"{get}; {only_two}.")

    def _lines(self, split: str) -> list[str]:
        if self.hparams["source"] == "huggingface":
            name = {"train": "train", "valid": "validation", "test": "test"}[split]
            table = load_hf_dataset(_import_datasets(), HF_DATASET, HF_CONFIG, split=name, cache_dir=None,
                                    unavailable=self.unavailable)
            return list(table["text"])
        path = self._folder() / f"wiki.{split}.tokens"
        if not path.exists():
            raise self.unavailable()
        return path.read_text(encoding="utf-8").splitlines()

    # ------------------------------------------------------------------ setup
    def setup(self, stage: str) -> None:
        """Reads the files, builds the vocabulary from the training file (or ``vocab_file``) and cuts the samples."""
        if self.train_dataset is not None:
            return
        train_words = tokenize_lines(self._lines(self.hparams["train_file"]))
        vocab_file = self.hparams.get("vocab_file")
        vocab_words = train_words if vocab_file in (None, self.hparams["train_file"]) else \
            tokenize_lines(self._lines(vocab_file))
        self.vocabulary = build_vocabulary(vocab_words, self.vocab_size)
        index = {w: i for i, w in enumerate(self.vocabulary)}

        def encode(words: list[str]) -> torch.Tensor:
            return torch.tensor([index.get(w, 0) for w in words], dtype=torch.long)

        train = TokenBlocks(encode(train_words), self.block_size)
        if self.hparams["val_file"] is None:
            g = torch.Generator().manual_seed(self.seed)
            order = torch.randperm(len(train), generator=g)
            n_val = max(1, round(self.hparams["val_fraction"] * len(train)))
            self.val_dataset = TokenBlocks(train.blocks[order[:n_val]].reshape(-1), self.block_size)
            train = TokenBlocks(train.blocks[order[n_val:].sort().values].reshape(-1), self.block_size)
        else:
            self.val_dataset = TokenBlocks(encode(tokenize_lines(self._lines(self.hparams["val_file"]))),
                                           self.block_size)
        self.train_dataset = train
        if self.hparams["test_file"] is not None:
            self.test_dataset = TokenBlocks(encode(tokenize_lines(self._lines(self.hparams["test_file"]))),
                                            self.block_size)
        if len(self.train_dataset) == 0:
            raise ValueError(f"{type(self).__name__}: the training file holds fewer than block_size="
                             f"{self.block_size} tokens; lower block_size")

    def test_dataloader(self) -> Any:
        """Test batches in a fixed order (refused with ``test_file=None``)."""
        if self.hparams["test_file"] is None:
            raise ValueError(f"{type(self).__name__}(test_file=None) has no test split; set test_file to one of "
                             f"{SPLITS} other than the training file to test")
        return super().test_dataloader()

    def decode(self, ids: torch.Tensor) -> str:
        """The words of token ids (for looking at samples)."""
        return " ".join(self.vocabulary[int(i)] for i in ids.reshape(-1))
