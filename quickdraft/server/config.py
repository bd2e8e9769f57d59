"""Validated configuration of `quickdraft serve`."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from quickdraft.config import LOGPROBS_MODES, EngineConfig
from quickdraft.models.generation_config import default_sampling_fields
from quickdraft.models.lora import LoRARequest
from quickdraft.models.overrides import check_hf_overrides
from quickdraft.models.tokenizer import check_chat_template
from quickdraft.pooling import POOLING_TYPES
from quickdraft.sampling_params import DEFAULT_MAX_LOGPROBS
from quickdraft.structured.reasoning import REASONING_PARSERS
from quickdraft.structured.tools import TOOL_CALL_PARSERS

# The name the embedded Gemma 3 270M is served under when no --served-model-name is given.
DEFAULT_SERVED_MODEL_NAME = "gemma-3-270m"
# A request body larger than this gets 413. 4 MiB holds a prompt of about a million tokens (as
# text) or half a million (as token ids), past any context this engine serves, and bounds what
# one request may cost the event loop: JSON parsing and validation hold Python's GIL, measured
# at up to 0.5 s in one stretch for 4 MiB of tiny chat messages on a slow CPU.
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
# A client that sends nothing of its request body for this long is dropped (with a 408).
DEFAULT_REQUEST_READ_TIMEOUT_SECONDS = 30.0
# The environment variable `quickdraft serve` reads the API key from (vLLM has VLLM_API_KEY).
API_KEY_ENV = "QUICKDRAFT_API_KEY"


@dataclass(kw_only=True)
class ServerConfig:
    model: str | None = None  # HF directory, .gguf file, or None for the embedded Gemma 3 270M
    # what clients put in "model" (default: derived from model); several (vLLM's): any of them is
    # taken, the first is the one responses and metrics carry
    served_model_name: str | list[str] | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "auto"
    device: str = "cpu"
    max_model_len: int | None = None
    max_num_seqs: int = 8  # requests decoded together (KV cache slots)
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None  # None: every slot can reach max_model_len at once
    kv_cache_dtype: str = "auto"  # or "float16": the target's keys and values in half the bytes
    seed: int = 0
    speculative_config: dict | None = None
    tensor_parallel_size: int = 1  # processes the target is split over (quickdraft/distributed)
    lazy_logits_rows: int | None = None  # EngineConfig's: LM-head rows before each walk (None: measured)
    weights_in_huge_pages: bool | None = None  # EngineConfig's (False: replicas share the mapped weights)
    scheduling_policy: str = "fcfs"  # EngineConfig's: "priority" orders requests by their `priority`
    logprobs_mode: str = "raw_logprobs"  # EngineConfig's: what generated tokens' logprobs hold
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # EngineConfig's: the most top logprobs a request may ask
    max_queue: int = 64  # requests waiting + running before new ones get 429
    shutdown_grace_seconds: float = 30.0  # in-flight requests get this long to finish on shutdown
    max_scenarios: int = 32  # distinct `scenario` label values before new ones become "other"
    log_level: str = "info"
    # Reads tool calls out of free text for tool_choice "auto" (quickdraft/structured/tools.py);
    # None: "auto" with tools is a 400, "required" and named functions work without it.
    tool_call_parser: str | None = None
    # vLLM's --reasoning-parser (deepseek_r1, qwen3): a chat reply's <think> block is returned as
    # `reasoning`, the rest as content (structured/reasoning.py); None: all content
    reasoning_parser: str | None = None
    # How /v1/embeddings pools a prompt's final hidden states (quickdraft/pooling.py): LAST, MEAN or
    # CLS; None: the model's own (a sentence-transformers directory's Pooling module, else LAST)
    pooling_type: str | None = None
    # tool_choice "auto": the <tool_call> blocks a reply writes are held to the tools' schemas by a
    # grammar (free text stays free; a request's own response_format replaces it)
    auto_tool_call_grammar: bool = True
    # The chat template for /v1/chat/completions, as a file or the jinja text itself (vLLM's
    # --chat-template); None: the model's own (the embedded base model has none).
    chat_template: str | None = None
    # Requests may send their own chat_template (vLLM's --trust-request-chat-template): jinja the
    # server renders (sandboxed, yet able to spend its time), so only for clients it trusts.
    trust_request_chat_template: bool = False
    # vLLM's --logits-processor-pattern: a regular expression (matched in full) of the qualified
    # names a request's `logits_processors` may import; None: the field is refused
    logits_processor_pattern: str | None = None
    # vLLM's --generation-config: "auto" (the HF model directory's generation_config.json gives the
    # sampling fields a request leaves out), "vllm" (ignore it) or a directory holding one; and
    # --override-generation-config, keys of that file to replace.
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    hf_overrides: dict | None = None  # vLLM's --hf-overrides (EngineConfig.hf_overrides)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # larger request bodies get 413
    request_read_timeout_seconds: float = DEFAULT_REQUEST_READ_TIMEOUT_SECONDS  # body stall -> 408, dropped
    # When set, every route that runs the model needs `Authorization: Bearer <api_key>` (401
    # otherwise; middleware.OPEN_PATHS stay open). Not in
    # the repr: configs end up in logs.
    api_key: str | None = field(default=None, repr=False)
    # CORS for browser clients (vLLM's --allowed-origins / -methods / -headers, --allow-credentials;
    # the same defaults): what a page of another origin may call.
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    # vLLM's LoRA serving: adapters (PEFT directories) a request names in "model".  lora_modules:
    # "name=path" or {"name", "path", "base_model_name"} (a JSON string or a dict); max_loras
    # adapters run in one step, of rank up to max_lora_rank, max_cpu_loras stay loaded.  With
    # allow_runtime_lora_updating (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING=true) clients add and
    # drop adapters through /v1/load_lora_adapter and /v1/unload_lora_adapter.
    enable_lora: bool = False
    lora_modules: list[str | dict] = field(default_factory=list)
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    allow_runtime_lora_updating: bool = False
    # vLLM's development endpoints (VLLM_SERVER_DEV_MODE=1): /reset_prefix_cache, and SGLang's
    # /update_weights_from_disk, the way an RL trainer hands a rollout server its new policy; each
    # runs once the requests in flight have finished, holding new ones until it has.
    enable_dev_endpoints: bool = False

    def __post_init__(self) -> None:
        for name in ("max_queue", "max_scenarios", "max_request_bytes", "tensor_parallel_size"):
            _check_positive_int(name, getattr(self, name))
        _check_positive_int("port", self.port, allow_zero=True)
        if self.port > 65535:
            raise ValueError(f"port must be <= 65535, got {self.port!r}")
        if not isinstance(self.shutdown_grace_seconds, (int, float)) or self.shutdown_grace_seconds < 0:
            raise ValueError(f"shutdown_grace_seconds must be a number >= 0, got {self.shutdown_grace_seconds!r}")
        timeout = self.request_read_timeout_seconds
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ValueError(f"request_read_timeout_seconds must be a number > 0, got {timeout!r}")
        if self.api_key is not None and not _is_token(self.api_key):
            # Clients send the key in a header (`Bearer <key>`): it must be something a header carries.
            raise ValueError("api_key must be a non-empty string of printable ASCII characters without spaces")
        if self.served_model_name is not None:
            names = [self.served_model_name] if isinstance(self.served_model_name, str) else self.served_model_name
            if (
                not isinstance(names, list)
                or not names
                or not all(isinstance(name, str) and name.strip() for name in names)
                or len(set(names)) != len(names)
            ):
                raise ValueError(
                    "served_model_name must be a non-empty string or a list of distinct ones, "
                    f"got {self.served_model_name!r}"
                )
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {list(TOOL_CALL_PARSERS)}, got {self.tool_call_parser!r}"
            )
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
                raise ValueError(f"{name} must be a list of non-empty strings, got {value!r}")
        if self.logits_processor_pattern is not None:
            try:
                re.compile(self.logits_processor_pattern)
            except (re.error, TypeError) as err:
                pattern = self.logits_processor_pattern
                message = f"logits_processor_pattern must be a regular expression, got {pattern!r}: {err}"
                raise ValueError(message) from err
        if self.allow_credentials and "*" in self.allowed_origins:
            raise ValueError("allow_credentials needs the allowed origins named: browsers refuse credentials with '*'")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {list(REASONING_PARSERS)}, got {self.reasoning_parser!r}"
            )
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {list(POOLING_TYPES)}, got {self.pooling_type!r}")
        if (self.tool_call_parser == "openai") != (self.reasoning_parser == "openai_gptoss"):
            raise ValueError(
                "tool_call_parser 'openai' and reasoning_parser 'openai_gptoss' go together: gpt-oss's harmony "
                "replies carry their calls and reasoning as messages, read by the one parser"
            )
        if self.chat_template is not None:
            check_chat_template(self.chat_template_text())
        adapters = self.lora_requests()  # a bad --lora-modules entry fails here, naming itself
        if (adapters or self.allow_runtime_lora_updating) and not self.enable_lora:
            raise ValueError("lora_modules and runtime LoRA updating need enable_lora (--enable-lora)")
        for adapter in adapters:
            if adapter.lora_name in self.model_names:
                raise ValueError(f"lora_modules: {adapter.lora_name!r} is also a served model name")
        self.default_sampling_fields()  # a bad setting fails at start, naming itself
        if self.hf_overrides is not None:
            check_hf_overrides(self.hf_overrides)
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {list(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= -1 (-1: no cap), got {self.max_logprobs!r}")
        if self.speculative_config is not None and not isinstance(self.speculative_config, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {self.speculative_config!r}")

    def lora_requests(self) -> list[LoRARequest]:
        """lora_modules as LoRARequests, ids 1, 2, ... in their order."""
        if not isinstance(self.lora_modules, list):
            raise ValueError(f"lora_modules must be a list, got {self.lora_modules!r}")
        requests: list[LoRARequest] = []
        for entry in self.lora_modules:
            name, path, base = lora_module_fields(entry)
            if any(other.lora_name == name for other in requests):
                raise ValueError(f"lora_modules: the name {name!r} is given twice")
            requests.append(LoRARequest(name, len(requests) + 1, path, base_model_name=base))
        return requests

    def default_sampling_fields(self) -> dict:
        """SamplingParams fields for what a request leaves out (models/generation_config.py)."""
        return default_sampling_fields(
            self.model, source=self.generation_config, overrides=self.override_generation_config
        )

    def chat_template_text(self) -> str | None:
        """The template's jinja text (read from its file where `chat_template` names one)."""
        if self.chat_template is None:
            return None
        path = Path(self.chat_template)
        looks_like_a_file = "{" not in self.chat_template and "\n" not in self.chat_template
        if looks_like_a_file:
            if not path.is_file():
                raise ValueError(f"chat_template: no such file {self.chat_template!r} (give a file or the jinja text)")
            return path.read_text()
        return self.chat_template

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model,
            dtype=self.dtype,
            device=self.device,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            kv_cache_dtype=self.kv_cache_dtype,
            seed=self.seed,
            speculative_config=self.speculative_config,
            tensor_parallel_size=self.tensor_parallel_size,
            lazy_logits_rows=self.lazy_logits_rows,
            weights_in_huge_pages=self.weights_in_huge_pages,
            scheduling_policy=self.scheduling_policy,
            enable_lora=self.enable_lora,
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            max_cpu_loras=self.max_cpu_loras,
            hf_overrides=self.hf_overrides,
            logprobs_mode=self.logprobs_mode,
            max_logprobs=self.max_logprobs,
        )

    @property
    def model_names(self) -> list[str]:
        """Every name clients may send in "model" (the first is model_name)."""
        if isinstance(self.served_model_name, list):
            return list(self.served_model_name)
        return [self.model_name]

    @property
    def model_name(self) -> str:
        """The name responses carry in "model" and the `model` label of every metric."""
        if isinstance(self.served_model_name, list):
            return self.served_model_name[0]
        if self.served_model_name is not None:
            return self.served_model_name
        if self.model is None or self.model in ("default", "gemma3-270m", DEFAULT_SERVED_MODEL_NAME):
            return DEFAULT_SERVED_MODEL_NAME
        path = Path(self.model)
        return path.stem if path.suffix == ".gguf" else path.name


