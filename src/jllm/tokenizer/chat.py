"""Chat templates: a conversation (a list of {"role", "content"} messages) rendered to the prompt text.

The template is the GGUF's `tokenizer.chat_template`, Jinja2 as Hugging Face writes it, rendered in an
immutable sandbox (the template comes from a downloaded file) with the helpers HF templates expect:
`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, loop controls and the `generation`
block. A GGUF without a template (gemma-3-270m's has none) gets a built-in one, as llama.cpp writes them:
gemma's turns for gemma models, ChatML for the others.

As llama.cpp does, a BOS the template writes at the start is dropped when the tokenizer adds BOS itself, so the
prompt does not start with two.
"""

from __future__ import annotations

import json
from datetime import datetime

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jllm.errors import JllmError
from jllm.tokenizer.tokenizer import Tokenizer

BUILTIN = {
    # llama.cpp's LLM_CHAT_TEMPLATE_CHATML
    "chatml": (
        "{%- for m in messages -%}"
        "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    ),
    # llama.cpp's LLM_CHAT_TEMPLATE_GEMMA: gemma has no system turn, so system text (trimmed) opens the next
    # user turn; "assistant" is "model"; every content is trimmed
    "gemma": (
        "{%- set ns = namespace(system='') -%}"
        "{%- for m in messages -%}"
        "{%- if m.role == 'system' -%}{%- set ns.system = ns.system + m.content | trim -%}"
        "{%- else -%}"
        "{%- set role = 'model' if m.role == 'assistant' else m.role -%}"
        "{{- '<start_of_turn>' + role + '\\n' -}}"
        "{%- if ns.system and role != 'model' -%}{{- ns.system + '\\n\\n' -}}{%- set ns.system = '' -%}{%- endif -%}"
        "{{- m.content | trim + '<end_of_turn>\\n' -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
    ),
}


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` (HF marks assistant text with it): renders its body as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _one_line(message: str | None) -> str:
    return " ".join(str(message).split())


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", strip_bos: bool = False,
                 origin: str = "chat template", is_builtin: bool = False):
        self.source = source
        self.origin = origin  # named in error messages
        self.is_builtin = is_builtin  # jllm's fallback: the GGUF carried none, which is how base models come
        self.bos_token, self.eos_token, self.strip_bos = bos_token, eos_token, strip_bos
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise JllmError(f"{origin} does not parse: {_one_line(e.message)} (template line {e.lineno})") from None

    @classmethod
    def from_metadata(cls, metadata: dict, tokenizer: Tokenizer) -> "ChatTemplate":
        """The GGUF's template, else the built-in one for its architecture."""
        def text(token_id: int | None) -> str:
            return tokenizer.token_text(token_id) if token_id is not None else ""

        tokens = dict(bos_token=text(tokenizer.bos_id), eos_token=text(tokenizer.eos_id), strip_bos=tokenizer.add_bos)
        source = metadata.get("tokenizer.chat_template")
        if isinstance(source, str) and source.strip():
            return cls(source, origin="the GGUF's chat template (tokenizer.chat_template)", **tokens)
        arch = str(metadata.get("general.architecture", ""))
        return cls.builtin("gemma" if arch.startswith("gemma") else "chatml", **tokens)

    @classmethod
    def builtin(cls, name: str, **kwargs) -> "ChatTemplate":
        if name not in BUILTIN:
            raise JllmError(f"no built-in chat template '{name}' (known: {', '.join(BUILTIN)})")
        return cls(BUILTIN[name], origin=f"the built-in '{name}' chat template", is_builtin=True, **kwargs)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """The prompt text for `messages`; `extra` variables (tools=..., enable_thinking=...) reach the template."""
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token, **extra,
                   "messages": messages, "add_generation_prompt": add_generation_prompt}
        try:
            text = self._template.render(**context)
        except jinja2.TemplateError as e:
            raise JllmError(f"{self.origin} failed: {_one_line(e.message or type(e).__name__)}") from None
        except Exception as e:  # a template is a program: a bad message shape shows up as any error
            raise JllmError(f"{self.origin} failed on these messages: {type(e).__name__}: {_one_line(str(e))}") from None
        if self.strip_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        return text
