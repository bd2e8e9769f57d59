"""Request bodies (pydantic, strict) and response bodies of the OpenAI-compatible API.

Requests are validated strictly: wrong types are errors (no "1" for 1), unknown fields are
errors (a parameter the engine cannot honour is refused, never ignored), and OpenAI fields
the engine does not support are accepted only at their default value.
"""

from __future__ import annotations

import functools
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from quickdraft.engine.beam_search import BeamSearchParams
from quickdraft.models.chat import ChatRenderError, ChatRendering
from quickdraft.outputs import RequestMetrics, RequestOutput, TokenLogprobs
from quickdraft.sampling_params import SamplingParams
from quickdraft.server.errors import bad_request
from quickdraft.structured import StructuredOutputsParams
from quickdraft.structured.tools import ToolCalling, resolve_tool_calling

# Bounds beyond SamplingParams' own: they keep float32 logits finite inside the engine (a
# temperature of 1e-40 divides logits into inf, and one request's NaN would fail its whole
# step), and the seed must fit torch.Generator.manual_seed.
MIN_POSITIVE_TEMPERATURE = 1e-4
MAX_TEMPERATURE = 1e4
REPETITION_PENALTY_RANGE = (1e-2, 1e2)
SEED_RANGE = (-(2**63), 2**64 - 1)
MAX_STOP_STRINGS = 16
MAX_N = 128  # completions per prompt, as OpenAI's API caps `n`
MAX_PROMPTS = 256  # prompts in one /v1/completions request
# Content parts are joined into one string for the chat template.
TEXT_PART_TYPES = ("text", "input_text")


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class LogitsProcessorConstructor(StrictModel):
    """vLLM's: a factory by qualified name, called with args and kwargs; its result is the processor."""

    qualname: str
    args: list[Any] | None = None
    kwargs: dict[str, Any] | None = None


class TextPart(StrictModel):
    type: Literal["text", "input_text"]
    text: str


class CalledFunction(StrictModel):
    name: str
    arguments: str  # JSON, as the model wrote it


class ToolCallMessage(StrictModel):
    """An earlier assistant turn's call, sent back with the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # a "tool" message: the call it answers
    tool_calls: list[ToolCallMessage] | None = None  # an "assistant" message: the calls it made
    # an "assistant" message's thinking, sent back (vLLM's field; DeepSeek's older name)
    reasoning: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


def conversation_of(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them (content parts joined; name, tool_call_id,
    tool_calls and an assistant's thinking as `reasoning_content` where given)."""
    conversation = []
    for message in messages:
        entry: dict[str, Any] = {"role": message.role, "content": message.text()}
        for key in ("name", "tool_call_id"):
            if getattr(message, key) is not None:
                entry[key] = getattr(message, key)
        if message.tool_calls:
            entry["tool_calls"] = [call.model_dump() for call in message.tool_calls]
        thinking = message.reasoning if message.reasoning is not None else message.reasoning_content
        if thinking is not None:  # the name reasoning templates read (Qwen3's, DeepSeek's)
            entry["reasoning_content"] = thinking
        conversation.append(entry)
    return conversation


