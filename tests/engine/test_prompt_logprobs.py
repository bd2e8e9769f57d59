"""SamplingParams.prompt_logprobs: every prompt token's logprob given those before it."""

from __future__ import annotations

import pytest
import torch

from quickdraft import LLM, SamplingParams
from tests.models.test_decoder import prompt

PROMPT = prompt(37, seed=5)


def reference_log_probs(path) -> torch.Tensor:  # [P, V] transformers' log-softmax at every prompt row
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("chunk", [256, 8], ids=["whole-prefill", "chunked-prefill"])
def test_prompt_logprobs_are_the_models_log_softmax_at_every_row(tiny_checkpoints, chunk):
    path = tiny_checkpoints["llama"]
    llm = LLM(str(path), max_model_len=128, max_num_batched_tokens=chunk)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    output = llm.generate({"prompt_token_ids": PROMPT}, params)[0]
    entries = output.prompt_logprobs
    assert entries is not None and len(entries) == len(PROMPT) and entries[0] is None
    reference = reference_log_probs(path)
    for position, entry in enumerate(entries[1:], start=1):
        assert entry.token_id == PROMPT[position]
        assert entry.logprob == pytest.approx(reference[position - 1, PROMPT[position]].item(), abs=1e-4)
        top_values, top_ids = reference[position - 1].topk(3)
        assert [top.token_id for top in entry.top] == top_ids.tolist()
        assert [top.logprob for top in entry.top] == pytest.approx(top_values.tolist(), abs=1e-4)
        assert entry.rank == 1 + int((reference[position - 1] > reference[position - 1, PROMPT[position]]).sum())
    plain = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=2))[0]
    assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == output.outputs[0].token_ids


def test_a_cached_prompt_is_computed_again_for_its_logprobs(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=128, block_size=8)
    asked = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    first = llm.generate({"prompt_token_ids": PROMPT}, asked)[0]
    again = llm.generate({"prompt_token_ids": PROMPT}, asked)[0]
    assert again.metrics.num_cached_tokens == 0  # a cached block has no logits
    assert [e.logprob for e in again.prompt_logprobs[1:]] == [e.logprob for e in first.prompt_logprobs[1:]]
    assert all(e.top == [] for e in first.prompt_logprobs[1:])
    hit = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=2))[0]
    assert hit.metrics.num_cached_tokens == 32  # the blocks it computed are shared as any others


def test_n_completions_compute_the_prompt_logprobs_once(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["gemma3"]), max_model_len=128, block_size=8)
    alone = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2, prompt_logprobs=1))[0]
    llm.engine.reset_prefix_cache()
    params = SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=4, prompt_logprobs=1)
    output = llm.generate({"prompt_token_ids": PROMPT}, params)[0]
    assert [e.logprob for e in output.prompt_logprobs[1:]] == [e.logprob for e in alone.prompt_logprobs[1:]]
    assert llm.get_metrics().num_cached_tokens == 2 * 32  # the other two children took the prompt's blocks


def test_speculation_leaves_the_prompt_logprobs_alone(tiny_checkpoints):
    path = str(tiny_checkpoints["gemma3"])
    params = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=2)
    plain = LLM(path, max_model_len=128).generate({"prompt_token_ids": PROMPT}, params)[0]
    spec = LLM(path, max_model_len=128, speculative_config={"method": "suffix"})
    drafted = spec.generate({"prompt_token_ids": PROMPT}, params)[0]
    assert drafted.prompt_logprobs == plain.prompt_logprobs
    assert drafted.outputs[0].token_ids == plain.outputs[0].token_ids


def test_prompt_logprobs_is_validated():
    with pytest.raises(ValueError, match="prompt_logprobs must be >= -1"):
        SamplingParams(prompt_logprobs=-2)
