"""The tiny V4.1 model shared by the backbone recipe and the DSpark recipe.

- :func:`hf_config` / :func:`model_config`: the ``config.json`` dict and its ``ModelConfig``.
- :func:`build_model`: a :class:`DeepseekV41Model` with unquantised (dense) weights, seeded
  initialisation, trainable parameters marked ``requires_grad``, Engram map bound.
- :func:`load_tokens` / :func:`batches`: the uint16 token files and deterministic windows.
- :func:`training_batch`: one reusable ``ForwardBatch`` + ``ModelCache`` + metadata for
  fixed-shape training batches (every row a prefill from position 0).
- :func:`fake_quantise_`: round every weight exactly as the export stores it.
- :func:`save_backbone` / :func:`load_backbone`: ``backbone.pt`` (state dict + config dict).

The folder is the package ``examples.tiny_model``: its scripts run from the repository root as
``python -m examples.tiny_model.<script>`` and import each other relatively.
"""

from __future__ import annotations

import copy
import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deepinfer.engine.model.cache import CacheLayout, ModelCache
from deepinfer.engine.model.config import ModelConfig
from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.model.metadata import AttentionMetadata, ForwardBatch, build_metadata
from deepinfer.engine.model.model_v41 import DeepseekV41Model
from deepinfer.engine.testing import tiny_v41_config, with_quantization

HERE = Path(__file__).resolve().parent
TOKENIZER_DIR = HERE / "tokenizer"
DATA_DIR = HERE / "data"
EVAL_TOKENS = 262_144  # validation targets every model is scored on (first tokens of the split)
TRAIN_SEQ_LEN = 512  # the training length; index_topk and the candidate filter cover it
CACHE_BLOCK_SIZE = 128

# The V4.1 schedule scaled to 8 layers: 0-1 SWA (Engram at 1), 2-4 ratio 2 (kv + index source
# 2, index source 4), 5-7 ratio 1 (kv + index + candidate source 5, index source 7); then three
# ratio-0 DSpark stages tapping the streams entering layers 5, 6, 7.
TEXT_CONFIG: dict[str, Any] = {
    "vocab_size": 8192,
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 128,
    "o_groups": 2,
    "o_lora_rank": 64,
    "sliding_window": 128,
    "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1, 0, 0, 0],
    "kv_source_layer_ids": [2, 5],
    "index_source_layer_ids": [2, 4, 5, 7],
    "candidate_source_layer_id": 5,
    "candidate_topk_blocks": 64,  # 64 blocks of 8 = 512 positions: nothing masked at 512
    "candidate_block_size": 8,
    "index_n_heads": 2,
    "index_head_dim": 32,
    "index_topk": TRAIN_SEQ_LEN,  # >= the ratio-1 entries at the training length
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "engram_layer_ids": [1],
    "engram_max_ngram_size": 3,
    "engram_vocab_size": 4099,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_pad_token_id": 2,
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 16,
    "dspark_target_layer_ids": [5, 6, 7],
    "dspark_markov_rank": 64,
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 2,
    "max_position_embeddings": 4096,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
}

# Parameters no gradient reaches: the indexer sits behind a top-k selection (and at the
# training length selects every entry), the router bias only chooses experts (trained by the
# load-balancing update instead), bias_vl serves image tokens only.
NON_DIFFERENTIABLE = re.compile(r"(\.indexer\.|\.gate\.bias$|\.gate\.bias_vl$)")


@functools.cache
def _token_map() -> torch.Tensor:
    """The Engram compressed token map of the tiny tokenizer ``[vocab]`` int64."""
    from deepinfer.engine.model.engram_hashing import compressed_token_map

    return compressed_token_map(_tokenizer())


def _engram_compressed_vocab_size() -> int:
    return int(_token_map().max()) + 1


@functools.cache
def _tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))


def hf_config(quantized: bool = True) -> dict[str, Any]:
    """The ``config.json`` dict (V4.1 nested layout); ``quantized`` adds the official
    ``quantization_config`` (FP8 32x32 blocks, FP4 experts)."""
    text = copy.deepcopy(TEXT_CONFIG)
    text["engram_compressed_vocab_size"] = _engram_compressed_vocab_size()
    raw = tiny_v41_config(vision=False, **text)
    raw["architectures"] = ["DeepseekV41ForCausalLM"]
    return with_quantization(raw, quantized)


def model_config(*, numerics: str = "float") -> ModelConfig:
    """The unquantised (dense) ``ModelConfig``; training runs ``numerics="float"``, ``"model"``
    adds the model's cache and indexer rounding (a dense model has no FP8 / FP4 linears)."""
    return parse_config(hf_config(quantized=False), numerics=numerics)


def build_model(
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    include_mtp: bool = False,
    *,
    seed: int = 0,
    numerics: str = "float",
) -> DeepseekV41Model:
    """The tiny model with dense weights, initialised from ``seed``; every float parameter a
    gradient can reach has ``requires_grad=True`` (see :data:`NON_DIFFERENTIABLE`)."""
    config = model_config(numerics=numerics)
    model = DeepseekV41Model(config, dtype=dtype, device=device, include_mtp=include_mtp)
    initialise_(model, seed)
    for name, p in model.named_parameters():
        p.requires_grad_(p.is_floating_point() and not NON_DIFFERENTIABLE.search(name))
    model.bind_engram(_token_map())
    return model


