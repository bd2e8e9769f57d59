"""The per-row processor call: which form a callable takes, what it is given, and the errors that
name it when it raises or returns no usable row."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from quickdraft import SamplingParams
from quickdraft.verify.logits_processors import LogitsProcessorError, apply_logits_processors, processor_arity


def two(output, logits):
    return logits


def three(prompt, output, logits):
    return logits


def three_with_default(prompt, output, logits, scale=1.0):
    return logits


def variadic(*args):
    return args[-1]


class Callable2:
    def __call__(self, output, logits):
        return logits


@pytest.mark.parametrize(
    ("processor", "arity"),
    [
        (two, 2),
        (three, 3),
        (three_with_default, 3),
        (variadic, 2),
        (Callable2(), 2),
        (functools.partial(three, [1]), 2),
        (lambda output, logits, scale=2.0: logits, 3),  # vLLM's rule: three declared parameters
    ],
)
def test_the_form_follows_the_declared_parameters(processor, arity):
    assert processor_arity(processor, index=0) == arity


@pytest.mark.parametrize("processor", [lambda logits: logits, lambda a, b, c, d: d, 3, "module.name"])
def test_other_shapes_are_refused_naming_the_entry(processor):
    with pytest.raises(ValueError, match=r"^logits_processors\[1\]"):
        SamplingParams(logits_processors=[two, processor])


def test_logits_processors_must_be_a_list():
    with pytest.raises(ValueError, match=r"^logits_processors must be a list"):
        SamplingParams(logits_processors=two)


def test_clone_and_replace_share_the_processors_and_know_their_forms():
    processor = Callable2()
    params = SamplingParams(logits_processors=[processor, three], n=2)
    assert params.clone().logits_processors[0] is processor
    assert params.logits_processor_arities == [2, 3] == dataclasses.replace(params, n=1).logits_processor_arities


def test_each_processor_sees_the_row_its_predecessor_returned_and_the_histories():
    seen = []

    def record(prompt, output, logits):
        seen.append((list(prompt), list(output), logits.clone()))
        logits = logits.clone()
        logits[0] += 5.0
        return logits

    def double(output, logits):
        seen.append((None, list(output), logits.clone()))
        return logits * 2

    row = torch.arange(4, dtype=torch.float32)
    out = apply_logits_processors(row, [record, double], arities=[3, 2], prompt_token_ids=(7, 8), output_token_ids=[3])
    assert torch.equal(out, torch.tensor([10.0, 2.0, 4.0, 6.0]))
    assert seen[0][:2] == ([7, 8], [3]) and torch.equal(seen[0][2], row)
    assert seen[1][:2] == (None, [3]) and torch.equal(seen[1][2], torch.tensor([5.0, 1.0, 2.0, 3.0]))


def raises(output, logits):
    raise KeyError("boom")


@pytest.mark.parametrize(
    ("processor", "message"),
    [
        (raises, r"logits_processors\[0\] \(.*raises\) raised KeyError: 'boom'"),
        (lambda output, logits: logits[:2], r"must return a tensor of shape \(4,\), got \(2,\)"),
        (lambda output, logits: logits.tolist(), r"got list"),
        (lambda output, logits: logits * float("nan"), "NaN"),
        (lambda output, logits: logits + float("inf"), r"\+inf"),
        (lambda output, logits: torch.full_like(logits, float("-inf")), "no token with a finite logit"),
        (lambda output, logits: logits.long(), "non-float"),
    ],
)
def test_a_processor_that_fails_is_named(processor, message):
    with pytest.raises(LogitsProcessorError, match=message) as caught:
        apply_logits_processors(torch.zeros(4), [processor], arities=[2], prompt_token_ids=(1,), output_token_ids=[])
    assert caught.value.param == "logits_processors"
