"""The embedded Gemma 3 270M against transformers on the same (dequantized) weights, and the
speculative drafters on the default (quantized) path."""

from __future__ import annotations

import math

import pytest
import torch

from quickdraft import LLM, SamplingParams
from quickdraft.engine.runner import SequenceWork

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Summarize: The meeting covered budgets, hiring and the new office. Budgets were cut by ten percent.",
    "Question: What is 17 times 3?\nAnswer:",
    "Once upon a time, in a small village by the sea,",
    "Translate to German: Good morning, how are you?",
]


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512, max_num_seqs=4, dtype="float32")  # dequantized, as transformers reads it


@pytest.fixture(scope="module")
def reference(llm):
    import transformers

    from quickdraft.models.gguf import default_model_dir, float_checkpoint_dir

    model = transformers.AutoModelForCausalLM.from_pretrained(
        float_checkpoint_dir(default_model_dir()), dtype=torch.float32
    )
    return model.eval()


def test_logits_match_transformers(llm, reference):
    for text in PROMPTS[:3]:
        ids = llm.tokenizer.encode(text)
        out = llm.engine.runner.forward(
            [SequenceWork(slot=0, cache_len=0, token_ids=ids, logits_nodes=list(range(len(ids))))]
        )
        with torch.no_grad():
            expected = reference(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(out.logits, expected, rtol=1e-3, atol=2e-3)


def test_greedy_tokens_match_transformers(llm, reference):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ours = llm.generate(PROMPTS, params)  # batched, continuous batching with 4 slots
    for text, output in zip(PROMPTS, ours):
        ids = torch.tensor([output.prompt_token_ids])
        with torch.no_grad():
            ref = reference.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert output.outputs[0].token_ids == ref[0, ids.shape[1] :].tolist(), text


def test_embedded_model_reloads_from_its_cached_conversion(monkeypatch):
    """A second load reads the cached conversion (config, tokenizer, float tensors) instead of
    converting the GGUF again (which takes most of a first load)."""
    from quickdraft.models import gguf

    LLM(max_model_len=256)  # converts if this machine never did

    def converted_again(*args, **kwargs):
        raise AssertionError("the embedded model was converted again")

    monkeypatch.setattr(gguf, "_convert", converted_again)
    LLM(max_model_len=256)


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "ngram", "num_speculative_tokens": 5},
        {"method": "suffix"},
        {"method": "ngram", "num_speculative_tokens": 4, "num_branches": 2, "dynamic_draft_length": True},
    ],
)
def test_speculative_greedy_equals_plain(spec):
    assert speculative_metrics_if_exact(spec, max_tokens=40).acceptance_length > 1.2


@pytest.mark.parametrize("spec", [{"method": "suffix"}, {"method": "eagle3", "min_draft_prob": 0.05}])
def test_rows_computed_when_the_walks_reach_them_keep_greedy_exact(spec):
    """One LM-head row before each walk, the others computed where the walk reaches them: on the
    real model's quantized head as on the tiny ones (whatever the CPU's measured choice is)."""
    assert speculative_metrics_if_exact(spec, max_tokens=40, lazy_logits_rows=1).num_drafts > 0


