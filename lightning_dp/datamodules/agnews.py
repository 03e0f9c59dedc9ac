"""AG News topic classification from GloVe vectors (thesis chapter 3).

Each text (title + description) becomes the mean (``pooling="mean"``, default) or the concatenation
(``pooling="concat"``) of the 50-dimensional GloVe vectors of its first ``max_tokens`` tokens; the texts come from
the official CSVs (``source="csv"``) or Hugging Face ``fancyzhx/ag_news``, and ``glove.6B.50d.txt`` is needed with
either. The steps, the thesis' model size and our reading of it, the formats: docs/data.md, "AG News".
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import TensorDataset

from lightning_dp import checks
from lightning_dp.datamodules.base import (
    SplitDataModule,
    _check_fractions,
    stratified_split,
)
from lightning_dp.datamodules.offline import (
    DataFormatError,
    DatasetUnavailableError,
    dataset_unavailable,
    import_datasets,
    load_hf_dataset,
)

__all__ = [
    "AGNewsDataModule",
    "CSV_URL",
    "GLOVE_FILE",
    "GLOVE_URL",
    "load_glove",
    "concat_embeddings",
    "mean_embeddings",
    "read_ag_news_csv",
    "tokenize",
]

#: Where the official CSVs can be fetched (``train.csv``, ``test.csv``).
CSV_URL = "https://github.com/mhjabreel/CharCnn_Keras/tree/master/data/ag_news_csv"
#: The archive of the GloVe 6B vectors (822 MB) and the file of it the thesis uses.
GLOVE_URL = "https://nlp.stanford.edu/data/glove.6B.zip"
GLOVE_FILE = "glove.6B.50d.txt"
#: Official CSV file of each split.
CSV_FILES: dict[str, str] = {"train": "train.csv", "test": "test.csv"}
#: Bump when tokenization or features change: cached features of older versions are then ignored.
FEATURES_VERSION = 1

Source = Literal["csv", "huggingface"]
Pooling = Literal["mean", "concat"]

# AG News keeps HTML character references with the "&" replaced by a space, e.g.
# "Australia #39;s first gold": numeric ones become their character, named ones a space.
_ENTITY = re.compile(r"&?#(\d{1,7});|&?(?:quot|amp|lt|gt|nbsp);")
_TOKEN = re.compile(r"[a-z0-9]+|'(?:s|re|ve|ll|d|m)\b")


def _decode_entity(match: re.Match) -> str:
    code = match.group(1)
    if code is None or int(code) > 0x10FFFF:
        return " "
    return chr(int(code))


def tokenize(text: str, *, max_tokens: Optional[int] = None) -> list[str]:
    """Split a text into lower-case word tokens, the simple regex tokenizer of the AG News features.

    Steps: lower-case; turn character references (``#39;`` -> ``'``, ``quot;`` -> space,
    with or without the ``&`` that AG News dropped) into characters; a backslash (AG News'
    line-break mark) becomes a space; the tokens are the maximal runs of ``[a-z0-9]``
    and the English clitics ``'s``, ``'re``, ``'ve``, ``'ll``, ``'d``, ``'m`` (tokens of
    GloVe's vocabulary). Punctuation is dropped and hyphenated words are split.

    Args:
        text: The text.
        max_tokens: Keep only the first ``max_tokens`` tokens (``None``: all).

    Returns:
        The tokens, in order.

    Example:
        >>> tokenize("Short-sellers, Wall Street #39;s dwindling\\\\band (Reuters)")
        ['short', 'sellers', 'wall', 'street', "'s", 'dwindling', 'band', 'reuters']
        >>> tokenize("One two three four", max_tokens=2)
        ['one', 'two']
    """
    text = _ENTITY.sub(_decode_entity, text.lower()).replace("\\", " ")
    matches = _TOKEN.finditer(text)
    if max_tokens is not None:
        matches = itertools.islice(matches, max_tokens)
    return [match.group(0) for match in matches]


def read_ag_news_csv(path: Union[str, "os.PathLike[str]"]) -> tuple[list[str], torch.Tensor]:
    """Read an official AG News CSV (``train.csv`` or ``test.csv``).

    Rows are ``class index (1-4), title, description``, quoted as in RFC 4180 (a quote
    inside a field is written ``""``). A first row whose class index is not a number is
    taken for a header (some copies, e.g. Kaggle's, have one) and skipped.

    Args:
        path: The CSV file.

    Returns:
        ``(texts, labels)``: title + ``" "`` + description of every row, and ``int64``
        labels 0-3 (class index minus one: World, Sports, Business, Sci/Tech).

    Raises:
        ValueError: If a row does not have three fields or its class index is not 1-4,
            or the file has no row.
    """
    texts: list[str] = []
    labels: list[int] = []
    with open(path, newline="", encoding="utf-8") as handle:
        for row_number, row in enumerate(csv.reader(handle), start=1):
            if not row:
                continue
            if len(row) != 3:
                raise DataFormatError(
                    f"{path}: row {row_number} has {len(row)} field(s); an AG News CSV row has 3: class index "
                    f"(1-4), title, description. Use the official files of {CSV_URL}"
                )
            try:
                label = int(row[0])
            except ValueError:
                if row_number == 1:  # a header row
                    continue
                raise DataFormatError(f"{path}: row {row_number}: class index {row[0]!r} is not an integer 1-4") from None
            if not 1 <= label <= 4:
                raise DataFormatError(f"{path}: row {row_number}: class index {label} is outside 1-4")
            texts.append(f"{row[1]} {row[2]}")
            labels.append(label - 1)
    if not labels:
        raise ValueError(f"{path}: no AG News rows; expected class index (1-4), title, description per row")
    return texts, torch.tensor(labels, dtype=torch.int64)


def load_glove(
    path: Union[str, "os.PathLike[str]"], *, vocabulary: Iterable[str], dim: int
) -> tuple[list[str], torch.Tensor]:
    """Read the GloVe vectors of the words of ``vocabulary`` from a Stanford GloVe text file.

    The file has one ``word v1 ... v_dim`` line per word, separated by single spaces
    (``glove.6B.50d.txt``: 400,000 lower-case words, ``dim=50``). It is read line by
    line; only the vectors of ``vocabulary`` are kept (the first line of a word that
    occurs twice wins), and reading stops once all were found.

    Args:
        path: The GloVe text file.
        vocabulary: The words whose vectors are needed.
        dim: The expected vector dimension; checked on the first line.

    Returns:
        ``(words, vectors)``: the found words (in file order) and their vectors, float32
        of shape ``(len(words), dim)``.

    Raises:
        ValueError: If the file is empty, its vectors do not have ``dim`` components, or
            a line of a needed word cannot be parsed.
    """
    needed = set(vocabulary)
    words: list[str] = []
    rows: list[np.ndarray] = []
    found: set[str] = set()
    line_number = 0
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if line_number == 1:
                fields = line.rstrip().count(" ")
                if fields != dim:
                    raise ValueError(
                        f"{path}: the vectors have {fields} components but embedding_dim={dim}; use the "
                        f"{dim}-dimensional GloVe file (the thesis uses {GLOVE_FILE} of {GLOVE_URL}) or set "
                        f"embedding_dim={fields} (and the network's in_features: embedding_dim, times max_tokens "
                        "for pooling='concat') to match this file"
                    )
            if not needed:
                break
            word = line[: line.find(" ")]
            if word not in needed or word in found:
                continue
            parts = line.rstrip().rsplit(" ", dim)
            if parts[0] != word:  # a multi-word entry whose first word is a token: not that token's vector
                continue
            try:
                vector = np.asarray(parts[1:], dtype=np.float32)
            except ValueError:
                vector = np.empty(0, dtype=np.float32)
            if vector.shape != (dim,):
                raise ValueError(f"{path}: line {line_number} (word {word!r}) is not '{word} v1 ... v{dim}'")
            words.append(word)
            rows.append(vector)
            found.add(word)
            if len(found) == len(needed):
                break
    if line_number == 0:
        raise ValueError(f"{path}: the GloVe file is empty; expected '<word> v1 ... v{dim}' lines ({GLOVE_FILE})")
    vectors = torch.from_numpy(np.stack(rows)) if rows else torch.zeros(0, dim)
    return words, vectors


def mean_embeddings(
    token_lists: Sequence[Sequence[str]], *, words: Sequence[str], vectors: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean word vector of each token list, skipping words without a vector.

    Computed in one :func:`torch.nn.functional.embedding_bag` call (``mode="mean"``):
    every occurrence of a known token counts; a list without a known token gets the
    zero vector.

    Args:
        token_lists: One list of tokens per text.
        words: The words that have a vector.
        vectors: Their vectors, shape ``(len(words), dim)``.

    Returns:
        ``(features, known)``: float32 features of shape ``(len(token_lists), dim)`` and
        the ``int64`` number of known tokens of each list.

    Example:
        >>> features, known = mean_embeddings([["a", "b", "zz"], ["zz"]], words=["a", "b"],
        ...                                   vectors=torch.tensor([[1.0, 0.0], [0.0, 3.0]]))
        >>> features.tolist(), known.tolist()
        ([[0.5, 1.5], [0.0, 0.0]], [2, 0])
    """
    index = {word: i for i, word in enumerate(words)}
    ids: list[int] = []
    offsets: list[int] = []
    for tokens in token_lists:
        offsets.append(len(ids))
        ids.extend(index[token] for token in tokens if token in index)
    ids_tensor = torch.tensor(ids, dtype=torch.int64)
    offsets_tensor = torch.tensor(offsets, dtype=torch.int64)
    features = F.embedding_bag(ids_tensor, vectors.to(torch.float32), offsets_tensor, mode="mean")
    known = torch.diff(offsets_tensor, append=torch.tensor([len(ids)]))
    return features, known


def concat_embeddings(
    token_lists: Sequence[Sequence[str]], *, words: Sequence[str], vectors: torch.Tensor, max_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The word vectors of each token list's first ``max_tokens`` tokens, concatenated in order.

    Position ``j`` of a list fills components ``j * dim`` to ``(j + 1) * dim - 1``; a token without a vector
    and every position past the end of a shorter list are zeros (this module's choice for "no word", as
    :func:`mean_embeddings` gives a text without a known token the zero vector).

    Args:
        token_lists: One list of tokens per text (tokens past ``max_tokens`` are ignored).
        words: The words that have a vector.
        vectors: Their vectors, shape ``(len(words), dim)``.
        max_tokens: Number of token positions of the feature.

    Returns:
        ``(features, known)``: float32 features of shape ``(len(token_lists), max_tokens * dim)`` and
        the ``int64`` number of known tokens among each list's first ``max_tokens``.

    Example:
        >>> features, known = concat_embeddings([["a", "zz", "b"], ["b"]], words=["a", "b"],
        ...                                     vectors=torch.tensor([[1.0, 0.0], [0.0, 3.0]]), max_tokens=2)
        >>> features.tolist(), known.tolist()
        ([[1.0, 0.0, 0.0, 0.0], [0.0, 3.0, 0.0, 0.0]], [1, 1])
    """
    checks.positive_int("max_tokens", max_tokens)
    index = {word: i + 1 for i, word in enumerate(words)}  # row 0 of the padded table is the zero vector
    ids = torch.zeros(len(token_lists), max_tokens, dtype=torch.int64)
    for row, tokens in enumerate(token_lists):
        kept = [index.get(token, 0) for token in tokens[:max_tokens]]
        ids[row, : len(kept)] = torch.tensor(kept, dtype=torch.int64)
    dim = vectors.shape[1]
    table = torch.cat([torch.zeros(1, dim, dtype=torch.float32), vectors.to(device="cpu", dtype=torch.float32)])
    features = F.embedding(ids, table).reshape(len(token_lists), max_tokens * dim)
    return features, (ids > 0).sum(dim=1)


def _import_datasets() -> Any:
    return import_datasets("source='huggingface'",
                           f"source='csv' with the official train.csv and test.csv ({CSV_URL})")


def _file_fingerprint(path: Path) -> dict[str, Any]:
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


class AGNewsDataModule(SplitDataModule):
    """AG News as GloVe vectors of each text's first tokens, averaged or concatenated (thesis chapter 3).

    See the module docstring for the features and the two sources. Splits:

    - train / val: the rows of the official training split (or a stratified subset of
      ``train_subset`` of them, seeded, for CPU-scaled runs), of which ``val_fraction``
      are held out for validation (stratified, seeded);
    - test: the official test split (or a stratified subset of ``test_subset`` rows).

    Batches are ``(x, y)`` with ``x`` float32 of shape :attr:`input_shape` per example,
    ``(B, embedding_dim)`` for ``pooling="mean"`` and ``(B, max_tokens * embedding_dim)`` for
    ``"concat"``, and ``y`` int64 in 0-3 (:attr:`classes`). Features are computed once in ``setup``; with
    ``cache=True`` they are saved as ``ag_news_features_<split>_<hash>.pt`` in
    ``data_dir`` (the hash covers the source files' path, size and modification time,
    the GloVe file, ``max_tokens``, ``embedding_dim``, ``pooling``, the subset size and the seed),
    so later runs skip tokenization and the GloVe pass. A read-only ``data_dir`` only
    disables the cache, with a warning.

    Args:
        data_dir: Directory of ``train.csv`` and ``test.csv`` (``source="csv"``), or the
            Hugging Face cache (``source="huggingface"``); also the default place of the
            GloVe file and of the feature cache.
        glove_path: The GloVe text file; default ``<data_dir>/glove.6B.50d.txt``.
        source: ``"csv"`` (official files) or ``"huggingface"`` (``fancyzhx/ag_news``).
        batch_size: Samples per batch, a positive integer.
        val_fraction: Fraction of the training rows held out for validation, in (0, 1).
        train_subset: Use only this many training rows (stratified, seeded), before the
            validation split; ``None`` for all 120,000.
        test_subset: Use only this many test rows (stratified, seeded); ``None`` for all 7,600.
        max_tokens: Number of leading tokens of a text that enter its feature (the thesis' text: 25; its
            Table 3.1 model size: 15 with ``pooling="concat"``).
        embedding_dim: Dimension of the GloVe vectors (thesis: 50), checked against the file.
        pooling: ``"mean"`` (the mean of the known tokens' vectors) or ``"concat"`` (the ``max_tokens``
            vectors side by side, zeros for unknown and missing tokens; the thesis' Table 3.1 size with
            ``max_tokens=15``). See the module docstring.
        cache: Save and reuse the computed features in ``data_dir``.
        seed: Seed of the subsets, the validation split and the training-loader shuffling.
        num_workers: DataLoader worker processes (0: load in the main process).

    Raises:
        ValueError: If an argument is outside its range.

    Example:
        >>> dm = AGNewsDataModule(data_dir="./data/ag_news", train_subset=12000)  # doctest: +SKIP
        >>> dm.setup("fit")  # doctest: +SKIP
        >>> len(dm.train_dataset), len(dm.val_dataset), dm.train_dataset[0][0].shape  # doctest: +SKIP
        (10800, 1200, torch.Size([50]))
    """

    name = "ag_news"
    hf_dataset = "fancyzhx/ag_news"
    num_classes: ClassVar[int] = 4
    classes: ClassVar[tuple[str, ...]] = ("World", "Sports", "Business", "Sci/Tech")

    def __init__(
        self,
        *,
        data_dir: Union[str, "os.PathLike[str]"] = "./data/ag_news",
        glove_path: Optional[Union[str, "os.PathLike[str]"]] = None,
        source: Source = "csv",
        batch_size: int = 256,
        val_fraction: float = 0.1,
        train_subset: Optional[int] = None,
        test_subset: Optional[int] = None,
        max_tokens: int = 25,
        embedding_dim: int = 50,
        pooling: Pooling = "mean",
        cache: bool = True,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        if source not in ("csv", "huggingface"):
            raise ValueError(
                f"{owner}: source must be 'csv' (official train.csv/test.csv in data_dir) or 'huggingface' "
                f"({self.hf_dataset}), got {source!r}"
            )
        checks.positive_int("batch_size", batch_size, owner=owner)
        _check_fractions(owner, val_fraction=val_fraction)
        for subset_name, subset in (("train_subset", train_subset), ("test_subset", test_subset)):
            if subset is not None and (isinstance(subset, bool) or not isinstance(subset, int) or subset < 1):
                raise ValueError(
                    f"{owner}: {subset_name} must be None (all rows) or a positive integer number of rows, "
                    f"got {subset!r}"
                )
        checks.positive_int("max_tokens", max_tokens, owner=owner)
        checks.positive_int("embedding_dim", embedding_dim, owner=owner)
        if pooling not in ("mean", "concat"):
            raise ValueError(
                f"{owner}: pooling must be 'mean' (the mean word vector, embedding_dim features) or 'concat' (the "
                f"max_tokens vectors side by side, max_tokens * embedding_dim features), got {pooling!r}"
            )
        checks.non_negative_int("num_workers", num_workers, owner=owner)
        if not isinstance(cache, bool):
            raise ValueError(f"{owner}: cache must be True or False, got {cache!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"{owner}: seed must be an integer, got {seed!r}")
        self.save_hyperparameters()
        self.data_dir = Path(data_dir).expanduser()
        self.glove_path = self.data_dir / GLOVE_FILE if glove_path is None else Path(glove_path).expanduser()
        self.source = source
        if source == "huggingface":
            _import_datasets()  # a missing extra is refused now, before any data is read
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.train_subset = train_subset
        self.test_subset = test_subset
        self.max_tokens = max_tokens
        self.embedding_dim = embedding_dim
        self.pooling = pooling
        self.cache = cache
        self.seed = seed
        self.num_workers = num_workers
        self.train_dataset: Optional[TensorDataset] = None
        self.val_dataset: Optional[TensorDataset] = None
        self.test_dataset: Optional[TensorDataset] = None

    @property
    def input_shape(self) -> tuple[int]:
        """Shape of one feature vector: ``(embedding_dim,)`` (mean) or ``(max_tokens * embedding_dim,)`` (concat);
        the ``in_features`` of the network."""
        return (self.embedding_dim * (self.max_tokens if self.pooling == "concat" else 1),)

    # ----------------------------------------------------------------- files
    def missing_files(self) -> list[Path]:
        """Files that ``setup`` needs and that are absent: the CSVs (``source="csv"``) and the GloVe file."""
        needed = [self.data_dir / name for name in CSV_FILES.values()] if self.source == "csv" else []
        needed.append(self.glove_path)
        return [path for path in needed if not path.is_file()]

    def _relative(self, path: Path) -> str:
        try:
            return str(path.resolve().relative_to(self.data_dir.resolve()))
        except ValueError:  # outside data_dir (glove_path elsewhere)
            return str(path.resolve())

    def unavailable(self, error: Optional[str] = None) -> DatasetUnavailableError:
        """The error of missing data: the CSVs (or the Hugging Face cache) and the GloVe file, where to
        get those that are missing, and ``error`` (the download's, one line) when a download failed."""
        owner = type(self).__name__
        missing = self.missing_files()
        glove = self._relative(self.glove_path)
        glove_fix = (f"unzip {GLOVE_FILE} of {GLOVE_URL} to {self.glove_path.resolve()} or pass "
                     f"glove_path=<path of {GLOVE_FILE}> (the thesis' 50-d GloVe 6B vectors; no other is substituted)")
        glove_source = f"{GLOVE_URL} (822 MB, holds {GLOVE_FILE})"
        if self.source == "huggingface":
            fixes = [f"offline, use source='csv' with the official train.csv and test.csv in data_dir (from {CSV_URL})"]
            if self.glove_path in missing:
                fixes.append(glove_fix)
            return dataset_unavailable(
                owner, "AG News", data_dir=self.data_dir, expected=[f"the Hugging Face cache of {self.hf_dataset}",
                                                                    glove],
                sources=[f"https://huggingface.co/datasets/{self.hf_dataset}", glove_source], error=error,
                fix="; ".join(fixes) + ".")
        sources, fixes = [], []
        if any(path != self.glove_path for path in missing):
            sources.append(f"{CSV_URL} (train.csv, test.csv; or Hugging Face dataset {self.hf_dataset})")
            fixes.append("copy train.csv and test.csv into data_dir, or pass source='huggingface'")
        if self.glove_path in missing:
            sources.append(glove_source)
            fixes.append(glove_fix)
        return dataset_unavailable(
            owner, "AG News", data_dir=self.data_dir, expected=[*CSV_FILES.values(), glove],
            missing=[self._relative(path) for path in missing],
            layout="the official CSVs without header: class index 1-4, title, description; the GloVe text file",
            sources=sources, error=error, fix="; ".join(fixes) + ".")

    def _check_files(self) -> None:
        if self.missing_files():
            raise self.unavailable()

    # ----------------------------------------------------------------- hooks
    def prepare_data(self) -> None:
        """Download the Hugging Face dataset into ``data_dir`` (``source="huggingface"``); no-op otherwise.

        The official CSVs and the GloVe file cannot be downloaded by this module: the
        error of ``setup`` says where to get them.
        """
        if self.source == "huggingface":
            load_hf_dataset(_import_datasets(), self.hf_dataset, cache_dir=self.data_dir,
                            unavailable=self.unavailable)

    def setup(self, stage: Optional[str] = None) -> None:
        """Compute the features of the splits needed by ``stage`` and build the datasets.

        Args:
            stage: ``"fit"``, ``"validate"``, ``"test"``, ``"predict"`` or ``None`` (all).
                Splits already built are kept.

        Raises:
            DatasetUnavailableError: (a :class:`FileNotFoundError`) If the CSVs or the GloVe
                file are missing (the message says where to get them and which argument to set).
            ValueError: If a file's content is invalid, or a subset or the validation
                split does not fit the data.
        """
        needs_fit = stage in (None, "fit", "validate") and self.train_dataset is None
        needs_test = stage in (None, "test", "predict") and self.test_dataset is None
        wanted = (["train"] if needs_fit else []) + (["test"] if needs_test else [])
        if not wanted:
            return
        self._check_files()
        data = self._features(wanted)
        if "train" in data:
            features, labels = data["train"]
            total = labels.numel()
            n_val = round(self.val_fraction * total)
            if not 0 < n_val < total:
                raise ValueError(
                    f"{type(self).__name__}: val_fraction={self.val_fraction} of {total} training rows gives "
                    f"{n_val} validation rows; need between 1 and {total - 1}. Raise train_subset or change "
                    "val_fraction"
                )
            train_idx, val_idx = stratified_split(labels, [total - n_val, n_val], seed=self.seed)
            self.train_dataset = TensorDataset(features[train_idx], labels[train_idx])
            self.val_dataset = TensorDataset(features[val_idx], labels[val_idx])
        if "test" in data:
            self.test_dataset = TensorDataset(*data["test"])

    # ----------------------------------------------------------------- features
    def _features(self, splits: Sequence[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Features and labels of ``splits``, from the cache or computed (one GloVe pass for all)."""
        result: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        keys = {split: self._cache_key(split) for split in splits}
        for split in splits:
            cached = self._read_cache(keys[split]) if self.cache else None
            if cached is not None:
                result[split] = cached
        todo = [split for split in splits if split not in result]
        if not todo:
            return result
        texts = self._read_texts(todo)
        tokens: dict[str, list[list[str]]] = {}
        labels: dict[str, torch.Tensor] = {}
        for split in todo:
            split_texts, split_labels = texts[split]
            rows = self._subset_rows(split, split_labels)
            tokens[split] = [tokenize(split_texts[i], max_tokens=self.max_tokens) for i in rows.tolist()]
            labels[split] = split_labels[rows]
        del texts
        vocabulary = {token for lists in tokens.values() for token_list in lists for token in token_list}
        words, vectors = load_glove(self.glove_path, vocabulary=vocabulary, dim=self.embedding_dim)
        for split in todo:
            if self.pooling == "concat":
                features, known = concat_embeddings(tokens[split], words=words, vectors=vectors,
                                                    max_tokens=self.max_tokens)
            else:
                features, known = mean_embeddings(tokens[split], words=words, vectors=vectors)
            self._warn_if_uncovered(split, known)
            result[split] = (features, labels[split])
            if self.cache:
                self._write_cache(keys[split], features, labels[split])
        return result

    def _subset_rows(self, split: str, labels: torch.Tensor) -> torch.Tensor:
        size = self.train_subset if split == "train" else self.test_subset
        total = labels.numel()
        if size is None:
            return torch.arange(total)
        if size > total:
            name = f"{split}_subset"
            raise ValueError(
                f"{type(self).__name__}: {name}={size} exceeds the {total} rows of the {split} split; lower "
                f"{name} or pass {name}=None for all rows"
            )
        return stratified_split(labels, [size, total - size], seed=self.seed)[0]

    def _warn_if_uncovered(self, split: str, known: torch.Tensor) -> None:
        empty = float((known == 0).float().mean()) if known.numel() else 0.0
        if empty > 0.5:
            rank_zero_warn(
                f"{type(self).__name__}: {empty:.0%} of the {split} texts have no token in {self.glove_path} "
                f"and get the zero vector; is it the lower-case GloVe 6B file ({GLOVE_FILE})?"
            )

    def _read_texts(self, splits: Sequence[str]) -> dict[str, tuple[list[str], torch.Tensor]]:
        if self.source == "csv":
            return {split: read_ag_news_csv(self.data_dir / CSV_FILES[split]) for split in splits}
        dataset_dict = load_hf_dataset(_import_datasets(), self.hf_dataset, cache_dir=self.data_dir,
                                       unavailable=self.unavailable)
        result = {}
        for split in splits:
            texts = [str(text) for text in dataset_dict[split]["text"]]
            labels = torch.tensor(list(dataset_dict[split]["label"]), dtype=torch.int64)
            if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= self.num_classes):
                raise ValueError(
                    f"{type(self).__name__}: {self.hf_dataset}[{split}]: labels must be in 0..3, "
                    f"got {int(labels.min())}..{int(labels.max())}"
                )
            result[split] = (texts, labels)
        return result

    # ----------------------------------------------------------------- cache
    def _cache_key(self, split: str) -> dict[str, Any]:
        texts = (_file_fingerprint(self.data_dir / CSV_FILES[split]) if self.source == "csv"
                 else {"hf_dataset": self.hf_dataset})
        return {
            "version": FEATURES_VERSION,
            "split": split,
            "texts": texts,
            "glove": _file_fingerprint(self.glove_path),
            "max_tokens": self.max_tokens,
            "embedding_dim": self.embedding_dim,
            # "mean" adds nothing, so the caches written before `pooling` existed stay valid
            **({"pooling": self.pooling} if self.pooling != "mean" else {}),
            "subset": self.train_subset if split == "train" else self.test_subset,
            "seed": self.seed,
        }

    def _cache_path(self, key: dict[str, Any]) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        return self.data_dir / f"ag_news_features_{key['split']}_{digest}.pt"

    def _read_cache(self, key: dict[str, Any]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        path = self._cache_path(key)
        if not path.is_file():
            return None
        try:
            stored = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # a truncated or foreign file: recompute
            rank_zero_warn(f"{type(self).__name__}: ignoring unreadable feature cache {path}: {err}")
            return None
        if not isinstance(stored, dict) or stored.get("key") != json.dumps(key, sort_keys=True):
            return None
        return stored["features"], stored["labels"]

    def _write_cache(self, key: dict[str, Any], features: torch.Tensor, labels: torch.Tensor) -> None:
        path = self._cache_path(key)
        partial = path.with_name(f"{path.name}.{os.getpid()}.part")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"key": json.dumps(key, sort_keys=True), "features": features, "labels": labels}, partial)
            os.replace(partial, path)
        except (OSError, RuntimeError) as err:  # torch.save raises RuntimeError for some I/O failures
            rank_zero_warn(f"{type(self).__name__}: could not write the feature cache {path} ({err}); "
                           "features will be recomputed next time (or pass cache=False)")
            if partial.exists():
                partial.unlink()
