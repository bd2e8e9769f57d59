"""The engine on a CUDA device: skipped without one (CI has none), run where a GPU is lent
(scripts/cuda-check.sh). On CUDA every drafter must stay exact against plain decoding on the
same device, sampling must keep the target's distribution, a forward must compute what the CPU
one does, and a row's logits must not depend on the rows beside it (the batch invariance that
makes greedy speculation exact by construction)."""

from __future__ import annotations

import pytest
import torch

from quickdraft import LLM, SamplingParams
from quickdraft.engine.runner import SequenceWork
from quickdraft.verify.tree import Tree
from tests.conftest import build_tiny_checkpoint
from tests.drafters.test_eagle import random_head
from tests.drafters.test_layer_skip import random_self_head
from tests.drafters.test_medusa import random_heads
from tests.engine.test_speculative import GarbageDrafter, assert_random_trees_keep_sampling, repetitive_prompts
from tests.models.test_decoder import make_runner, prompt
from tests.models.test_quantized_loader import tiny_gguf_paths  # noqa: F401  (a fixture used below)
from tests.stats_checks import assert_speculation_keeps_sampling

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GREEDY = dict(temperature=0.0, ignore_eos=True)
ARCHS = ("gemma3", "llama", "qwen3")


def cuda_llm(path, **options) -> LLM:
    return LLM(str(path), **{"device": "cuda", "max_model_len": 256, "max_num_seqs": 4, **options})


def greedy_tokens(llm: LLM, *, max_tokens: int = 30) -> list[list[int]]:
    outs = llm.generate(repetitive_prompts(), SamplingParams(max_tokens=max_tokens, **GREEDY))
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cuda_heads")
    return {
        "eagle3": str(random_head(root / "eagle3")),
        "eagle3_copy": str(random_head(root / "eagle3_copy", copy_dim=16, copy_gate_bias=1.5)),
        "medusa": str(random_heads(root / "medusa")),
        "self": str(random_self_head(root / "self")),
    }


@pytest.fixture(scope="module")
def plain_cuda(tiny_checkpoints) -> dict[tuple[str, str], list[list[int]]]:
    return {
        (arch, dtype): greedy_tokens(cuda_llm(tiny_checkpoints[arch], dtype=dtype))
        for arch in ARCHS
        for dtype in ("float32", "bfloat16")
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_on_cuda_computes_what_the_cpu_forward_does(tiny_checkpoints, arch):
    tokens = prompt(40)  # longer than gemma's sliding window of 8
    work = [SequenceWork(slot=0, cache_len=0, token_ids=tokens, logits_nodes=list(range(len(tokens))))]
    cpu, _ = make_runner(tiny_checkpoints[arch])
    cuda, _ = make_runner(tiny_checkpoints[arch], device=torch.device("cuda"))
    on_cuda = cuda.forward(work).logits
    assert on_cuda.device.type == "cuda"
    torch.testing.assert_close(on_cuda.cpu(), cpu.forward(work).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_rows_logits_do_not_depend_on_the_rows_beside_it(tiny_checkpoints, arch, dtype):
    """A token decoded alone, then verified in a tree beside another request's prefill: the
    same bits, as on the CPU kernels.  torch's CUDA matmul and SDPA alone do not give that in
    float32 (benchmarks/cuda_invariance.py); the float path calls them with fixed row counts
    (kernels/fixed_rows.py)."""
    context, other = prompt(23, seed=8), prompt(37, seed=9)
    nodes = [context[-1], 5, 9, 11, 6, 7]
    parents = [-1, 0, 0, 1, 1, 2]
    runner, cache = make_runner(tiny_checkpoints[arch], dtype=getattr(torch, dtype), device=torch.device("cuda"))
    runner.forward([SequenceWork(slot=0, cache_len=0, token_ids=context[:-1])])
    cache.commit(0, len(context) - 1)
    alone = runner.forward(
        [SequenceWork(slot=0, cache_len=len(context) - 1, token_ids=[context[-1]], logits_nodes=[0])]
    )
    tree = runner.forward(
        [
            SequenceWork(slot=1, cache_len=0, token_ids=other, logits_nodes=[len(other) - 1]),
            SequenceWork(
                slot=0,
                cache_len=len(context) - 1,
                token_ids=nodes,
                tree=Tree(parents),
                logits_nodes=list(range(len(nodes))),
            ),
        ]
    )
    root_row = tree.logits[tree.logits_offsets[1]]
    assert torch.equal(root_row, alone.logits[0]), (root_row - alone.logits[0]).abs().max().item()


SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 5},
    "ngram-tree": {"method": "ngram", "num_speculative_tokens": 4, "num_branches": 3},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
    "eagle3-chain": {"method": "eagle3", "head": "eagle3", "num_speculative_tokens": 4, "top_k": 1},
    "eagle3-tree": {
        "method": "eagle3",
        "head": "eagle3",
        "num_speculative_tokens": 4,
        "top_k": 3,
        "max_draft_tokens": 10,
    },
    "eagle3-copy": {"method": "eagle3", "head": "eagle3_copy", "num_speculative_tokens": 4, "top_k": 2},
    "medusa": {"method": "medusa", "head": "medusa"},
    "self": {"method": "self", "head": "self", "num_speculative_tokens": 3, "top_k": 2, "max_draft_tokens": 8},
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["gemma3", "llama"])
@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_speculation_on_cuda_equals_plain(tiny_checkpoints, heads, plain_cuda, name, arch, dtype):
    spec = dict(SPECS[name])
    if "head" in spec:
        spec["head"] = heads[spec["head"]]
    llm = cuda_llm(tiny_checkpoints[arch], dtype=dtype, speculative_config=spec)
    assert greedy_tokens(llm) == plain_cuda[(arch, dtype)]
    metrics = llm.get_metrics()
    assert metrics.num_drafts > 0 and metrics.num_draft_tokens > metrics.num_drafts
    assert llm.engine.cache.num_free_slots == 4


