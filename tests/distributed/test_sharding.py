"""Which slice each rank holds: the slices add back up to the unsharded layer (no processes:
each rank's partial output is computed in turn and the partial sums are added here)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from quickdraft.distributed.sharding import ShardLayout, check_tensor_parallel
from quickdraft.models.config import ModelConfig
from quickdraft.models.decoder import DecoderLayer
from quickdraft.models.loader import convert_hf_tensors, decoder_plan, read_hf_config, read_hf_tensors
from quickdraft.models.quantized import QuantizedWeight, quantize_q8_0


def load_state(path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    config = ModelConfig.from_hf_dict(read_hf_config(path))
    return config, convert_hf_tensors(config, decoder_plan(config), read_hf_tensors(path))


def build_layer(config: ModelConfig, state: dict[str, torch.Tensor], index: int) -> DecoderLayer:
    layer = DecoderLayer(config, layer_index=index, dtype=torch.float32)
    prefix = f"layers.{index}."
    layer.load_state_dict({k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)})
    return layer


@pytest.mark.parametrize("arch", ["gemma3", "llama", "qwen3"])
def test_mlp_and_attention_partials_add_up_to_the_full_layer(tiny_checkpoints, arch):
    """Column-parallel gate/up and q/k/v, row-parallel down and o: the ranks' partial outputs
    (their reduce is left out) sum to the unsharded MLP and attention-output matmuls."""
    config, state = load_state(tiny_checkpoints[arch])
    full = build_layer(config, state, 1)
    x = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(0))
    rotary = (torch.ones(5, 1, config.head_dim), torch.zeros(5, 1, config.head_dim))  # position 0
    q, k, v = full.attention_inputs(x, rotary=rotary, linear=torch.nn.functional.linear)
    expected_mlp = full._mlp(x, torch.nn.functional.linear)
    expected_o = torch.nn.functional.linear(q.flatten(1), full.o_proj, full.o_bias)  # q as a stand-in for attended
    mlp_sum, o_sum = torch.zeros_like(expected_mlp), torch.zeros_like(expected_o)
    for rank in range(2):
        layout = ShardLayout(config=config, rank=rank, size=2)
        shard = build_layer(layout.local_config(), layout.shard_state(state), 1)
        shard.reduce_output = lambda partial: partial  # this rank's partial sum alone
        sq, sk, sv = shard.attention_inputs(x, rotary=rotary, linear=torch.nn.functional.linear)
        heads = slice(layout.first_head, layout.first_head + layout.num_heads)
        kv_heads = slice(layout.first_kv_head, layout.first_kv_head + layout.num_kv_heads)
        torch.testing.assert_close(sq, q[:, heads])
        torch.testing.assert_close(sk, k[:, kv_heads])
        torch.testing.assert_close(sv, v[:, kv_heads])
        mlp_sum += shard._mlp(x, torch.nn.functional.linear)
        o_sum += shard._output_linear(sq.flatten(1), shard.o_proj, None, torch.nn.functional.linear)
    assert full.down_bias is None and full.o_bias is None  # biases: the qwen2 test below
    torch.testing.assert_close(mlp_sum, expected_mlp)
    torch.testing.assert_close(o_sum, expected_o)


def test_biases_are_added_once_after_the_sum(tiny_checkpoints):
    """qwen2 has q/k/v biases (column-split with their rows); the row-parallel bias is replicated
    and added after the reduce, not once per rank."""
    config, state = load_state(tiny_checkpoints["qwen2"])
    config = dataclasses.replace(config, mlp_bias=True)
    layer_state = {k: v for k, v in state.items() if k.startswith("layers.0.")}
    layer_state["layers.0.gate_up_bias"] = torch.randn(2 * config.intermediate_size)
    layer_state["layers.0.down_bias"] = torch.randn(config.hidden_size)
    full = build_layer(config, layer_state, 0)
    x = torch.randn(3, config.hidden_size)
    partials: list[torch.Tensor] = []
    for rank in range(2):
        layout = ShardLayout(config=config, rank=rank, size=2)
        shard = build_layer(layout.local_config(), layout.shard_state(layer_state), 0)
        shard.reduce_output = lambda partial: partial  # no reduce: the output is partial + bias
        partials.append(shard._mlp(x, torch.nn.functional.linear) - full.down_bias)
    torch.testing.assert_close(sum(partials) + full.down_bias, full._mlp(x, torch.nn.functional.linear))


def test_kv_heads_are_replicated_when_fewer_than_ranks():
    """Gemma 3 270M: 4 q heads, 1 KV head; over 2 ranks each keeps the KV head its q heads use."""
    config = _config(num_heads=4, num_kv_heads=1)
    layouts = [ShardLayout(config=config, rank=rank, size=2) for rank in range(2)]
    assert [(lay.first_head, lay.num_heads, lay.first_kv_head, lay.num_kv_heads) for lay in layouts] == [
        (0, 2, 0, 1),
        (2, 2, 0, 1),
    ]
    config = _config(num_heads=8, num_kv_heads=2)
    kv = [ShardLayout(config=config, rank=rank, size=4).first_kv_head for rank in range(4)]
    assert kv == [0, 0, 1, 1]  # q heads 0-3 attend to KV head 0, 4-7 to KV head 1


def test_lm_head_slices_pad_the_last_rank():
    config = _config(vocab_size=11)
    weight = torch.arange(11 * 2, dtype=torch.float32).view(11, 2)
    pieces = [ShardLayout(config=config, rank=rank, size=2).lm_head_slice(weight) for rank in range(2)]
    assert [p.shape[0] for p in pieces] == [6, 6]
    assert torch.equal(torch.cat(pieces)[:11], weight)
    assert pieces[0].data_ptr() == weight.data_ptr()  # a view: a tied head costs no memory
    assert torch.equal(pieces[1][5], torch.zeros(2))


def test_quantized_slices_keep_the_stored_blocks():
    """Q8_0 weights: q/k/v and gate/up by row ranges, o/down by whole 32-wide blocks of columns,
    the LM head by vocabulary rows padded with zero rows; the values are the full weight's."""
    config = _config(vocab_size=11)  # 4 heads of 16, 2 KV heads, intermediate 128, hidden 64
    torch.manual_seed(0)

    def q8(rows: int, cols: int) -> QuantizedWeight:
        return QuantizedWeight.from_parts([quantize_q8_0(torch.randn(rows, cols))])

    qkv, gate_up, o, down, head = q8(128, 64), q8(256, 64), q8(64, 64), q8(64, 128), q8(11, 64)
    for rank in range(2):
        layout = ShardLayout(config=config, rank=rank, size=2)
        for leaf, weight in (("qkv_proj", qkv), ("gate_up_proj", gate_up), ("o_proj", o), ("down_proj", down)):
            piece = layout.shard_quantized_weight(leaf, weight)
            assert isinstance(piece, QuantizedWeight)
            assert torch.equal(piece.dequantize(), layout.shard_layer_tensor(leaf, weight.dequantize())), leaf
        rows = layout.lm_head_slice(head)
        assert isinstance(rows, QuantizedWeight) and rows.shape == (6, 64)
        assert torch.equal(rows.dequantize()[: 6 - rank], head.dequantize()[6 * rank : 6 * rank + 6 - rank])
    assert torch.equal(ShardLayout(config=config, rank=1, size=2).lm_head_slice(head).dequantize()[5], torch.zeros(64))
    # 4 ranks: one head of 16 columns each, half a Q8_0 block of o_proj
    with pytest.raises(ValueError, match="splits o_proj inside a quantized block"):
        ShardLayout(config=config, rank=1, size=4).shard_quantized_weight("o_proj", o)


@pytest.mark.parametrize(
    ("fields", "size", "message"),
    [
        (dict(num_heads=4, num_kv_heads=2), 3, "num_attention_heads"),
        (dict(num_heads=4, num_kv_heads=2), 8, "num_attention_heads"),
        (dict(num_heads=6, num_kv_heads=3), 2, "num_key_value_heads"),
        (dict(intermediate_size=130), 4, "intermediate_size"),
        ({}, 0, "positive integer"),
    ],
)
def test_bad_splits_name_the_field(fields, size, message):
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(_config(**fields), size)


def _config(**fields) -> ModelConfig:
    base = dict(
        model_type="llama",
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        activation="silu",
        layer_types=("full_attention",),
        rope_by_layer_type={"full_attention": _rope()},
        attn_scale=0.25,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    return ModelConfig(**{**base, **fields})


def _rope():
    from quickdraft.models.config import RopeConfig

    return RopeConfig(theta=10000.0)