class SamplingFields(StrictModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # None: the served model
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    temperature: float | None = None  # None: 1.0, as OpenAI
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    # vLLM's: lower is served first by a server started with --scheduling-policy priority
    priority: int = 0
    # vLLM's: the request's prefix-cache blocks are shared only with requests of the same salt
    # (tenants cannot learn from a cache hit's speed what others sent)
    cache_salt: str | None = None
    # vLLM's: the response's id is built from it (the engine's own ids stay unique)
    request_id: str | None = None
    # vLLM's: logprobs name tokens "token_id:<id>" (for tokens whose text does not decode alone)
    return_tokens_as_token_ids: bool = False
    # OpenAI's predicted outputs: {"type": "content", "content": text or text parts}, the reply
    # expected (mostly): drafted as it stands, so a right guess is decoded many tokens a forward
    prediction: dict[str, Any] | None = None
    # vLLM's: processors by qualified name, that --logits-processor-pattern allows
    # (server/logits_processors.py); applied to every verified row, so exact under speculation
    logits_processors: list[str | LogitsProcessorConstructor] | None = None
    # vLLM's beam search: the n best continuations by summed logprob (engine/beam_search.py),
    # ranked with length_penalty; whole responses only
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # Extensions (vLLM's names), all handled by SamplingParams.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens
    # vLLM's: each prompt token's logprob, rank and the top k, in whole responses
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # vLLM's; no effect with these (fast) tokenizers
    include_stop_str_in_output: bool = False
    # vLLM's extension: the generated token ids next to the text (a client can then compare
    # outputs exactly, e.g. speculative against plain decoding).
    return_token_ids: bool = False
    # Structured outputs, at most one per request: OpenAI's response_format, vLLM's
    # structured_outputs object (json / regex / choice / grammar / json_object) or its older
    # guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: the whitespace a JSON constraint allows (a regex), beside whichever field gave it
    guided_whitespace_pattern: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def check_unsupported(self) -> None:
        """OpenAI fields the engine cannot honour: a 400 naming the field unless left at default."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        if self.stop is not None and isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:
            raise bad_request(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}", param="stop")
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request(
                "prompt_logprobs are returned in whole responses only: ask with stream: false",
                param="prompt_logprobs",
                code="unsupported_value",
            )

    def beam_search_params(self, *, max_tokens: int | None, room: int) -> BeamSearchParams:
        """use_beam_search's settings (n beams, max_tokens, or `room`: the context left to the
        longest prompt); a 400 naming any field beam search would not honour."""
        for name in sorted(self.model_fields_set - BEAM_SEARCH_FIELDS):
            value, default = getattr(self, name), type(self).model_fields[name].default
            if value != default and not (name == "temperature" and value == 0):
                raise bad_request(
                    f"{name} is not used by beam search (it ranks beams by the model's logprobs): leave it out",
                    param=name,
                    code="unsupported_parameter",
                )
        try:
            return BeamSearchParams(
                beam_width=self.n,
                max_tokens=max_tokens if max_tokens is not None else room,
                ignore_eos=self.ignore_eos,
                length_penalty=self.length_penalty,
            )
        except ValueError as err:
            field_name = str(err).split(" ", 1)[0]
            param = {"beam_width": "n"}.get(field_name, field_name)
            raise bad_request(f"{param}{str(err)[len(field_name) :]}", param=param) from err

    def sampling_kwargs(self, defaults: dict[str, Any]) -> dict[str, Any]:
        """SamplingParams keyword arguments of the fields set; a field left out takes `defaults`
        (the model's generation config: models/generation_config.py), else SamplingParams'."""
        temperature = self.temperature if self.temperature is not None else defaults.get("temperature", 1.0)
        kwargs: dict[str, Any] = {
            "n": self.n,
            "temperature": temperature,
            "seed": self.seed,
            "stop": self.stop,
            "min_tokens": self.min_tokens,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
        }
        optional = {
            "top_p": self.top_p if self.top_p is not None else defaults.get("top_p"),
            "top_k": self.top_k if self.top_k is not None else defaults.get("top_k"),
            "min_p": self.min_p if self.min_p is not None else defaults.get("min_p"),
            "repetition_penalty": (
                self.repetition_penalty if self.repetition_penalty is not None else defaults.get("repetition_penalty")
            ),
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "logit_bias": self.logit_bias,
            "allowed_token_ids": self.allowed_token_ids,
            "bad_words": self.bad_words,
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
            "prompt_logprobs": self.prompt_logprobs,
        }
        kwargs.update({name: value for name, value in optional.items() if value is not None})
        structured = self.structured_outputs_params()
        if structured is not None:
            kwargs["structured_outputs"] = structured
        if self.prediction is not None:
            kwargs["prediction"] = _prediction_text(self.prediction)
        return kwargs

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's constraint from whichever field gave it; a 400 naming that field when
        it is malformed, invalid (schema, regex, grammar) or given twice."""
        given = {}
        if self.response_format is not None and self.response_format.get("type") != "text":
            given["response_format"] = _from_response_format(self.response_format)
        if self.structured_outputs is not None:
            given["structured_outputs"] = self.structured_outputs
        guided = {
            "guided_json": ("json", self.guided_json),
            "guided_regex": ("regex", self.guided_regex),
            "guided_choice": ("choice", self.guided_choice),
            "guided_grammar": ("grammar", self.guided_grammar),
        }
        given |= {name: {kind: value} for name, (kind, value) in guided.items() if value is not None}
        given |= self.tool_constraint(beside=bool(given))
        if not given:
            if self.guided_whitespace_pattern is not None:
                raise bad_request(
                    "guided_whitespace_pattern: a JSON constraint (response_format, structured_outputs, guided_json) "
                    "must come with it",
                    param="guided_whitespace_pattern",
                )
            return None
        if len(given) > 1:
            names = ", ".join(given)
            raise bad_request(f"give one structured output constraint per request, got {names}", param=list(given)[1])
        ((param, fields),) = given.items()
        if self.guided_whitespace_pattern is not None:
            if isinstance(fields, StructuredOutputsParams) or "whitespace_pattern" in fields:
                raise bad_request(
                    "guided_whitespace_pattern: give the pattern once, beside a JSON constraint",
                    param="guided_whitespace_pattern",
                )
            fields = {**fields, "whitespace_pattern": self.guided_whitespace_pattern}
        try:
            return StructuredOutputsParams.from_value(fields)
        except (ValueError, TypeError) as err:
            raise bad_request(f"{param}: {err}", param=param) from err

    def tool_constraint(self, *, beside: bool) -> dict[str, StructuredOutputsParams]:
        """{request field: the constraint its tool calling puts on the reply}, if any; `beside`:
        the request gives a constraint of its own."""
        return {}


# What a beam search request may set (the rest would be ignored, so it is refused).
BEAM_SEARCH_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "messages",
        "n",
        "max_tokens",
        "max_completion_tokens",
        "ignore_eos",
        "length_penalty",
        "use_beam_search",
        "user",
        "metadata",
        "priority",
        "cache_salt",
        "request_id",
        "return_token_ids",
        "truncate_prompt_tokens",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "add_special_tokens",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "chat_template_kwargs",
        "documents",
    }
)

