"""AG News DataModule on generated fixtures in the official CSV and GloVe text formats."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

import lightning_dp.datamodules.agnews as agnews
from lightning_dp.callbacks import DPSGD
from lightning_dp.datamodules import AGNewsDataModule
from lightning_dp.datamodules.agnews import (
    CSV_URL,
    GLOVE_FILE,
    GLOVE_URL,
    concat_embeddings,
    load_glove,
    mean_embeddings,
    read_ag_news_csv,
    tokenize,
)
from lightning_dp.models import BagOfWordsMLP, ImageClassifier
from tests.helpers import trainer

DIM = 50
# Words of the fixture GloVe file; every other token of the fixture texts is out of vocabulary.
GLOVE_WORDS = ("the", "wall", "street", "'s", "reuters", "band", "green", "president", "election", "war",
               "game", "team", "win", "stocks", "market", "profit", "software", "internet", "computer")
CLASS_WORDS = (("president", "election", "war"), ("game", "team", "win"), ("stocks", "market", "profit"),
               ("software", "internet", "computer"))

# The first official training row, verbatim: a backslash marks a line break of the article.
REUTERS_ROW = ('"3","Wall St. Bears Claw Back Into the Black (Reuters)","Reuters - Short-sellers, Wall Street\'s '
               'dwindling\\band of ultra-cynics, are seeing green again."')
# Its first 25 tokens (there are 24) and the ones the fixture GloVe knows.
REUTERS_TOKENS = ["wall", "st", "bears", "claw", "back", "into", "the", "black", "reuters", "reuters", "short",
                  "sellers", "wall", "street", "'s", "dwindling", "band", "of", "ultra", "cynics", "are", "seeing",
                  "green", "again"]


def glove_vectors() -> dict[str, torch.Tensor]:
    """Deterministic 50-d vectors, multiples of 1/64 (exact in float32 and in the text file)."""
    g = torch.Generator().manual_seed(0)
    values = torch.randint(-64, 65, (len(GLOVE_WORDS), DIM), generator=g).double() / 64
    return dict(zip(GLOVE_WORDS, values))


def write_glove(path: Path, words=GLOVE_WORDS) -> dict[str, torch.Tensor]:
    vectors = glove_vectors()
    lines = [" ".join([word, *(repr(float(v)) for v in vectors[word])]) for word in words]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return vectors


def csv_line(label: int, title: str, description: str) -> str:
    """One row in the official quoting: every field quoted, a quote inside a field doubled."""
    return ",".join('"' + field.replace('"', '""') + '"' for field in (str(label), title, description))


def generated_rows(per_class: int, *, offset: int) -> list[tuple[int, str, str]]:
    rows = []
    for i in range(per_class):
        for label, words in enumerate(CLASS_WORDS, start=1):
            rows.append((label, f"{words[i % 3].title()} update {offset + i}", f"The {words[(i + 1) % 3]} news, "
                         f"said \"{words[(i + 2) % 3]}\" sources."))
    return rows


def write_ag_news(directory: Path, *, per_class_train: int = 10, per_class_test: int = 5, glove: bool = True) -> None:
    """train.csv (4 x per_class_train rows), test.csv (4 x per_class_test, the first three special), glove."""
    directory.mkdir(parents=True, exist_ok=True)
    train = [csv_line(*row) for row in generated_rows(per_class_train, offset=0)]
    (directory / "train.csv").write_text("\n".join(train) + "\n", encoding="utf-8")
    special = [
        REUTERS_ROW,
        csv_line(1, "Zzyzx!!!", "--"),  # no known token at all
        # "computer", then 24 unknown tokens: the known words after them are beyond the first 25
        csv_line(4, 'He said "hi"', "computer " + "blorp " * 24 + "software internet market"),
    ]
    rest = generated_rows(per_class_test, offset=100)
    for label in (3, 1, 4):  # keep 5 rows per class: drop one generated row of each special row's class
        rest.remove(next(row for row in rest if row[0] == label))
    test = special + [csv_line(*row) for row in rest]
    (directory / "test.csv").write_text("\n".join(test) + "\n", encoding="utf-8")
    if glove:
        write_glove(directory / GLOVE_FILE)


@pytest.fixture
def ag_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "ag_news"
    write_ag_news(directory)
    return directory


def _sizes(dm: AGNewsDataModule) -> list[int]:
    return [len(dm.train_dataset), len(dm.val_dataset), len(dm.test_dataset)]


# ---------------------------------------------------------------- parsing and features
def test_read_csv_official_quoting(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text(REUTERS_ROW + "\n" + '"1","He said ""no"", twice","Line one\\Line two"\n', encoding="utf-8")
    texts, labels = read_ag_news_csv(path)
    assert labels.tolist() == [2, 0] and labels.dtype == torch.int64
    assert texts[0] == ("Wall St. Bears Claw Back Into the Black (Reuters) Reuters - Short-sellers, Wall Street's "
                        "dwindling\\band of ultra-cynics, are seeing green again.")
    assert texts[1] == 'He said "no", twice Line one\\Line two'


def test_read_csv_skips_a_header_and_rejects_bad_rows(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text('Class Index,Title,Description\n"2","a","b"\n', encoding="utf-8")
    assert read_ag_news_csv(path)[1].tolist() == [1]
    for content, message in (('"5","a","b"\n', "class index 5 is outside 1-4"),
                             ('"1","a"\n', "row 1 has 2 field"),
                             ('"1","a","b"\n"x","a","b"\n', "row 2: class index 'x'"),
                             ("", "no AG News rows")):
        path.write_text(content, encoding="utf-8")
        with pytest.raises(ValueError, match=message):
            read_ag_news_csv(path)


def test_tokenize():
    reuters = 'Wall St. Bears Claw Back Into the Black (Reuters) Reuters - Short-sellers, Wall Street\'s ' \
              'dwindling\\band of ultra-cynics, are seeing green again.'
    assert tokenize(reuters) == REUTERS_TOKENS
    assert tokenize("Australia #39;s first gold &#36;5 quot;yes quot; &lt;b&gt;") == [
        "australia", "'s", "first", "gold", "5", "yes", "b"]
    assert tokenize("It's, we're 'quoted' don't") == ["it", "'s", "we", "'re", "quoted", "don", "t"]
    assert tokenize("a b c d e", max_tokens=3) == ["a", "b", "c"]
    assert tokenize("!!! --") == []


def test_load_glove_keeps_only_needed_words(tmp_path):
    path = tmp_path / GLOVE_FILE
    vectors = write_glove(path)
    words, table = load_glove(path, vocabulary={"market", "the", "unknown"}, dim=DIM)
    assert words == ["the", "market"] and table.dtype == torch.float32 and table.shape == (2, DIM)
    assert torch.equal(table.double(), torch.stack([vectors["the"], vectors["market"]]))
    assert load_glove(path, vocabulary=[], dim=DIM)[1].shape == (0, DIM)
    with pytest.raises(ValueError, match=r"have 50 components but embedding_dim=100.*embedding_dim=50"):
        load_glove(path, vocabulary={"the"}, dim=100)
    path.write_text("", encoding="utf-8")
    with pytest.raises(ValueError, match="empty"):
        load_glove(path, vocabulary={"the"}, dim=DIM)


def test_mean_embeddings_skips_unknown_tokens():
    table = torch.tensor([[1.0, 2.0], [3.0, -2.0]])
    features, known = mean_embeddings([["a", "x", "b", "a"], ["x"], []], words=["a", "b"], vectors=table)
    torch.testing.assert_close(features, torch.tensor([[5 / 3, 2 / 3], [0.0, 0.0], [0.0, 0.0]]))
    assert known.tolist() == [3, 0, 0]


def test_features_match_hand_computation(ag_dir):
    dm = AGNewsDataModule(data_dir=ag_dir, cache=False)
    dm.setup("test")
    assert dm.train_dataset is None and len(dm.test_dataset) == 20
    x, y = dm.test_dataset.tensors
    assert x.dtype == torch.float32 and x.shape == (20, DIM) and y.dtype == torch.int64
    assert y[:3].tolist() == [2, 0, 3]  # test split kept in file order
    vectors = glove_vectors()
    # Reuters row: mean over every occurrence of a known token among its first 25 tokens (9 of 24).
    known = [token for token in REUTERS_TOKENS if token in vectors]
    assert known == ["wall", "the", "reuters", "reuters", "wall", "street", "'s", "band", "green"]
    expected = torch.stack([vectors[token] for token in known]).mean(0)
    torch.testing.assert_close(x[0].double(), expected, atol=1e-6, rtol=0)
    assert torch.equal(x[1], torch.zeros(DIM))  # no known token: zero vector
    # Only the first 25 tokens count: "software internet market" come after them.
    torch.testing.assert_close(x[2].double(), vectors["computer"], atol=1e-6, rtol=0)
    # The first generated row: "Game update 100","The team news, said ""win"" sources." (class 2).
    assert y[3].item() == 1
    expected = torch.stack([vectors[token] for token in ("game", "the", "team", "win")]).mean(0)
    torch.testing.assert_close(x[3].double(), expected, atol=1e-6, rtol=0)


def test_concat_features_match_hand_computation(ag_dir):
    """pooling='concat': the vectors of the first max_tokens tokens side by side, zeros for unknown tokens and
    past the end of a text; the thesis' Table 3.1 size needs 15 x 50 = 750 inputs."""
    dm = AGNewsDataModule(data_dir=ag_dir, pooling="concat", max_tokens=15, cache=False)
    assert dm.input_shape == (750,)
    dm.setup("test")
    x, y = dm.test_dataset.tensors
    assert x.dtype == torch.float32 and x.shape == (20, 750)
    vectors = glove_vectors()
    zero = torch.zeros(DIM, dtype=torch.float64)
    expected = torch.cat([vectors.get(token, zero) for token in REUTERS_TOKENS[:15]])
    torch.testing.assert_close(x[0].double(), expected, atol=1e-6, rtol=0)
    assert torch.equal(x[1], torch.zeros(750))  # no known token
    # 'He said "hi"', "computer", then unknown tokens: "computer" fills the fourth position only
    torch.testing.assert_close(x[2, 3 * DIM:4 * DIM].double(), vectors["computer"], atol=1e-6, rtol=0)
    assert torch.equal(x[2, :3 * DIM], torch.zeros(3 * DIM)) and torch.equal(x[2, 4 * DIM:], torch.zeros(11 * DIM))
    # "Game update 100 The team news said win sources": 9 tokens, then 6 positions of zeros
    tokens = ["game", "update", "100", "the", "team", "news", "said", "win", "sources"]
    expected = torch.cat([vectors.get(token, zero) for token in tokens] + [zero] * 6)
    torch.testing.assert_close(x[3].double(), expected, atol=1e-6, rtol=0)
    # the mean of the concatenated known vectors is the mean pooling of the same tokens
    mean = AGNewsDataModule(data_dir=ag_dir, max_tokens=15, cache=False)
    mean.setup("test")
    known = torch.tensor([sum(t in vectors for t in tokens)]).double()
    torch.testing.assert_close(x[3].double().reshape(15, DIM).sum(0) / known, mean.test_dataset.tensors[0][3].double(),
                               atol=1e-6, rtol=0)


