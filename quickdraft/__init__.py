"""quickdraft: lossless speculative decoding inference engine."""

from quickdraft.llm import LLM
from quickdraft.outputs import CompletionOutput, RequestOutput
from quickdraft.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
