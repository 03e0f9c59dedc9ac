"""Offline data: a dataset that is missing and cannot be downloaded gives one clear error and leaves nothing.

Every download is made to fail without network: the official-file downloads get a connection
that delivers a few bytes and then resets (through the real download code), the Hugging Face
loads get a stand-in ``datasets`` package whose ``load_dataset`` writes part of a cache and then
raises the error ``datasets`` raises offline.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import socket
import sys
import types
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import lightning_dp.datamodules.hospital as hospital
import lightning_dp.datamodules.offline as offline
from lightning_dp.datamodules import (
    FEMNISTDataModule,
    AGNewsDataModule,
    DatasetUnavailableError,
    DigitsDataModule,
    FashionMNISTDataModule,
    FEMNISTFairnessDataModule,
    HospitalChargesDataModule,
    MNISTDataModule,
    SyntheticLinearMixtureDataModule,
    WikiText2DataModule,
)
from lightning_dp.datamodules.offline import (
    DownloadError,
    dataset_unavailable,
    download_guard,
    one_line,
    publish,
    removing_on_failure,
)

MNIST_FILES = ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
               "t10k-labels-idx1-ubyte.gz"]
CIFAR_FILES = [f"cifar-10-batches-py/data_batch_{i}" for i in range(1, 6)] + ["cifar-10-batches-py/test_batch"]
WIKI_FILES = ["wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens"]
HUB_ERROR = "Couldn't reach '{}' on the Hub (LocalEntryNotFoundError)"


def listing(root: Path) -> list[str]:
    """Every file and directory under ``root`` (relative), sorted; [] when ``root`` does not exist."""
    return sorted(str(path.relative_to(root)) for path in root.rglob("*")) if root.exists() else []


# ----------------------------------------------------------------------------- broken downloads
class _Response(io.BytesIO):
    """A response that delivers ``payload``; with ``reset``, the connection then drops mid-file."""

    def __init__(self, payload: bytes, reset: bool) -> None:
        super().__init__(payload)
        self.reset = reset

    def read(self, size: int = -1) -> bytes:
        data = super().read(size)
        if self.reset and not data:
            raise ConnectionResetError(104, "Connection reset by peer")
        return data


def broken_opener(served: dict[str, bytes]) -> Callable[..., _Response]:
    """An ``urlopen``: files named in ``served`` arrive whole; any other gets 13 bytes, then a reset."""

    def urlopen(request: Any, timeout: float = 0.0) -> _Response:
        name = getattr(request, "full_url", request).rsplit("/", 1)[-1]
        if name in served:
            return _Response(served[name], reset=False)
        return _Response(b"partial bytes", reset=True)

    return urlopen


def break_official_downloads(monkeypatch: pytest.MonkeyPatch, served: dict[str, bytes] = {}) -> None:  # noqa: B006
    """Route every official download (MNIST, CIFAR and CMS through ``offline.download_file``, WikiText's zip) to
    :func:`broken_opener`: they all look ``urllib.request.urlopen`` up when they run."""
    monkeypatch.setattr(urllib.request, "urlopen", broken_opener(served))


def offline_datasets(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """Install a ``datasets`` stand-in whose ``load_dataset`` leaves part of a cache, then fails as offline."""
    calls: list[tuple[str, Any]] = []

    def load_dataset(path: str, *args: Any, cache_dir: Any = None, **kwargs: Any) -> Any:
        calls.append((path, cache_dir))
        if cache_dir is not None:
            half = Path(cache_dir) / path.replace("/", "___") / "0.0.0" / "train.arrow.incomplete"
            half.parent.mkdir(parents=True)
            half.write_bytes(b"half an arrow file")
            if (Path(cache_dir) / "mine").is_dir():  # also writes into a directory the user already had
                (Path(cache_dir) / "mine" / "lock").write_text("")
        raise ConnectionError(HUB_ERROR.format(path))

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return calls


def _md5(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


# ----------------------------------------------------------------------------- the cases
def _mnist_family(module: type) -> Callable[..., Any]:
    def case(data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
        # the image files arrive whole (md5 verified), the label files break: an attempt half done
        served = {name: f"official {name}".encode() for name in MNIST_FILES if "images" in name}
        monkeypatch.setattr(module, "md5s", {name: _md5(served.get(name, b"?")) for name in MNIST_FILES})
        break_official_downloads(monkeypatch, served)
        return module(data_dir=data_dir, download=True)
    return case


def _federated_vision(dataset: str) -> Callable[..., Any]:
    def case(data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
        pytest.importorskip("flwr_datasets")
        from lightning_dp.datamodules import FederatedVisionDataModule

        break_official_downloads(monkeypatch)
        return FederatedVisionDataModule(dataset=dataset, data_dir=data_dir, download=True)
    return case


def _hospital(data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    break_official_downloads(monkeypatch)
    return HospitalChargesDataModule(data_dir=data_dir, download=True)


def _wikitext(data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    break_official_downloads(monkeypatch)  # the zip arrives truncated
    return WikiText2DataModule(str(data_dir), download=True)


def _hub(factory: Callable[[Path], Any]) -> Callable[..., Any]:
    def case(data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
        offline_datasets(monkeypatch)
        return factory(data_dir)
    return case


def _hub_federated_vision(data_dir: Path) -> Any:
    pytest.importorskip("flwr_datasets")
    from lightning_dp.datamodules import FederatedVisionDataModule

    return FederatedVisionDataModule(dataset="cifar10", data_dir=data_dir, source="huggingface")


#: id -> (DataModule with a failing download, call that downloads, dataset id or file that must be named,
#: files that must be named)
CASES: dict[str, tuple[Callable[..., Any], str, list[str]]] = {
    "mnist-idx": (_mnist_family(MNISTDataModule), "prepare_data", MNIST_FILES),
    "fashion-mnist-idx": (_mnist_family(FashionMNISTDataModule), "prepare_data", MNIST_FILES),
    "federated-mnist-idx": (_federated_vision("mnist"), "prepare_data", MNIST_FILES),
    "federated-cifar10-files": (_federated_vision("cifar10"), "prepare_data", CIFAR_FILES),
    "hospital-csv": (_hospital, "prepare_data", [hospital.OFFICIAL_FILENAME]),
    "wikitext-zip": (_wikitext, "prepare_data", WIKI_FILES),
    "mnist-hf": (_hub(lambda d: MNISTDataModule(data_dir=d, source="huggingface")), "prepare_data",
                 ["ylecun/mnist", *MNIST_FILES]),
    "fashion-mnist-hf": (_hub(lambda d: FashionMNISTDataModule(data_dir=d, source="huggingface")), "prepare_data",
                         ["zalando-datasets/fashion_mnist", *MNIST_FILES]),
    "federated-cifar10-hf": (_hub(_hub_federated_vision), "prepare_data", ["uoft-cs/cifar10", *CIFAR_FILES]),
    "femnist-hf": (_hub(lambda d: FEMNISTDataModule(data_dir=d, source="huggingface")), "prepare_data",
                   ["flwrlabs/femnist", "train/*.json", "test/*.json"]),
    "femnist-fairness-hf": (_hub(lambda d: FEMNISTFairnessDataModule(data_dir=d, source="huggingface")), "prepare_data",
                            ["flwrlabs/femnist", "train/*.json", "test/*.json"]),
    "agnews-hf": (_hub(lambda d: AGNewsDataModule(data_dir=d, source="huggingface")), "prepare_data",
                  ["fancyzhx/ag_news", "train.csv", "test.csv", "glove.6B.50d.txt"]),
    "wikitext-hf": (_hub(lambda d: WikiText2DataModule(str(d), source="huggingface")), "setup",
                    ["Salesforce/wikitext", *WIKI_FILES]),
}


def _fail(case: str, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> DatasetUnavailableError:
    factory, call, _ = CASES[case]
    datamodule = factory(data_dir, monkeypatch)
    with pytest.raises(DatasetUnavailableError) as info:
        getattr(datamodule, call)(*(("fit",) if call == "setup" else ()))
    return info.value


@pytest.mark.parametrize("case", list(CASES))
def test_a_failed_download_raises_one_message_naming_data_dir_files_and_sources(case, tmp_path, monkeypatch):
    data_dir = tmp_path / "data"
    error = _fail(case, data_dir, monkeypatch)
    message = str(error)
    assert isinstance(error, FileNotFoundError)
    assert str(data_dir.resolve()) in message and error.data_dir == data_dir.resolve()
    for name in CASES[case][2]:
        assert name in message, f"{name!r} not named in:\n{message}"
    assert error.sources and all(source in message for source in error.sources)
    # the download's error, on one line of a short message
    lines = message.splitlines()
    assert 3 <= len(lines) <= 6, message
    download_line = [line for line in lines if line.strip().startswith("download error:")]
    assert len(download_line) == 1 and error.download_error in download_line[0]
    assert any(word in error.download_error for word in ("Connection reset", "on the Hub", "not a zip file"))
    assert error.__cause__ is not None  # the original error stays attached for debugging
    assert "\n" not in error.download_error


@pytest.mark.parametrize("case", list(CASES))
def test_a_failed_download_leaves_no_new_file_or_directory(case, tmp_path, monkeypatch):
    data_dir = tmp_path / "new" / "data"  # neither it nor its parent exists yet
    _fail(case, data_dir, monkeypatch)
    assert listing(tmp_path) == []


@pytest.mark.parametrize("case", list(CASES))
def test_a_failed_download_keeps_the_users_files(case, tmp_path, monkeypatch):
    data_dir = tmp_path / "data"
    (data_dir / "mine").mkdir(parents=True)
    (data_dir / "notes.txt").write_text("my notes")
    (data_dir / "mine" / "keep.txt").write_text("keep")
    before = listing(tmp_path)
    _fail(case, data_dir, monkeypatch)
    assert listing(tmp_path) == before
    assert (data_dir / "notes.txt").read_text() == "my notes" and (data_dir / "mine" / "keep.txt").read_text() == "keep"


def test_the_hub_is_asked_for_the_dataset_in_data_dir(tmp_path, monkeypatch):
    calls = offline_datasets(monkeypatch)
    with pytest.raises(DatasetUnavailableError):
        MNISTDataModule(data_dir=tmp_path / "hf", source="huggingface").setup("fit")  # setup alone, too
    assert calls == [("ylecun/mnist", str(tmp_path / "hf"))]


def test_a_download_that_succeeds_after_a_failure_still_works(tmp_path, monkeypatch):
    """The clean-up of a failed attempt does not get in the way of the next one."""
    data_dir = tmp_path / "data"
    _fail("mnist-idx", data_dir, monkeypatch)
    served = {name: f"official {name}".encode() for name in MNIST_FILES}
    monkeypatch.setattr(MNISTDataModule, "md5s", {name: _md5(payload) for name, payload in served.items()})
    break_official_downloads(monkeypatch, served)
    MNISTDataModule(data_dir=data_dir, download=True).prepare_data()
    assert listing(tmp_path) == ["data", *(f"data/{name}" for name in sorted(MNIST_FILES))]


# ----------------------------------------------------------------------------- no download tried
@pytest.mark.parametrize("factory, names", [
    (lambda d: MNISTDataModule(data_dir=d), MNIST_FILES),
    (lambda d: FashionMNISTDataModule(data_dir=d, subset="t10k"), MNIST_FILES[2:]),
    (lambda d: HospitalChargesDataModule(data_dir=d), [hospital.OFFICIAL_FILENAME]),
    (lambda d: FEMNISTDataModule(data_dir=d), ["train/*.json", "test/*.json"]),
    (lambda d: AGNewsDataModule(data_dir=d), ["train.csv", "test.csv", "glove.6B.50d.txt"]),
    (lambda d: WikiText2DataModule(str(d), train_file="valid", val_file=None), ["wiki.valid.tokens",
                                                                                "wiki.test.tokens"]),
], ids=["mnist", "fashion-mnist-t10k", "hospital", "femnist-leaf", "agnews-csv", "wikitext"])
def test_missing_files_without_download_are_the_same_error(factory, names, tmp_path):
    data_dir = tmp_path / "data"
    datamodule = factory(data_dir)
    with pytest.raises(DatasetUnavailableError) as info:
        datamodule.prepare_data()
        datamodule.setup("fit")
    message = str(info.value)
    assert str(data_dir.resolve()) in message and all(name in message for name in names)
    assert "download error" not in message and info.value.download_error is None
    assert listing(tmp_path) == []


@pytest.mark.parametrize("dataset, names", [("mnist", MNIST_FILES), ("cifar10", CIFAR_FILES)])
def test_federated_vision_without_download(dataset, names, tmp_path):
    pytest.importorskip("flwr_datasets")
    from lightning_dp.datamodules import FederatedVisionDataModule

    with pytest.raises(DatasetUnavailableError) as info:
        FederatedVisionDataModule(dataset=dataset, data_dir=tmp_path / "data").setup()
    assert all(name in str(info.value) for name in names) and "download=True" in str(info.value)
    assert listing(tmp_path) == []


def test_bundled_and_generated_data_need_no_network(monkeypatch):
    def no_network(*args: Any, **kwargs: Any) -> None:
        raise OSError("network access in an offline test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    digits = DigitsDataModule()
    digits.prepare_data()
    digits.setup("fit")
    synthetic = SyntheticLinearMixtureDataModule(num_clients=4, num_val_clients=2, num_test_clients=2, samples_per_client=5)
    synthetic.prepare_data()
    synthetic.setup("fit")
    assert len(digits.train_dataset) > 0 and len(synthetic.train_clients) == 4


# ----------------------------------------------------------------------------- the shared pieces
def test_the_message_format_and_the_error_type():
    error = dataset_unavailable("MNISTDataModule", "MNIST", data_dir="/data/mnist", expected=["a.gz", "b.gz"],
                                missing=["b.gz"], layout="IDX", sources=["https://x/", "hub y"],
                                error=DownloadError("long\nmessage", [("https://x/b.gz", "reset\n by peer")]),
                                fix="copy them")
    assert str(error) == (
        "MNISTDataModule: MNIST is incomplete in data_dir=/data/mnist and could not be downloaded.\n"
        "  expected there: a.gz, b.gz (IDX); missing: b.gz\n"
        "  get them from:  https://x/ or hub y\n"
        "  download error: https://x/b.gz: reset by peer\n"
        "  fix: copy them"
    )
    assert isinstance(error, FileNotFoundError) and error.errno is None
    copy = pickle.loads(pickle.dumps(error))  # crosses process boundaries (DDP spawn, dataloader workers)
    assert str(copy) == str(error) and copy.expected == ("a.gz", "b.gz") and copy.dataset == "MNIST"
    assert one_line(ValueError("x" * 1000)).endswith("...") and len(one_line(ValueError("x" * 1000))) == 400


def test_removing_on_failure_removes_only_what_the_block_added(tmp_path):
    root = tmp_path / "data"
    (root / "old").mkdir(parents=True)
    (root / "old" / "kept.txt").write_text("kept")
    (root / "link").symlink_to(tmp_path, target_is_directory=True)
    before = listing(root)
    with pytest.raises(KeyError), removing_on_failure(root, sweep=True):
        (root / "old" / "new.txt").write_text("new")
        (root / "fresh" / "deep").mkdir(parents=True)
        (root / "fresh" / "deep" / "f").write_text("f")
        (root / "link2").symlink_to(tmp_path / "old-target", target_is_directory=True)
        raise KeyError("boom")
    assert listing(root) == before and (root / "old" / "kept.txt").read_text() == "kept"
    with pytest.raises(KeyError), removing_on_failure(root / "a" / "b"):  # no sweep: only what it created goes
        (root / "old" / "other.txt").write_text("a concurrent writer's")
        raise KeyError("boom")
    assert listing(root) == sorted([*before, "old/other.txt"])
    with removing_on_failure(root):  # success: everything stays
        (root / "made.txt").write_text("made")
    assert (root / "made.txt").exists()


def test_download_guard_passes_import_errors_through(tmp_path):
    def unavailable(error: str) -> DatasetUnavailableError:
        return DatasetUnavailableError(f"unavailable: {error}")

    with pytest.raises(ImportError), download_guard(tmp_path / "a", unavailable):
        raise ImportError("pip install datasets")
    with pytest.raises(DatasetUnavailableError, match="unavailable: TimeoutError: slow"), \
            download_guard(tmp_path / "b", unavailable):
        raise TimeoutError("slow")
    assert listing(tmp_path) == []


def test_publish_never_replaces_what_exists(tmp_path):
    staged, target = tmp_path / "staged", tmp_path / "target"
    staged.write_text("new")
    target.write_text("user's")
    assert publish(staged, target) is False and target.read_text() == "user's"
    target.unlink()
    assert publish(staged, target) is True and target.read_text() == "new" and not staged.exists()


def test_a_cifar_download_only_adds_the_files_an_existing_folder_lacks(tmp_path, monkeypatch):
    import tarfile

    import lightning_dp.datamodules.cifar as cifar

    archive = tmp_path / "mirror" / cifar.ARCHIVE
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tar:
        for name in [*CIFAR_FILES, "cifar-10-batches-py/batches.meta"]:
            info = tarfile.TarInfo(name)
            info.size = len(b"official")
            tar.addfile(info, io.BytesIO(b"official"))
    monkeypatch.setattr(cifar, "ARCHIVE_MD5", offline.md5sum(archive))
    monkeypatch.setattr(cifar, "MIRRORS", (archive.parent.as_uri() + "/",))
    folder = tmp_path / "data" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    (folder / "test_batch").write_bytes(b"the user's copy")
    (folder / "notes.txt").write_text("mine")
    cifar.download_cifar10(tmp_path / "data")
    assert (folder / "test_batch").read_bytes() == b"the user's copy" and (folder / "notes.txt").exists()
    assert all((tmp_path / "data" / name).read_bytes() == b"official" for name in CIFAR_FILES[:5])
    assert listing(tmp_path / "data") == sorted(["cifar-10-batches-py", *CIFAR_FILES,
                                                 "cifar-10-batches-py/batches.meta", "cifar-10-batches-py/notes.txt"])


def test_only_local_rank_zero_sweeps_a_shared_cache(tmp_path, monkeypatch):
    """Under DDP every rank loads; a failing rank other than local zero leaves the cache to rank zero."""
    from lightning_dp.datamodules.offline import DatasetUnavailableError, dataset_unavailable, load_hf_dataset

    class Failing:
        @staticmethod
        def load_dataset(path, *args, cache_dir, **kwargs):
            (Path(cache_dir) / "being_downloaded_by_rank_zero.arrow").write_text("x")
            raise ConnectionError("offline")

    def unavailable(error):
        return dataset_unavailable("X", "X", data_dir=tmp_path, expected=["x"], sources=["y"], error=error)

    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(DatasetUnavailableError):
        load_hf_dataset(Failing, "org/x", cache_dir=tmp_path, unavailable=unavailable)
    assert (tmp_path / "being_downloaded_by_rank_zero.arrow").exists()
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(DatasetUnavailableError):
        load_hf_dataset(Failing, "org/y", cache_dir=tmp_path / "c", unavailable=unavailable)
    assert not (tmp_path / "c").exists()


def test_every_format_error_is_a_data_format_error():
    """One base for the readers' format errors: ``except DataFormatError`` catches a bad IDX, LEAF or CIFAR file."""
    from lightning_dp.datamodules import CIFARFormatError, DataFormatError, IDXFormatError, LEAFFormatError
    from lightning_dp.datamodules.idx import parse_idx

    for cls in (CIFARFormatError, IDXFormatError, LEAFFormatError):
        assert issubclass(cls, DataFormatError) and issubclass(cls, ValueError)
    with pytest.raises(DataFormatError):
        parse_idx(b"\x00\x00\x07\x01")  # an unknown type code