def speculative_metrics_if_exact(spec: dict, *, max_tokens: int, lazy_logits_rows: int | None = None):
    """Generate PROMPTS plainly and with `spec`; assert identical tokens, return the metrics."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    plain = LLM(max_model_len=512, max_num_seqs=4).generate(PROMPTS, params)
    llm = LLM(max_model_len=512, max_num_seqs=4, speculative_config=spec, lazy_logits_rows=lazy_logits_rows)
    ours = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in plain]
    return llm.get_metrics()


def test_draft_model_greedy_equals_plain():
    """The embedded model drafting for itself: exact output, nearly every draft accepted."""
    from quickdraft.models.gguf import default_model_dir

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = LLM(max_model_len=256).generate(PROMPTS[:2], params)
    llm = LLM(max_model_len=256, speculative_model=str(default_model_dir()), num_speculative_tokens=3)
    ours = llm.generate(PROMPTS[:2], params)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in plain]
    assert llm.get_metrics().acceptance_rate > 0.8


@pytest.mark.parametrize("shape", [{"top_k": 1}, {"top_k": 3, "max_draft_tokens": 10}, "hybrid"])
def test_eagle_head_greedy_equals_plain(tmp_path, shape):
    """Any head keeps the output exact: here an untrained one sized for Gemma 3 270M."""
    from tests.drafters.test_eagle import random_head

    head = str(
        random_head(tmp_path / "head", feature_layers=(1, 9, 17), draft_vocab=2048, hidden=640, vocab_size=262144)
    )
    eagle = {"method": "eagle3", "head": head, "num_speculative_tokens": 4}
    spec = {"method": "hybrid", "drafters": [{"method": "suffix"}, eagle]} if shape == "hybrid" else {**eagle, **shape}
    assert speculative_metrics_if_exact(spec, max_tokens=24).num_drafts > 0


@pytest.mark.parametrize("kind", ["medusa", "self-chain", "self-tree"])
def test_medusa_and_self_heads_greedy_equal_plain(tmp_path, kind):
    """Untrained medusa heads and [self] head sized for Gemma 3 270M keep the output exact."""
    from tests.drafters.test_layer_skip import random_self_head
    from tests.drafters.test_medusa import random_heads

    if kind == "medusa":
        head = random_heads(
            tmp_path / "h", num_heads=3, hidden=640, feature_layer=17, draft_vocab=2048, vocab_size=262144
        )
        spec = {"method": "medusa", "head": str(head)}
    else:
        head = random_self_head(
            tmp_path / "h", feature_layer=5, hidden=640, draft_vocab=2048, vocab_size=262144, scale=0.02
        )
        spec = {
            "model": "[self]",
            "head": str(head),
            "num_speculative_tokens": 3,
            "top_k": 1 if kind == "self-chain" else 2,
        }
    assert speculative_metrics_if_exact(spec, max_tokens=24).num_drafts > 0


@pytest.mark.parametrize(
    "options",
    [
        {"top_k": 1},  # the default head (with a copy path), a chain
        {"top_k": 3, "max_draft_tokens": 10},  # its mixture's top-k children in a dynamic tree
        {"head": "eagle3-nocopy", "top_k": 1},  # the head without a copy path, by its name
    ],
)
def test_shipped_eagle3_heads_load_by_name_and_draft_usefully(options):
    """{"method": "eagle3"} finds the heads shipped for the embedded model; output stays exact."""
    metrics = speculative_metrics_if_exact(
        {"method": "eagle3", "num_speculative_tokens": 4, "head_dtype": "bfloat16", **options}, max_tokens=48
    )
    assert metrics.acceptance_length > 1.3  # an untrained head stays near 1.0


@pytest.mark.parametrize("method", ["eagle3", "self"])
def test_a_head_with_no_options_drafts_as_its_manifest_recommends(method):
    """{"method": "eagle3"} or {"method": "self"} alone: the shipped head's recommended chain of 8
    cut below path probability 0.2 (eagle3: 1.89x here vs 1.33x for the drafter's own dynamic
    tree; [self]: see its manifest's "choices")."""
    speculator = LLM(max_model_len=256, speculative_config={"method": method}).engine.speculator
    assert speculator.config.num_speculative_tokens == 8
    drafter = speculator.drafter
    assert (drafter.depth, drafter.top_k) == (8, 1) and drafter.min_log_prob == pytest.approx(math.log(0.2))


@pytest.mark.parametrize(
    "spec",
    [
        {"model": "[self]"},  # the shipped [self] head (first layers + a copy path), no other argument
        {"method": "self", "top_k": 2, "max_draft_tokens": 8},  # the same head growing a tree
        {"method": "medusa"},  # the shipped medusa heads by name
    ],
)
def test_shipped_self_and_medusa_heads_load_by_name_and_stay_exact(spec):
    metrics = speculative_metrics_if_exact(spec, max_tokens=48)
    assert metrics.num_drafts > 0 and metrics.acceptance_length > 1.05  # untrained heads stay near 1.0


def test_shipped_hybrid_of_the_demo_is_exact():
    """The demo's hybrid (suffix, then the shipped copy head where retrieval drafts under 2 tokens,
    its paths cut below probability 0.2) keeps the output exact and drafts."""
    spec = {
        "method": "hybrid",
        "skip_after": 2,
        "max_draft_tokens": 12,
        "drafters": [
            {"method": "suffix"},
            {"method": "eagle3", "top_k": 1, "head_dtype": "bfloat16", "min_draft_prob": 0.2},
        ],
    }
    assert speculative_metrics_if_exact(spec, max_tokens=48).acceptance_length > 1.3


def no_immediate_repeat(output, logits):
    """A logits processor: the last output token cannot come again at once."""
    if output:
        logits[output[-1]] = float("-inf")
    return logits


def favour_prompt_tokens(prompt, output, logits):
    """A logits processor of the three-argument form: the prompt's tokens gain 2."""
    logits[torch.tensor(prompt)] += 2.0
    return logits


# One request per prompt, each with other sampling parameters, all seeded: a mixed batch.
SEEDED = [
    SamplingParams(temperature=0.8, seed=11, max_tokens=32, ignore_eos=True, logits_processors=[favour_prompt_tokens]),
    SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=12, max_tokens=32, ignore_eos=True),
    SamplingParams(temperature=0.7, min_p=0.05, repetition_penalty=1.2, seed=13, max_tokens=32, ignore_eos=True),
    SamplingParams(
        temperature=1.2, presence_penalty=0.5, frequency_penalty=0.3, seed=14, max_tokens=32, ignore_eos=True
    ),
    SamplingParams(temperature=0.6, top_k=5, min_tokens=8, seed=15, max_tokens=32),
    SamplingParams(temperature=0, seed=16, max_tokens=32, ignore_eos=True, logits_processors=[no_immediate_repeat]),
]


