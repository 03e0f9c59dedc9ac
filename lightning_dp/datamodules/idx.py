"""Reader and writer for the IDX format of the MNIST family of datasets.

:func:`read_idx` reads plain or gzip-compressed IDX files (a magic number, big-endian sizes, C-order elements) and
:func:`write_idx` writes them; :class:`IDXFormatError` for a file that is not one. The layout, the element types
and an example: docs/data.md, "The IDX format".
"""

from __future__ import annotations

import gzip
import math
import os
import struct
import zlib
from typing import Union

import numpy as np
import torch

from lightning_dp.datamodules.offline import DataFormatError

__all__ = ["IDX_DTYPES", "IDXFormatError", "parse_idx", "read_idx", "write_idx"]

PathLike = Union[str, "os.PathLike[str]"]

#: IDX element-type code -> (torch dtype, big-endian numpy dtype).
IDX_DTYPES: dict[int, tuple[torch.dtype, np.dtype]] = {
    0x08: (torch.uint8, np.dtype(">u1")),
    0x09: (torch.int8, np.dtype(">i1")),
    0x0B: (torch.int16, np.dtype(">i2")),
    0x0C: (torch.int32, np.dtype(">i4")),
    0x0D: (torch.float32, np.dtype(">f4")),
    0x0E: (torch.float64, np.dtype(">f8")),
}
_TORCH_TO_CODE = {torch_dtype: code for code, (torch_dtype, _) in IDX_DTYPES.items()}
_GZIP_MAGIC = b"\x1f\x8b"


class IDXFormatError(DataFormatError):
    """Raised when a file is not a valid IDX file (bad magic, truncated, dims mismatch)."""


def _describe_codes() -> str:
    return ", ".join(f"0x{code:02X} ({dtype})" for code, (dtype, _) in IDX_DTYPES.items())


def parse_idx(data: bytes, *, source: str = "<bytes>") -> torch.Tensor:
    """Decode the bytes of an (uncompressed) IDX file.

    Args:
        data: The full content of the file.
        source: A name for the data, used in error messages.

    Returns:
        A tensor with the file's shape and the dtype of its type code (native byte order).

    Raises:
        IDXFormatError: If the magic number is wrong, the type code unknown, the file
            shorter than its header says (truncated) or longer (dims mismatch).
    """
    if len(data) < 4:
        raise IDXFormatError(
            f"{source}: truncated IDX file: {len(data)} bytes, the 4-byte magic number is incomplete"
        )
    zero0, zero1, code, ndim = data[0], data[1], data[2], data[3]
    if zero0 != 0 or zero1 != 0:
        raise IDXFormatError(
            f"{source}: bad IDX magic number 0x{data[:4].hex().upper()}: the first two bytes must be "
            "0x00 0x00 (is this an IDX file? gzip files are detected and decompressed automatically)"
        )
    if code not in IDX_DTYPES:
        raise IDXFormatError(
            f"{source}: bad IDX magic number 0x{data[:4].hex().upper()}: unknown type code "
            f"0x{code:02X}; expected one of {_describe_codes()}"
        )
    if ndim == 0:
        raise IDXFormatError(f"{source}: IDX header declares 0 dimensions; at least one is required")
    header_size = 4 + 4 * ndim
    if len(data) < header_size:
        raise IDXFormatError(
            f"{source}: truncated IDX file: the header declares {ndim} dimensions "
            f"({header_size} header bytes) but the file has only {len(data)} bytes"
        )
    shape = struct.unpack(f">{ndim}I", data[4:header_size])
    torch_dtype, np_dtype = IDX_DTYPES[code]
    expected = math.prod(shape) * np_dtype.itemsize
    actual = len(data) - header_size
    if actual < expected:
        raise IDXFormatError(
            f"{source}: truncated IDX file: dims {tuple(shape)} of {torch_dtype} need {expected} "
            f"data bytes but only {actual} are present"
        )
    if actual > expected:
        raise IDXFormatError(
            f"{source}: IDX dims mismatch: dims {tuple(shape)} of {torch_dtype} need {expected} "
            f"data bytes but the file holds {actual} ({actual - expected} unexpected trailing bytes)"
        )
    array = np.frombuffer(data, dtype=np_dtype, offset=header_size).reshape(shape)
    # Native byte order and a writable copy: torch does not take big-endian or read-only buffers.
    return torch.from_numpy(array.astype(np_dtype.newbyteorder("="), copy=True))


