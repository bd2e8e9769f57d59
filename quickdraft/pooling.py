"""Embeddings from the target: a prompt's final hidden states (after the model's last norm, the
LM head's input) pooled into one vector (vLLM's `LLM.embed` and `/v1/embeddings`, llama.cpp's
`--embeddings`).

The engine runs an embedding prompt as a prefill of its own (Engine.embed), in chunks of the
step's token budget; the kernels being batch-invariant, its vector is the same bits however it
was chunked and whatever ran beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# LAST: the last token's state (vLLM's default for decoder-only models: the only one that saw the
# whole prompt); MEAN: the average over the prompt's tokens; CLS: the first token's.
POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass
class PoolingParams:
    """How one prompt becomes an embedding (vLLM's PoolingParams, with the pooler's type).

    normalize: scale the vector to unit L2 norm (cosine similarity is then a dot product).
    dimensions: the length asked for; only the model's hidden size (a model trained for
    shortened "matryoshka" embeddings could cut them, these are not).
    truncate_prompt_tokens: keep only the prompt's last k tokens (None: the whole prompt).
    """

    pooling_type: str = "LAST"
    normalize: bool = True
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.pooling_type, str) or self.pooling_type.upper() not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {list(POOLING_TYPES)}, got {self.pooling_type!r}")
        self.pooling_type = self.pooling_type.upper()
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
        for name in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")

    def check_dimensions(self, hidden_size: int) -> None:
        if self.dimensions is not None and self.dimensions != hidden_size:
            raise ValueError(
                f"dimensions: this model's embeddings have {hidden_size} dimensions and cannot be shortened to "
                f"{self.dimensions} (it was not trained for matryoshka embeddings)"
            )


def pool(hidden: torch.Tensor, params: PoolingParams) -> torch.Tensor:  # [T, D] final states -> [D] float32
    if params.pooling_type == "LAST":
        vector = hidden[-1].float()
    elif params.pooling_type == "CLS":
        vector = hidden[0].float()
    else:
        vector = hidden.float().mean(dim=0)
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, p=2.0, dim=0)
    return vector


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding (vLLM's output of LLM.embed)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
