"""Embeddings (quickdraft/pooling.py, Engine.embed, LLM.embed): the model's final hidden states
pooled, equal to transformers' own, the same bits however the prompt is chunked and whatever
generates beside it."""

from __future__ import annotations

import pytest
import torch

from quickdraft import LLM, PoolingParams, SamplingParams
from quickdraft.kv.cache import CacheFullError

PROMPT = list(range(5, 45))  # 40 token ids


@pytest.fixture(scope="module")
def llms(tiny_checkpoints):
    return {arch: LLM(str(tiny_checkpoints[arch]), max_model_len=64) for arch in ("llama", "gemma3")}


def transformers_final_states(path, ids: list[int]) -> torch.Tensor:  # [T, D] after the last norm
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_embeddings_are_transformers_final_states_pooled(llms, tiny_checkpoints, arch):
    states = transformers_final_states(tiny_checkpoints[arch], PROMPT)
    expected = {"LAST": states[-1], "MEAN": states.mean(0), "CLS": states[0]}
    for pooling, vector in expected.items():
        [out] = llms[arch].embed([PROMPT], PoolingParams(pooling_type=pooling, normalize=False))
        assert out.prompt_token_ids == PROMPT and out.finished
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), vector, rtol=1e-4, atol=1e-4)
    [unit] = llms[arch].embed([PROMPT])  # the default: the last token's, normalized
    torch.testing.assert_close(
        torch.tensor(unit.outputs.embedding), states[-1] / states[-1].norm(), rtol=1e-4, atol=1e-5
    )


def test_encode_runs_vllm_s_pooling_tasks(llms, tiny_checkpoints):
    """LLM.encode: "token_embed" is every prompt token's final state (normalized per token by
    default), "embed" what LLM.embed gives; the task and the model are checked by name."""
    llm = llms["gemma3"]
    states = transformers_final_states(tiny_checkpoints["gemma3"], PROMPT)
    [raw] = llm.encode([PROMPT], PoolingParams(normalize=False), pooling_task="token_embed")
    assert raw.prompt_token_ids == PROMPT and raw.finished and raw.outputs.data.shape == states.shape
    torch.testing.assert_close(raw.outputs.data, states, rtol=1e-4, atol=1e-4)
    [unit] = llm.encode(PROMPT, pooling_task="token_embed", truncate_prompt_tokens=8)
    assert unit.prompt_token_ids == PROMPT[-8:] and unit.outputs.data.shape == (8, states.shape[1])
    last = llm.encode([PROMPT[-8:]], pooling_task="token_embed")[0].outputs.data
    assert torch.equal(unit.outputs.data, last)  # what the kept tokens alone give
    torch.testing.assert_close(unit.outputs.data.norm(dim=-1), torch.ones(8))
    embedded = llm.embed([PROMPT])[0].outputs.embedding
    assert llm.encode([PROMPT])[0].outputs.data.tolist() == embedded  # the default task: embed
    assert llm.encode([PROMPT], pooling_task="embed")[0].outputs.data.tolist() == embedded
    with pytest.raises(ValueError, match="pooling_task must be one of"):
        llm.encode([PROMPT], pooling_task="reward")
    with pytest.raises(ValueError, match="'token_classify' needs a classification head"):
        llm.encode([PROMPT], pooling_task="token_classify")


def test_chunks_and_neighbours_change_no_bit(tiny_checkpoints, llms):
    """A prompt prefilled in chunks of 7 gives the very bits of one forward; embedding between the
    steps of a generating request leaves its output and its vector unchanged."""
    path = str(tiny_checkpoints["gemma3"])
    whole = llms["gemma3"].embed([PROMPT], PoolingParams(pooling_type="MEAN"))[0].outputs.embedding
    chunked = LLM(path, max_model_len=64, max_num_batched_tokens=7)
    assert chunked.embed([PROMPT], PoolingParams(pooling_type="MEAN"))[0].outputs.embedding == whole
    greedy = SamplingParams(temperature=0, max_tokens=12)
    expected = chunked.generate([[3, 4, 5, 6]], greedy)[0].outputs[0].token_ids
    engine = chunked.engine
    request_id = engine.add_request(prompt_token_ids=[3, 4, 5, 6], params=greedy)
    vectors, steps = [], 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps in (1, 3, 5):
            vectors.append(engine.embed([PROMPT], PoolingParams(pooling_type="MEAN"))[0].tolist())
    assert engine.get_request(request_id).output_token_ids == expected
    assert vectors == [whole] * 3
    engine.release(request_id)


