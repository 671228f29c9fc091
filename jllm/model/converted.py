"""Converted-weights cache: the int8 matrices and scales made from one GGUF file, so later loads skip
dequantization and requantization.

File format, version 1 (`<models cache>/converted/<key>.jllmw`):
    8 bytes   magic b"JLLMW\\x00\\x01\\x00"
    8 bytes   little-endian uint64: length H of the JSON header
    H bytes   JSON: {"version": 1, "source": {...}, "tensors": {name: [dtype, shape, offset, nbytes]}}
    data      raw little-endian tensor bytes, each at its offset from the start of the data section
The key hashes the GGUF's absolute path, size and modification time, the precision and this format's
version, so a changed file is converted afresh. Tensors are read one at a time with plain file reads (no
memory map), so peak memory stays at the final weights plus one matrix.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path

import numpy as np
import torch

MAGIC = b"JLLMW\x00\x01\x00"
VERSION = 1
_DTYPES = {"int8": (torch.int8, np.int8), "float32": (torch.float32, np.float32)}


def cache_key(gguf_path: Path, precision: str) -> str:
    st = os.stat(gguf_path)
    ident = f"{Path(gguf_path).resolve()}|{st.st_size}|{st.st_mtime_ns}|{precision}|v{VERSION}"
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


def converted_dir() -> Path:
    from jllm.store import models_dir

    return Path(os.environ.get("JLLM_CONVERTED_DIR") or models_dir() / "converted")


class ConvertedReader:
    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            if f.read(8) != MAGIC:
                raise ValueError("bad magic")
            (h,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(h))
        if header.get("version") != VERSION:
            raise ValueError("version mismatch")
        self.tensors = header["tensors"]
        self.data_start = 16 + h
        self.expected_size = self.data_start + sum(t[3] for t in self.tensors.values())
        if os.path.getsize(path) != self.expected_size:
            raise ValueError("truncated")

    def get(self, name: str) -> torch.Tensor:
        dtype, shape, offset, nbytes = self.tensors[name]
        arr = np.fromfile(self.path, dtype=_DTYPES[dtype][1], count=nbytes // np.dtype(_DTYPES[dtype][1]).itemsize,
                          offset=self.data_start + offset)
        return torch.from_numpy(arr).reshape(shape)


class ConvertedWriter:
    """Collects tensors in a temporary file; `commit()` renames it into place atomically."""

    def __init__(self, path: Path, source: dict):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.source = path, source
        self.data = tempfile.TemporaryFile(dir=path.parent)
        self.tensors: dict[str, list] = {}
        self.offset = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        dtype = str(t.dtype).replace("torch.", "")
        b = t.contiguous().numpy().tobytes()
        self.tensors[name] = [dtype, list(t.shape), self.offset, len(b)]
        self.data.write(b)
        self.offset += len(b)

    def commit(self) -> None:
        header = json.dumps({"version": VERSION, "source": self.source, "tensors": self.tensors}).encode()
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".partial")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(MAGIC + struct.pack("<Q", len(header)) + header)
                self.data.seek(0)
                while chunk := self.data.read(1 << 24):
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        finally:
            self.data.close()


def open_converted(gguf_path: Path, precision: str) -> tuple[ConvertedReader | None, Path]:
    """The reader for an existing valid cache file (or None) and the path a new one should be written to."""
    path = converted_dir() / f"{cache_key(gguf_path, precision)}.jllmw"
    if path.exists():
        try:
            return ConvertedReader(path), path
        except (ValueError, OSError, json.JSONDecodeError, KeyError):
            path.unlink(missing_ok=True)      # damaged: convert again
    return None, path
