"""One config-driven decoder for Gemma 3 (text), Llama 3, Qwen2/2.5 and Qwen3.

The forward takes a flat batch of new tokens with their absolute positions and an
``AttentionBatch`` (built by the runner) that says which cached keys and which tree
ancestors each token sees.  It can start at any layer from given hidden states, stop after
any layer, capture the hidden states of chosen layers, and compute logits for chosen rows
only: everything a drafter that reuses the target's layers or features needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from quickdraft.kernels.attention import attention
from quickdraft.kernels.quant_linear import (
    FusedLayerWeights,
    FusedStack,
    MixtureWeights,
    fused_decoder_layer,
    fused_layer_available,
    lm_head_activation_levels,
    quant_linear,
)
from quickdraft.kv.cache import KVCache
from quickdraft.models.attention import AttentionBatch
from quickdraft.models.config import SLIDING_ATTENTION, ModelConfig
from quickdraft.models.layers import LinearFn, RMSNorm, RotaryTable, apply_rotary
from quickdraft.models.lora import LoRABatch
from quickdraft.models.quantized import QuantizedWeight, embedding_rows


class LogitsBuffer:
    """Memory that a runner's forwards write their LM-head rows into, kept from one forward to
    the next: every forward's [M, V] float32 logits in fresh memory cost a page fault per
    4 KiB on the CPU (M MiB for Gemma's 262k vocabulary; at 32 decodes a step that was ~10% of
    the step, and it moved from run to run with the allocator's state).  The rows handed out
    are valid until the next forward through the same buffer; more rows than `max_bytes`
    holds get fresh memory, so one wide prefill does not stay resident."""

    def __init__(self, *, vocab_size: int, max_bytes: int):
        if vocab_size <= 0 or max_bytes < 0:
            raise ValueError(f"LogitsBuffer needs vocab_size > 0 and max_bytes >= 0, got {vocab_size}, {max_bytes}")
        self.vocab_size = vocab_size
        self.max_rows = max_bytes // (4 * vocab_size)
        self._memory = torch.empty(0, vocab_size, dtype=torch.float32)  # [capacity, V]

    def rows(self, count: int) -> torch.Tensor | None:  # -> [count, V] float32, or None past the cap
        if count > self.max_rows:
            return None
        if count > self._memory.shape[0]:
            capacity = min(self.max_rows, max(count, 2 * self._memory.shape[0]))
            self._memory = torch.empty(capacity, self.vocab_size, dtype=torch.float32)
        return self._memory[:count]


class LogitsArena(LogitsBuffer):
    """A LogitsBuffer whose calls get the rows after those of the calls before (until `reset`):
    the rows of a step computed in several calls stay valid together.  Past its memory a call
    gets fresh memory (None)."""

    def __init__(self, *, vocab_size: int, max_bytes: int):
        super().__init__(vocab_size=vocab_size, max_bytes=max_bytes)
        self._used = 0

    def reset(self, expected_rows: int) -> None:
        """Forgets the rows handed out; room for `expected_rows` (within the cap) from now on."""
        self._used = 0
        rows = min(expected_rows, self.max_rows)
        if rows > self._memory.shape[0]:
            self._memory = torch.empty(max(rows, 2 * self._memory.shape[0]), self.vocab_size, dtype=torch.float32)

    def rows(self, count: int) -> torch.Tensor | None:
        if self._used + count > self._memory.shape[0]:
            return None
        out = self._memory[self._used : self._used + count]
        self._used += count
        return out


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [M, V] for the requested rows, None when not asked
    hidden_states: torch.Tensor  # [N, D] output of the last layer that ran (before final norm)
    captured: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [N, D] its output


def _weight(rows: int, cols: int, dtype: torch.dtype) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(rows, cols, dtype=dtype), requires_grad=False)


def _bias(rows: int, enabled: bool, dtype: torch.dtype) -> torch.nn.Parameter | None:
    if not enabled:
        return None
    return torch.nn.Parameter(torch.zeros(rows, dtype=dtype), requires_grad=False)


@dataclass(frozen=True)
class GatedActivation:
    """An MLP's activation of its gate and up halves: gelu_tanh(gate) * up, silu(gate) * up, or
    gpt-oss's "swiglu_oai": gate clamped to <= limit and up to [-limit, limit], then
    gate * sigmoid(alpha * gate) * (up + 1)."""

    kind: str = "silu"
    limit: float = 7.0
    alpha: float = 1.702

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:  # [N, 2 I] -> [N, I]
        gate, up = gate_up.chunk(2, dim=-1)
        if self.kind == "swiglu_oai":
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return (F.gelu(gate, approximate="tanh") if self.kind == "gelu_tanh" else F.silu(gate)) * up


class Expert(torch.nn.Module):
    """One expert of a mixture-of-experts layer: the dense MLP's two matmuls at the experts' width
    (gate and up fused as there, so a quantized expert runs the same kernels), with biases where
    the model has them (gpt-oss)."""

    def __init__(self, *, hidden_size: int, intermediate_size: int, dtype: torch.dtype, bias: bool = False):
        super().__init__()
        self.gate_up_proj = _weight(2 * intermediate_size, hidden_size, dtype)
        self.down_proj = _weight(hidden_size, intermediate_size, dtype)
        self.gate_up_bias = _bias(2 * intermediate_size, bias, dtype)
        self.down_bias = _bias(hidden_size, bias, dtype)

    def forward(self, x: torch.Tensor, *, linear: LinearFn, act: GatedActivation) -> torch.Tensor:  # [n, D] -> [n, D]
        return linear(act(linear(x, self.gate_up_proj, self.gate_up_bias)), self.down_proj, self.down_bias)


class DecoderLayer(torch.nn.Module):
    def __init__(self, config: ModelConfig, *, layer_index: int, dtype: torch.dtype):
        super().__init__()
        c = config
        self.layer_index = layer_index
        self.is_sliding = c.layer_types[layer_index] == SLIDING_ATTENTION
        self.rotary_key = c.rotary_key(layer_index)  # which of the decoder's rotary tables it reads
        self.q_size, self.kv_size = c.q_size, c.kv_size
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.attn_scale = c.attn_scale
        self.attn_softcap = c.attn_logit_softcapping  # Gemma 2; None elsewhere
        self.act = GatedActivation(kind=c.activation, limit=c.swiglu_limit, alpha=c.swiglu_alpha)
        # gpt-oss's activation runs in the one-call layer only in its experts (it has no dense MLP)
        self.fusable = c.activation != "swiglu_oai" or layer_index in c.moe_layers
        # Quantized layers run as one C++ call (csrc/quant_linear.cpp) unless this is False.
        self.fused = True
        # (the weights, norms and biases it was built from, the fused kernel's arguments or None)
        self._fused_cache: tuple[tuple, FusedLayerWeights | None] | None = None
        # Tensor parallelism (quickdraft/distributed): o_proj and down_proj hold a slice of their
        # input dimension on each rank, so their outputs are partial sums that this adds up over
        # the ranks (before the bias, which is added once).  None: the whole layer is here.
        self.reduce_output: Callable[[torch.Tensor], torch.Tensor] | None = None
        # q, k and v share one matmul, gate and up another: fewer passes over the input.
        self.qkv_proj = _weight(c.q_size + 2 * c.kv_size, c.hidden_size, dtype)
        self.qkv_bias = _bias(c.q_size + 2 * c.kv_size, c.qkv_bias, dtype)
        self.o_proj = _weight(c.hidden_size, c.q_size, dtype)
        self.o_bias = _bias(c.hidden_size, c.o_bias, dtype)
        # A mixture-of-experts layer has a router and experts instead of the dense MLP's weights.
        moe = layer_index in c.moe_layers
        self.gate_up_proj = None if moe else _weight(2 * c.intermediate_size, c.hidden_size, dtype)
        self.gate_up_bias = _bias(2 * c.intermediate_size, c.mlp_bias, dtype)
        self.down_proj = None if moe else _weight(c.hidden_size, c.intermediate_size, dtype)
        self.down_bias = _bias(c.hidden_size, c.mlp_bias, dtype)
        self.router = _weight(c.num_experts, c.hidden_size, dtype) if moe else None
        self.router_bias = _bias(c.num_experts, moe and c.router_bias, dtype)
        self.experts = (
            torch.nn.ModuleList(
                Expert(
                    hidden_size=c.hidden_size,
                    intermediate_size=c.moe_intermediate_size,
                    dtype=dtype,
                    bias=c.expert_bias,
                )
                for _ in range(c.num_experts)
            )
            if moe
            else None
        )
        # gpt-oss: one sink logit per query head, joining each softmax's denominator
        self.sinks = (
            torch.nn.Parameter(torch.zeros(c.num_heads, dtype=dtype), requires_grad=False)
            if c.attention_sinks
            else None
        )
        self.experts_per_token, self.moe_renormalize = c.experts_per_token, c.moe_renormalize
        self.expert_bias = c.expert_bias  # the experts have gate_up and down biases (gpt-oss)
        shared = moe and c.shared_expert_intermediate_size > 0
        self.shared_expert = (
            Expert(hidden_size=c.hidden_size, intermediate_size=c.shared_expert_intermediate_size, dtype=dtype)
            if shared
            else None
        )
        gated = shared and c.shared_expert_gated
        self.shared_expert_gate = _weight(1, c.hidden_size, dtype) if gated else None  # [1, D]

        def norm(*shape: int) -> RMSNorm:
            return RMSNorm(shape, eps=c.rms_norm_eps, unit_offset=c.norm_unit_offset, dtype=dtype)

        self.input_layernorm = norm(c.hidden_size)
        self.post_attention_layernorm = norm(c.hidden_size)
        # q and k heads normalised in one call: row h holds q_norm (h < H) or k_norm.
        self.qk_norm = norm(c.num_heads + c.num_kv_heads, c.head_dim) if c.qk_norm else None
        self.pre_feedforward_layernorm = norm(c.hidden_size) if c.sandwich_norms else None
        self.post_feedforward_layernorm = norm(c.hidden_size) if c.sandwich_norms else None

    def forward(
        self,
        hidden: torch.Tensor,  # [N, D]
        *,
        rotary: tuple[torch.Tensor, torch.Tensor],  # cos, sin [N, 1, head_dim]
        attn: AttentionBatch,
        cache: KVCache,
        linear: LinearFn,
        lora: LoRABatch | None = None,
        allow_fused: bool = True,  # False: this layer's torch code (the one-call layer takes no adapters)
    ) -> torch.Tensor:  # [N, D]
        fused = self._fused_weights_for(hidden) if allow_fused else None
        if fused is not None:
            return self._fused_forward(hidden, fused, rotary=rotary, attn=attn, cache=cache)
        q, k, v = self.attention_inputs(hidden, rotary=rotary, linear=linear, lora=lora)
        cache.write(
            self.layer_index,
            keys=k,
            values=v,
            block_index=attn.block_index[cache.group_of_layer[self.layer_index]],
            block_offset=attn.block_offset,
        )
        return self.block_output(hidden, self._attend(q, attn, cache), linear=linear, lora=lora)

    def _fused_weights_for(self, hidden: torch.Tensor, *, kernel_ready: bool = False) -> FusedLayerWeights | None:
        """The one-call C++ layer's arguments where it applies (quantized weights, float32 biases,
        on the CPU, a compiled build), else None: the layer below, per matmul.  `kernel_ready`:
        the caller checked fused_layer_available() for this forward already."""
        if (
            not self.fused
            or not self.fusable
            or self.reduce_output is not None
            or not hidden.is_cpu
            or hidden.dtype != torch.float32
            or self.head_dim % 16
            or not (kernel_ready or fused_layer_available())
        ):
            return None
        return self._fused_weights()

    def _fused_weights(self) -> FusedLayerWeights | None:
        """The kernel's arguments that stay from call to call, gathered at the first fused call and
        again whenever a weight, norm or bias is replaced; None where a weight is not quantized.
        The check reads the module dicts directly: torch's Module.__getattr__ costs ~1 us a lookup,
        and this runs for every layer of every forward."""
        modules = self._modules
        weights = (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj)  # plain attributes
        norms = tuple(
            None if modules.get(name) is None else modules[name]._parameters["weight"]
            for name in (
                "input_layernorm",
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
                "qk_norm",
            )
        )
        biases = (self.qkv_bias, self.o_bias, self.gate_up_bias, self.down_bias)  # None: plain attributes
        experts, expert_biases = self._expert_weights()  # ((), ()) for a dense layer
        shared = self._shared_expert_weights()  # (gate_up, down, gate or None) or ()
        # gpt-oss: the sinks and the router's bias
        sinks, router_bias = self._parameters.get("sinks"), self._parameters.get("router_bias")
        sources = weights + norms + biases + experts + shared + (sinks, router_bias) + expert_biases
        cached = self._fused_cache
        if cached is not None and len(sources) == len(cached[0]) and all(a is b for a, b in zip(sources, cached[0])):
            return cached[1]
        dense = weights if not experts else weights[:2]  # a mixture's layer has no dense MLP weights
        usable = all(isinstance(w, QuantizedWeight) for w in dense + experts[1:] + shared[:2]) and all(
            isinstance(w, torch.Tensor) and w.dtype == torch.float32
            for w in biases + experts[:1] + shared[2:] + (sinks, router_bias) + expert_biases
            if w is not None
        )
        layer = (
            FusedLayerWeights.of(
                weights=dict(zip(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), weights)),
                mixture=(
                    MixtureWeights(
                        router=experts[0],
                        experts=list(zip(experts[1::2], experts[2::2])),
                        experts_per_token=self.experts_per_token,
                        renormalize=self.moe_renormalize,
                        shared=(shared[0], shared[1]) if shared else None,
                        shared_gate=shared[2] if shared else None,
                        router_bias=router_bias,
                        expert_biases=list(zip(expert_biases[0::2], expert_biases[1::2])) or None,
                        swiglu_oai=(self.act.limit, self.act.alpha) if self.act.kind == "swiglu_oai" else None,
                    )
                    if experts
                    else None
                ),
                norms=dict(zip(("input", "post_attention", "pre_feedforward", "post_feedforward", "qk"), norms)),
                extras=dict(zip(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), biases)) | {"sinks": sinks},
                eps=self.input_layernorm.eps,
                gelu=self.act.kind == "gelu_tanh",
                num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                scale=self.attn_scale,
                softcap=self.attn_softcap,
            )
            if usable
            else None
        )
        self._fused_cache = (sources, layer)  # the sources kept alive: their ids stay theirs
        return layer

    def _expert_weights(self) -> tuple[tuple, tuple]:
        """((router, gate_up of expert 0, down of expert 0, ...), (gate_up bias of expert 0, down
        bias of expert 0, ...)) of a mixture's layer, the biases () where the model's experts have
        none (all but gpt-oss: their lookups would double the pass); ((), ()) for a dense layer.
        Read from the modules' dicts: with 128 experts, torch's Module.__getattr__ would cost a
        quarter of a millisecond a layer on every forward."""
        experts = self._modules.get("experts")
        if experts is None:
            return (), ()
        weights: list = [self._parameters.get("router", self.__dict__.get("router"))]
        biases: list = []
        with_biases = self.expert_bias
        for expert in experts._modules.values():
            attributes, parameters = expert.__dict__, expert._parameters
            for name in ("gate_up_proj", "down_proj"):
                value = attributes.get(name)
                weights.append(parameters.get(name) if value is None else value)
            if with_biases:
                biases += (parameters.get("gate_up_bias"), parameters.get("down_bias"))
        return tuple(weights), tuple(biases)

    def _shared_expert_weights(self) -> tuple:
        """(gate_up, down, the [1, D] gate or None) of a mixture's shared expert, () without one."""
        expert = self._modules.get("shared_expert")
        if expert is None:
            return ()
        gate = self._parameters.get("shared_expert_gate", self.__dict__.get("shared_expert_gate"))
        weights = []
        for name in ("gate_up_proj", "down_proj"):
            value = expert.__dict__.get(name)
            weights.append(expert._parameters.get(name) if value is None else value)
        return (*weights, gate)

    def _fused_forward(
        self,
        hidden: torch.Tensor,
        layer: FusedLayerWeights,
        *,
        rotary: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionBatch,
        cache: KVCache,
    ) -> torch.Tensor:  # [N, D] -> [N, D]
        return fused_decoder_layer(
            hidden,
            layer=layer,
            rotary=rotary,
            cache_keys=cache.keys[self.layer_index],
            cache_values=cache.values[self.layer_index],
            sequences=attn.fused_sequences(cache, layer=self.layer_index, sliding=self.is_sliding),
        )

    # The pieces below are also driven by feature-level draft heads that hold a decoder layer
    # of the target's architecture (MTP layers) and attend over their own caches.
    def attention_inputs(
        self,
        hidden: torch.Tensor,
        *,
        rotary: tuple[torch.Tensor, torch.Tensor],
        linear: LinearFn,
        lora: LoRABatch | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # hidden [N, D] (the layer's input) -> q [N, H, hd], k and v [N, Hkv, hd]
        x = self.input_layernorm(hidden)
        qkv = self._with_adapters(linear(x, self.qkv_proj, self.qkv_bias), x, "qkv_proj", linear, lora).view(
            x.shape[0], self.num_heads + 2 * self.num_kv_heads, self.head_dim
        )
        qk, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.qk_norm is not None:
            qk = self.qk_norm(qk)
        cos, sin = rotary
        qk = apply_rotary(qk, cos, sin)  # q and k heads rotated together
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return q, k, v

    def block_output(
        self, hidden: torch.Tensor, attended: torch.Tensor, *, linear: LinearFn, lora: LoRABatch | None = None
    ) -> torch.Tensor:
        # hidden [N, D] (the layer's input), attended [N, H * hd] -> the layer's output [N, D]
        attn_out = self._output_linear(attended, self.o_proj, self.o_bias, linear)
        attn_out = self._with_adapters(attn_out, attended, "o_proj", linear, lora)
        if self.pre_feedforward_layernorm is not None:
            # Gemma: norm the attention output, add, then norm again before the MLP.
            hidden = hidden + self.post_attention_layernorm(attn_out)
            mlp_out = self._mlp(self.pre_feedforward_layernorm(hidden), linear, lora)
            return hidden + self.post_feedforward_layernorm(mlp_out)
        hidden = hidden + attn_out
        return hidden + self._mlp(self.post_attention_layernorm(hidden), linear, lora)

    def _mlp(
        self, x: torch.Tensor, linear: LinearFn, lora: LoRABatch | None = None
    ) -> torch.Tensor:  # [N, D] -> [N, D]
        if self.experts is not None:
            return self._mixture(x, linear)
        gate_up = self._with_adapters(linear(x, self.gate_up_proj, self.gate_up_bias), x, "gate_up_proj", linear, lora)
        hidden = self.act(gate_up)
        return self._with_adapters(
            self._output_linear(hidden, self.down_proj, self.down_bias, linear), hidden, "down_proj", linear, lora
        )

    def _mixture(self, x: torch.Tensor, linear: LinearFn) -> torch.Tensor:  # [N, D] -> [N, D]
        """Each row through its top-k experts by router probability, their outputs weighted and
        added in rank order: a row's sum runs in one order whatever rows share the forward, and
        an expert's matmuls, run once for the rows that chose it, compute each row alone."""
        assert self.experts is not None and self.router is not None
        k = self.experts_per_token
        # the router stays a float matrix (as llama.cpp keeps it): the float path's invariant kernel
        probs = torch.softmax(linear(x, self.router, self.router_bias).float(), dim=-1)  # [N, E]
        weights, chosen = probs.topk(k, dim=-1)  # [N, k], largest first
        if self.moe_renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype).reshape(-1)  # [N * k]: entry i is row i // k's rank i % k
        # The entries grouped by expert (a stable sort: rows ascending within each) and each
        # expert's count, read to the host once: each expert slices its entries (no per-expert
        # mask, nonzero or host read).
        order = torch.argsort(chosen.reshape(-1), stable=True)  # [N * k]
        counts = torch.bincount(chosen.reshape(-1), minlength=len(self.experts)).tolist()
        rows_of, ranks_of = order // k, order % k  # [N * k] each
        by_rank = x.new_zeros(k, x.shape[0], x.shape[1])  # [k, N, D]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            entries, rows, ranks = (t[start : start + count] for t in (order, rows_of, ranks_of))  # [n] each
            start += count
            out = self.experts[expert](x.index_select(0, rows), linear=linear, act=self.act)  # [n, D]
            by_rank[ranks, rows] = out * weights.index_select(0, entries)[:, None]
        total = by_rank[0]
        for rank in range(1, k):
            total = total + by_rank[rank]
        if self.shared_expert is not None:
            shared = self.shared_expert(x, linear=linear, act=self.act)  # [N, D]
            if self.shared_expert_gate is not None:
                gate = torch.sigmoid(linear(x, self.shared_expert_gate, None).float())  # [N, 1]
                shared = shared * gate.to(x.dtype)
            total = total + shared
        return total

    def _with_adapters(
        self, out: torch.Tensor, x: torch.Tensor, site: str, linear: LinearFn, lora: LoRABatch | None
    ) -> torch.Tensor:  # out [N, M] (site's output for x [N, K]) with its rows' LoRA deltas added
        if lora is None:
            return out
        return lora.add_deltas(out, x, layer=self.layer_index, site=site, linear=linear)

    def _output_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, linear: LinearFn
    ) -> torch.Tensor:  # [N, K] -> [N, D], the layer's output width
        if self.reduce_output is None:
            return linear(x, weight, bias)
        out = self.reduce_output(linear(x, weight, None))  # partial sums over this rank's K slice
        return out if bias is None else out + bias

    def _attend(self, q: torch.Tensor, attn: AttentionBatch, cache: KVCache) -> torch.Tensor:
        # q [N, H, hd] -> [N, H * hd], each sequence over its cached keys with its mask
        num_tokens = q.shape[0]
        out = q.new_empty(num_tokens, self.num_heads, self.head_dim)
        for seq in attn.sequences:
            kv_start = seq.sliding_kv_start if self.is_sliding else seq.full_kv_start
            mask = seq.sliding_mask if self.is_sliding else seq.full_mask
            keys, values = cache.read(self.layer_index, slot=seq.slot, start=kv_start, end=seq.kv_end)
            if keys.dtype != q.dtype:  # a float16 cache (kv_cache_dtype) beside float compute
                keys, values = keys.to(q.dtype), values.to(q.dtype)
            out[seq.row_start : seq.row_end] = attention(
                q[seq.row_start : seq.row_end],
                keys,
                values,
                mask=mask,
                scale=self.attn_scale,
                softcap=self.attn_softcap,
                sinks=self.sinks,
            )
        return out.view(num_tokens, self.q_size)