def test_truncation_normalisation_and_bad_input(llms):
    llm = llms["llama"]
    last_ten = llm.embed([PROMPT[-10:]])[0].outputs.embedding
    truncated = llm.embed([PROMPT], truncate_prompt_tokens=10)[0]
    assert truncated.outputs.embedding == last_ten and truncated.prompt_token_ids == PROMPT[-10:]
    assert torch.tensor(last_ten).norm().item() == pytest.approx(1.0, abs=1e-5)
    hidden = llm.engine.model_config.hidden_size
    assert len(llm.embed("a text prompt", PoolingParams(dimensions=hidden))[0].outputs.embedding) == hidden
    with pytest.raises(ValueError, match="cannot be shortened to 8"):
        llm.embed([PROMPT], PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="the prompt has 65 tokens, but max_model_len is 64: too long"):
        llm.embed([[1] * 65])
    assert len(llm.embed([[1] * 64])[0].outputs.embedding) == hidden  # a prompt may fill the context
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.embed([PROMPT, []])
    for bad, message in (
        ({"pooling_type": "max"}, "pooling_type must be one of"),
        ({"normalize": 1}, "normalize must be"),
        ({"dimensions": 0}, "dimensions must be a positive integer"),
        ({"truncate_prompt_tokens": True}, "truncate_prompt_tokens must be a positive integer"),
    ):
        with pytest.raises(ValueError, match=message):
            PoolingParams(**bad)


def test_a_full_cache_is_a_clear_error_and_leaves_the_slot_free(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["llama"]), max_model_len=64, max_num_seqs=1)
    engine = llm.engine
    request_id = engine.add_request(prompt_token_ids=[3, 4, 5], params=SamplingParams(max_tokens=30))
    engine.step()  # its slot is taken
    with pytest.raises(CacheFullError, match="slots are in use"):
        engine.embed([PROMPT], PoolingParams())
    engine.abort_request(request_id)
    engine.release(request_id)
    assert len(llm.embed([PROMPT])) == 1 and engine.cache.num_free_slots == 1


def test_score_pairs_texts_and_embeds_each_once(llms, monkeypatch):
    llm = llms["llama"]
    texts = ["a cat", "a dog", "the sea"]
    vectors = {t: torch.tensor(out.outputs.embedding) for t, out in zip(texts, llm.embed(texts))}
    calls = []
    embed = llm.engine.embed
    monkeypatch.setattr(llm.engine, "embed", lambda prompts, params: calls.append(prompts) or embed(prompts, params))
    one_to_many = llm.score("a cat", texts)
    assert len(calls) == 3  # "a cat" once, though it is on both sides
    cosine = lambda a, b: torch.nn.functional.cosine_similarity(vectors[a], vectors[b], dim=0).item()  # noqa: E731
    assert [out.outputs.score for out in one_to_many] == pytest.approx([cosine("a cat", t) for t in texts], abs=1e-6)
    assert one_to_many[0].outputs.score == pytest.approx(1.0, abs=1e-6)
    pairwise = llm.score(texts[:2], texts[1:])
    assert [out.outputs.score for out in pairwise] == pytest.approx(
        [cosine("a cat", "a dog"), cosine("a dog", "the sea")], abs=1e-6
    )
    first = llm.tokenizer.encode("a cat")
    assert pairwise[0].prompt_token_ids == first + llm.tokenizer.encode("a dog")
    with pytest.raises(ValueError, match="one text with N, or N with N: got 2 and 3"):
        llm.score(texts[:2], texts)
    with pytest.raises(ValueError, match="non-empty"):
        llm.score([], texts)