def test_concat_embeddings_truncates_and_pads():
    words, table = ["a", "b"], torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    features, known = concat_embeddings([["b", "a", "b"], [], ["zz", "a"]], words=words, vectors=table, max_tokens=2)
    assert features.tolist() == [[3.0, 4.0, 1.0, 2.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 2.0]]
    assert known.tolist() == [2, 0, 1]


# ---------------------------------------------------------------- splits
def test_split_sizes_and_stratification(ag_dir):
    dm = AGNewsDataModule(data_dir=ag_dir, val_fraction=0.2, batch_size=8, cache=False)
    dm.setup()
    assert _sizes(dm) == [32, 8, 20]
    assert torch.bincount(dm.val_dataset.tensors[1]).tolist() == [2, 2, 2, 2]
    assert torch.bincount(dm.train_dataset.tensors[1]).tolist() == [8, 8, 8, 8]
    assert dm.input_shape == (50,) and dm.num_classes == 4 and dm.classes[3] == "Sci/Tech"
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (8, DIM) and y.shape == (8,)


def test_stratified_subsets(ag_dir):
    dm = AGNewsDataModule(data_dir=ag_dir, train_subset=20, test_subset=8, val_fraction=0.2, cache=False)
    dm.setup()
    assert _sizes(dm) == [16, 4, 8]
    assert torch.bincount(dm.val_dataset.tensors[1]).tolist() == [1, 1, 1, 1]
    assert torch.bincount(dm.test_dataset.tensors[1]).tolist() == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="train_subset=41 exceeds the 40 rows"):
        AGNewsDataModule(data_dir=ag_dir, train_subset=41, cache=False).setup("fit")
    with pytest.raises(ValueError, match="gives 0 validation rows"):
        AGNewsDataModule(data_dir=ag_dir, train_subset=4, val_fraction=0.1, cache=False).setup("fit")