def initialise_(model: DeepseekV41Model, seed: int) -> None:
    """GPT-style init: N(0, 0.02) weights, residual outputs scaled by 1/sqrt(2 L), unit norms;
    mHC starts near identity (pre 0.5, post 1, comb diagonal-heavy), sinks and biases zero."""
    generator = torch.Generator().manual_seed(seed)
    num_layers = model.config.num_layers
    nc = model.config.hc_mult
    with torch.no_grad():
        for name, p in model.named_parameters():
            value = _initial_value(name, tuple(p.shape), nc, num_layers, generator)
            if value is not None:
                p.copy_(value.to(p.dtype))


def _initial_value(name, shape, nc, num_layers, generator) -> torch.Tensor | None:
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("tid2eid"):
        return None
    if name.endswith(("norm.weight", "q_weight", "k_weight")) or leaf == "norm":
        return torch.ones(shape)
    if re.search(r"hc_\w+_base$", name):
        base = torch.zeros(shape)
        base[2 * nc :] = (2.0 * torch.eye(nc)).flatten()  # comb logits: favour the diagonal
        return base
    if re.search(r"hc_\w+_scale$", name):
        return torch.ones(shape)
    if re.search(r"hc_\w+_fn$", name):
        return torch.randn(shape, generator=generator) * 0.005
    if leaf in ("attn_sink", "bias", "bias_vl") or "confidence_head" in name:
        return torch.zeros(shape)
    std = 0.02
    if re.search(r"(wo_b|w2)\.weight$", name):
        std /= math.sqrt(2 * num_layers)
    return torch.randn(shape, generator=generator) * std


def trainable_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


# -- data ----------------------------------------------------------------------------------


def load_tokens(split: str, data_dir: str | Path = DATA_DIR) -> np.ndarray:
    """``data/{split}.bin`` as a uint16 array (memory-mapped)."""
    path = Path(data_dir) / f"{split}.bin"
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: run prepare_corpus.py and train_tokenizer.py (README steps 1-2)"
        )
    return np.memmap(path, dtype=np.uint16, mode="r")


def batches(tokens: np.ndarray, batch: int, seq_len: int, seed: int, step: int) -> np.ndarray:
    """Step ``step``'s ``[batch, seq_len + 1]`` int64 windows at random offsets; depends only
    on (seed, step), so a run can resume or be repeated exactly."""
    if len(tokens) < seq_len + 2:
        raise ValueError(f"{len(tokens)} tokens: need at least seq_len + 2 = {seq_len + 2}")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch)
    return np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int64)


# -- fixed-shape forward batches -----------------------------------------------------------


@dataclass
class TrainingBatch:
    """A reusable batch: ``batch.input_ids`` is overwritten in place each step; positions,
    index lists (``metadata``) and the cache never change shape."""

    batch: ForwardBatch
    cache: ModelCache
    metadata: AttentionMetadata

    def load(self, input_ids: torch.Tensor) -> None:
        """Copy ``[B, S]`` (or flat) token ids in (non-blocking) and cut the cache's autograd
        history from the previous step."""
        self.batch.input_ids.copy_(input_ids.reshape(-1), non_blocking=True)
        for key, t in self.cache.tensors.items():
            self.cache.tensors[key] = t.detach()


