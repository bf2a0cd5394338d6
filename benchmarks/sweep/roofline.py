"""Decode and prefill rooflines for a DeepSeek-V4-family config on one device.

The arithmetic of ``shared/specs/performance.md`` section 4, for the layer count actually used:

- bytes per decode step = weights every step reads (attention, shared expert, router in FP8,
  LM head in bf16) + distinct experts hit ``E_d(B) = n * (1 - (1 - k/n)^B)`` per layer x bytes
  per expert (FP4 at 4.25 bits or FP8 at 1 byte + scales) + the KV each sequence reads;
- FLOPs per token = 2 x active linear parameters + attention core (2*2*heads*head_dim per entry
  attended) + the indexer scan;
- step time = max(bytes / copy bandwidth, FLOPs / tensor-core rate).

Prefill counts its FLOPs per layer (:meth:`ModelShape.prefill_layer_flops`): the GEMMs of the
layer's projections, shared and routed experts and router at the FP8 rate, and the attention
core and indexer products, averaged over the prompt's positions, at the bf16 rate; the LM head
runs for one row per prompt.

Plain Python: no torch, so it is unit-testable anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FP4_BYTES_PER_PARAM = 4.25 / 8  # e2m1 plus one ue8m0 scale per 32
FP8_BYTES_PER_PARAM = 1.0


@dataclass(frozen=True)
class ModelShape:
    """The sizes the roofline needs, read from a (text) config dict."""

    num_layers: int
    compress_ratios: tuple[int, ...]
    hidden_size: int
    vocab_size: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    num_experts: int
    experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    expert_bytes_per_param: float
    # V4.1: the layers that run the indexer; every compressed layer attends the top-k of a
    # shared cache. None (V4): ratio-4 layers index and select, ratio-128 ones attend all.
    index_source_layers: tuple[int, ...] | None = None

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        c = config.get("text_config", config)
        layers = int(c["num_hidden_layers"])
        ratios = tuple(int(r) for r in c.get("compress_ratios", [0] * layers)[:layers])
        fp4 = c.get("expert_dtype", "fp4") == "fp4"
        return cls(
            num_layers=layers, compress_ratios=ratios, hidden_size=c["hidden_size"],
            vocab_size=c["vocab_size"], num_heads=c["num_attention_heads"],
            head_dim=c["head_dim"], rope_dim=c["qk_rope_head_dim"], q_lora_rank=c["q_lora_rank"],
            o_groups=c["o_groups"], o_lora_rank=c["o_lora_rank"],
            sliding_window=c["sliding_window"], index_heads=c["index_n_heads"],
            index_head_dim=c["index_head_dim"], index_topk=c["index_topk"],
            num_experts=c["n_routed_experts"], experts_per_token=c["num_experts_per_tok"],
            num_shared_experts=c.get("n_shared_experts", 1),
            moe_intermediate_size=c["moe_intermediate_size"],
            expert_bytes_per_param=FP4_BYTES_PER_PARAM if fp4 else FP8_BYTES_PER_PARAM,
            index_source_layers=tuple(c["index_source_layer_ids"])
            if "index_source_layer_ids" in c else None,
        )  # fmt: skip

    # ---------------------------------------------------------------- parameters
    @property
    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def expert_bytes(self) -> float:
        return self.expert_params * self.expert_bytes_per_param

    def attention_params(self, ratio: int) -> int:
        """One layer's attention projections, plus its compressor and indexer when it has them."""
        d, h, hd = self.hidden_size, self.num_heads, self.head_dim
        params = d * self.q_lora_rank + self.q_lora_rank * h * hd + d * hd
        params += h * hd * self.o_lora_rank + self.o_groups * self.o_lora_rank * d
        if ratio:
            overlap = 2 if ratio == 4 else 1  # CSA compresses overlapping windows
            params += 2 * d * hd * overlap  # compressor kv + gate
        if ratio == 4:
            ih, ihd = self.index_heads, self.index_head_dim
            params += self.q_lora_rank * ih * ihd + d * ih + 2 * 2 * d * ihd
        return params

    @property
    def dense_params_per_step(self) -> int:
        """Parameters every step reads whatever the batch, except the LM head."""
        attention = sum(self.attention_params(r) for r in self.compress_ratios)
        shared = self.num_layers * self.num_shared_experts * self.expert_params
        router = self.num_layers * self.hidden_size * self.num_experts
        return attention + shared + router

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        routed = self.num_layers * self.num_experts * self.expert_params
        return self.dense_params_per_step + routed + 2 * self.lm_head_params

    @property
    def active_params(self) -> int:
        """Parameters one token multiplies with (no embedding lookup)."""
        routed = self.num_layers * self.experts_per_token * self.expert_params
        return self.dense_params_per_step + routed + self.lm_head_params

    # ---------------------------------------------------------------- per step
    def distinct_experts(self, num_tokens: int) -> float:
        """Expected distinct experts per layer hit by ``num_tokens`` tokens, uniform routing."""
        n, k = self.num_experts, self.experts_per_token
        return n * (1 - (1 - k / n) ** num_tokens)

    @property
    def kv_entry_bytes(self) -> float:
        """FP8 no-rope part with one fp32 scale per 64, bf16 rope part."""
        nope = self.head_dim - self.rope_dim
        return nope + nope / 64 * 4 + 2 * self.rope_dim

    @property
    def index_key_bytes(self) -> float:
        return self.index_head_dim / 2 + 4  # FP4 key plus a scale

    def kv_bytes_per_token(self, context: int) -> float:
        """KV bytes one decoding sequence reads per step at ``context`` tokens."""
        total = 0.0
        for ratio in self.compress_ratios:
            window = min(context, self.sliding_window)
            if ratio == 4:
                entries = window + min(self.index_topk, context // 4)
                total += (context // 4) * self.index_key_bytes
            elif ratio:
                entries = window + context // ratio
            else:
                entries = window
            total += entries * self.kv_entry_bytes
        return total

    def weight_bytes_per_step(self, num_tokens: int) -> float:
        dense = self.dense_params_per_step * FP8_BYTES_PER_PARAM + 2 * self.lm_head_params
        experts = self.num_layers * self.distinct_experts(num_tokens) * self.expert_bytes
        return dense + experts

    def attention_flops_per_token(self, context: int) -> float:
        per_entry = 2 * 2 * self.num_heads * self.head_dim
        total = 0.0
        for ratio in self.compress_ratios:
            window = min(context, self.sliding_window)
            if ratio == 4:
                total += (window + min(self.index_topk, context // 4)) * per_entry
                total += (context // 4) * self.index_heads * self.index_head_dim * 2
            elif ratio:
                total += (window + context // ratio) * per_entry
            else:
                total += window * per_entry
        return total

    def flops_per_token(self, context: int) -> float:
        return 2 * self.active_params + self.attention_flops_per_token(context)

    def prefill_layer_flops(
        self, ratio: int, prompt_len: int, layer: int | None = None
    ) -> dict[str, float]:
        """FLOPs per prompt token of one layer of compression ``ratio`` (0: sliding window
        only), averaged over the positions of a ``prompt_len``-token prompt (see
        :meth:`prefill_layer_work`)."""
        work = self.prefill_layer_work(ratio, 0, prompt_len, layer)
        return {key: value / prompt_len for key, value in work.items()}

    def prefill_layer_work(
        self, ratio: int, start: int, end: int, layer: int | None = None
    ) -> dict[str, float]:
        """FLOPs of layer ``layer`` (compression ``ratio``) for the prompt tokens at positions
        ``start .. end - 1`` (a chunk): ``gemm`` (every linear a token passes), ``attention``
        (2 products per head per entry attended: the window, then the top-k compressed
        entries, or all of them in a V4 ratio-128 layer) and ``indexer`` (its scan of every
        compressed entry: V4's ratio-4 layers, V4.1's index sources, counted whole although
        V4.1's later sources score only the candidate blocks)."""
        experts = self.num_shared_experts + self.experts_per_token
        gemm = 2 * (self.attention_params(ratio) + experts * self.expert_params
                    + self.hidden_size * self.num_experts)  # fmt: skip
        v41 = self.index_source_layers is not None
        selects = ratio == 4 or (v41 and ratio > 0)
        indexes = layer in self.index_source_layers if v41 else ratio == 4

        def entries(n: int) -> float:  # summed over the tokens that see 1 .. n tokens
            total = _sum_min_position(n, self.sliding_window)
            if selects:
                total += _sum_min_compressed(n, ratio, self.index_topk)
            elif ratio:
                total += _sum_compressed(n, ratio)
            return total

        scanned = _sum_compressed(end, ratio) - _sum_compressed(start, ratio) if indexes else 0
        return {"gemm": gemm * (end - start),
                "attention": 2 * 2 * self.num_heads * self.head_dim * (entries(end) - entries(start)),
                "indexer": 2 * self.index_heads * self.index_head_dim * scanned}  # fmt: skip


def _sum_min_position(length: int, cap: int) -> float:
    """``sum(min(n, cap) for n in 1..length)``: window entries of each token, summed."""
    if length <= cap:
        return length * (length + 1) / 2
    return cap * (cap + 1) / 2 + (length - cap) * cap


def _sum_compressed(length: int, ratio: int) -> int:
    """``sum(n // ratio for n in 1..length)``: compressed entries visible, summed."""
    if length <= 0:
        return 0
    q, rem = divmod(length, ratio)
    return ratio * q * (q - 1) // 2 + q * (rem + 1)


def _sum_min_compressed(length: int, ratio: int, cap: int) -> int:
    """``sum(min(cap, n // ratio) for n in 1..length)``: the top-k of the visible, summed."""
    below = min(length, cap * ratio - 1)  # tokens that see fewer than cap entries
    return _sum_compressed(below, ratio) + cap * (length - below)


@dataclass(frozen=True)
class Device:
    """Measured ceilings: copy bandwidth (bytes/s), tensor-core (matmul) rate of the linear
    layers (FLOP/s) and, when known apart, the bf16 rate of the attention products."""

    bandwidth: float
    flops: float
    attention_flops: float | None = None


# The H200's rates measured on the lent machine (shared/specs/toolchain.md: copy, bf16 and FP8
# GEMMs at 8192^3): the ceilings of a breakdown made on another machine.
H200 = Device(bandwidth=4.25e12, flops=1449e12, attention_flops=786e12)


def decode_point(shape: ModelShape, device: Device, batch: int, context: int) -> dict[str, float]:
    """Ceiling for a decode step of ``batch`` sequences at ``context`` tokens each."""
    num_bytes = shape.weight_bytes_per_step(batch) + batch * shape.kv_bytes_per_token(context)
    t_mem = num_bytes / device.bandwidth
    t_comp = batch * shape.flops_per_token(context) / device.flops
    step = max(t_mem, t_comp)
    return {"batch": batch, "bytes": num_bytes, "t_mem_s": t_mem, "t_comp_s": t_comp,
            "step_s": step, "tok/s/user": 1 / step, "tok/s/gpu": batch / step}  # fmt: skip


def prefill_point(
    shape: ModelShape, device: Device, num_tokens: int, prompt_len: int
) -> dict[str, float]:
    """Ceiling for one step prefilling ``num_tokens`` tokens of prompts of ``prompt_len``: the
    FLOPs counted per layer (GEMMs at ``device.flops``, attention and indexer products at
    ``device.attention_flops``), or the weight bytes if they take longer."""
    num_prompts = max(1, num_tokens // max(prompt_len, 1))
    gemm = attention = 0.0
    for index, ratio in enumerate(shape.compress_ratios):
        layer = shape.prefill_layer_flops(ratio, prompt_len, index)
        gemm += num_tokens * layer["gemm"]
        attention += num_tokens * (layer["attention"] + layer["indexer"])
    gemm += num_prompts * 2 * shape.lm_head_params
    t_comp = gemm / device.flops + attention / (device.attention_flops or device.flops)
    t_mem = shape.weight_bytes_per_step(num_tokens) / device.bandwidth
    step = max(t_mem, t_comp)
    return {"tokens": num_tokens, "gemm_flops": gemm, "attention_flops": attention,
            "t_comp_s": t_comp, "t_mem_s": t_mem, "step_s": step,
            "tok/s/gpu": num_tokens / step}  # fmt: skip
