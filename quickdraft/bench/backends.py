"""The engines a Spec-Bench run compares: quickdraft itself and the peers people already use.

Every backend answers one prompt (token ids from quickdraft's tokenizer, so all engines see
the same input) and reports a TurnRecord.  Peers are optional: constructing one whose
package is missing or whose model format it cannot read raises PeerUnavailable with the
reason, which the report shows in place of the peer's figures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from quickdraft.bench.specbench import TurnRecord


class PeerUnavailable(RuntimeError):
    """A peer that cannot run here (not installed, unsupported model): the message says why."""


@dataclass(frozen=True)
class BenchSampling:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class QuickdraftBackend:
    """One quickdraft engine shared by plain decoding and every speculative method."""

    engine = "quickdraft"

    def __init__(self, llm, *, name: str, speculative_config: dict | None, reference: str | None):
        self.llm = llm
        self.name = name
        self.speculative_config = speculative_config
        self.reference = reference
        self.setting = f"quickdraft {llm.config.dtype} {llm.engine.quantization or 'float weights'}"
        self._speculator = None  # built by open()

    def open(self) -> None:
        self.llm.engine.set_speculative_config(self.speculative_config)
        self._speculator = self.llm.engine.speculator

    def activate(self) -> None:
        """Make this run's speculator the engine's again (runs interleaved question by question)."""
        self.llm.engine.set_speculator(self._speculator)

    def begin_question(self) -> None:
        """Each question starts from an empty prefix cache (its later turns reuse its earlier
        ones): the runs share one engine, and a run must not find the prompt that the run before
        it just computed (its TTFT would be a cache hit, and a feature-reading drafter's first
        turn would be prefilled anew anyway)."""
        self.llm.engine.reset_prefix_cache()

    def generate(self, prompt_ids: list[int], *, sampling: BenchSampling, seed: int) -> TurnRecord:
        from quickdraft.sampling_params import SamplingParams

        params = SamplingParams(
            max_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            seed=seed,
        )
        start = time.perf_counter()
        output = self.llm.generate([{"prompt_token_ids": prompt_ids}], params)[0]
        seconds = time.perf_counter() - start
        m = output.metrics
        return TurnRecord(
            seconds=seconds,
            ttft=m.first_token_time - start,
            token_ids=list(output.outputs[0].token_ids),
            text=output.outputs[0].text,
            target_forwards=m.num_target_forwards,
            draft_tokens=m.num_draft_tokens,
            accepted_tokens=m.num_accepted_tokens,
            accepted_per_position=list(m.accepted_per_position),
            drafted_per_position=list(m.drafted_per_position),
        )

    def close(self) -> None:
        self.llm.engine.set_speculative_config(None)


class TransformersBackend:
    """transformers `generate`: plain, prompt lookup, or with an assistant (draft) model."""

    engine = "transformers"

    def __init__(
        self,
        *,
        name: str,
        model_dir: Path,
        dtype: str,
        device: str,
        eos_token_ids: list[int],
        decode,
        reference: str | None,
        prompt_lookup_num_tokens: int | None = None,
        assistant_dir: Path | None = None,
        num_assistant_tokens: int | None = None,
    ):
        try:
            import transformers
        except ImportError as err:
            raise PeerUnavailable(f"transformers is not installed ({err}); pip install 'quickdraft[peers]'") from err
        self.transformers = transformers
        self.name = name
        self.reference = reference
        self.model_dir = model_dir
        self.dtype = dtype
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.decode = decode
        self.prompt_lookup_num_tokens = prompt_lookup_num_tokens
        self.assistant_dir = assistant_dir
        self.num_assistant_tokens = num_assistant_tokens
        self.model = None
        self.assistant = None
        self.forwards = 0
        extra = ""
        if prompt_lookup_num_tokens:
            extra = f", prompt_lookup_num_tokens={prompt_lookup_num_tokens}"
        if assistant_dir is not None:
            extra = f", assistant_model={assistant_dir.name}, num_assistant_tokens={num_assistant_tokens}"
        self.setting = f"transformers {transformers.__version__} {dtype}{extra}"

    def _load(self, path: Path):
        import torch

        from quickdraft.models.gguf import float_checkpoint_dir

        # a GGUF conversion keeps its quantized tensors in the file: transformers reads a float copy
        model = self.transformers.AutoModelForCausalLM.from_pretrained(
            float_checkpoint_dir(path), dtype=getattr(torch, self.dtype)
        )
        return model.to(self.device).eval()

    def open(self) -> None:
        self.model = self._load(self.model_dir)
        self.model.register_forward_pre_hook(self._count_forward)
        if self.assistant_dir is not None:
            self.assistant = self._load(self.assistant_dir)
            if self.num_assistant_tokens:
                self.assistant.generation_config.num_assistant_tokens = self.num_assistant_tokens
                self.assistant.generation_config.num_assistant_tokens_schedule = "constant"

    def _count_forward(self, module, args) -> None:
        self.forwards += 1

    def generate(self, prompt_ids: list[int], *, sampling: BenchSampling, seed: int) -> TurnRecord:
        import torch

        streamer = _FirstTokenClock()
        kwargs = dict(
            max_new_tokens=sampling.max_new_tokens,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.eos_token_ids[0],
            streamer=streamer,
        )
        if sampling.greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            torch.manual_seed(seed)
            kwargs.update(
                do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None
            )
        if self.prompt_lookup_num_tokens:
            kwargs["prompt_lookup_num_tokens"] = self.prompt_lookup_num_tokens
        if self.assistant is not None:
            kwargs["assistant_model"] = self.assistant
        inputs = torch.tensor([prompt_ids], device=self.device)
        self.forwards = 0
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(inputs, attention_mask=torch.ones_like(inputs), **kwargs)
        seconds = time.perf_counter() - start
        token_ids = out[0, len(prompt_ids) :].tolist()
        return TurnRecord(
            seconds=seconds,
            ttft=(streamer.first_token_time or time.perf_counter()) - start,
            token_ids=token_ids,
            text=self.decode(token_ids),
            target_forwards=self.forwards,
        )

    def begin_question(self) -> None:
        pass  # its own prefix reuse (if any) only ever sees its own earlier prompts

    def close(self) -> None:
        self.model = self.assistant = None


class _FirstTokenClock:
    """A transformers streamer that only notes when the first generated token arrived."""

    def __init__(self):
        self.calls = 0
        self.first_token_time: float | None = None

    def put(self, value) -> None:
        self.calls += 1  # the first call carries the prompt
        if self.calls == 2 and self.first_token_time is None:
            self.first_token_time = time.perf_counter()

    def end(self) -> None:
        pass


class LlamaCppBackend:
    """llama-cpp-python on the GGUF file itself: plain, or its prompt-lookup drafter."""

    engine = "llama.cpp"

    def __init__(
        self,
        *,
        name: str,
        gguf_path: Path | None,
        eos_token_ids: list[int],
        decode,
        reference: str | None,
        n_ctx: int,
        num_pred_tokens: int | None = None,
    ):
        try:
            import llama_cpp
        except ImportError as err:
            raise PeerUnavailable(f"llama-cpp-python is not installed ({err}); see scripts/setup-peers.sh") from err
        if gguf_path is None:
            raise PeerUnavailable("llama-cpp-python needs a GGUF file; this model is an HF directory")
        self.llama_cpp = llama_cpp
        self.name = name
        self.reference = reference
        self.gguf_path = gguf_path
        self.eos_token_ids = set(eos_token_ids)
        self.decode = decode
        self.n_ctx = n_ctx
        self.num_pred_tokens = num_pred_tokens
        self.llama = None
        self.draft = None
        extra = f", prompt lookup num_pred_tokens={num_pred_tokens}" if num_pred_tokens else ""
        self.setting = f"llama-cpp-python {llama_cpp.__version__} {gguf_path.name}{extra}"

    def open(self) -> None:
        import torch

        if self.num_pred_tokens:
            self.draft = _CountingPromptLookup(self.llama_cpp, num_pred_tokens=self.num_pred_tokens)
        # With a drafter llama-cpp-python keeps every position's logits, but sizes that buffer from
        # `logits_all` alone (0.3.x): without logits_all=True a prompt over n_batch tokens fails.
        self.llama = self.llama_cpp.Llama(
            model_path=str(self.gguf_path),
            n_ctx=self.n_ctx,
            n_batch=512,
            n_threads=torch.get_num_threads(),
            draft_model=self.draft,
            logits_all=self.draft is not None,
            verbose=False,
        )

    def generate(self, prompt_ids: list[int], *, sampling: BenchSampling, seed: int) -> TurnRecord:
        self.llama.reset()  # no prefix reuse across turns: every engine prefills the whole prompt
        self.llama.set_seed(seed)
        if self.draft is not None:
            self.draft.calls = 0
        token_ids: list[int] = []
        first_token_time = None
        start = time.perf_counter()
        for token in self.llama.generate(
            prompt_ids,
            temp=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            min_p=0.0,
            repeat_penalty=1.0,
            reset=True,
        ):
            if first_token_time is None:
                first_token_time = time.perf_counter()
            token_ids.append(token)
            if token in self.eos_token_ids or len(token_ids) >= sampling.max_new_tokens:
                break
        seconds = time.perf_counter() - start
        # With the drafter, every target evaluation after the prompt asks it for a draft.
        forwards = 1 + self.draft.calls if self.draft is not None else len(token_ids)
        return TurnRecord(
            seconds=seconds,
            ttft=(first_token_time or start) - start,
            token_ids=token_ids,
            text=self.decode(token_ids),
            target_forwards=min(forwards, len(token_ids)),
        )

    def begin_question(self) -> None:
        pass  # its own prefix reuse (if any) only ever sees its own earlier prompts

    def close(self) -> None:
        if self.llama is not None:
            self.llama.close()
        self.llama = None


def _CountingPromptLookup(llama_cpp, *, num_pred_tokens: int):
    """llama-cpp-python's own prompt-lookup drafter, counting how often it is asked."""

    class CountingPromptLookup(llama_cpp.llama_speculative.LlamaPromptLookupDecoding):
        calls = 0

        def __call__(self, input_ids, *args, **kwargs):
            self.calls += 1
            return super().__call__(input_ids, *args, **kwargs)

    return CountingPromptLookup(num_pred_tokens=num_pred_tokens)