def test_splits_are_deterministic_by_seed(ag_dir):
    features = []
    for seed in (1, 1, 2):
        dm = AGNewsDataModule(data_dir=ag_dir, train_subset=24, seed=seed, cache=False)
        dm.setup("fit")
        features.append(dm.val_dataset.tensors[0])
    assert torch.equal(features[0], features[1]) and not torch.equal(features[0], features[2])


def test_feature_cache_is_reused_and_keyed_by_settings(ag_dir, monkeypatch):
    first = AGNewsDataModule(data_dir=ag_dir, train_subset=20)
    first.setup()
    assert len(list(ag_dir.glob("ag_news_features_*.pt"))) == 2

    def no_glove(*args, **kwargs):
        raise AssertionError("GloVe read although the features are cached")

    monkeypatch.setattr(agnews, "load_glove", no_glove)
    again = AGNewsDataModule(data_dir=ag_dir, train_subset=20)
    again.setup()
    for a, b in zip((first.train_dataset, first.test_dataset), (again.train_dataset, again.test_dataset)):
        assert all(torch.equal(s, t) for s, t in zip(a.tensors, b.tensors))
    with pytest.raises(AssertionError, match="GloVe read"):  # other settings: another cache entry
        AGNewsDataModule(data_dir=ag_dir, train_subset=20, max_tokens=5).setup("test")
    with pytest.raises(AssertionError, match="GloVe read"):
        AGNewsDataModule(data_dir=ag_dir, train_subset=20, pooling="concat").setup("test")
    monkeypatch.undo()
    for path in ag_dir.glob("ag_news_features_test_*.pt"):
        path.write_bytes(b"truncated")
    recomputed = AGNewsDataModule(data_dir=ag_dir, train_subset=20)
    with pytest.warns(UserWarning, match="ignoring unreadable feature cache"):
        recomputed.setup("test")
    assert torch.equal(recomputed.test_dataset.tensors[0], first.test_dataset.tensors[0])


