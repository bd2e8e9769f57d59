"""The embedded Gemma 3 270M run as stored (GGUF Q4_K_M with the quantized kernels, the default)."""

from __future__ import annotations

import pytest
import torch

from quickdraft import LLM
from quickdraft.engine.runner import SequenceWork
from quickdraft.verify.tree import Tree
from tests.models.test_real_gemma import PROMPTS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512, max_num_seqs=4)


def test_default_is_quantized_and_small(llm):
    assert llm.engine.quantization == "gguf"
    assert llm.engine.model.embed_tokens.nbytes < 200e6  # Q8_0 [262144, 640], not 671 MB of float32


def _forward(llm, work):
    return llm.engine.runner.forward(work).logits


def test_whole_forward_batch_invariant(llm):
    """A token's logits: alone, in a chain, in a tree with wrong siblings, beside another request."""
    ids = llm.tokenizer.encode(PROMPTS[2])
    prefix, rest = ids[:-8], ids[-8:]
    n = len(prefix)
    for slot in range(3):
        _forward(llm, [SequenceWork(slot=slot, cache_len=0, token_ids=prefix, logits_nodes=[0])])
    alone = torch.cat(
        [
            _forward(llm, [SequenceWork(slot=0, cache_len=n + i, token_ids=[tok], logits_nodes=[0])])
            for i, tok in enumerate(rest)
        ]
    )
    chain = _forward(
        llm,
        [
            SequenceWork(
                slot=2, cache_len=n, token_ids=[ids[3], 7, 8, 9], tree=Tree([-1, 0, 0, 1]), logits_nodes=[0, 3]
            ),
            SequenceWork(slot=1, cache_len=n, token_ids=rest, logits_nodes=list(range(len(rest)))),
        ],
    )[2:]
    assert torch.equal(chain, alone)
    tree = _forward(
        llm,
        [
            SequenceWork(
                slot=1,
                cache_len=n,
                token_ids=[rest[0], 3, rest[1], 5, 6, rest[2]],
                tree=Tree([-1, 0, 0, 2, 2, 2]),
                logits_nodes=[0, 2, 5],
            )
        ],
    )
    assert torch.equal(tree, alone[:3])


def test_agrees_with_float32_teacher_forced():
    """Int8 activations move the logits a little: the argmax agrees on nearly every position."""
    quantized = LLM(max_model_len=512)
    floats = LLM(max_model_len=512, dtype="float32")
    agree = total = 0
    for text in PROMPTS:
        ids = quantized.tokenizer.encode(text)
        work = [SequenceWork(slot=0, cache_len=0, token_ids=ids, logits_nodes=list(range(len(ids))))]
        a = quantized.engine.runner.forward(work).logits.argmax(-1)
        b = floats.engine.runner.forward(work).logits.argmax(-1)
        agree += int((a == b).sum())
        total += len(ids)
    assert agree / total > 0.9
