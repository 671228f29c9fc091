"""Converted-weights cache: the int8 matrices and scales made from one GGUF file, so later loads skip
dequantization and requantization.

File format, version 5 (4 held Q5_K at 8 bits, 3 had no 6-bit tiles, 2 no compact 4-bit tiles) (`<models cache>/converted/<key>.jllmw`):
    8 bytes   magic b"JLLMW\\x00\\x05\\x00"
    data      raw little-endian tensor bytes, each at its offset from the start of the data section (byte 8)
    H bytes   JSON: {"version": 5, "source": {...}, "tensors": {name: [dtype, shape, offset, nbytes]}}
    8 bytes   little-endian uint64: H
The index sits at the end so tensors stream straight into the file as they are converted; a file is written
as `<key>.partial`, fsynced and renamed, so a reader never sees a half-written one.
The key hashes the GGUF's absolute path, size and modification time, the precision and this format's
version, so a changed file is converted afresh. Tensors are read one at a time with plain file reads, so peak
memory stays at the final weights plus one matrix. Not memory-mapped, on purpose: mapped weights are page
cache, which this machine kind's proactive reclaim (DAMON) evicts while a chat sits idle; the next token then
waits on the disk (BENCHMARKS.md, "Memory and load"). Read into process memory they stay put, and a hot
read costs well under a second.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch

from jllm.catalog import models_dir
from jllm.model.linear import WEIGHT_LEVELS

VERSION = 5
MAGIC = b"JLLMW\x00" + bytes([VERSION, 0])
_DTYPES = {"int8": torch.int8, "float32": torch.float32, "uint8": torch.uint8, "int64": torch.int64,
           "bool": torch.bool}


def cache_key(gguf_path: Path, precision: str) -> str:
    st = os.stat(gguf_path)
    ident = f"{Path(gguf_path).resolve()}|{st.st_size}|{st.st_mtime_ns}|{precision}|v{VERSION}"
    if precision == "int8":                       # 8- or 7-bit weights by the CPU (model/linear.py)
        ident += f"|{WEIGHT_LEVELS:g}"
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


def converted_dir() -> Path:
    return Path(os.environ.get("JLLM_CONVERTED_DIR") or models_dir() / "converted")


class ConvertedReader:
    def __init__(self, path: Path):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            if f.read(8) != MAGIC or size < 16:
                raise ValueError("bad magic")
            f.seek(size - 8)
            (h,) = struct.unpack("<Q", f.read(8))
            if h > size - 16:
                raise ValueError("bad index length")
            f.seek(size - 8 - h)
            header = json.loads(f.read(h))
        if header.get("version") != VERSION:
            raise ValueError("version mismatch")
        self.tensors = header["tensors"]
        self.source = header.get("source")       # {"gguf": its path, "precision": ...}: what it was made from
        self.data_start = 8
        if self.data_start + sum(t[3] for t in self.tensors.values()) != size - 8 - h:
            raise ValueError("truncated")

    def get(self, name: str, alloc=None) -> torch.Tensor:
        """The named tensor, read from the file into alloc(nbytes) (a uint8 tensor; default: ordinary memory)."""
        dtype, shape, offset, nbytes = self.tensors[name]
        out = alloc(nbytes) if alloc is not None else torch.empty(nbytes, dtype=torch.uint8)
        view = memoryview(out.numpy()).cast("B")
        with open(self.path, "rb") as f:
            f.seek(self.data_start + offset)
            done = 0
            while done < nbytes:
                n = f.readinto(view[done:])
                if not n:
                    raise ValueError("truncated")
                done += n
        return out.view(_DTYPES[dtype]).view(shape)


class ConvertedWriter:
    """Streams tensors into `<path>.partial`; `commit()` appends the index, fsyncs and renames atomically."""

    def __init__(self, path: Path, source: dict):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.source = path, source
        self.tmp = path.with_suffix(f".{os.getpid()}.partial")
        self.f = open(self.tmp, "wb")
        self.f.write(MAGIC)
        self.tensors: dict[str, list] = {}
        self.offset = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        arr = t.contiguous().numpy()
        self.tensors[name] = [str(t.dtype).replace("torch.", ""), list(t.shape), self.offset, arr.nbytes]
        self.f.write(memoryview(arr).cast("B"))
        self.offset += arr.nbytes

    def commit(self) -> None:
        try:
            header = json.dumps({"version": VERSION, "source": self.source, "tensors": self.tensors}).encode()
            self.f.write(header + struct.pack("<Q", len(header)))
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
            os.replace(self.tmp, self.path)
        except BaseException:
            self.abort()
            raise
        remove_unusable(self.path.parent)

    def abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)


def remove_unusable(directory: Path) -> None:
    """Delete the converted files no load can use again, each holding a model's weights (~1 GB for the 1.5B):
    those of another format version (their keys never match again; two jllm versions sharing one directory
    would each convert again after the other ran: JLLM_CONVERTED_DIR separates them), and those of this one
    whose GGUF is gone or has changed (its size or time: the key a load would look for is no longer theirs).
    Files that are not ours, or cannot be read (another process's, damaged), are left alone: a load that meets
    a damaged one deletes it."""
    for path in directory.glob("*.jllmw"):
        try:
            with open(path, "rb") as f:
                magic = f.read(8)
            if magic[:6] != MAGIC[:6]:
                continue                          # not a converted file
            if magic != MAGIC:
                path.unlink()
                continue
            source = ConvertedReader(path).source
            gguf, precision = source["gguf"], source["precision"]
        except (ValueError, OSError, json.JSONDecodeError, KeyError, TypeError):
            continue
        try:
            current = cache_key(Path(gguf), precision)
        except OSError:
            current = None                        # the GGUF is gone
        if current != path.stem:
            path.unlink(missing_ok=True)


def open_converted(gguf_path: Path, precision: str) -> tuple[ConvertedReader | None, Path]:
    """The reader for an existing valid cache file (or None) and the path a new one should be written to."""
    path = converted_dir() / f"{cache_key(gguf_path, precision)}.jllmw"
    if path.exists():
        try:
            return ConvertedReader(path), path
        except (ValueError, OSError, json.JSONDecodeError, KeyError):
            path.unlink(missing_ok=True)      # damaged: convert again
    return None, path