def test_warns_when_most_texts_have_no_glove_word(ag_dir):
    write_glove(ag_dir / GLOVE_FILE, words=("band",))  # only the Reuters row has it
    dm = AGNewsDataModule(data_dir=ag_dir, cache=False)
    with pytest.warns(UserWarning, match="of the test texts have no token in"):
        dm.setup("test")


# ---------------------------------------------------------------- errors and arguments
def test_missing_glove_is_an_error_naming_path_source_and_argument(tmp_path):
    write_ag_news(tmp_path, glove=False)
    with pytest.raises(FileNotFoundError) as info:
        AGNewsDataModule(data_dir=tmp_path).setup("fit")
    message = str(info.value)
    assert str((tmp_path / GLOVE_FILE).resolve()) in message
    assert GLOVE_URL in message and "glove_path=" in message and CSV_URL not in message
    assert "missing: glove.6B.50d.txt" in message  # the CSVs are there
    other = tmp_path / "vectors.txt"
    with pytest.raises(FileNotFoundError, match="vectors.txt"):
        AGNewsDataModule(data_dir=tmp_path, glove_path=other).setup("test")
    write_glove(other)
    dm = AGNewsDataModule(data_dir=tmp_path, glove_path=other, cache=False)
    dm.setup("test")
    assert len(dm.test_dataset) == 20


