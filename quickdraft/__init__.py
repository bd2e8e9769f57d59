"""quickdraft: lossless speculative decoding inference engine."""

from quickdraft.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from quickdraft.llm import LLM
from quickdraft.models.lora import LoRARequest
from quickdraft.outputs import CompletionOutput, RequestOutput
from quickdraft.pooling import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingParams,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from quickdraft.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "LoRARequest",
    "PoolingOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "SamplingParams",
    "ScoringOutput",
    "ScoringRequestOutput",
]
__version__ = "0.1.0"