# Token ids are tried before strings, first match wins: pydantic's default ("smart") union
# validates a list against every member, and a list of a million ids checked as list[str]
# yields a million errors first (seconds of the GIL; 15x the time of list[int] alone).
PromptField = Annotated[str | list[int] | list[str] | list[list[int]], Field(union_mode="left_to_right")]


class CompletionRequest(SamplingFields):
    prompt: PromptField
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's: a text prompt gets the tokenizer's BOS
    suffix: str | None = None
    best_of: int | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise bad_request("suffix is not supported by this server", param="suffix", code="unsupported_parameter")
        if self.stream and isinstance(self.best_of, int) and self.best_of > self.n:
            raise bad_request(
                "best_of: completions chosen from best_of cannot be streamed (which are best is known only at "
                "the end); ask with stream: false",
                param="best_of",
                code="unsupported_value",
            )

    def sampling_params(self, defaults: dict[str, Any], *, max_logprobs: int) -> SamplingParams:
        """The request's SamplingParams; `defaults` for the fields it leaves out (and for
        max_tokens sent as null: OpenAI's 16 stays the default of a field left out);
        `max_logprobs` the server's cap on logprobs (-1: none)."""
        kwargs = self.sampling_kwargs(defaults) | {
            "max_tokens": self.max_tokens if self.max_tokens is not None else defaults.get("max_tokens"),
            "logprobs": self.logprobs,
            "best_of": self.best_of,
        }
        if self.echo and self.logprobs is not None:  # the echoed prompt's tokens carry theirs too
            if self.prompt_logprobs not in (None, self.logprobs):
                raise bad_request(
                    "prompt_logprobs: with echo and logprobs the prompt's logprobs are computed with logprobs' "
                    f"top {self.logprobs}; give the same number or leave prompt_logprobs out",
                    param="prompt_logprobs",
                )
            kwargs["prompt_logprobs"] = self.logprobs
        renamed = {"prompt_logprobs": "logprobs"} if self.echo and self.logprobs is not None else {}
        return build_sampling_params(kwargs, renamed=renamed, max_logprobs=max_logprobs)

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts (texts or token ids): one, or a batch of up to MAX_PROMPTS."""
        prompt = self.prompt
        batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        if len(batch) > MAX_PROMPTS:
            raise bad_request(f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(batch)}", param="prompt")
        for position, one in enumerate(batch):
            if isinstance(one, list) and not one:  # a text "" still has its BOS token
                where = f"[{position}]" if len(batch) > 1 else ""
                raise bad_request(f"prompt{where}: the prompt is empty", param="prompt")
        return batch


class ToolFields(StrictModel):
    """OpenAI's function calling fields (quickdraft/structured/tools.py)."""

    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # The server's settings (ServerConfig.auto_tool_call_grammar, .tool_call_parser), given before
    # tool_calling is read.
    _constrain_auto_calls: bool = PrivateAttr(default=False)
    _tool_call_parser: str = PrivateAttr(default="hermes")
    _server_settings_given: bool = PrivateAttr(default=False)

    def use_server_tool_settings(self, *, constrain_auto_calls: bool, parser: str | None) -> None:
        if "tool_calling" in self.__dict__:
            raise RuntimeError("the server's tool settings came after tool_calling was read")
        self._constrain_auto_calls = constrain_auto_calls
        self._tool_call_parser = parser or "hermes"
        self._server_settings_given = True

    @property
    def tool_call_parser(self) -> str:
        return self._tool_call_parser

    @functools.cached_property
    def tool_calling(self) -> ToolCalling | None:
        """From tools / tool_choice / parallel_tool_calls; a 400 naming the field at fault."""
        if not self._server_settings_given:  # read before them, it would be built with the defaults
            raise RuntimeError("tool_calling read before use_server_tool_settings")
        try:
            return resolve_tool_calling(
                tools=self.tools,
                tool_choice=self.tool_choice,
                parallel_tool_calls=self.parallel_tool_calls,
                constrain_auto=self._constrain_auto_calls,
                parser=self._tool_call_parser,
            )
        except ValueError as err:
            param = "tool_choice" if str(err).startswith("tool_choice") else "tools"
            raise bad_request(str(err), param=param) from err


