"""What every DataModule does when its data is missing and cannot be fetched.

One exception, :class:`DatasetUnavailableError`, whose ``str()`` is the whole message (built by
:func:`dataset_unavailable`); downloads (:func:`download_file`, :func:`load_hf_dataset`) go through
:func:`download_guard`, :func:`staging_area` and :func:`publish`, so a failed one leaves nothing half-made in
``data_dir``. Each helper and an example: docs/data.md, "When the data is missing".
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Optional, Union

__all__ = [
    "ChecksumError",
    "DataFormatError",
    "DatasetUnavailableError",
    "DownloadError",
    "STAGING_PREFIX",
    "dataset_unavailable",
    "download_file",
    "download_guard",
    "import_datasets",
    "load_hf_dataset",
    "md5_check",
    "md5sum",
    "one_line",
    "publish",
    "removing_on_failure",
    "staging_area",
]

PathLike = Union[str, "os.PathLike[str]"]
UrlOpener = Callable[..., Any]
#: Name prefix of the temporary download directories inside a ``data_dir``.
STAGING_PREFIX = ".lightning-dp-download-"
_MAX_ERROR_CHARS = 400


class DataFormatError(ValueError):
    """A file is not in its dataset's official format (the message names the file and the problem). One base for the
    format errors of every reader (:class:`~lightning_dp.datamodules.idx.IDXFormatError`, LEAF's JSON, CIFAR's
    batches), so that ``except DataFormatError`` catches any of them; a ``ValueError``, as before."""


class DatasetUnavailableError(FileNotFoundError):
    """A dataset's files are missing from ``data_dir`` and could not (or may not) be downloaded.

    ``str(error)`` is the whole message for a person (a few lines, no traceback needed).
    A subclass of :class:`FileNotFoundError`, so ``except FileNotFoundError`` still catches it.

    Attributes:
        dataset: The dataset's name, e.g. ``"MNIST"``.
        data_dir: The resolved directory that was looked in.
        expected: The files (relative to ``data_dir``) the loader reads.
        sources: Where to get them (URLs, Hugging Face dataset ids).
        download_error: The download's error in one line, or ``None`` when none was tried.
    """

    def __init__(self, message: str, *, dataset: str = "", data_dir: Optional[PathLike] = None,
                 expected: Sequence[str] = (), sources: Sequence[str] = (),
                 download_error: Optional[str] = None) -> None:
        super().__init__(message)
        self.dataset = dataset
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.expected = tuple(expected)
        self.sources = tuple(sources)
        self.download_error = download_error

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class DownloadError(RuntimeError):
    """No address served a file; :meth:`summary` gives each address and its failure on one line."""

    def __init__(self, message: str, failures: Sequence[tuple[str, str]] = ()) -> None:
        super().__init__(message)
        self.failures = [(str(url), str(reason)) for url, reason in failures]

    def summary(self) -> str:
        return "; ".join(f"{url}: {reason}" for url, reason in self.failures) or str(self)


def one_line(error: Union[BaseException, str]) -> str:
    """An error as ``"Type: message"`` on one line, at most a few hundred characters."""
    if isinstance(error, DownloadError):
        text = error.summary()
    elif isinstance(error, BaseException):
        text = f"{type(error).__name__}: {error}"
    else:
        text = str(error)
    text = " ".join(text.split())
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."


def dataset_unavailable(
    owner: str,
    dataset: str,
    *,
    data_dir: PathLike,
    expected: Sequence[str],
    sources: Sequence[str],
    missing: Optional[Sequence[str]] = None,
    layout: str = "",
    error: Optional[Union[BaseException, str]] = None,
    fix: str = "",
) -> DatasetUnavailableError:
    """Build the one message of a missing dataset (the only place that formats it).

    Args:
        owner: The class that needs the data, e.g. ``"MNISTDataModule"``.
        dataset: The dataset's name, e.g. ``"MNIST"``.
        data_dir: The directory looked in (printed resolved).
        expected: Every file (or folder/pattern), relative to ``data_dir``, that the loader reads.
        sources: Where to get them: official URLs, ``Hugging Face dataset <id>``.
        missing: Those of ``expected`` that are absent, when only some are (named after the list).
        layout: The raw format in a few words, e.g. ``"official IDX files, gzipped or not"``.
        error: The download's error (any exception or text; shortened to one line), or
            ``None`` when no download was tried.
        fix: What to do, e.g. ``"pass download=True, or copy the files into data_dir"``.

    Returns:
        The exception, to be raised by the caller.
    """
    where = Path(data_dir).expanduser().resolve()
    failed = one_line(error) if error is not None else None
    missing = list(missing) if missing is not None else []
    partial = 0 < len(missing) < len(expected)
    prefix = "" if owner == dataset else f"{owner}: "
    headline = f"{prefix}{dataset} is {'incomplete' if partial else 'not'} in data_dir={where}"
    lines = [headline + (" and could not be downloaded." if failed else ".")]
    listed = ", ".join(expected)
    if layout:
        listed += f" ({layout})"
    if partial:
        listed += f"; missing: {', '.join(missing)}"
    lines.append(f"  expected there: {listed}")
    lines.append(f"  get them from:  {' or '.join(sources)}")
    if failed:
        lines.append(f"  download error: {failed}")
    if fix:
        lines.append(f"  fix: {fix}")
    return DatasetUnavailableError("\n".join(lines), dataset=dataset, data_dir=where, expected=expected,
                                   sources=sources, download_error=failed)


# ----------------------------------------------------------------------------- disk hygiene
def _listing(directory: Path) -> set[str]:
    """Every path under ``directory``, relative to it (symlinked folders are not entered)."""
    found: set[str] = set()
    for root, dirs, files in os.walk(directory):
        relative = os.path.relpath(root, directory)
        found.update(os.path.normpath(os.path.join(relative, name)) for name in (*dirs, *files))
    return found


def _remove_new(directory: Path, before: set[str]) -> None:
    """Remove what is under ``directory`` and not in ``before`` (a new folder goes whole)."""
    for root, dirs, files in os.walk(directory):
        relative = os.path.relpath(root, directory)
        for name in list(dirs):
            if os.path.normpath(os.path.join(relative, name)) in before:
                continue
            dirs.remove(name)
            path = os.path.join(root, name)
            if os.path.islink(path):
                os.unlink(path)
            else:
                shutil.rmtree(path, ignore_errors=True)
        for name in files:
            if os.path.normpath(os.path.join(relative, name)) not in before:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(root, name))


def import_datasets(needed_by: str, alternative: str) -> Any:
    """The Hugging Face ``datasets`` package, or an ``ImportError`` saying how to install it or what to use instead.

    Args:
        needed_by: What needs it, e.g. ``"source='huggingface'"``.
        alternative: The offline source to use instead, e.g. ``"source='idx' with the official IDX files"``.
    """
    from lightning_dp.extras import require

    return require("datasets", "hf", needed_by, alternative)


@contextlib.contextmanager
def removing_on_failure(directory: PathLike, *, sweep: bool = False) -> Iterator[Path]:
    """Create ``directory`` (with missing parents); if the block raises, remove what was created for it.

    On an exception, the directories created here are removed (when empty), deepest first,
    and the exception propagates. With ``sweep=True``, every file and folder that appeared
    under ``directory`` during the block is removed first (for writers that do not stage
    their output, e.g. the ``datasets`` library; a concurrent writer's new files would go
    too). What existed before is never removed or changed.

    Yields:
        ``directory`` as a :class:`~pathlib.Path`.
    """
    directory = Path(directory).expanduser()
    created = [path for path in (directory, *directory.absolute().parents) if not path.exists()]
    before = _listing(directory) if sweep and directory.is_dir() else set()
    directory.mkdir(parents=True, exist_ok=True)
    try:
        yield directory
    except BaseException:
        if sweep and directory.is_dir():
            _remove_new(directory, before)
        for path in created:  # deepest first
            try:
                path.rmdir()
            except OSError:  # not empty: someone else wrote there meanwhile
                break
        raise


@contextlib.contextmanager
def download_guard(
    directory: PathLike, unavailable: Callable[[str], DatasetUnavailableError], *, sweep: bool = False
) -> Iterator[Path]:
    """Run a download into ``directory``: clean up on failure and raise one clear error.

    Any :class:`Exception` of the block (network, HTTP, checksum, disk, the ``datasets``
    library's errors) becomes ``unavailable(one_line(error))``, raised from it, after
    :func:`removing_on_failure` removed what the attempt created (``sweep``: see there). :class:`ImportError`
    (a missing optional package has its own message) and :class:`DatasetUnavailableError`
    pass through unchanged.

    Args:
        directory: The ``data_dir`` the download writes into.
        unavailable: Builds the DataModule's message from the one-line download error.
        sweep: Also remove every file and folder that appeared in ``directory`` during a
            failed block (for downloads that are not staged).

    Yields:
        ``directory`` as a :class:`~pathlib.Path`.
    """
    with removing_on_failure(directory, sweep=sweep) as path:
        try:
            yield path
        except (ImportError, DatasetUnavailableError):
            raise
        except Exception as err:
            raise unavailable(one_line(err)) from err


@contextlib.contextmanager
def staging_area(directory: PathLike) -> Iterator[Path]:
    """A fresh temporary directory inside ``directory`` (same file system, so :func:`publish` is a
    rename), removed with everything left in it when the block ends."""
    with tempfile.TemporaryDirectory(dir=directory, prefix=STAGING_PREFIX) as tmp:
        yield Path(tmp)


def publish(staged: PathLike, target: PathLike) -> bool:
    """Move a finished download into place with one atomic rename, unless ``target`` exists.

    Returns:
        Whether it was moved (``False``: an existing file or folder was kept).
    """
    target = Path(target)
    if target.exists() or target.is_symlink():
        return False
    os.replace(staged, target)
    return True


def load_hf_dataset(
    datasets_module: Any,
    path: str,
    *args: Any,
    cache_dir: Optional[PathLike],
    unavailable: Callable[[str], DatasetUnavailableError],
    **kwargs: Any,
) -> Any:
    """``datasets_module.load_dataset(path, *args, cache_dir=cache_dir, **kwargs)`` under :func:`download_guard`.

    Args:
        datasets_module: The imported ``datasets`` package (each DataModule imports it with
            its own install hint).
        path: The Hugging Face dataset id, e.g. ``"ylecun/mnist"``.
        cache_dir: The cache directory (the DataModule's ``data_dir``); ``None``: the
            library's default cache, which is left to the library.
        unavailable: Builds the DataModule's message from the one-line error.

    Returns:
        What ``load_dataset`` returns.

    Raises:
        DatasetUnavailableError: If the dataset is neither cached nor downloadable.
    """
    if cache_dir is None:
        try:
            return datasets_module.load_dataset(path, *args, **kwargs)
        except (ImportError, DatasetUnavailableError):
            raise
        except Exception as err:
            raise unavailable(one_line(err)) from err
    # Only one process per machine sweeps: under DDP every rank loads, and a rank that fails must not remove
    # what another rank is downloading into the same cache (two independent jobs sharing a data_dir still could).
    sweep = os.environ.get("LOCAL_RANK", "0") == "0"
    with download_guard(cache_dir, unavailable, sweep=sweep):
        return datasets_module.load_dataset(path, *args, cache_dir=str(cache_dir), **kwargs)


# --------------------------------------------------------------------------- downloads
class ChecksumError(RuntimeError):
    """Raised when a downloaded file does not have the expected md5 sum."""


def md5sum(path: PathLike, *, chunk_size: int = 1 << 20) -> str:
    """The hexadecimal md5 digest (32 lowercase characters) of a file, read ``chunk_size`` bytes at a time."""
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(chunk_size), b""):
            digest.update(chunk)
    return digest.hexdigest()


def md5_check(md5: str) -> Callable[[Path], None]:
    """A :func:`download_file` check: the file's md5 sum is ``md5``, else :class:`ChecksumError`."""
    def check(path: Path) -> None:
        actual = md5sum(path)
        if actual != md5.lower():
            raise ChecksumError(f"md5 mismatch: expected {md5.lower()}, got {actual}")
    return check


def download_file(filename: str, *, directory: PathLike, urls: Sequence[str], check: Callable[[Path], object],
                  urlopen: Optional[UrlOpener] = None, timeout: float = 60.0, advice: str = "") -> Path:
    """Download ``directory/filename`` from the first of ``urls`` that serves a file passing ``check``.

    The body is written to ``<filename>.part`` and renamed only after ``check(part)`` returned (it raises
    ``ValueError``, ``OSError`` or :class:`ChecksumError` for a wrong file), so an interrupted or wrong download
    never leaves a file that looks complete; when no address served it, nothing is left behind (not even the
    directory, when it was created here).

    Args:
        filename: the name the file gets in ``directory``.
        directory: destination, created if missing.
        urls: full addresses tried in order (``https://``, ``http://`` or ``file://``).
        check: raises unless the downloaded file is the official one (:func:`md5_check`, or a layout check; what
            it returns is ignored).
        urlopen: a function with the signature of :func:`urllib.request.urlopen` (injectable for tests, proxies);
            default: ``urllib.request.urlopen``, looked up at the call.
        timeout: seconds before a connection attempt is abandoned.
        advice: a last line for the error, e.g. how to get the file by hand.

    Raises:
        DownloadError: no address served a file that passed ``check``; the message lists each address and why.
    """
    target_dir = Path(directory).expanduser()
    destination = target_dir / filename
    partial = destination.with_name(destination.name + ".part")
    opener = urlopen if urlopen is not None else urllib.request.urlopen
    failures = []
    with removing_on_failure(target_dir):
        for url in urls:
            request = urllib.request.Request(url, headers={"User-Agent": "lightning-dp"})
            try:
                with opener(request, timeout=timeout) as response, open(partial, "wb") as handle:
                    for chunk in iter(lambda: response.read(1 << 20), b""):
                        handle.write(chunk)
                check(partial)
                os.replace(partial, destination)
                return destination
            except (urllib.error.URLError, OSError, ValueError, UnicodeDecodeError, ChecksumError) as err:
                failures.append((url, str(err)))
            finally:
                if partial.exists():
                    partial.unlink()
        raise DownloadError(
            f"could not download {filename} into {target_dir.resolve()}:\n"
            + "\n".join(f"  {url}: {reason}" for url, reason in failures) + (f"\n{advice}" if advice else ""),
            failures,
        )
