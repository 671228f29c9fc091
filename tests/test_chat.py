"""jllm.tokenizer.chat: GGUF chat templates in a sandbox, and the built-in ones for GGUFs without a template."""

from __future__ import annotations

from functools import lru_cache

import pytest

from jllm.errors import JllmError
from jllm.gguf.reader import read_gguf
from jllm.tokenizer.chat import ChatTemplate
from jllm.tokenizer.tokenizer import Tokenizer
from test_tokenizer import bpe_metadata, spm_metadata

QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def user_text(chatml_prompt: str) -> str:
    """The user message inside a ChatML prompt of the reference fixtures."""
    return chatml_prompt.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]


# --- templates without a model --------------------------------------------------------------------------

def test_builtin_chatml():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ChatTemplate.builtin("chatml").render(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert ChatTemplate.builtin("chatml").render(messages, add_generation_prompt=False).endswith("Hi<|im_end|>\n")


def test_builtin_gemma_folds_system_into_first_user_turn():
    messages = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hello\n"},
                {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Bye"}]
    assert ChatTemplate.builtin("gemma").render(messages) == (
        "<start_of_turn>user\nBe brief.\n\nHello<end_of_turn>\n"
        "<start_of_turn>model\nHi!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n"
        "<start_of_turn>model\n")


def test_hf_helpers():
    tmpl = ChatTemplate("{{ messages[0] | tojson }}|{{ strftime_now('%Y') | length }}|"
                        "{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{{ m.content }}{% endfor %}"
                        "{% generation %}{{ bos_token }}{% endgeneration %}", bos_token="<s>")
    messages = [{"role": "user", "content": "café <b>"}, {"role": "user", "content": "2"}]
    assert tmpl.render(messages) == '{"role": "user", "content": "café <b>"}|4|2<s>'


def test_bos_written_by_the_template_is_dropped_when_the_tokenizer_adds_it():
    source = "{{ bos_token }}{{ messages[0].content }}"
    assert ChatTemplate(source, bos_token="<bos>", strip_bos=True).render([{"role": "user", "content": "x"}]) == "x"
    assert ChatTemplate(source, bos_token="<bos>").render([{"role": "user", "content": "x"}]) == "<bos>x"


@pytest.mark.parametrize("source, message", [
    ("{{ raise_exception('Only user and\\nassistant roles') }}", "failed: Only user and assistant roles"),
    ("{% for m in messages %}", "does not parse"),
    ("{{ messages.append(1) }}", "unsafe"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
    ("{{ messages[0].content + 1 }}", "failed on these messages: TypeError"),
])
def test_template_errors_are_one_line_jllm_errors(source, message):
    with pytest.raises(JllmError, match=message) as err:
        ChatTemplate(source).render([{"role": "user", "content": "x"}])
    assert "\n" not in str(err.value)


def test_from_metadata_picks_gguf_template_or_builtin():
    tok = Tokenizer.from_metadata(bpe_metadata())
    md = {**bpe_metadata(), "tokenizer.chat_template": "{{ eos_token }}", "general.architecture": "qwen2"}
    assert ChatTemplate.from_metadata(md, tok).render([]) == "<|im_end|>"
    assert not ChatTemplate.from_metadata(md, tok).is_builtin
    md = {**bpe_metadata(), "general.architecture": "qwen2"}
    assert ChatTemplate.from_metadata(md, tok).is_builtin
    assert ChatTemplate.from_metadata(md, tok).source == ChatTemplate.builtin("chatml").source
    spm = {**spm_metadata(), "general.architecture": "gemma3"}
    tmpl = ChatTemplate.from_metadata(spm, Tokenizer.from_metadata(spm))
    assert tmpl.source == ChatTemplate.builtin("gemma").source and tmpl.bos_token == "<bos>" and tmpl.strip_bos


# --- the real models ---------------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def _load(path: str) -> tuple[dict, Tokenizer, ChatTemplate]:
    md = read_gguf(path).metadata
    tok = Tokenizer.from_metadata(md)
    return md, tok, ChatTemplate.from_metadata(md, tok)


@pytest.mark.parametrize("alias", ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"])
def test_qwen_template_reproduces_llama_cpp_prompts(alias, real_model, reference):
    _, tok, tmpl = _load(str(real_model(alias)))
    for case in reference(alias)["greedy"]:
        user = {"role": "user", "content": user_text(case["prompt_text"])}
        assert tmpl.render([{"role": "system", "content": QWEN_SYSTEM}, user]) == case["prompt_text"]
        assert tmpl.render([user]) == case["prompt_text"]  # the template's default system message
        assert tok.encode(tmpl.render([user])) == case["prompt_ids"]


def test_smollm_prompts_are_plain_chatml(real_model, reference):
    _, tok, tmpl = _load(str(real_model("smollm2-135m")))
    chatml = ChatTemplate.builtin("chatml")
    for case in reference("smollm2-135m")["greedy"]:
        user = {"role": "user", "content": user_text(case["prompt_text"])}
        # the fixtures were rendered as ChatML without a system turn
        assert chatml.render([user]) == case["prompt_text"]
        assert tok.encode(chatml.render([user])) == case["prompt_ids"]
        # the GGUF's own template adds SmolLM's default system message
        system = f"<|im_start|>system\n{SMOLLM_SYSTEM}<|im_end|>\n"
        assert tmpl.render([user]) == system + case["prompt_text"]


def test_gemma_gguf_has_no_template_and_gets_the_builtin(real_model):
    md, tok, tmpl = _load(str(real_model("gemma-3-270m")))
    assert "tokenizer.chat_template" not in md
    text = tmpl.render([{"role": "system", "content": "Answer in French."},
                        {"role": "user", "content": "What is a cache?"}])
    assert text == ("<start_of_turn>user\nAnswer in French.\n\nWhat is a cache?<end_of_turn>\n"
                    "<start_of_turn>model\n")
    ids = tok.encode(text)
    start, end = tok.vocab.tokens.index("<start_of_turn>"), tok.vocab.tokens.index("<end_of_turn>")
    assert ids[:2] == [tok.bos_id, start] and ids.count(start) == 2 and ids.count(end) == 1
    assert end in tok.eot_ids
