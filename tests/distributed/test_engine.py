"""The engine with a target split over 2 processes: greedy output equals 1 process, speculation
stays lossless, bad configs fail before any process starts, followers never outlive rank 0's use.

Each LLM with tensor_parallel_size=2 starts a follower process (~5 s on 2 cores): one per
architecture is shared by the tests of this module."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from quickdraft import LLM, SamplingParams
from quickdraft.config import EngineConfig
from quickdraft.models.quantized import QuantizedWeight
from tests.drafters.test_eagle import head_dir  # noqa: F401  (fixture)
from tests.engine.test_speculative import PositionalDrafter
from tests.models.test_decoder import prompt

SETTINGS = dict(max_model_len=256, max_num_seqs=4, block_size=8, max_num_batched_tokens=32)
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
# A long prompt (prefilled in chunks of 32), a short one, and a repetitive one (n-gram drafts hit).
PROMPTS = [prompt(70, seed=5), prompt(6, seed=6), [40, 41, 42, 43] * 5]


def token_ids(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


# Tied and untied LM heads; float weights and weights quantized to Q8_0 at load (the kernels'
# int8 block sums split at block edges; the all_reduce adds the two ranks' partial sums).
@pytest.fixture(scope="module", params=["gemma3", "llama", "gemma3-q8_0", "llama-q8_0"])
def pair(request, tiny_checkpoints):
    """(one process, two processes) over the same checkpoint, and the two processes' plain greedy
    output (speculation on them must give it exactly: batch invariance holds per tp size)."""
    arch, _, quantization = request.param.partition("-")
    path = str(tiny_checkpoints[arch])
    settings = dict(SETTINGS, quantization=quantization or None)
    single = LLM(path, **settings)
    split = LLM(path, tensor_parallel_size=2, **settings)
    if quantization:
        assert split.engine.quantization == quantization
        assert isinstance(split.engine.model.layers[0].o_proj, QuantizedWeight)  # its slice, kept quantized
    yield single, split, token_ids(split)
    split.close()


def test_greedy_equals_one_process(pair):
    """Float weights: the same tokens as one process.  Quantized weights: the all_reduce adds two
    partial sums where one process adds every block in turn, and the next layer's int8
    activations can round a value the other way, so a near-tie may pick another token: the
    tokens agree for a long stretch, not to the end (the logits' closeness is tested per step in
    test_decoder.py)."""
    single, split, expected = pair
    ours = token_ids(single)
    if split.engine.quantization is None:
        assert expected == ours
    else:
        agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(expected, ours)]
        assert min(agree) >= 8 and sum(agree) >= 2 * len(PROMPTS) * GREEDY.max_tokens // 3, agree
    cached_before = split.get_metrics().num_cached_tokens
    assert token_ids(split) == expected  # again: the prompts' blocks now come from the prefix cache
    assert split.get_metrics().num_cached_tokens > cached_before


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 4}, {"method": "suffix"}])
def test_speculative_equals_plain(pair, spec):
    """Verification runs on rank 0 from the gathered logits: greedy speculation == plain."""
    _, split, expected = pair
    split.engine.set_speculative_config(spec)
    try:
        assert token_ids(split) == expected
    finally:
        split.engine.set_speculative_config(None)


def test_eagle_head_reads_rank_0s_features_and_lm_head(pair, head_dir):  # noqa: F811
    """A feature-level head on rank 0: it reads the captured (all-reduced, full) hidden states and
    borrows rows of the full LM head that rank 0 keeps; still exactly plain greedy."""
    _, split, expected = pair
    split.engine.set_speculative_config({"method": "eagle3", "head": str(head_dir), "num_speculative_tokens": 3})
    try:
        assert token_ids(split) == expected
    finally:
        split.engine.set_speculative_config(None)


def test_tree_drafts_move_kv_on_every_rank(pair):
    """Random trees whose branches hold the right token somewhere: accepted paths off the leftmost
    branch compact the KV cache, which the follower replays; output stays plain greedy."""
    _, split, expected = pair
    prompt_tokens = PROMPTS[0]
    continuation = expected[0]
    choices = {i: [token, (token + 1) % 300, 3] for i, token in enumerate(continuation)}
    split.engine.set_drafter(PositionalDrafter(choices=choices, seed=1), num_speculative_tokens=6)
    cache = split.engine.cache
    sent: list = []
    take_moves = cache.take_moves
    cache.take_moves = lambda: sent.extend(moves := take_moves()) or moves  # count what the follower gets
    try:
        before = split.get_metrics().num_accepted_tokens
        assert token_ids(split, [prompt_tokens]) == [continuation]
        assert split.get_metrics().num_accepted_tokens > before + 8
        assert sent  # some accepted paths left the leftmost branch
    finally:
        del cache.take_moves
        split.engine.set_speculator(None)


def test_bad_configs_fail_before_any_process_starts(tiny_checkpoints):
    path = str(tiny_checkpoints["llama"])  # 4 heads, 2 KV heads, intermediate 128
    with pytest.raises(ValueError, match="num_attention_heads"):
        LLM(path, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="num_attention_heads"):
        LLM(path, tensor_parallel_size=8)  # more ranks than heads
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(tensor_parallel_size=0)


def test_followers_stop_with_close_and_a_dead_follower_fails_fast(tiny_checkpoints):
    path = str(tiny_checkpoints["llama"])
    llm = LLM(path, tensor_parallel_size=2, **SETTINGS)
    follower = llm.engine.tensor_parallel.processes[0]
    follower.kill()
    follower.wait(timeout=10)
    started = time.monotonic()
    with pytest.raises(RuntimeError):
        llm.generate([[5, 6, 7]], GREEDY)
    assert time.monotonic() - started < 30  # an error, not a hang
    llm.close()

    llm = LLM(path, tensor_parallel_size=2, **SETTINGS)
    processes = llm.engine.tensor_parallel.processes
    assert len(token_ids(llm, [[5, 6, 7]])[0]) == GREEDY.max_tokens
    llm.close()
    assert [p.wait(timeout=30) for p in processes] == [0]


def test_followers_end_when_rank_0_is_killed(tiny_checkpoints):
    """SIGKILL of rank 0 leaves no orphan: its sockets close and the follower's wait fails."""
    code = (
        "import os, signal\n"
        "from quickdraft import LLM\n"
        f"llm = LLM({str(tiny_checkpoints['llama'])!r}, tensor_parallel_size=2, max_model_len=64)\n"
        "print(llm.engine.tensor_parallel.processes[0].pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root)
    follower = int(done.stdout.split()[0])
    deadline = time.monotonic() + 20
    while _alive(follower) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(follower)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited (its parent, gone, cannot reap it)