def lora_module_fields(entry: object) -> tuple[str, str, str | None]:
    """(name, path, base model name) of a --lora-modules entry: "name=path" or a JSON object."""
    if isinstance(entry, str) and entry.lstrip().startswith("{"):
        try:
            entry = json.loads(entry)
        except json.JSONDecodeError as err:
            raise ValueError(f"lora_modules: {entry!r} is not valid JSON ({err})") from err
    if isinstance(entry, dict):
        name, path, base = entry.get("name"), entry.get("path"), entry.get("base_model_name")
        unknown = set(entry) - {"name", "path", "base_model_name"}
        if (
            unknown
            or not isinstance(name, str)
            or not isinstance(path, str)
            or not (base is None or isinstance(base, str))
        ):
            raise ValueError(
                f'lora_modules: {entry!r} must be {{"name": ..., "path": ..., "base_model_name": optional}}'
            )
        return name, path, base
    if isinstance(entry, str) and "=" in entry:
        name, path = entry.split("=", 1)
        return name, path, None
    raise ValueError(f"lora_modules: {entry!r} must be name=path or a JSON object with name and path")


def _is_token(value: object) -> bool:
    return isinstance(value, str) and bool(value) and all("!" <= char <= "~" for char in value)


def _check_positive_int(name: str, value: object, *, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