def read_idx(path: PathLike) -> torch.Tensor:
    """Read an IDX file, plain or gzip-compressed.

    Compression is detected from the content (the gzip magic ``1f 8b``), so a file
    works whatever its name.

    Args:
        path: Path of the file, e.g. ``"data/mnist/t10k-images-idx3-ubyte.gz"``.

    Returns:
        A tensor with the file's shape (e.g. ``(10000, 28, 28)``) and dtype
        (``torch.uint8`` for the MNIST files).

    Raises:
        FileNotFoundError: If the file does not exist.
        IDXFormatError: If the content is not valid IDX or the gzip stream is corrupt.

    Example:
        >>> images = read_idx("data/mnist/t10k-images-idx3-ubyte.gz")  # doctest: +SKIP
        >>> images.shape, images.dtype  # doctest: +SKIP
        (torch.Size([10000, 28, 28]), torch.uint8)
    """
    source = os.fspath(path)
    with open(source, "rb") as handle:
        data = handle.read()
    if data[:2] == _GZIP_MAGIC:
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as err:
            raise IDXFormatError(f"{source}: corrupt or truncated gzip stream: {err}") from err
    return parse_idx(data, source=source)


def write_idx(path: PathLike, tensor: torch.Tensor) -> None:
    """Write a tensor as an IDX file, gzip-compressed when ``path`` ends with ``.gz``.

    Args:
        path: Destination path; parent directories must exist.
        tensor: At least one dimension, each below 2**32; dtype one of ``torch.uint8``,
            ``int8``, ``int16``, ``int32``, ``float32``, ``float64`` (the IDX types).

    Raises:
        TypeError: If the dtype has no IDX type code (cast first, e.g. ``t.to(torch.int32)``).
        ValueError: If the tensor has no dimension, more than 255, or a dimension too large.

    Example:
        >>> import tempfile, os, torch
        >>> path = os.path.join(tempfile.mkdtemp(), "x-idx3-ubyte")
        >>> write_idx(path, torch.zeros(2, 28, 28, dtype=torch.uint8))
        >>> os.path.getsize(path)  # 16 header bytes + 2 * 784
        1584
    """
    tensor = torch.as_tensor(tensor).detach().cpu().contiguous()
    if tensor.dtype not in _TORCH_TO_CODE:
        raise TypeError(
            f"write_idx: dtype {tensor.dtype} has no IDX type code; supported: {_describe_codes()}. "
            "Cast the tensor first, e.g. tensor.to(torch.int32)."
        )
    if not 1 <= tensor.ndim <= 255:
        raise ValueError(f"write_idx: the tensor must have 1 to 255 dimensions, got {tensor.ndim}")
    if any(size >= 2**32 for size in tensor.shape):
        raise ValueError(f"write_idx: every dimension must be below 2**32, got shape {tuple(tensor.shape)}")
    code = _TORCH_TO_CODE[tensor.dtype]
    np_dtype = IDX_DTYPES[code][1]
    header = struct.pack(">BBBB", 0, 0, code, tensor.ndim) + struct.pack(f">{tensor.ndim}I", *tensor.shape)
    payload = header + tensor.numpy().astype(np_dtype, copy=False).tobytes()
    target = os.fspath(path)
    if target.endswith(".gz"):
        # mtime=0 makes the output byte-identical for identical input (reproducible fixtures).
        payload = gzip.compress(payload, mtime=0)
    with open(target, "wb") as handle:
        handle.write(payload)
