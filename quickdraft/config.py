"""Validated engine configuration."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    model: str | None = None  # HF directory, .gguf file, or None for the embedded Gemma 3 270M
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int | None = None  # default: min(model's context, 4096)
    max_num_seqs: int = 8  # requests decoded together (KV cache slots)
    max_num_batched_tokens: int = 512  # tokens per forward; longer prompts prefill in chunks
    seed: int = 0  # seeds the RNG of requests that give no seed of their own
    speculative_config: dict | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 2
        ):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.speculative_config is not None:
            raise NotImplementedError(
                "speculative_config is not available yet in this build: plain decoding only"
            )
