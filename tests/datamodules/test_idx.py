"""IDX reader and writer: round trips, exact bytes, and errors on corrupted files."""

from __future__ import annotations

import gzip
import struct

import pytest
import torch

from lightning_dp.datamodules.idx import IDX_DTYPES, IDXFormatError, parse_idx, read_idx, write_idx

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.float32, torch.float64]


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator, dtype=dtype) * 1e3
    info = torch.iinfo(dtype)
    values = torch.randint(info.min, info.max, shape, generator=generator, dtype=torch.int64).to(dtype)
    values.view(-1)[:2] = torch.tensor([info.min, info.max], dtype=dtype)  # the extremes survive
    return values


@pytest.mark.parametrize("suffix", ["", ".gz"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7,), (3, 5, 4), (2, 1, 3, 2)])
def test_round_trip(tmp_path, suffix, dtype, shape):
    tensor = _sample(dtype, shape)
    path = tmp_path / f"x-idx{len(shape)}{suffix}"
    write_idx(path, tensor)
    read = read_idx(path)
    assert read.dtype == dtype
    assert read.shape == tensor.shape
    assert torch.equal(read, tensor)
    assert path.read_bytes()[:2] == (b"\x1f\x8b" if suffix else b"\x00\x00")


def test_exact_bytes_big_endian(tmp_path):
    path = tmp_path / "labels-idx1-ubyte"
    write_idx(path, torch.tensor([7, 2, 1], dtype=torch.uint8))
    assert path.read_bytes() == bytes([0, 0, 0x08, 1, 0, 0, 0, 3, 7, 2, 1])
    path = tmp_path / "ints-idx2-int"
    write_idx(path, torch.tensor([[1, -2]], dtype=torch.int32))
    assert path.read_bytes() == bytes([0, 0, 0x0C, 2]) + struct.pack(">II", 1, 2) + struct.pack(">ii", 1, -2)


def test_type_codes_are_the_official_ones():
    assert {code: dtype for code, (dtype, _) in IDX_DTYPES.items()} == {
        0x08: torch.uint8,
        0x09: torch.int8,
        0x0B: torch.int16,
        0x0C: torch.int32,
        0x0D: torch.float32,
        0x0E: torch.float64,
    }


def test_gzip_is_detected_from_content_and_output_is_reproducible(tmp_path):
    tensor = _sample(torch.uint8, (4, 28, 28))
    first, second = tmp_path / "a.gz", tmp_path / "b.gz"
    write_idx(first, tensor)
    write_idx(second, tensor)
    assert first.read_bytes() == second.read_bytes()
    renamed = tmp_path / "no-extension"
    renamed.write_bytes(first.read_bytes())
    assert torch.equal(read_idx(renamed), tensor)


def _valid_bytes() -> bytes:
    return bytes([0, 0, 0x08, 2, 0, 0, 0, 2, 0, 0, 0, 3]) + bytes(range(6))


def test_parse_valid_bytes():
    assert parse_idx(_valid_bytes()).tolist() == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x00\x00", "magic number is incomplete"),
        (b"\x01\x00\x08\x01\x00\x00\x00\x01\x05", "bad IDX magic"),
        (b"\x00\x00\x0a\x01\x00\x00\x00\x01\x05", "unknown type code 0x0A"),
        (b"\x00\x00\x08\x00", "0 dimensions"),
        (b"\x00\x00\x08\x03\x00\x00\x00\x02", "header declares 3 dimensions"),
        (_valid_bytes()[:-1], "truncated IDX file"),
        (_valid_bytes() + b"\x00\x00", "dims mismatch"),
    ],
)
def test_corrupted_content_raises(tmp_path, data, message):
    for name, payload in (("plain", data), ("packed.gz", gzip.compress(data))):
        path = tmp_path / name
        path.write_bytes(payload)
        with pytest.raises(IDXFormatError, match=message) as info:
            read_idx(path)
        assert str(path) in str(info.value)


def test_truncated_gzip_raises(tmp_path):
    path = tmp_path / "x.gz"
    write_idx(path, _sample(torch.uint8, (10, 28, 28)))
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(IDXFormatError, match="gzip"):
        read_idx(path)


def test_truncated_real_layout_names_sizes(tmp_path):
    path = tmp_path / "images-idx3-ubyte"
    write_idx(path, torch.zeros(3, 28, 28, dtype=torch.uint8))
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(IDXFormatError, match=r"dims \(3, 28, 28\).*2352 data bytes but only 2252"):
        read_idx(path)


def test_missing_file_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_idx(tmp_path / "absent")


def test_writer_rejects_unsupported_dtype_and_rank(tmp_path):
    with pytest.raises(TypeError, match="int64 has no IDX type code"):
        write_idx(tmp_path / "x", torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="1 to 255 dimensions"):
        write_idx(tmp_path / "x", torch.tensor(1, dtype=torch.uint8))