class ChatTemplateFields(ToolFields):
    """How the conversation is rendered (vLLM's fields), for chat requests and /tokenize."""

    add_generation_prompt: bool = True
    # vLLM's: the last message stays open for the model to continue (a prefilled reply)
    continue_final_message: bool = False
    # vLLM's: jinja text for this request instead of the model's template (taken only by a server
    # started with --trust-request-chat-template: a template is code the server runs)
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # more template variables (vLLM's)
    # vLLM's: documents for a RAG template (the template variable `documents`), e.g. {"title", "text"}
    documents: list[dict[str, str]] | None = None

    def rendering(self) -> ChatRendering:
        """The fields as a ChatRendering (tools as the server's settings read them); a 400 naming
        the field at fault."""
        try:
            return ChatRendering(
                template=self.chat_template,
                add_generation_prompt=self.add_generation_prompt,
                continue_final_message=self.continue_final_message,
                variables=dict(self.chat_template_kwargs or {}),
                documents=self.documents,
                calling=self.tool_calling,
                tool_call_parser=self.tool_call_parser,
            )
        except ChatRenderError as err:
            raise bad_request(str(err), param=err.param, code=err.code) from err


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    add_special_tokens: bool = False  # vLLM's: the template writes BOS itself; true adds the tokenizer's too
    max_tokens: int | None = None  # None: until EOS or the end of the context
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    store: bool | None = None
    # vLLM's: the reply starts with the last message's text when that message is the assistant's
    # (a prefilled reply continued with continue_final_message comes back whole)
    echo: bool = False

    def check_unsupported(self) -> None:
        super().check_unsupported()
        self.rendering()
        if self.store:
            raise bad_request("store is not supported by this server", param="store", code="unsupported_parameter")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise bad_request("give max_completion_tokens or max_tokens, not both", param="max_completion_tokens")

    def sampling_params(self, defaults: dict[str, Any], *, max_logprobs: int) -> SamplingParams:
        """The request's SamplingParams; `defaults` for the fields it leaves out (max_tokens
        too: else until EOS or the end of the context); `max_logprobs` the server's cap (-1: none)."""
        use_new_name = self.max_completion_tokens is not None
        max_tokens = self.max_completion_tokens if use_new_name else self.max_tokens
        if max_tokens is None:
            max_tokens = defaults.get("max_tokens")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        kwargs = self.sampling_kwargs(defaults) | {"max_tokens": max_tokens, "logprobs": logprobs}
        renamed = {"logprobs": "top_logprobs"}
        if use_new_name:
            renamed["max_tokens"] = "max_completion_tokens"
        return build_sampling_params(kwargs, renamed=renamed, max_logprobs=max_logprobs)

    def conversation(self) -> list[dict[str, Any]]:
        return conversation_of(self.messages)

    def echoed_text(self) -> str:
        """What `echo` puts before the reply: the last message's text if it is the assistant's."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""

    def tool_constraint(self, *, beside: bool) -> dict[str, StructuredOutputsParams]:
        calling = self.tool_calling
        if calling is None or (calling.mode == "auto" and beside):  # the request's own constraint wins
            return {}
        constraint = calling.constraint()
        return {} if constraint is None else {"tool_choice": constraint}


class TokenizeRequest(ChatTemplateFields):
    """vLLM's /tokenize: a prompt, or chat messages rendered through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # None: True for a prompt (BOS as /v1/completions adds it), False for messages (the template writes it)
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("give exactly one of prompt or messages", param="prompt" if self.prompt else "messages")
        if self.messages is not None and not self.messages:
            raise bad_request("messages: at least one message is needed", param="messages")
        self.rendering()

    def conversation(self) -> list[dict[str, Any]]:
        return conversation_of(self.messages or [])