@pytest.fixture(scope="module")
def seeded_plain():
    outputs = LLM(max_model_len=512, max_num_seqs=6).generate(PROMPTS, SEEDED)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "ngram", "num_speculative_tokens": 5},
        {"method": "suffix"},
        {"method": "eagle3", "top_k": 3, "max_draft_tokens": 10},
        {"method": "hybrid", "skip_after": 2, "drafters": [{"method": "suffix"}, {"method": "eagle3", "top_k": 1}]},
        "draft_model",
    ],
    ids=str,
)
def test_seeded_sampled_speculation_equals_seeded_plain(seeded_plain, spec):
    """Position-keyed sampling on the real model: the same seeded tokens with any drafter."""
    from quickdraft.models.gguf import default_model_dir

    if spec == "draft_model":
        spec = {"method": "draft_model", "model": str(default_model_dir()), "num_speculative_tokens": 3}
    llm = LLM(max_model_len=512, max_num_seqs=6, speculative_config=spec)
    ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SEEDED)]
    assert ours == seeded_plain
    assert llm.get_metrics().num_accepted_tokens > 0


def test_embeddings_match_transformers_and_stay_whole_when_chunked(llm, reference):
    """The embedded model's embeddings: its float path equal to transformers' final hidden states
    (the last token's, normalized), the quantized default within rounding of it, and a long prompt
    prefilled in chunks of 16 the very bits of one forward."""
    text = " ".join(PROMPTS)
    ids = llm.tokenizer.encode(text)
    with torch.no_grad():
        states = reference.model(torch.tensor([ids])).last_hidden_state[0]
    expected = states[-1] / states[-1].norm()
    ours = torch.tensor(llm.embed(text)[0].outputs.embedding)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
    quantized = LLM(max_model_len=512, max_num_seqs=2)
    vector = quantized.embed(text)[0].outputs.embedding
    assert torch.nn.functional.cosine_similarity(torch.tensor(vector), expected, dim=0) > 0.99
    chunked = LLM(max_model_len=512, max_num_seqs=2, max_num_batched_tokens=16)
    assert len(ids) > 64 and chunked.embed(text)[0].outputs.embedding == vector
