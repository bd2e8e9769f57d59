"""bad_words in the engine: a word taken from the greedy answer is no longer generated, and with
the words set every drafter (garbage included) returns exactly what plain decoding does."""

from __future__ import annotations

import itertools

import pytest

from quickdraft import LLM, SamplingParams
from tests.engine.test_speculative import EXACTNESS_CONFIGS, repetitive_prompts, speculative_llm


def contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i : i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


@pytest.fixture(scope="module")
def target(tiny_checkpoints) -> str:
    return str(tiny_checkpoints["gemma3"])


@pytest.fixture(scope="module")
def case(target):
    """A prompt, and a two-token word of printable characters its greedy answer contains."""
    llm = LLM(target, max_model_len=256)
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    for prompt in repetitive_prompts():
        tokens = llm.generate([prompt], greedy)[0].outputs[0].token_ids
        for first, second in itertools.pairwise(tokens):
            word = llm.tokenizer.decode([first, second])
            if (
                word.isprintable()
                and not word.startswith(" ")
                and llm.tokenizer.encode(word, add_special_tokens=False) == [first, second]
            ):
                return {"prompt": prompt, "word": word, "ids": [first, second], "tokens": tokens}
    pytest.fail("no answer of the tiny model has two printable one-byte tokens in a row")


def test_a_bad_word_is_no_longer_generated(target, case):
    llm = LLM(target, max_model_len=256)
    assert contains(case["tokens"], case["ids"])
    params = SamplingParams(max_tokens=24, temperature=0.0, bad_words=[case["word"]])
    tokens = llm.generate([case["prompt"]], params)[0].outputs[0].token_ids
    assert not contains(tokens, case["ids"]) and tokens != case["tokens"]
    # Up to the word, the answer is the same: only the pair's second token after its first is banned.
    start = next(i for i in range(len(case["tokens"])) if case["tokens"][i : i + 2] == case["ids"])
    assert tokens[: start + 1] == case["tokens"][: start + 1]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("config", EXACTNESS_CONFIGS)
def test_speculation_with_bad_words_equals_plain(target, case, config, temperature):
    params = SamplingParams(max_tokens=24, temperature=temperature, seed=3, bad_words=[case["word"], "e"])
    prompts = [case["prompt"], *repetitive_prompts()[:3]]
    plain = [o.outputs[0].token_ids for o in LLM(target, max_model_len=256).generate(prompts, params)]
    llm = speculative_llm(target, config, max_model_len=256)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    assert llm.get_metrics().num_draft_tokens > 0
    assert not any(contains(tokens, case["ids"]) for tokens in plain)