def training_batch(
    config: ModelConfig,
    batch: int,
    seq_len: int,
    device: torch.device | str,
    cache_dtype: torch.dtype = torch.float32,
) -> TrainingBatch:
    """``batch`` sequences of ``seq_len`` tokens, each a prefill from position 0 in its own
    state slot and blocks; logits for every token."""
    device = torch.device(device)
    blocks_per_seq = -(-seq_len // CACHE_BLOCK_SIZE)
    layout = CacheLayout(
        num_blocks=batch * blocks_per_seq, num_slots=batch, block_size=CACHE_BLOCK_SIZE
    )
    fb = ForwardBatch(
        input_ids=torch.zeros(batch * seq_len, dtype=torch.int64, device=device),
        positions=torch.arange(seq_len, device=device).repeat(batch),
        cu_seqlens_q=(torch.arange(batch + 1, device=device) * seq_len).to(torch.int32),
        seq_lens=torch.full((batch,), seq_len, dtype=torch.int32, device=device),
        block_tables=torch.arange(batch * blocks_per_seq, device=device, dtype=torch.int32).view(
            batch, blocks_per_seq
        ),
        state_slots=torch.arange(batch, dtype=torch.int32, device=device),
    )
    # float rows whatever the numerics: training backpropagates through the cache
    cache = ModelCache(config, layout, dtype=cache_dtype, device=device, packed=False)
    metadata = build_metadata(fb, config, layout, cache.ring_size)
    return TrainingBatch(fb, cache, metadata)


def forward_batch(batch: int, seq_len: int, device, config: ModelConfig | None = None):
    """``(ForwardBatch, ModelCache)`` of :func:`training_batch` (metadata: ``.metadata``)."""
    tb = training_batch(config or model_config(), batch, seq_len, device)
    return tb.batch, tb.cache


def token_nll(
    model: DeepseekV41Model, tb: TrainingBatch, windows: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    """Next-token cross entropy of ``windows`` ``[B, S + 1]`` (inputs ``[:, :-1]``, targets
    ``[:, 1:]``) through ``model.forward_step``; fp32 scalar (``mean`` or ``sum``)."""
    tb.load(windows[:, :-1])
    logits = model.forward_step(tb.batch, tb.cache, tb.metadata).logits
    targets = windows[:, 1:].reshape(-1).to(logits.device)
    return torch.nn.functional.cross_entropy(logits, targets, reduction=reduction)


@torch.no_grad()
def eval_windows(tokens: np.ndarray, seq_len: int, max_tokens: int = EVAL_TOKENS) -> np.ndarray:
    """The first ``max_tokens`` targets of ``tokens`` as ``[n, seq_len + 1]`` int64 windows
    (window ``i`` starts at ``i * seq_len``: each target is predicted once, with the context
    its window gives it)."""
    n = min(max_tokens, len(tokens) - 1) // seq_len
    if n == 0:
        raise ValueError(f"{len(tokens)} tokens: fewer than one window of {seq_len + 1}")
    index = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return np.asarray(tokens[index], dtype=np.int64)


@torch.no_grad()
def mean_nll(model: DeepseekV41Model, windows: np.ndarray, batch: int, device) -> float:
    """Mean next-token NLL (nats) over all targets of ``windows`` ``[n, S + 1]``."""
    n, seq_len = windows.shape[0], windows.shape[1] - 1
    cache_dtype = model.embed.weight.dtype
    full = training_batch(model.config, min(batch, n), seq_len, device, cache_dtype)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for start in range(0, n, batch):
        chunk = torch.from_numpy(windows[start : start + batch]).to(device)
        tb = full
        if chunk.shape[0] != full.batch.state_slots.shape[0]:
            tb = training_batch(model.config, chunk.shape[0], seq_len, device, cache_dtype)
        total += token_nll(model, tb, chunk, reduction="sum").double()
    return float(total) / (n * seq_len)


# -- quantisation as exported ----------------------------------------------------------------


def fake_quantise_(model: torch.nn.Module, config: dict[str, Any] | None = None) -> None:
    """Replace every weight by the value the exported checkpoint stores: FP8 e4m3 32x32 blocks
    (ue8m0), FP4 e2m1 experts (ue8m0 per 32), FP8 Engram rows (per 32), BF16 where the format
    stores BF16 (F32 tensors unchanged). Names are the model's (= official) names."""
    from .quantise import quant_groups, swap_in_quantised

    swap_in_quantised(quant_groups(model, config or hf_config(quantized=True)))


def stored_value(name: str, value: torch.Tensor, stored_dtype, parsed: ModelConfig):
    """fp32 value of ``value`` after the round trip through its on-disk format, one tensor at
    a time through the kernels' own quantisers (the reference :func:`fake_quantise_` matches)."""
    import deepinfer.kernels as K
    from deepinfer.engine.checkpoint.inventory import ENGRAM_SCALE_BLOCK

    v = value.float()
    if stored_dtype == torch.float8_e4m3fn:
        block = (1, ENGRAM_SCALE_BLOCK) if name.endswith("engram.embed.weight") else None
        codes, scale = K.fp8_block_quant(v, block or parsed.weight_block)
        return K.fp8_block_dequant(codes, scale, block or parsed.weight_block, out_dtype=v.dtype)
    if stored_dtype == torch.int8:
        packed, scale = K.fp4_quant(v, 32)
        return K.fp4_dequant(packed, scale, 32, out_dtype=v.dtype)
    return v.to(stored_dtype).float()


# -- backbone files --------------------------------------------------------------------------


def save_backbone(model: torch.nn.Module, path: str | Path, extra: dict | None = None) -> Path:
    """``backbone.pt``: ``{"state_dict": fp32 backbone tensors (no mtp.*), "config": the
    config.json dict, "extra": run facts}``."""
    state = {
        k: v.detach().cpu().clone()
        for k, v in model.state_dict().items()
        if not k.startswith("mtp.")
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {"state_dict": state, "config": hf_config(quantized=True), "extra": extra or {}}, path
    )
    return path


def load_backbone(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    include_mtp: bool = False,
    *,
    numerics: str = "float",
) -> DeepseekV41Model:
    """The model of ``backbone.pt`` (``mtp.*`` keep their fresh initialisation when built)."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    model = build_model(device, dtype, include_mtp, numerics=numerics)
    missing, unexpected = model.load_state_dict(saved["state_dict"], strict=False)
    missing = [k for k in missing if not k.startswith("mtp.")]
    if missing or unexpected:
        raise ValueError(f"{path}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model