def test_missing_csv_is_an_error_naming_files_url_and_alternative(tmp_path):
    write_glove(tmp_path / GLOVE_FILE)
    with pytest.raises(FileNotFoundError) as info:
        AGNewsDataModule(data_dir=tmp_path).setup("test")
    message = str(info.value)
    assert "train.csv, test.csv" in message and CSV_URL in message and "source='huggingface'" in message
    assert GLOVE_URL not in message
    with pytest.raises(FileNotFoundError, match=r"(?s)train\.csv.*glove\.6B\.50d\.txt"):
        AGNewsDataModule(data_dir=tmp_path / "empty").setup()


def test_glove_of_another_dimension(ag_dir):
    with pytest.raises(ValueError, match="embedding_dim=100"):
        AGNewsDataModule(data_dir=ag_dir, embedding_dim=100, cache=False).setup("test")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"source": "torchtext"}, "source must be 'csv'"),
        ({"batch_size": 0}, "batch_size must be a positive integer"),
        ({"val_fraction": 1.0}, r"val_fraction must be a number in the open interval \(0, 1\)"),
        ({"train_subset": 0}, "train_subset must be None"),
        ({"test_subset": 2.5}, "test_subset must be None"),
        ({"max_tokens": 0}, "max_tokens must be a positive integer"),
        ({"embedding_dim": -50}, "embedding_dim must be a positive integer"),
        ({"pooling": "max"}, "pooling must be 'mean'.*or 'concat'"),
        ({"cache": "yes"}, "cache must be True or False"),
        ({"seed": 1.5}, "seed must be an integer"),
        ({"num_workers": -1}, "num_workers"),
    ],
)
def test_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AGNewsDataModule(**kwargs)


def test_defaults_hparams_and_keyword_only():
    dm = AGNewsDataModule()
    assert dm.data_dir == Path("./data/ag_news") and dm.glove_path == Path("./data/ag_news") / GLOVE_FILE
    assert dm.max_tokens == 25 and dm.embedding_dim == 50 and dm.source == "csv" and dm.pooling == "mean"
    assert dm.hparams_initial["data/max_tokens"] == 25 and dm.hparams["train_subset"] is None
    with pytest.raises(TypeError):
        AGNewsDataModule("./data")  # type: ignore[misc]
    with pytest.raises(RuntimeError, match=r"call setup\('fit'\) first"):
        dm.train_dataloader()


# ---------------------------------------------------------------- huggingface source
class _FakeDatasets(types.ModuleType):
    """Stands in for the `datasets` package: splits with `text` (title + " " + description) and `label` 0-3."""

    def __init__(self, directory: Path) -> None:
        super().__init__("datasets")
        self.calls: list[tuple[str, str]] = []
        self._splits = {}
        for split in ("train", "test"):
            texts, labels = read_ag_news_csv(directory / f"{split}.csv")
            self._splits[split] = {"text": texts, "label": labels.tolist()}

    def load_dataset(self, path: str, *, cache_dir: str):
        self.calls.append((path, cache_dir))
        return self._splits


