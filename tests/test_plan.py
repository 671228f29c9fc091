"""jllm plan: the budget computed from GGUF headers matches what the engine really allocates."""

import pytest

from jllm.engine import Engine
from jllm.errors import JllmError
from jllm.plan import check_limit, plan, total_bytes
from synthetic import write_tiny_model

pytestmark = pytest.mark.usefixtures("native_kernels")      # built before the first model runs


@pytest.mark.parametrize("precision", ["int8", "native"])
@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_planned_weights_and_kv_match_the_engine(arch, precision, tmp_path, monkeypatch):
    monkeypatch.setenv("JLLM_CONVERTED_DIR", str(tmp_path / "conv"))
    path = tmp_path / f"{arch}.gguf"
    write_tiny_model(path, arch)
    (row,) = plan(str(path), None, ctx=128, precision=precision)
    eng = Engine(str(path), ctx_size=128, threads=1, precision=precision)
    norms = sum(t.n_elements * 4 for t in eng.gguf.tensors.values() if len(t.shape) == 1)
    assert row.weights == eng.model.w.nbytes() + norms
    assert row.kv == eng.cache.nbytes()


def test_draft_subset_shrinks_the_plan_and_limit_refuses(tmp_path):
    path = tmp_path / "q.gguf"
    write_tiny_model(path, "qwen2")
    full, sub = plan(str(path), str(path), ctx=64, precision="int8", draft_vocab=100)
    assert sub.weights < full.weights
    rows = [full, sub]
    check_limit(rows, total_bytes(rows))
    with pytest.raises(JllmError, match="memory limit.*or drop the draft"):
        check_limit(rows, total_bytes(rows) - 1)
    with pytest.raises(JllmError, match=r"lower -c/--ctx-size\)$"):        # no draft to drop
        check_limit([full], total_bytes([full]) - 1)


def test_a_draft_or_head_for_another_target_is_refused_as_the_engine_refuses_it(tmp_path):
    from test_eagle3 import write_head

    qwen = write_tiny_model(tmp_path / "q.gguf", "qwen2")
    write_tiny_model(tmp_path / "l.gguf", "llama")
    write_head(tmp_path / "h.gguf", qwen)
    assert len(plan(str(tmp_path / "q.gguf"), str(tmp_path / "h.gguf"), ctx=64, precision="int8")) == 2
    with pytest.raises(JllmError, match="was not made for l.gguf"):
        plan(str(tmp_path / "l.gguf"), str(tmp_path / "h.gguf"), ctx=64, precision="int8")
    with pytest.raises(JllmError, match="cannot draft for"):
        plan(str(tmp_path / "q.gguf"), str(tmp_path / "l.gguf"), ctx=64, precision="int8")
