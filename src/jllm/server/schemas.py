"""Request bodies of the OpenAI-compatible endpoints, as pydantic models.

Only what jllm can honour is accepted: unknown fields are ignored (clients send many), but a field that would
change the answer and that jllm cannot do (n > 1, logprobs, non-zero presence/frequency penalties, image
parts, tools, a JSON response format) is a 400, never silently dropped. Ranges follow OpenAI's API reference.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from jllm.sampling import SamplingParams


MAX_STOPS = 64          # each is looked for after every token: OpenAI allows 4, llama.cpp's clients send more


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Completion(_Body):
    """The fields chat and text completions share."""

    model: str | None = None                     # None: the served model
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)   # OpenAI's default, not greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    prompt_cache_key: str | None = None          # the conversation id of the persistent KV cache
    # llama.cpp server's extensions
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    repeat_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                              repeat_penalty=self.repeat_penalty, seed=self.seed,
                              max_tokens=self.max_completion_tokens or self.max_tokens or default_max_tokens,
                              stop=tuple(s for s in stop if s))

    @field_validator("seed", mode="before")
    @classmethod
    def _whole_seed(cls, v):
        if isinstance(v, float) and not (v.is_integer() and 0 <= v < 2**64):
            raise ValueError("the seed must be a whole number from 0 to 2^64 - 1")
        return v

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings (got {len(v)})")
        return v

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v):
        if v != 1:
            raise ValueError("only n=1 is supported (one choice per request)")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _neutral(cls, v):
        if v != 0:
            raise ValueError("presence and frequency penalties are not supported (use repeat_penalty)")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v):
        for part in v if isinstance(v, list) else ():
            kind = part.type if isinstance(part, ContentPart) else part.get("type") if isinstance(part, dict) else None
            if kind is None:
                raise ValueError("a content part needs a type (only 'text' parts are supported)")
            if kind != "text":
                raise ValueError(f"content parts of type {kind!r} are not supported (text only)")
        return v

    def for_template(self) -> dict:
        """{"role", "content": str}: text parts joined; OpenAI's "developer" is the templates' "system"."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ChatRequest(_Completion):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool | None = None
    # function calling is not supported, unless the request forbids using it (the choice fields come first:
    # the tools' validators read them)
    tool_choice: str | dict | None = None
    tools: list | None = None
    function_call: str | dict | None = None
    functions: list | None = None                # the older form
    response_format: dict | None = None          # {"type": "text"} only: jllm does not constrain its output

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, v, info):
        choice = info.data.get("tool_choice" if info.field_name == "tools" else "function_call")
        if v and choice != "none":
            raise ValueError("function calling is not supported (only with the choice \"none\")")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v):
        kind = (v or {}).get("type", "text")
        if kind != "text":
            raise ValueError(f"{kind!r} is not supported (jllm does not constrain its output; only 'text')")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v:
            raise ValueError("logprobs are not supported")
        return v


class CompletionRequest(_Completion):
    prompt: str | list[int]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None                    # insertion: not supported
    best_of: int | None = None                   # several candidates, the best returned: not supported

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and any(isinstance(x, (str, list)) for x in v):
            raise ValueError("one prompt per request: a string or a list of token ids, not a batch of prompts")
        return v

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v):
        if len(v) == 0:
            raise ValueError("the prompt is empty")
        return v

    @field_validator("logprobs", "echo", "suffix")
    @classmethod
    def _unsupported(cls, v, info):
        if v:
            raise ValueError(f"{info.field_name} is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _one_candidate(cls, v):
        if v is not None and v != 1:
            raise ValueError("only best_of=1 is supported (one candidate per request)")
        return v
