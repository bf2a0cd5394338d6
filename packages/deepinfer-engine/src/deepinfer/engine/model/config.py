"""Model configuration of the DeepSeek-V4 family: the frozen :class:`ModelConfig` the model
code reads, its validation and the schedule derived from it (layer kinds, shared sources).
Reading a ``config.json`` into it is :mod:`deepinfer.engine.model.config_parsing`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

V4_ARCH = "DeepseekV4ForCausalLM"
V41_ARCH = "DeepseekV41ForCausalLM"
ARCHITECTURES = (V4_ARCH, V41_ARCH)
NUMERICS = ("model", "float")  # see ModelConfig.numerics
# V4 tells its layer kinds apart by ratio, as its flat ``compress_ratios`` does.
V4_CSA_RATIO = 4
V4_RATIO_RULE = "0 sliding window, 4 compressed sparse (CSA), any other ratio heavily compressed"


class ConfigError(ValueError):
    """A config.json field is missing, of the wrong kind or inconsistent with the others."""


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters (used only by layers with compression ratio > 0)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float


@dataclass(frozen=True)
class QuantConfig:
    """How weights are stored: FP8 e4m3 block-scaled linears and (optionally) FP4 experts."""

    weight_block_size: tuple[int, int]
    scale_fmt: str = "ue8m0"
    expert_dtype: str = "fp8"  # "fp4": routed experts packed e2m1, ue8m0 scale per 32


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model code reads. Layer lists cover the backbone layers only."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    mtp_compress_ratios: tuple[int, ...]
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_hash_layers: int
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    num_nextn_predict_layers: int
    quantization: QuantConfig | None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    pad_token_id: int | None = None
    # V4.1 (CSA2 shared KV, candidate pre-filter, Engram, DSpark, vision)
    kv_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()
    candidate_source_layer_id: int | None = None
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    gate_temp: float = 1.0
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 0
    engram_vocab_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_pad_token_id: int | None = None
    engram_compressed_vocab_size: int = 0
    dspark_block_size: int = 0
    dspark_noise_token_id: int | None = None
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 0
    dspark_n_routed_experts: int | None = None
    dspark_num_experts_per_tok: int | None = None
    dspark_confidence_temperature: float = 1.0  # confidence = sigmoid(logit / temperature)
    image_token_id: int | None = None
    vision_config: Mapping[str, Any] | None = field(default=None, compare=False)
    # "model": the roundings the model defines (cache and indexer formats, FP8 inputs of FP8 /
    # FP4 linears; :mod:`.variant`); "float": none of them, a pure floating-point debug path.
    numerics: str = "model"

    def __post_init__(self) -> None:
        _validate(self)

    # -- derived schedule -------------------------------------------------------------------
    @property
    def is_v41(self) -> bool:
        return self.architecture == V41_ARCH

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    def layer_kind(self, layer_id: int) -> str:
        """``swa``, ``csa`` (ratio 4), ``hca`` (any other ratio > 0), or V4.1 ``c1`` / ``c2``."""
        ratio = self.compress_ratios[layer_id]
        if ratio == 0:
            return "swa"
        if self.is_v41:
            return f"c{ratio}"
        return "csa" if ratio == V4_CSA_RATIO else "hca"

    def is_hash_layer(self, layer_id: int) -> bool:
        return layer_id < self.num_hash_layers

    def kv_source_of(self, layer_id: int) -> int | None:
        """The layer whose compressed cache ``layer_id`` attends to (itself in V4)."""
        if self.compress_ratios[layer_id] == 0:
            return None
        if not self.is_v41:
            return layer_id
        return max(s for s in self.kv_source_layer_ids if s <= layer_id)

    def index_source_of(self, layer_id: int) -> int | None:
        """The layer whose indexer chooses ``layer_id``'s compressed entries (None: all of them)."""
        kind = self.layer_kind(layer_id)
        if kind in ("swa", "hca"):
            return None
        if not self.is_v41:
            return layer_id
        return max(s for s in self.index_source_layer_ids if s <= layer_id)

    def owns_compressor(self, layer_id: int) -> bool:
        return self.kv_source_of(layer_id) == layer_id

    def owns_indexer(self, layer_id: int) -> bool:
        return self.index_source_of(layer_id) == layer_id

    @property
    def weight_block(self) -> tuple[int, int] | None:
        return None if self.quantization is None else self.quantization.weight_block_size

    @property
    def num_mtp_layers(self) -> int:
        return len(self.mtp_compress_ratios)

    def with_overrides(self, **changes: Any) -> ModelConfig:
        return replace(self, **changes)


