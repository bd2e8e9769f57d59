"""Our decoder against transformers' reference on tiny random checkpoints of every architecture."""

from __future__ import annotations

import functools

import pytest
import torch

from quickdraft.engine.runner import ModelRunner, SequenceWork
from quickdraft.kernels.attention import kernel_available as attention_kernel
from quickdraft.kernels.cpu_linear import kernel_available as cpu_linear_kernel
from quickdraft.kv.cache import KVCache
from quickdraft.models.decoder import LogitsBuffer
from quickdraft.models.loader import load_decoder
from quickdraft.verify.tree import Tree
from tests.conftest import ARCHS


def make_runner(
    path,
    *,
    num_slots=2,
    max_len=128,
    dtype=torch.float32,
    block_size=5,
    quantization=None,
    gguf_path=None,
    device: torch.device | None = None,
):
    """A runner over a paged cache whose small odd blocks make every test cross block edges."""
    device = device or torch.device("cpu")
    model, config = load_decoder(
        path, dtype=dtype, device=device, max_len=max_len, quantization=quantization, gguf_path=gguf_path
    )
    cache = KVCache(
        num_layers=config.num_layers,
        num_slots=num_slots,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_len=max_len,
        dtype=dtype,
        block_size=block_size,
        layer_windows=config.layer_windows,  # sliding layers give back blocks behind their window
        device=device,
    )
    return ModelRunner(model=model, cache=cache, device=device), cache