class PooledInputs(StrictModel):
    """The inputs of /v1/embeddings and /classify: a text, a list of texts, a token-id list or a
    list of them; vLLM's truncate_prompt_tokens and add_special_tokens."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True  # a text input gets the tokenizer's BOS, as /v1/completions

    def prompts(self) -> list[str | list[int]]:
        """The inputs, each a text or a token-id list; a 400 for an empty one."""
        given = self.input
        inputs: list[str | list[int]]
        if isinstance(given, str):
            inputs = [given]
        elif given and all(isinstance(item, int) for item in given):
            inputs = [list(given)]  # type: ignore[arg-type]  # one prompt of token ids
        else:
            inputs = list(given)  # type: ignore[arg-type]
        if not inputs:
            raise bad_request("input: at least one input is needed", param="input")
        for index, item in enumerate(inputs):
            if not item:
                raise bad_request(f"input[{index}] is empty", param="input")
        return inputs


class EmbeddingRequest(PooledInputs):
    """OpenAI's /v1/embeddings, with vLLM's extra fields (truncate_prompt_tokens, add_special_tokens,
    normalize); the vectors come from the model's final hidden states (quickdraft/pooling.py)."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool = True


class ClassificationRequest(PooledInputs):
    """vLLM's /classify: each input's class probabilities from a *ForSequenceClassification model."""


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling: /v1/embeddings' fields and each input's result of a pooling task
    (LLM.encode): "embed", "classify", "token_embed" or "token_classify"; none named: the model's
    own (a classifier's probabilities, else an embedding)."""

    task: str | None = None


def _texts(value: str | list[str], *, param: str) -> list[str]:
    texts = [value] if isinstance(value, str) else list(value)
    if not texts:
        raise bad_request(f"{param}: at least one text is needed", param=param)
    for index, text in enumerate(texts):
        if not text:
            raise bad_request(f"{param}[{index}] is empty", param=param)
    return texts


class ScoreRequest(StrictModel):
    """vLLM's /score (/v1/score) for embedding models: each pair's cosine similarity; text_1 pairs
    with every text_2 (1:N) or the i-th with the i-th (N:N)."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    user: str | None = None

    def texts(self) -> tuple[list[str], list[str]]:
        return _texts(self.text_1, param="text_1"), _texts(self.text_2, param="text_2")


class RerankRequest(StrictModel):
    """vLLM's /rerank (/v1/rerank, /v2/rerank: Jina's and Cohere's API): the documents ordered by
    their score against the query, the best `top_n` of them (0 or None: all)."""

    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = None
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    user: str | None = None

    def texts(self) -> tuple[list[str], list[str]]:
        if self.top_n is not None and self.top_n < 0:
            raise bad_request(f"top_n must be >= 0, got {self.top_n}", param="top_n")
        return _texts(self.query, param="query"), _texts(self.documents, param="documents")


class DetokenizeRequest(StrictModel):
    """vLLM's /detokenize: token ids back to text."""

    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(StrictModel):
    """vLLM's /v1/load_lora_adapter: a PEFT LoRA directory served under a name from now on."""

    lora_name: str
    lora_path: str


class UpdateWeightsFromDiskRequest(StrictModel):
    """SGLang's /update_weights_from_disk: a local checkpoint directory (safetensors under the
    model's tensor names, all or some of them) whose weights replace the served model's."""

    model_path: str
    load_format: str | None = None  # SGLang's; only its default (safetensors) is read


class UnloadLoRAAdapterRequest(StrictModel):
    """vLLM's /v1/unload_lora_adapter (lora_int_id, where sent, must be the adapter's)."""

    lora_name: str
    lora_int_id: int | None = None


def _prediction_text(prediction: dict[str, Any]) -> str:
    """OpenAI's `prediction` object as its text; a 400 naming it when it is not one."""
    content = prediction.get("content")
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text" for part in content):
        content = "".join(str(part.get("text", "")) for part in content)
    if prediction.get("type") != "content" or not isinstance(content, str) or not content or len(prediction) != 2:
        raise bad_request(
            'prediction must be {"type": "content", "content": <text or text parts>} with some text',
            param="prediction",
        )
    return content


def _from_response_format(response_format: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's response_format as StructuredOutputsParams fields."""
    kind = response_format.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request(
                'response_format: type "json_schema" needs "json_schema": {"name": ..., "schema": {...}}',
                param="response_format",
            )
        return {"json": spec["schema"]}
    if kind == "structural_tag":  # vLLM's: {"type", "structures": [{"begin", "schema", "end"}], "triggers"}
        return {"structural_tag": response_format}
    raise bad_request(
        f'response_format.type must be "text", "json_object", "json_schema" or "structural_tag", got {kind!r}',
        param="response_format",
        code="unsupported_value",
    )


def build_sampling_params(kwargs: dict[str, Any], *, renamed: dict[str, str], max_logprobs: int) -> SamplingParams:
    """SamplingParams from request fields; a ValueError becomes a 400 naming the request field."""
    _check_server_bounds(kwargs, renamed=renamed, max_logprobs=max_logprobs)
    try:
        return SamplingParams(**kwargs)
    except ValueError as err:
        # SamplingParams' messages start with the field name ("top_p must be ...").
        field_name = str(err).split(" ", 1)[0].rstrip(":").split("[", 1)[0]  # "logit_bias[7] must ..."
        param = renamed.get(field_name, field_name if field_name in kwargs else None)
        message = str(err)
        if param is not None and param != field_name:
            message = f"{param}{message[len(field_name) :]}"
        raise bad_request(message, param=param) from err


def _check_server_bounds(kwargs: dict[str, Any], *, renamed: dict[str, str], max_logprobs: int) -> None:
    for name in ("n", "best_of"):
        count = kwargs.get(name)
        if isinstance(count, int) and count > MAX_N:
            raise bad_request(f"{name} must be <= {MAX_N}, got {count}", param=name)
    temperature = kwargs["temperature"]
    if temperature != 0 and not MIN_POSITIVE_TEMPERATURE <= temperature <= MAX_TEMPERATURE:
        raise bad_request(
            f"temperature must be 0 (greedy) or in [{MIN_POSITIVE_TEMPERATURE}, {MAX_TEMPERATURE}], "
            f"got {temperature!r}",
            param="temperature",
        )
    penalty = kwargs.get("repetition_penalty")
    low, high = REPETITION_PENALTY_RANGE
    if penalty is not None and not low <= penalty <= high:
        raise bad_request(f"repetition_penalty must be in [{low}, {high}], got {penalty!r}", param="repetition_penalty")
    seed = kwargs.get("seed")
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise bad_request(f"seed must fit in 64 bits, got {seed!r}", param="seed")
    for field in ("logprobs", "prompt_logprobs"):
        count = kwargs.get(field)
        if count is None or (0 <= count <= max_logprobs) or (max_logprobs == -1 and count >= -1):
            continue
        name = renamed.get(field, field)
        allowed = "an integer >= -1 (-1: every token)" if max_logprobs == -1 else f"in [0, {max_logprobs}]"
        raise bad_request(f"{name} must be {allowed} (the server's --max-logprobs), got {count!r}", param=name)


# ---- responses ---------------------------------------------------------------------------
def usage_body(*, num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens`: prompt tokens the prefix
    cache supplied."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def usage_of(output: RequestOutput, *, predicted: bool = False) -> dict[str, Any]:
    """The usage of a finished request; `predicted`: it brought a prediction, whose drafted
    tokens the target kept or rejected (OpenAI's completion_tokens_details)."""
    usage = usage_body(
        num_prompt_tokens=output.metrics.num_prompt_tokens,  # every prompt's, for a batch
        num_completion_tokens=sum(len(completion.token_ids) for completion in output.outputs),
        num_cached_tokens=output.metrics.num_cached_tokens,
    )
    if predicted:
        metrics = output.metrics
        usage["completion_tokens_details"] = {
            "accepted_prediction_tokens": metrics.num_accepted_tokens,
            "rejected_prediction_tokens": metrics.num_draft_tokens - metrics.num_accepted_tokens,
        }
    return usage


def speculation_body(metrics: RequestMetrics, *, method: str, adaptive: bool) -> dict[str, Any]:
    """The request's own acceptance figures (an extension field next to `usage`).

    `draft_length_choices[k]` counts the decoding steps for which adaptive speculation chose
    to draft k tokens (0: plain decoding); empty when speculation is not adaptive.
    """
    return {
        "method": method,
        "adaptive": adaptive,
        "drafts": metrics.num_drafts,
        "draft_tokens": metrics.num_draft_tokens,
        "accepted_tokens": metrics.num_accepted_tokens,
        "target_forwards": metrics.num_target_forwards,
        "acceptance_rate": metrics.acceptance_rate,
        "acceptance_length": metrics.acceptance_length,
        "accepted_per_position": list(metrics.accepted_per_position),
        "drafted_per_position": list(metrics.drafted_per_position),
        "draft_seconds": metrics.draft_seconds,
        "verify_seconds": metrics.verify_seconds,
        "draft_length_choices": list(metrics.draft_length_choices),
    }


# JSON has no -inf: a token a constraint or a filter rules out is sent with this logprob (vLLM's)
LOGPROB_FLOOR = -9999.0


def json_logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


class CompletionLogprobs:
    """The legacy completions `logprobs` object, built incrementally (text offsets carry over)."""

    def __init__(self, *, decode):
        self._decode = decode  # token id -> its text (special tokens included)
        self._offset = 0

    def body(self, token_logprobs: list[TokenLogprobs], *, prompt: list[int] | None = None) -> dict[str, Any]:
        """The object for `token_logprobs`; `prompt` (its token ids) puts an echoed prompt first,
        its first token with null logprobs (nothing precedes it), the others' from `token_logprobs`,
        which then starts with the prompt's entries (`RequestOutput.prompt_logprobs[1:]`)."""
        first = [] if prompt is None else [prompt[0]]
        ids = first + [entry.token_id for entry in token_logprobs]
        tokens, offsets = [], []
        for token_id in ids:
            token = self._decode(token_id)
            tokens.append(token)
            offsets.append(self._offset)
            self._offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [None] * len(first) + [json_logprob(entry.logprob) for entry in token_logprobs],
            "top_logprobs": [None] * len(first)
            + [
                {self._decode(top.token_id): json_logprob(top.logprob) for top in entry.top} for entry in token_logprobs
            ],
            "text_offset": offsets,
        }


def prompt_logprobs_body(entries: list[TokenLogprobs | None], *, decode) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first: nothing precedes it), its
    own {"logprob", "rank", "decoded_token"} under its id, then the top ones' (rank 1..k)."""
    body: list[dict[str, Any] | None] = []
    for entry in entries:
        if entry is None:
            body.append(None)
            continue
        ranked = {
            str(entry.token_id): {
                "logprob": json_logprob(entry.logprob),
                "rank": entry.rank,
                "decoded_token": decode(entry.token_id),
            }
        }
        for rank, top in enumerate(entry.top, start=1):
            ranked.setdefault(
                str(top.token_id),
                {"logprob": json_logprob(top.logprob), "rank": rank, "decoded_token": decode(top.token_id)},
            )
        body.append(ranked)
    return body


def chat_logprobs_body(token_logprobs: list[TokenLogprobs], *, decode) -> dict[str, Any]:
    """The chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for entry in token_logprobs:
        token = decode(entry.token_id)
        content.append(
            {
                "token": token,
                "logprob": json_logprob(entry.logprob),
                "bytes": list(token.encode("utf-8")),
                "top_logprobs": [
                    {"token": name, "logprob": json_logprob(top.logprob), "bytes": list(name.encode("utf-8"))}
                    for top, name in ((top, decode(top.token_id)) for top in entry.top)
                ],
            }
        )
    return {"content": content}


def now_seconds() -> int:
    return int(time.time())
