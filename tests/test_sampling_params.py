import dataclasses
import re

import pytest

from quickdraft.sampling_params import DEFAULT_MAX_LOGPROBS, SamplingParams, bad_words_token_ids


def test_defaults_are_valid_and_normalized():
    p = SamplingParams()
    assert p.n == 1
    assert p.temperature == 1.0 and not p.is_greedy
    assert p.top_p == 1.0 and p.top_k == 0 and p.min_p == 0.0
    assert p.max_tokens == 16 and p.min_tokens == 0
    assert p.stop == [] and p.stop_token_ids == []
    assert p.seed is None and p.logprobs is None


def test_stop_is_normalized_to_a_list():
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(stop=["a", "bc"]).stop == ["a", "bc"]
    assert SamplingParams(stop=("a",)).stop == ["a"]
    assert SamplingParams(stop_token_ids=(5, 7)).stop_token_ids == [5, 7]


def test_int_given_for_float_becomes_float():
    p = SamplingParams(temperature=0, top_p=1, repetition_penalty=2)
    assert isinstance(p.temperature, float) and p.temperature == 0.0
    assert isinstance(p.top_p, float) and isinstance(p.repetition_penalty, float)


def test_is_greedy_only_for_temperature_zero():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.3).is_greedy
    assert not SamplingParams(temperature=1e-3).is_greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(top_k=-1),
        dict(top_k=0),
        dict(top_k=1),
        dict(top_p=1e-6),
        dict(min_p=0.0),
        dict(min_p=1.0),
        dict(presence_penalty=-2.0, frequency_penalty=2.0),
        dict(max_tokens=None, min_tokens=1000),
        dict(max_tokens=5, min_tokens=5),
        dict(logprobs=0),
        dict(logprobs=DEFAULT_MAX_LOGPROBS),
        dict(seed=0),
        dict(seed=-3),
        dict(ignore_eos=True, skip_special_tokens=False, include_stop_str_in_output=True),
    ],
)
def test_valid_edge_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


# (field, bad value[, what the message must show when it is not the value itself])
_INVALID = [
    ("n", 0),
    ("n", -1),
    ("n", 1.0),
    ("temperature", -0.1),
    ("temperature", "0.7"),
    ("temperature", None),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.01),
    ("top_p", "1"),
    ("top_k", -2),
    ("top_k", 1.5),
    ("top_k", True),
    ("top_k", "5"),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("frequency_penalty", 2.01),
    ("frequency_penalty", -3.0),
    ("seed", 1.5),
    ("seed", "42"),
    ("seed", True),
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("max_tokens", 3.0),
    ("min_tokens", -1),
    ("min_tokens", 17),  # > default max_tokens=16
    ("stop", ""),
    ("stop", ["ok", ""], ""),
    ("stop", 5),
    ("stop", ["ok", 3], 3),
    ("stop_token_ids", [1, -2], -2),
    ("stop_token_ids", [1, "2"], "2"),
    ("stop_token_ids", 3),
    ("logprobs", -2),
    ("logprobs", 2.0),
    ("ignore_eos", 1),
    ("skip_special_tokens", "yes"),
    ("spaces_between_special_tokens", 0),
    ("include_stop_str_in_output", None),
    ("detokenize", 0),
    ("logit_bias", [1, 2]),
    ("logit_bias", {"seven": 1.0}, "seven"),
    ("logit_bias", {-1: 1.0}, -1),
    ("logit_bias", {5: 100.5}, 100.5),
    ("logit_bias", {5: float("nan")}, float("nan")),
    ("logit_bias", {5: "1"}, "1"),
    ("allowed_token_ids", [], "not be empty"),
    ("allowed_token_ids", [3, -1], -1),
    ("allowed_token_ids", 3),
]


@pytest.mark.parametrize("field, value, shown", [(c + (c[1],))[:3] for c in _INVALID])
def test_invalid_value_raises_naming_the_field(field, value, shown):
    with pytest.raises(ValueError, match=re.escape(field)) as info:
        SamplingParams(**{field: value})
    # the message shows the bad value too (or says what is wrong with it)
    assert (shown if isinstance(shown, str) and " " in shown else repr(shown)) in str(info.value)


def test_stop_strings_need_the_text_detokenize_false_leaves_out():
    with pytest.raises(ValueError, match=r"detokenize=False leaves out: got stop=\['\\n'\]"):
        SamplingParams(stop="\n", detokenize=False)
    assert SamplingParams(stop_token_ids=[3], detokenize=False).stop_token_ids == [3]


def test_logit_bias_keys_given_as_json_strings_become_token_ids():
    params = SamplingParams(logit_bias={"17": 2, 3: -100})
    assert params.logit_bias == {17: 2.0, 3: -100.0}
    assert isinstance(params.logit_bias[17], float)
    assert SamplingParams(allowed_token_ids=(4, 2)).allowed_token_ids == [4, 2]


def test_n_asks_for_several_completions():
    assert SamplingParams(n=4).n == 4  # engine/parallel_sampling.py runs them
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        SamplingParams(n=0)


def test_min_tokens_above_max_tokens_names_both():
    with pytest.raises(ValueError, match=r"min_tokens.*max_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_unknown_and_positional_arguments_are_rejected():
    with pytest.raises(TypeError):
        SamplingParams(temprature=0.5)  # typo
    with pytest.raises(TypeError):
        SamplingParams(1)  # keyword-only


def test_clone_is_an_independent_copy():
    p = SamplingParams(stop=["x"], stop_token_ids=[3], seed=1)
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("y")
    q.stop_token_ids.append(4)
    assert p.stop == ["x"] and p.stop_token_ids == [3]


def test_dataclasses_replace_revalidates():
    p = SamplingParams(temperature=0.5)
    assert dataclasses.replace(p, top_k=3).top_k == 3
    with pytest.raises(ValueError, match="top_k"):
        dataclasses.replace(p, top_k=-5)


@pytest.mark.parametrize("words", ["bad", [""], ["ok", 3], ["  "]])
def test_bad_words_must_be_non_empty_strings(words):
    with pytest.raises(ValueError, match=r"^bad_words must be"):
        SamplingParams(bad_words=words)


def test_bad_words_are_tokenized_as_written_and_after_a_space_where_that_differs():
    vocab = {"x": [7], " x": [8], "ab": [1, 2], " ab": [1, 9], "cd": [3, 4], " cd": [5, 6, 6]}
    ids = bad_words_token_ids(["x", " ab", "cd"], encode=vocab.__getitem__)
    # " ab" starts with the same token as "ab", " cd" has another length: only as written
    assert ids == [[7], [8], [1, 2], [3, 4]]