@functools.cache
def reference_model(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def reference_logits(path, token_ids: list[int]) -> torch.Tensor:  # -> [T, V]
    with torch.no_grad():
        return reference_model(path)(torch.tensor([token_ids])).logits[0]


def prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(tiny_checkpoints, arch):
    tokens = prompt(40)  # longer than gemma's sliding window of 8
    runner, _ = make_runner(tiny_checkpoints[arch])
    out = runner.forward([SequenceWork(slot=0, cache_len=0, token_ids=tokens, logits_nodes=list(range(len(tokens))))])
    torch.testing.assert_close(out.logits, reference_logits(tiny_checkpoints[arch], tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_decode_match_transformers(tiny_checkpoints, arch):
    tokens = prompt(30, seed=2)
    runner, cache = make_runner(tiny_checkpoints[arch])
    got = []
    cache_len = 0
    for chunk in [tokens[:7], tokens[7:19]] + [[t] for t in tokens[19:]]:
        out = runner.forward(
            [SequenceWork(slot=1, cache_len=cache_len, token_ids=chunk, logits_nodes=list(range(len(chunk))))]
        )
        got.append(out.logits)
        cache_len += len(chunk)
        cache.commit(1, cache_len)
    torch.testing.assert_close(torch.cat(got), reference_logits(tiny_checkpoints[arch], tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_forward_equals_each_path_run_alone(tiny_checkpoints, arch):
    """Every tree node's logits equal those of its root-to-node path decoded as a chain."""
    context = prompt(12, seed=3)
    #          root  a   b   a1  a2  b1  a1x
    parents = [-1, 0, 0, 1, 1, 2, 3]
    nodes = [context[-1], 11, 12, 13, 14, 15, 16]
    runner, cache = make_runner(tiny_checkpoints[arch])
    runner.forward([SequenceWork(slot=0, cache_len=0, token_ids=context[:-1])])
    cache.commit(0, len(context) - 1)
    tree = runner.forward(
        [
            SequenceWork(
                slot=0,
                cache_len=len(context) - 1,
                token_ids=nodes,
                tree=Tree(parents),
                logits_nodes=list(range(len(nodes))),
            )
        ]
    )
    for node in range(len(nodes)):
        path = []
        walk = node
        while walk >= 0:
            path.append(nodes[walk])
            walk = parents[walk]
        chain = context[:-1] + path[::-1]
        expected = reference_logits(tiny_checkpoints[arch], chain)[-1]
        torch.testing.assert_close(tree.logits[node], expected, rtol=1e-4, atol=1e-4)


def test_batched_sequences_equal_single(tiny_checkpoints):
    path = tiny_checkpoints["gemma3"]
    a, b = prompt(20, seed=4), prompt(9, seed=5)
    runner, _cache = make_runner(path)
    both = runner.forward(
        [
            SequenceWork(slot=0, cache_len=0, token_ids=a, logits_nodes=[len(a) - 1]),
            SequenceWork(slot=1, cache_len=0, token_ids=b, logits_nodes=[len(b) - 1]),
        ]
    )
    torch.testing.assert_close(both.logits[0], reference_logits(path, a)[-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(both.logits[1], reference_logits(path, b)[-1], rtol=1e-4, atol=1e-4)


def test_layer_range_and_captured_hidden_states(tiny_checkpoints):
    import transformers

    path = tiny_checkpoints["llama"]
    tokens = prompt(10, seed=6)
    runner, cache = make_runner(path)
    full = runner.forward(
        [SequenceWork(slot=0, cache_len=0, token_ids=tokens, logits_nodes=[9])], capture_layers=(0, 2)
    )
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = ref(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(full.forward.captured[0], hidden[1][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(full.forward.captured[2], hidden[3][0], rtol=1e-4, atol=1e-4)
    # Running layers [0, 2) then [2, 4) from the hidden states gives the same logits.
    model = runner.model
    from quickdraft.models.attention import AttentionBatch, build_sequence_attention

    seq, positions = build_sequence_attention(
        slot=1, row_start=0, cache_len=0, tree=None, num_new=10, sliding_window=None
    )
    cache.reserve(1, 10)
    blocks, rows = cache.locate_all(1, list(range(10)))
    attn = AttentionBatch([seq], block_index=torch.tensor(blocks), block_offset=torch.tensor(rows))
    low = model(torch.tensor(tokens), torch.tensor(positions), attn=attn, cache=cache, end_layer=2)
    high = model(
        None,
        torch.tensor(positions),
        attn=attn,
        cache=cache,
        start_layer=2,
        hidden_states=low.hidden_states,
        logits_rows=torch.tensor([9]),
    )
    torch.testing.assert_close(high.logits, full.logits, rtol=1e-5, atol=1e-5)


def test_bfloat16_close_to_float32(tiny_checkpoints):
    path = tiny_checkpoints["gemma3"]
    tokens = prompt(16, seed=7)
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        runner, _ = make_runner(path, dtype=dtype)
        logits[dtype] = runner.forward(
            [SequenceWork(slot=0, cache_len=0, token_ids=tokens, logits_nodes=[15])]
        ).logits.float()
    torch.testing.assert_close(logits[torch.bfloat16], logits[torch.float32], rtol=0.1, atol=0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_float_weights_forward_is_batch_invariant(tiny_checkpoints, arch, dtype):
    """The float path (HF weights, dtype float32 / bfloat16) on the CPU: a token's logits are the
    same bits decoded alone, as a node of a tree beside another request's 150-row prefill (more
    rows than one kernel call takes), and at the end of its path decoded as a chain.  float32 on
    AVX-512 and AVX2 CPUs, bfloat16 on AVX-512 ones (elsewhere torch's GEMM: not invariant)."""
    if not (cpu_linear_kernel(dtype) and attention_kernel()):
        pytest.skip(f"no {dtype} float kernels on this CPU")
    context, other = prompt(30, seed=11), prompt(150, seed=12)
    nodes = [context[-1], 21, 22, 23, 24, 25]
    parents = [-1, 0, 0, 1, 3, 2]
    runner, cache = make_runner(tiny_checkpoints[arch], dtype=dtype, max_len=256)
    runner.forward([SequenceWork(slot=0, cache_len=0, token_ids=context[:-1])])
    cache.commit(0, len(context) - 1)
    cache_len = len(context) - 1

    def decode(tokens: list[int]) -> torch.Tensor:  # -> [V], the last token's logits
        work = SequenceWork(slot=0, cache_len=cache_len, token_ids=tokens, logits_nodes=[len(tokens) - 1])
        return runner.forward([work]).logits[0].clone()

    tree = runner.forward(
        [
            SequenceWork(slot=1, cache_len=0, token_ids=other, logits_nodes=[149]),
            SequenceWork(slot=0, cache_len=cache_len, token_ids=nodes, tree=Tree(parents), logits_nodes=list(range(6))),
        ]
    )
    rows = tree.logits[tree.logits_offsets[1] :]
    assert torch.equal(rows[0], decode(nodes[:1]))
    for node in (3, 4, 5):  # depth 2, 3 and 2 on two branches
        path = Tree(parents).path(node)
        assert torch.equal(rows[node], decode([nodes[i] for i in path])), node


def test_sharded_checkpoint_loads_the_same(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints["qwen2"]
    sharded = tmp_path / "sharded"
    reference_model(path).save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").exists()
    tokens = prompt(6, seed=9)
    runner, _ = make_runner(sharded)
    out = runner.forward([SequenceWork(slot=0, cache_len=0, token_ids=tokens, logits_nodes=[5])])
    torch.testing.assert_close(out.logits[0], reference_logits(path, tokens)[-1], rtol=1e-4, atol=1e-4)


def test_logits_buffer_reuses_its_memory_up_to_its_cap():
    buffer = LogitsBuffer(vocab_size=10, max_bytes=4 * 10 * 6)  # 6 rows
    first = buffer.rows(2)
    assert first is not None and first.shape == (2, 10) and first.dtype == torch.float32
    grown = buffer.rows(3)  # doubles to 4 rows
    assert grown is not None and buffer.rows(4).data_ptr() == grown.data_ptr()  # type: ignore[union-attr]
    widest = buffer.rows(6)  # capped at 6, not 8
    assert widest is not None and widest.shape == (6, 10)
    assert buffer.rows(1).data_ptr() == widest.data_ptr()  # type: ignore[union-attr]
    assert buffer.rows(7) is None  # past the cap: the caller takes fresh memory
    with pytest.raises(ValueError, match="vocab_size"):
        LogitsBuffer(vocab_size=0, max_bytes=100)


def test_reused_logits_memory_gives_the_same_bits(tiny_checkpoints, tmp_path):
    """Forwards that write their logits into the runner's buffer (the engine's step) compute the
    bits of forwards that allocate (quantized LM head, the path that uses the buffer); without
    reuse_logits every forward's logits are a tensor of their own."""
    path = tiny_checkpoints["llama"]
    fresh, _ = make_runner(path, quantization="q8_0")
    reused, _ = make_runner(path, quantization="q8_0")
    tokens = prompt(12)
    pointers = set()
    steps = ((0, tokens[:8], [4, 5, 6, 7]), (8, tokens[8:], [0, 3]), (12, tokens[:5], [0, 1, 2, 3, 4]))
    for cache_len, chunk, nodes in steps:
        work = [SequenceWork(slot=0, cache_len=cache_len, token_ids=chunk, logits_nodes=nodes)]
        expected, got = fresh.forward(work).logits, reused.forward(work, reuse_logits=True).logits
        assert got is not None and expected is not None
        assert torch.equal(got, expected)
        pointers.add(got.data_ptr())
    assert len(pointers) == 2  # one memory, then one of twice its rows when a forward needed more
    buffered, buffered_copy = got, got.clone()  # the buffer's rows of the last forward
    kept = reused.forward(work).logits
    assert kept is not None and kept.data_ptr() != buffered.data_ptr()
    assert torch.equal(buffered, buffered_copy)  # it did not write into the buffer
    copy = kept.clone()
    reused.forward([SequenceWork(slot=1, cache_len=0, token_ids=tokens[3:9], logits_nodes=[0, 1, 2, 3, 4, 5])])
    assert torch.equal(kept, copy)  # a forward without reuse_logits keeps its logits
