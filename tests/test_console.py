"""jllm.console: a warning that comes while an answer streams starts a line of its own where stdout and stderr
go to the same place, and adds nothing where they do not."""

import sys

from jllm import console


def _run(tmp_path, same: bool) -> tuple[str, str]:
    out_path, err_path = tmp_path / "out", tmp_path / ("out" if same else "err")
    with open(out_path, "w") as out, open(err_path, "a") as err:
        saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = out, (out if same else err)
        try:
            console.answer("It is")
            console.warn("the cache is full")
            console.answer(" sunny")
            console.end_answer()
            console.warn("after the end")
        finally:
            sys.stdout, sys.stderr = saved
    return out_path.read_text(), err_path.read_text()


def test_a_warning_mid_answer_gets_its_own_line(tmp_path):
    out, _ = _run(tmp_path, same=True)
    assert out == "It is\njllm: warning: the cache is full\n sunny\njllm: warning: after the end\n"


def test_apart_nothing_is_added(tmp_path):
    out, err = _run(tmp_path, same=False)
    assert out == "It is sunny\n"
    assert err == "jllm: warning: the cache is full\njllm: warning: after the end\n"
