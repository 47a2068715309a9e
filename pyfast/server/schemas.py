"""OpenAI request schemas (pydantic, strict: a string is not a number, a float is not an int).

Unknown fields are accepted and ignored, as clients send fields a server may not implement.
Extensions beyond the OpenAI API follow llama-server's names (``top_k``, ``min_p``,
``repeat_penalty``, ``ignore_eos``, ``n_predict``, ``json_schema``, ``grammar``, ``cache_prompt``)
and vLLM's (``continue_final_message``, ``add_generation_prompt``, ``guided_json``,
``guided_regex``, ``guided_grammar``). ``NativeCompletionRequest`` is llama-server's
``POST /completion``.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 16          # choices per request
MAX_STOP = 16       # stop strings per request
MAX_TOP_LOGPROBS = 20


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool = False


class ContentPart(_Strict):
    type: str
    text: Optional[str] = None


class ChatMessage(_Strict):
    role: Annotated[str, Field(min_length=1, max_length=64)]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict]] = None
    tool_call_id: Optional[str] = None


Stop = Union[str, Annotated[list[str], Field(max_length=MAX_STOP)], None]


class _Sampling(_Strict):
    model: Optional[str] = None
    max_tokens: Optional[Annotated[int, Field(ge=0)]] = None
    temperature: Optional[Annotated[float, Field(ge=0.0, le=2.0)]] = None
    top_p: Optional[Annotated[float, Field(gt=0.0, le=1.0)]] = None
    top_k: Optional[Annotated[int, Field(ge=0)]] = None
    min_p: Optional[Annotated[float, Field(ge=0.0, le=1.0)]] = None
    frequency_penalty: Optional[Annotated[float, Field(ge=-2.0, le=2.0)]] = None
    presence_penalty: Optional[Annotated[float, Field(ge=-2.0, le=2.0)]] = None
    repeat_penalty: Optional[Annotated[float, Field(gt=0.0)]] = None
    repeat_last_n: Optional[Annotated[int, Field(ge=-1)]] = None
    seed: Optional[Annotated[int, Field(ge=0, le=2**63 - 1)]] = None
    logit_bias: Optional[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]]] = None
    stop: Stop = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    user: Optional[str] = None
    # llama-server: n_predict (-1 = until the context is full) when max_tokens is not given
    n_predict: Optional[Annotated[int, Field(ge=-1)]] = None
    cache_prompt: bool = True  # the prompt cache is always used; accepted for compatibility
    # constrained output (pyfast.constrain): llama-server's json_schema / grammar, a regex, and
    # vLLM's guided_* names; at most one of them (and response_format) per request
    json_schema: Union[dict, bool, None] = None
    grammar: Optional[str] = None
    regex: Optional[str] = None
    guided_json: Union[dict, str, None] = None
    guided_regex: Optional[str] = None
    guided_grammar: Optional[str] = None


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Optional[Annotated[int, Field(ge=0)]] = None
    logprobs: bool = False
    top_logprobs: Optional[Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]] = None
    response_format: Optional[dict] = None
    tools: Optional[Annotated[list[dict], Field(max_length=256)]] = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: Optional[bool] = None
    chat_template_kwargs: Optional[dict] = None
    # assistant prefill: the reply continues the last (assistant) message (vLLM's names; as in
    # llama-server, a conversation ending with an assistant message is continued by default)
    continue_final_message: Optional[bool] = None
    add_generation_prompt: Optional[bool] = None
    # special-token text in message content ("<|im_end|>") is plain text unless the caller,
    # trusting its messages, asks for it to be parsed (llama-server's parse_special)
    parse_special: bool = False


Prompt = Union[
    str,
    Annotated[list[str], Field(min_length=1)],
    Annotated[list[int], Field(min_length=1)],
    Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)],
]


class CompletionRequest(_Sampling):
    prompt: Prompt
    logprobs: Optional[Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]] = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[Annotated[int, Field(ge=1)]] = None


class TokenizeRequest(_Strict):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(_Strict):
    tokens: list[int]



class ApplyTemplateRequest(_Strict):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: Optional[Annotated[list[dict], Field(max_length=256)]] = None
    chat_template_kwargs: Optional[dict] = None
    continue_final_message: Optional[bool] = None
    add_generation_prompt: Optional[bool] = None


NativePrompt = Union[str, Annotated[list[Union[int, str]], Field(min_length=1)]]


class NativeCompletionRequest(_Sampling):
    """llama-server's ``POST /completion``: ``prompt`` is a string, token ids, or a mix of both
    (the strings tokenized in place), ``n_predict`` caps the reply (-1: until the slot's context
    is full), ``n_probs`` adds each token's top-n probabilities, ``stop`` is a list of strings."""

    prompt: NativePrompt
    n_probs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] = 0
    id_slot: Optional[int] = None
    return_tokens: bool = True


class EmbeddingRequest(_Strict):
    input: Union[
        Annotated[str, Field(max_length=1 << 24)],
        Annotated[list[str], Field(min_length=1, max_length=2048)],
        Annotated[list[int], Field(min_length=1)],
        Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1, max_length=2048)],
    ]
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    pooling: Optional[Literal["mean", "last", "cls"]] = None
    normalize: bool = True
    dimensions: Optional[int] = None
    user: Optional[str] = None