@pytest.mark.parametrize("tree", [False, True])
def test_garbage_drafter_on_cuda_keeps_greedy_exact(tiny_checkpoints, plain_cuda, tree):
    llm = cuda_llm(tiny_checkpoints["qwen3"], speculative_config={"method": "ngram", "num_speculative_tokens": 6})
    llm.engine.speculator.drafter = GarbageDrafter(vocab_size=320, tree=tree)
    assert greedy_tokens(llm) == plain_cuda[("qwen3", "float32")]
    assert llm.get_metrics().num_draft_tokens > 100


def test_draft_model_on_cuda_equals_plain(tiny_checkpoints, plain_cuda, tmp_path):
    other = build_tiny_checkpoint("gemma3", tmp_path / "draft", seed=5)
    llm = cuda_llm(tiny_checkpoints["gemma3"], dtype="float32", speculative_model=str(other), num_speculative_tokens=4)
    assert greedy_tokens(llm) == plain_cuda[("gemma3", "float32")]
    drafter = llm.engine.speculator.drafter
    assert drafter.cache.num_free_slots == drafter.cache.num_slots


def test_a_gguf_model_on_cuda_decodes_exactly_and_q8_0_is_refused_by_name(tiny_checkpoints, tiny_gguf_paths):  # noqa: F811
    """On CUDA a GGUF file's weights are dequantized once to the model dtype (no GPU kernel for
    them yet), and a q8_0 request is an error that names the way out."""
    path = tiny_gguf_paths["gemma3-mixed"]
    plain = greedy_tokens(cuda_llm(path))
    spec = cuda_llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 4, "num_branches": 2})
    assert greedy_tokens(spec) == plain
    with pytest.raises(ValueError, match="quantization 'q8_0' has CPU kernels only: on cuda use quantization 'none'"):
        cuda_llm(tiny_checkpoints["llama"], quantization="q8_0")


def test_sampled_speculation_on_cuda_keeps_the_target_distribution(tiny_checkpoints):
    assert_random_trees_keep_sampling(str(tiny_checkpoints["llama"]), device="cuda")


def test_sampled_eagle3_tree_on_cuda_keeps_the_target_distribution(tiny_checkpoints, heads, monkeypatch):
    spec = {**SPECS["eagle3-tree"], "head": heads["eagle3"]}
    monkeypatch.setattr(LLM, "__init__", _on_cuda(LLM.__init__))
    assert_speculation_keeps_sampling(
        str(tiny_checkpoints["gemma3"]),
        spec,
        prompt=repetitive_prompts()[0],
        draws=600,
        min_draft_tokens=300,
        require_accepts=False,
    )


def _on_cuda(init):
    def init_on_cuda(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "device": "cuda"})

    return init_on_cuda


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_adapters_on_cuda_keep_rows_and_speculation_exact(tiny_checkpoints, tmp_path, dtype):
    """A batch mixing two adapters and the base model gives each prompt its tokens alone, and
    suffix speculation gives plain decoding's (torch layers: the adapters' deltas through the
    fixed-shape linear)."""
    from quickdraft import LoRARequest
    from tests.models.test_lora import write_peft_adapter

    base = tiny_checkpoints["gemma3"]
    adapters = [LoRARequest(f"a{i}", i, str(write_peft_adapter(base, tmp_path / f"a{i}", seed=i))) for i in (1, 2)]
    prompts = repetitive_prompts()
    loras = [adapters[0], None, adapters[1], adapters[0]]
    params = SamplingParams(max_tokens=24, **GREEDY)
    llm = cuda_llm(base, dtype=dtype, enable_lora=True, max_loras=2)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras)]
    alone = [llm.generate([p], params, lora_request=lora)[0].outputs[0].token_ids for p, lora in zip(prompts, loras)]
    assert together == alone
    assert together[0] != llm.generate([prompts[0]], params)[0].outputs[0].token_ids
    spec = cuda_llm(base, dtype=dtype, enable_lora=True, max_loras=2, speculative_config={"method": "suffix"})
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, lora_request=loras)] == together


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpt_oss_on_cuda(tmp_path, dtype):
    """gpt-oss's sinks and clamped activation on CUDA (the torch code: the fixed-row attention
    with a sink column, the experts' activation): the CPU forward's logits in float32, and a
    garbage drafter's trees return plain greedy decoding's tokens in both dtypes."""
    path = build_tiny_checkpoint("gpt_oss", tmp_path / "gpt_oss", qk_scale=6.0)
    tokens = prompt(40)  # past its sliding window of 8
    work = [SequenceWork(slot=0, cache_len=0, token_ids=tokens, logits_nodes=list(range(len(tokens))))]
    if dtype == "float32":
        cpu, _ = make_runner(path)
        cuda, _ = make_runner(path, device=torch.device("cuda"))
        torch.testing.assert_close(cuda.forward(work).logits.cpu(), cpu.forward(work).logits, rtol=1e-4, atol=1e-4)
    plain = greedy_tokens(cuda_llm(path, dtype=dtype))
    llm = cuda_llm(path, dtype=dtype, speculative_config={"method": "ngram", "num_speculative_tokens": 6})
    llm.engine.speculator.drafter = GarbageDrafter(vocab_size=320, tree=True)
    assert greedy_tokens(llm) == plain