class Decoder(torch.nn.Module):
    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, max_len: int):
        super().__init__()
        self.config = config
        self.dtype = dtype
        c = config
        self.embed_tokens = _weight(c.vocab_size, c.hidden_size, dtype)
        self.layers = torch.nn.ModuleList(DecoderLayer(c, layer_index=i, dtype=dtype) for i in range(c.num_layers))
        self.norm = RMSNorm((c.hidden_size,), eps=c.rms_norm_eps, unit_offset=c.norm_unit_offset, dtype=dtype)
        self.lm_head = None if c.tie_word_embeddings else _weight(c.vocab_size, c.hidden_size, dtype)
        self.rotary = torch.nn.ModuleDict(
            {
                key: RotaryTable(c.rope_for(key), head_dim=c.head_dim, max_len=max_len, dtype=dtype)
                for key in c.rotary_keys
            }
        )
        # The reference rounds the embedding scale to the model dtype first.
        self.embed_scale = (
            None if c.embed_scale is None else torch.tensor(c.embed_scale, dtype=dtype, device="cpu").item()
        )
        self.linear: LinearFn = F.linear
        self._fused_stack: FusedStack | None = None  # every layer in one C++ call per forward
        # Set where requests may run LoRA adapters: every forward then computes its layers one way
        # (the stack, which takes adapters, or the torch layers), so a row's bits never depend on
        # whether an adapter's rows share its forward.
        self.lora_enabled = False

    @property
    def lm_head_weight(self) -> torch.Tensor | QuantizedWeight:  # [V, D]
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:  # [N] -> [N, D]
        hidden = embedding_rows(self.embed_tokens, token_ids)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        return hidden

    def compute_logits(self, hidden: torch.Tensor, *, buffer: LogitsBuffer | None = None) -> torch.Tensor:
        """[M, D] -> [M, V]; a quantized LM head on the CPU writes into `buffer`'s rows when given."""
        weight = self.lm_head_weight
        # Rows are taken only for the path that writes into them: a float LM head would grow the
        # buffer (up to its cap) and leave it unused.
        out = None
        if buffer is not None and hidden.is_cpu and isinstance(weight, QuantizedWeight):
            out = buffer.rows(hidden.shape[0])  # None past its cap
        logits = self.lm_head_matmul(self.norm(hidden), weight, out=out)
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def lm_head_matmul(
        self,
        normed: torch.Tensor,  # [M, D], the final norm's output
        weight: torch.Tensor | QuantizedWeight,  # [V, D] (a tensor-parallel rank: its shard's rows)
        *,
        out: torch.Tensor | None = None,  # [M, V] float32 for a quantized head on the CPU
    ) -> torch.Tensor:  # [M, V]
        """The LM head's matmul, without the soft cap: a quantized head on the CPU takes the
        activation levels that lm_head_activation_levels picks for it (every target-logits path
        goes through here, so they all compute the same bits)."""
        if normed.is_cpu and isinstance(weight, QuantizedWeight):
            return quant_linear(normed, weight, None, out=out, activation_levels=lm_head_activation_levels(weight))
        return self.linear(normed, weight, None)

    @torch.inference_mode()
    def logits_of_tokens(self, hidden: torch.Tensor, token_ids: list[list[int]]) -> list[torch.Tensor]:
        """Row i's logits of the tokens token_ids[i] only (hidden [M, D], the last layer's output):
        dot products with their dequantized LM-head rows, one row at a time, so a row's values
        depend on its own tokens alone (the same whichever rows share the call)."""
        normed = self.norm(hidden)  # [M, D]
        cap = self.config.final_logit_softcapping
        out = []
        for row, ids in zip(normed, token_ids):
            weights = embedding_rows(self.lm_head_weight, torch.tensor(ids, device=hidden.device))  # [k, D]
            logits = torch.mv(weights.to(row.dtype), row).float()  # [k]
            out.append(torch.tanh(logits / cap) * cap if cap else logits)
        return out

    def _stack_for(self, hidden: torch.Tensor) -> FusedStack | None:
        """The one-call stack of every layer where each layer runs the one-call C++ layer (see
        DecoderLayer._fused_weights_for), rebuilt when a layer's arguments were; else None."""
        if not fused_layer_available():  # once per forward, not per layer: it reads the environment
            return None
        layers = []
        for layer in self.layers:
            fused = layer._fused_weights_for(hidden, kernel_ready=True)
            if fused is None:
                return None
            layers.append(fused)
        stack = self._fused_stack
        if stack is None or not stack.built_from(layers):
            stack = self._fused_stack = FusedStack(layers)
        return stack

    def _stack_forward(
        self,
        stack: FusedStack,
        hidden: torch.Tensor,  # [N, D]
        *,
        rotary: dict[str, tuple[torch.Tensor, torch.Tensor]],  # per rotary key: cos, sin [N, 1, hd]
        attn: AttentionBatch,
        cache: KVCache,
        layers: range,
        capture_layers: tuple[int, ...],
        lora: LoRABatch | None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """`layers` of the stack in one call: what the loop over DecoderLayer.forward computes."""
        names = list(rotary)
        rotary_kind = [names.index(layer.rotary_key) for layer in self.layers]
        keys = [(cache.group_of_layer[i], layer.is_sliding) for i, layer in enumerate(self.layers)]
        distinct = list(dict.fromkeys(keys))  # (cache group, sliding) kinds, first layer of each first
        capture = [i for i in capture_layers if i in layers]
        out, captured = stack.forward(
            hidden,
            start=layers.start,
            end=layers.stop,
            rotary_kind=rotary_kind,
            sequence_kind=[distinct.index(key) for key in keys],
            rotary=[rotary[name] for name in names],
            sequences=[attn.fused_sequences(cache, layer=keys.index(key), sliding=key[1]) for key in distinct],
            cache_keys=cache.keys,
            cache_values=cache.values,
            capture=capture,
            lora=lora,
        )
        return out, dict(zip(capture, captured))

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor | None,  # [N]
        positions: torch.Tensor,  # [N] absolute positions
        *,
        attn: AttentionBatch,
        cache: KVCache,
        hidden_states: torch.Tensor | None = None,  # [N, D] input when start_layer > 0
        start_layer: int = 0,
        end_layer: int | None = None,  # exclusive
        capture_layers: tuple[int, ...] = (),
        logits_rows: torch.Tensor | None = None,  # [M] rows that need logits; None = no logits
        logits_buffer: LogitsBuffer | None = None,  # where the logits may be written (valid until its next use)
        lora: LoRABatch | None = None,  # the rows that run LoRA adapters
    ) -> ForwardOutput:
        end_layer = self.config.num_layers if end_layer is None else end_layer
        if not 0 <= start_layer < end_layer <= self.config.num_layers:
            raise ValueError(f"invalid layer range [{start_layer}, {end_layer})")
        if start_layer == 0:
            hidden = self.embed(token_ids)
        elif hidden_states is None:
            raise ValueError("start_layer > 0 needs hidden_states from layer start_layer - 1")
        else:
            hidden = hidden_states
        rotary = {name: table.lookup(positions) for name, table in self.rotary.items()}
        captured: dict[int, torch.Tensor] = {}
        stack = self._stack_for(hidden)
        if stack is not None:
            hidden, captured = self._stack_forward(
                stack,
                hidden,
                rotary=rotary,
                attn=attn,
                cache=cache,
                layers=range(start_layer, end_layer),
                capture_layers=capture_layers,
                lora=lora,
            )
        else:
            for index in range(start_layer, end_layer):
                layer = self.layers[index]
                layer_rotary = rotary[layer.rotary_key]
                hidden = layer(
                    hidden,
                    rotary=layer_rotary,
                    attn=attn,
                    cache=cache,
                    linear=self.linear,
                    lora=lora,
                    allow_fused=not self.lora_enabled,
                )
                if index in capture_layers:
                    captured[index] = hidden
        logits = None
        if logits_rows is not None:
            if end_layer != self.config.num_layers:
                raise ValueError("logits need the full stack of layers (end_layer = num_layers)")
            logits = self.compute_logits(hidden[logits_rows], buffer=logits_buffer)
        return ForwardOutput(logits=logits, hidden_states=hidden, captured=captured)
