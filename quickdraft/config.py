"""Validated engine configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

from quickdraft.sampling_params import DEFAULT_MAX_LOGPROBS

KV_CACHE_DTYPES = ("auto", "float32", "float16")
SCHEDULING_POLICIES = ("fcfs", "priority")  # quickdraft/engine/scheduler.py
# vLLM's: what a generated token's `logprobs` hold (quickdraft/verify/sampler.py)
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


def check_ranks_by_logprobs(logprobs_mode: str, *, what: str) -> None:
    """`what` (beam search, best_of) ranks by summed logprobs: an engine returning logits cannot."""
    if not logprobs_mode.endswith("logprobs"):
        raise ValueError(
            f"{what} ranks by summed logprobs, and this engine's logprobs_mode {logprobs_mode!r} returns logits: "
            "load it with raw_logprobs or processed_logprobs"
        )


@dataclass
class EngineConfig:
    model: str | None = None  # HF directory, .gguf file, or None for the embedded Gemma 3 270M
    # "auto": float32 compute, a GGUF model's weights kept as stored (see quantization);
    # "float32" / "bfloat16": float weights of that dtype (a GGUF model dequantized).
    dtype: str = "auto"
    # None / "auto", "none", "gguf" (as stored in the .gguf), "gguf+q8_0" (as stored, and the
    # file's float matrices quantized to Q8_0 at load), "q8_0" (quantized at load) or "stored" (a
    # HF checkpoint's float16 / bfloat16 matrices as they are; what "auto" picks for such a one).
    quantization: str | None = None
    device: str = "cpu"
    max_model_len: int | None = None  # default: min(model's context, 4096)
    max_num_seqs: int = 8  # requests decoded together (KV cache slots)
    max_num_batched_tokens: int = 512  # tokens per forward; longer prompts prefill in chunks
    block_size: int = 16  # tokens per KV cache block (the unit of paging and of prefix caching)
    # A prompt that starts with full blocks already cached (an earlier turn, a shared system
    # prompt) reuses their KV instead of computing it; exact (see quickdraft/kv/cache.py).
    enable_prefix_caching: bool = True
    # Bytes of KV cache (all layers); None: enough for every slot at max_model_len at once, so
    # nothing ever waits.  Less packs more requests per byte: when blocks run out, the newest
    # running requests are preempted and recompute later (vLLM's kv_cache_memory_bytes).
    kv_cache_memory_bytes: int | None = None
    # How the target's KV cache holds keys and values: "auto" (the compute dtype) or "float16"
    # (half the bytes: a batch of decodes over long contexts is bound by reading them; each key
    # and value rounds once when written, so outputs may differ slightly from "auto", and stay
    # the same for plain and speculative decoding).  llama.cpp's default cache type is f16.
    kv_cache_dtype: str = "auto"
    seed: int = 0  # seeds the RNG of requests that give no seed of their own
    speculative_config: SpeculativeConfig | dict | None = None
    # Processes the target's layers and LM head are split over (quickdraft/distributed): rank 0
    # is this process and runs everything else (scheduler, drafter, verification); 1 = no split.
    tensor_parallel_size: int = 1
    # LM-head rows a verification computes before walking its tree: greedy and keyed walks read
    # only the rows on their path (about accepted + 1), so the rest need not be computed.  n > 0:
    # n nodes of each such proposal's first-child chain, then each row a walk reaches with n - 1
    # more of its chain, one LM-head call per round for the step; 0: every row in the forward;
    # None: chosen from the LM head's measured cost on the CPU (the rows that cost what reading
    # the head once does), 0 elsewhere.  Exact either way: rows are batch-invariant.
    lazy_logits_rows: int | None = None
    # Where quantized weights live: True, in this process's own memory in 2 MB pages (decoding
    # reads every weight once a token; in 4 KB pages the TLB misses cost ~10% of a step); False,
    # mapped from the packed-weight file (page cache shared by every process serving the model,
    # as llama.cpp maps a GGUF); None: True where the kernel offers transparent huge pages.
    weights_in_huge_pages: bool | None = None
    # vLLM's: "fcfs" (first come, first served) or "priority" (requests' `priority`, lower first;
    # quickdraft/engine/scheduler.py)
    scheduling_policy: str = "fcfs"
    # vLLM's LoRA settings (quickdraft/models/lora.py): requests may run PEFT LoRA adapters;
    # at most max_loras distinct adapters run in one step (requests of others wait), of rank up to
    # max_lora_rank; max_cpu_loras adapters stay loaded (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # vLLM's hf_overrides: keys replacing those of the model's config.json, and classifier_from_token
    # + method (or is_original_qwen3_reranker) to read a causal LM as a reranker at some tokens'
    # logits (quickdraft/models/overrides.py).
    hf_overrides: dict | None = None
    # vLLM's logprobs_mode: what SamplingParams.logprobs return for generated tokens.  "raw_*": the
    # model's logits (after a structured output's mask and the request's logits processors, which
    # define its distribution); "processed_*": what the token was sampled from (allowed tokens, bad
    # words, biases, penalties, min_tokens; for sampled requests temperature, then top_k / top_p /
    # min_p's dropped tokens at -inf: the distribution an RL trainer needs); "_logprobs" their
    # log_softmax, "_logits" the values themselves.  Prompt logprobs are always raw logprobs.
    logprobs_mode: str = "raw_logprobs"
    # vLLM's max_logprobs: the most top logprobs (and prompt logprobs) a request may ask; -1: any
    # number, and a request's -1 means every token of the vocabulary
    max_logprobs: int = DEFAULT_MAX_LOGPROBS

    def __post_init__(self) -> None:
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "tensor_parallel_size",
            "max_loras",
            "max_lora_rank",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {list(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}"
            )
        cap = self.max_logprobs
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < -1:
            raise ValueError(f"max_logprobs must be an integer >= -1 (-1: no cap), got {cap!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {list(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        lazy = self.lazy_logits_rows
        if lazy is not None and (not isinstance(lazy, int) or isinstance(lazy, bool) or lazy < 0):
            raise ValueError(f"lazy_logits_rows must be None or an integer >= 0, got {lazy!r}")
        if lazy and self.tensor_parallel_size > 1:
            # the split LM head is a collective call: every process would have to join each late row's
            raise ValueError(
                "lazy_logits_rows > 0 needs tensor_parallel_size 1 (the split LM head runs in the forward)"
            )
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        memory = self.kv_cache_memory_bytes
        if memory is not None and (not isinstance(memory, int) or isinstance(memory, bool) or memory < 1):
            raise ValueError(f"kv_cache_memory_bytes must be a positive integer or None, got {memory!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype != "auto" and self.tensor_parallel_size > 1:
            raise ValueError("kv_cache_dtype other than 'auto' needs tensor_parallel_size 1 (not built for the split)")
        if self.weights_in_huge_pages is not None and not isinstance(self.weights_in_huge_pages, bool):
            raise ValueError(f"weights_in_huge_pages must be true, false or None, got {self.weights_in_huge_pages!r}")
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be true or false, got {self.enable_lora!r}")
        cpu_loras = self.max_cpu_loras
        if cpu_loras is not None and (
            not isinstance(cpu_loras, int) or isinstance(cpu_loras, bool) or cpu_loras < self.max_loras
        ):
            raise ValueError(
                f"max_cpu_loras must be None or an integer >= max_loras ({self.max_loras}), got {cpu_loras!r}"
            )
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("enable_lora needs tensor_parallel_size 1 (adapters are not split over ranks)")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.hf_overrides is not None:
            from quickdraft.models.overrides import check_hf_overrides

            self.hf_overrides = check_hf_overrides(self.hf_overrides)
        if isinstance(self.speculative_config, dict):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        elif self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            raise ValueError(
                f"speculative_config must be a dict or SpeculativeConfig, got {type(self.speculative_config).__name__}"
            )


SELF_DRAFTER = "[self]"


@dataclass
class SpeculativeConfig:
    """Which drafter proposes, how many tokens, and its own options.

    ``{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}``: keys other
    than the ones below are the drafter's own options, checked by the drafter.
    """

    method: str
    # None: the method's own default, filled in by the engine (DrafterRegistry.default_num_speculative_tokens)
    num_speculative_tokens: int | None = None
    model: str | None = None  # the draft model, for method "draft_model"
    # Per-request draft length that grows after a full accept and shrinks after an early
    # reject (between 1 and num_speculative_tokens). Off by default.
    dynamic_draft_length: bool = False
    # Adaptive speculation: each step, every request's draft length (0..num_speculative_tokens,
    # 0 = plain decoding) maximises the step's expected tokens per second, from the request's
    # recent acceptance and a cost model of the step fitted online (quickdraft/engine/adaptive.py).
    adaptive: bool = False
    adaptive_prior: float = 0.5  # acceptance assumed before any draft was verified
    adaptive_probe_every: int = 8  # a request decoding plainly this many steps drafts a short probe
    # vLLM's: steps draft nothing while at least this many requests run (None: always draft).
    # A fixed rule for busy batches, where a drafted row costs about what a committed one does;
    # `adaptive` decides from measured acceptance and step costs instead.
    disable_by_batch_size: int | None = None
    drafter_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or not self.method:
            raise ValueError(f"speculative_config 'method' must be a non-empty string, got {self.method!r}")
        k = self.num_speculative_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 63):
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 63], got {k!r}")
        if not isinstance(self.dynamic_draft_length, bool):
            raise ValueError(f"dynamic_draft_length must be true or false, got {self.dynamic_draft_length!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be true or false, got {self.adaptive!r}")
        if self.adaptive and self.dynamic_draft_length:
            raise ValueError("adaptive and dynamic_draft_length both set the draft length: choose one")
        probe = self.adaptive_probe_every
        if isinstance(probe, bool) or not isinstance(probe, int) or probe < 1:
            raise ValueError(f"adaptive_probe_every must be a positive integer, got {probe!r}")
        limit = self.disable_by_batch_size
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 2):
            raise ValueError(
                f"disable_by_batch_size must be an integer >= 2 (requests running), got {limit!r}; "
                "leave it out to always draft"
            )
        prior = self.adaptive_prior
        if isinstance(prior, bool) or not isinstance(prior, (int, float)) or not 0.0 < prior < 1.0:
            raise ValueError(f"adaptive_prior must be a number in (0, 1), got {prior!r}")

    @classmethod
    def from_dict(cls, config: dict) -> SpeculativeConfig:
        if config.get("model") == SELF_DRAFTER:  # vLLM's spelling of layer-skip self-drafting
            if config.get("method", "self") != "self":
                raise ValueError(f"speculative model {SELF_DRAFTER!r} is the 'self' method, not {config['method']!r}")
            config = {**{k: v for k, v in config.items() if k != "model"}, "method": "self"}
        if "method" not in config:
            if config.get("model"):
                config = {**config, "method": "draft_model"}
            else:
                raise ValueError("speculative_config needs a 'method' (e.g. ngram, suffix, draft_model)")
        known = {
            "method",
            "num_speculative_tokens",
            "model",
            "dynamic_draft_length",
            "adaptive",
            "adaptive_prior",
            "adaptive_probe_every",
            "disable_by_batch_size",
        }
        options = {k: v for k, v in config.items() if k not in known}
        return cls(**{k: v for k, v in config.items() if k in known}, drafter_options=options)