def _fail(field_name: str, value: Any, expected: str) -> None:
    raise ConfigError(f"config field {field_name!r} = {value!r}: expected {expected}")


def _validate(c: ModelConfig) -> None:
    if c.architecture not in ARCHITECTURES:
        _fail("architectures", c.architecture, f"one of {ARCHITECTURES}")
    if c.numerics not in NUMERICS:
        _fail("numerics", c.numerics, f"one of {NUMERICS}")
    if len(c.compress_ratios) != c.num_layers:
        _fail("compress_ratios", c.compress_ratios, f"{c.num_layers} backbone entries")
    if c.is_v41:
        bad = sorted({r for r in c.compress_ratios if r not in (0, 1, 2)})
        if bad:
            _fail("compress_ratios", bad, f"ratios in [0, 1, 2] for {c.architecture}")
    else:
        # The compressor's math holds for any window; only CSA overlaps (spec 2.3). The KV block
        # size must be a multiple of every ratio (checked where the block size is known).
        bad = sorted({r for r in c.compress_ratios if r < 0})
        if bad:
            _fail("compress_ratios", bad, f"ratios >= 0 for {c.architecture} ({V4_RATIO_RULE})")
    if c.rope_head_dim % 2 or not 0 < c.rope_head_dim <= c.head_dim:
        _fail("qk_rope_head_dim", c.rope_head_dim, f"an even number <= head_dim {c.head_dim}")
    if (c.num_heads * c.head_dim) % c.o_groups:
        _fail("o_groups", c.o_groups, "a divisor of num_attention_heads * head_dim")
    if c.num_experts_per_tok > c.n_routed_experts:
        _fail("num_experts_per_tok", c.num_experts_per_tok, "<= n_routed_experts")
    if c.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
        _fail("scoring_func", c.scoring_func, "sqrtsoftplus, sigmoid or softmax")
    if c.num_hash_layers > c.num_layers:
        _fail("num_hash_layers", c.num_hash_layers, f"<= num_hidden_layers {c.num_layers}")
    if any(not 0 <= i < c.num_layers for i in c.dspark_target_layer_ids):
        _fail("dspark_target_layer_ids", c.dspark_target_layer_ids,
              f"backbone layer ids < num_hidden_layers {c.num_layers}")  # fmt: skip
    if c.is_v41:
        _validate_v41(c)


def _validate_v41(c: ModelConfig) -> None:
    compressed = [i for i, r in enumerate(c.compress_ratios) if r > 0]
    if compressed and (not c.kv_source_layer_ids or c.kv_source_layer_ids[0] > compressed[0]):
        _fail(
            "kv_source_layer_ids", c.kv_source_layer_ids, f"a source at or before {compressed[0]}"
        )
    for name, ids in (
        ("kv_source_layer_ids", c.kv_source_layer_ids),
        ("index_source_layer_ids", c.index_source_layer_ids),
    ):
        for i in ids:
            if not 0 <= i < c.num_layers or c.compress_ratios[i] == 0:
                _fail(name, ids, "ids of backbone layers with compress ratio > 0")
    if compressed and (not c.index_source_layer_ids or c.index_source_layer_ids[0] > compressed[0]):
        _fail("index_source_layer_ids", c.index_source_layer_ids, "a source before every use")
    for i in compressed:
        for source in (c.kv_source_of(i), c.index_source_of(i)):
            if c.compress_ratios[source] != c.compress_ratios[i]:
                _fail(
                    "compress_ratios", c.compress_ratios, f"layer {i} to share its sources' ratio"
                )
    cand = c.candidate_source_layer_id
    if cand is not None and cand not in c.index_source_layer_ids:
        _fail("candidate_source_layer_id", cand, "one of index_source_layer_ids")
    if cand is not None:
        later = [i for i in c.index_source_layer_ids if i > cand]
        if any(c.compress_ratios[i] != c.compress_ratios[cand] for i in later):
            _fail("index_source_layer_ids", later, f"the candidate source's ratio after {cand}")
    if len(c.engram_num_embeddings) not in (0, len(c.engram_layer_ids)):
        _fail("engram_num_embeddings", c.engram_num_embeddings, "one entry per engram layer")