def test_huggingface_source_gives_the_csv_features(ag_dir, tmp_path, monkeypatch):
    fake = _FakeDatasets(ag_dir)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    hf_dir = tmp_path / "hf"
    dm = AGNewsDataModule(data_dir=hf_dir, glove_path=ag_dir / GLOVE_FILE, source="huggingface", val_fraction=0.2)
    dm.prepare_data()
    dm.setup()
    assert fake.calls[0] == ("fancyzhx/ag_news", str(hf_dir))
    reference = AGNewsDataModule(data_dir=ag_dir, val_fraction=0.2, cache=False)
    reference.setup()
    for a, b in zip((dm.train_dataset, dm.val_dataset, dm.test_dataset),
                    (reference.train_dataset, reference.val_dataset, reference.test_dataset)):
        assert all(torch.equal(s, t) for s, t in zip(a.tensors, b.tensors))


def test_huggingface_source_without_datasets_installed(ag_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(ImportError, match=r"pip install 'lightning-dp\[hf\]'.*source='csv'"):
        AGNewsDataModule(data_dir=ag_dir, source="huggingface")  # refused before any data is read


# ---------------------------------------------------------------- training
def test_bag_of_words_mlp_trains_with_dp_sgd(ag_dir):
    torch.manual_seed(0)
    model = ImageClassifier(BagOfWordsMLP(), num_classes=4, lr=0.5)
    before = [p.detach().clone() for p in model.parameters()]
    dp = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
    dm = AGNewsDataModule(data_dir=ag_dir, val_fraction=0.2, batch_size=8, cache=False)
    t = trainer(max_epochs=2, callbacks=[dp])
    t.fit(model, dm)
    assert t.global_step == 8  # 2 epochs x 32 / 8 expected batches
    assert torch.isfinite(t.callback_metrics["val/loss"]) and dp.epsilon > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    results = t.test(model, dm, verbose=False)
    assert 0.0 <= results[0]["test/acc"] <= 1.0


def test_the_thesis_model_trains_on_concatenated_vectors(ag_dir):
    """Table 3.7's layers over pooling='concat' of 15 tokens (750 inputs, Table 3.1's 113,156 parameters)."""
    torch.manual_seed(0)
    dm = AGNewsDataModule(data_dir=ag_dir, pooling="concat", max_tokens=15, val_fraction=0.2, batch_size=8,
                          cache=False)
    network = BagOfWordsMLP(in_features=dm.input_shape[0], hidden=(128, 128), activation="leaky_relu")
    assert sum(p.numel() for p in network.parameters()) == 113_156
    model = ImageClassifier(network, num_classes=4, lr=0.5)
    dp = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
    t = trainer(max_epochs=1, callbacks=[dp])
    t.fit(model, dm)
    assert t.global_step == 4 and torch.isfinite(t.callback_metrics["val/loss"]) and dp.epsilon > 0


def test_a_network_of_another_width_is_refused_before_any_batch(ag_dir):
    """ImageClassifier.setup compares the network's in_features with the data's feature width: a network built
    for the mean vector (50) on concatenated vectors (750) is refused with the fix, not a bare shape error."""
    dm = AGNewsDataModule(data_dir=ag_dir, pooling="concat", max_tokens=15, val_fraction=0.2, batch_size=8,
                          cache=False)
    model = ImageClassifier(BagOfWordsMLP(in_features=50), num_classes=4, lr=0.5)
    t = trainer(max_epochs=1, callbacks=[DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, seed=0)])
    with pytest.raises(ValueError, match=r"in_features=50 but AGNewsDataModule gives features of shape \(750,\); "
                                         r"set the network's in_features=750"):
        t.fit(model, dm)
    assert t.global_step == 0
