"""V4.1 logits against the transformers main-branch ``deepseek_v41`` port, imported from a
directory outside this repository (``--port DIR``: ``DIR/deepseek_v41/`` holds the port's
``configuration_`` and ``modeling_deepseek_v41.py``; its code is never part of this tree).

Random fp32 models with every V4.1 layer kind (ratio 0 / 2 / 1 layers, KV and index sources, a
re-indexing source, the candidate filter, Engram) run one prefill in both. With head sizes that
split into the rounding blocks ("active") both round the window KV, the compressed entries and
the indexer q / k; with sizes that do not ("inactive") neither does. Reported per case: argmax
agreement, mean and max |delta log-probability| over positions and vocabulary, the rounding
flips (elements whose rounded value differs between the two, with the input difference that
put them on either side of a boundary) and, to show the differences come from those flips
alone, the same metrics once our model takes the port's rounded values at every site.

Two more rows locate the fp32 gap that seeds the flips:

- ``port_layout``: our model with its attention reductions (softmax denominator, probabilities
  times values) taken over the port's dense key axis: the prefill's tokens in order, then the
  compressed entries in order, masked to our index lists, the sink as one more column. Every
  other op is ours. With it the whole model is bit-identical to the port, so the attention's
  summation layout is the only fp32 difference left.
- ``port_chunked``: the port against itself, the same tokens prefilled in two halves (its cache
  carried over) instead of at once. The port's own attention sums follow its call's key axis,
  so this is the spread the port's numerics have between two ways of running one sequence.
- ``port_perturbed`` (every element of the port's first hidden states one fp32 ulp up or down),
  ``port_perturbed_attn`` (the same on layer 0's attention output), ``port_perturbed_one`` (one
  element of the first hidden states one ulp) and ``port_threads1`` (the port on one thread):
  the port against itself under the smallest differences an fp32 implementation can have
  (``port_self``), the ceiling for any implementation not bit-identical to it.

    python -m benchmarks.fidelity.v41_port_parity --port PORT_DIR --out parity.json
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

import torch

from benchmarks.common import environment, print_table, write_json
from benchmarks.fidelity.port_self import PERTURBED, compare, flips, run_port, self_rows
from deepinfer.engine.checkpoint.transformers_names import from_transformers
from deepinfer.engine.model.cache import overlapped
from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.model.model import build_model
from deepinfer.engine.testing.configs import tiny_v41_config
from deepinfer.engine.testing.random_checkpoint import testing_tokenizer_for
from deepinfer.engine.testing.simple_runner import SimpleRunner
from deepinfer.kernels import registry
from deepinfer.kernels.reference.cache_rows import rows_of

LAYOUT = dict(
    num_hidden_layers=6,
    compress_ratios=[0, 2, 2, 2, 1, 1, 0, 0, 0],
    kv_source_layer_ids=[1, 4],
    index_source_layer_ids=[1, 3, 4, 5],  # 3 re-indexes against 1's keys
    candidate_source_layer_id=4,
    candidate_topk_blocks=4,
    candidate_block_size=8,
    index_topk=16,
    sliding_window=16,
    engram_layer_ids=[1, 3],
    dspark_target_layer_ids=[3, 4, 5],
    hidden_size=128,
    num_attention_heads=4,
    q_lora_rank=128,
    o_groups=2,
    o_lora_rank=64,
    index_n_heads=16,  # enough that no two entries tie at score 0 (ReLU) near the top k
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    hc_mult=4,
)
HEADS = {
    # the released model's head sizes: every rounding site splits into whole blocks
    "active": dict(head_dim=512, qk_rope_head_dim=64, index_head_dim=128),
    # no site splits (40 % 32, 40 % 16, 24 % 32): neither side rounds
    "inactive": dict(head_dim=40, qk_rope_head_dim=8, index_head_dim=24),
}


def _port(directory: str):
    sys.path.insert(0, directory)
    cfg = importlib.import_module("deepseek_v41.configuration_deepseek_v41")
    modeling = importlib.import_module("deepseek_v41.modeling_deepseek_v41")
    return cfg, modeling


def _config(heads: str) -> dict[str, Any]:
    return tiny_v41_config(vision=False, **LAYOUT, **HEADS[heads])


def _randomise(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Fan-in scaled weights, norms near one: activations of realistic size at any width."""
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if not t.is_floating_point():
                continue
            noise = torch.randn(t.shape, generator=gen)
            if t.dim() >= 2:
                t.copy_(noise / t.shape[-1] ** 0.5)
            elif "norm" in name or name.endswith("scale"):
                t.copy_(1 + 0.1 * noise)
            else:
                t.copy_(0.1 * noise)


class _OurSites:
    """Stands in for one layer's rounding: records each site, or (``forced``) returns the port's
    rounded value there instead of its own."""

    def __init__(self, inner, layer: int, calls: dict, forced: dict | None) -> None:
        self.inner, self.layer, self.calls, self.forced = inner, layer, calls, forced

    def _site(self, site: str, x: torch.Tensor, fn) -> torch.Tensor:
        d = x.shape[-1]
        if self.forced is not None:
            y = self.forced[(self.layer, site)][1].reshape(x.shape).to(x.dtype)
        else:
            y = fn(x)
        self.calls[(self.layer, site)] = (x.reshape(-1, d).clone(), y.reshape(-1, d).clone())
        return y

    def kv(self, x):
        return self._site("kv", x, self.inner.kv)

    def entries(self, x):
        return self._site("entries", x, self.inner.entries)

    def index(self, x):
        return self._site("index_k" if x.dim() == 2 else "index_q", x, self.inner.index)


class _PortLayout:
    """Our attention op, reduced over the port's key axis for one one-shot prefill: columns are
    the step's tokens in order, then the kv source's entries in emission order (the arena rows
    each layer's source wrote, recorded here), masked to our index lists; the sink is the last
    column. Installed as the reference ``sparse_mqa_sink`` while our model runs."""

    def __init__(self, model) -> None:
        self.layer, self.emitted = -1, {}
        for i, layer in enumerate(model.layers):
            attn = layer.attn
            attn.register_forward_pre_hook(lambda _m, _a, i=i: setattr(self, "layer", i))
            if hasattr(attn, "compressor"):
                write = attn.write_entries

                def recorded(x, ctx, i=i, write=write, attn=attn):
                    key = (attn.ratio, overlapped(attn.config, i))
                    self.emitted[i] = ctx.metadata.plans[key].emit_rows.clone()
                    return write(x, ctx)

                attn.write_entries = recorded
        self.config = model.config

    def __call__(self, q, kv, indices, sink, scale):
        window, step, *arena = kv
        if bool((indices[indices >= 0] < window.shape[0]).any()):
            raise RuntimeError("port_layout: only a one-shot prefill (no window rows) is mapped")
        tokens = step.shape[0]
        rows = [rows_of(step, torch.arange(tokens))]
        column = torch.where(indices >= 0, indices - window.shape[0], -1).long()
        if arena:
            emitted = self.emitted[self.config.kv_source_of(self.layer)].long()
            rows.append(rows_of(arena[0], emitted))
            slot = torch.full((arena[0].shape[0],), -1, dtype=torch.long)
            slot[emitted] = torch.arange(emitted.numel())
            comp = column >= tokens
            column = torch.where(comp, slot[(column - tokens).clamp(min=0)] + tokens, column)
        keys = torch.cat(rows)
        width = keys.shape[0]
        keep = torch.zeros(q.shape[0], width + 1, dtype=torch.bool)
        keep.scatter_(1, column.masked_fill(column < 0, width), True)
        logits = torch.matmul(q.float(), keys.t()) * scale
        logits = logits.masked_fill(~keep[:, None, :width], float("-inf"))
        sinks = sink.float()[None, :, None].expand(q.shape[0], -1, 1)
        logits = torch.cat([logits, sinks], dim=-1)
        logits = logits - logits.amax(-1, keepdim=True)
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        return torch.matmul(probs, keys).to(q.dtype)


def _ours(config, state, forced: dict | None):
    model = build_model(config, device="cpu", dtype=torch.float32).eval()
    model.load_state_dict(state, strict=True)
    calls: dict = {}
    for i, layer in enumerate(model.layers):
        attn = layer.attn
        attn.rounding = _OurSites(attn.rounding, i, calls, forced)
        indexer = getattr(attn, "indexer", None)
        if indexer is not None and hasattr(indexer, "rounding"):
            indexer.rounding = _OurSites(indexer.rounding, i, calls, forced)
    return model, calls


def run_case(
    cfg_mod, modeling, heads: str, seed: int, tokens: int, draws: int = 1
) -> dict[str, Any]:
    raw = _config(heads)
    text = raw["text_config"]
    port_text = {k: v for k, v in text.items() if k not in ("model_type", "engram_pad_token_id")}
    if port_text["candidate_source_layer_id"] is None:  # the port's "off" is negative
        port_text["candidate_source_layer_id"] = -1
    port_cfg = cfg_mod.DeepseekV41TextConfig(engram_pad_id=text["engram_pad_token_id"], **port_text)
    port_cfg._attn_implementation = "eager"
    gen = torch.Generator().manual_seed(seed)
    port = modeling.DeepseekV41ForCausalLM(port_cfg).float().eval()
    _randomise(port, gen)
    tokenizer = testing_tokenizer_for(text["vocab_size"])
    from transformers import PreTrainedTokenizerFast

    def rebind() -> None:  # a fresh n-gram history before each port run
        if text["engram_layer_ids"]:
            port.model.bind_tokenizer(PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend))

    ids = torch.randint(0, text["vocab_size"], (tokens,), generator=gen)
    rebind()
    want, port_calls = run_port(port, modeling, ids)
    result: dict[str, Any] = {"heads": heads, "seed": seed, "tokens": tokens}
    result.update(self_rows(port, modeling, ids, want, port_calls, seed, rebind, draws))
    half = tokens // 2
    rebind()
    with torch.no_grad():
        first = port(input_ids=ids[None, :half], use_cache=True)
        rest = port(
            input_ids=ids[None, half:], past_key_values=first.past_key_values, use_cache=True
        )
    chunked = torch.cat([first.logits[0], rest.logits[0]])
    # The port keeps a float Engram table's scale but never reads it; so do we (not loaded).
    state = {k: v for k, v in from_transformers(port.state_dict()).items()
             if not k.endswith("engram.embed.scale")}  # fmt: skip
    config = parse_config(raw)
    from deepinfer.engine.model.engram_hashing import compressed_token_map

    for mode, forced in (("as_is", None), ("port_rounding", port_calls), ("port_layout", None)):
        model, calls = _ours(config, state, forced)
        model.bind_engram(compressed_token_map(tokenizer.backend))
        op = registry.OPS["sparse_mqa_sink"]
        if mode == "port_layout":
            layout = _PortLayout(model)
            registry.OPS[op.name] = registry.OpDef(op.name, op.contract, layout)
        try:
            with torch.no_grad():
                got = SimpleRunner(model, max_seqs=1, max_len=tokens).step({0: ids.tolist()})[0]
        finally:
            registry.OPS[op.name] = op
        result[mode] = compare(want, got)
        if mode == "as_is":
            result["sites"] = flips(port_calls, calls)
    result["port_chunked"] = compare(want, chunked)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", required=True, help="directory holding deepseek_v41/")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--out", default=None)
    parser.add_argument("--draws", type=int, default=1, help="sign draws of port_perturbed")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    cfg_mod, modeling = _port(args.port)
    cases = [run_case(cfg_mod, modeling, h, s, args.tokens, args.draws) for h in HEADS
             for s in args.seeds]  # fmt: skip
    modes = ("as_is", "port_layout", "port_chunked", *PERTURBED)
    keep = ("argmax_agree", "mean_abs_dlogp", "max_abs_dlogp")
    rows = [{"heads": c["heads"], "seed": c["seed"], **{f"{m}.{k}": c[m][k] for m in modes
             for k in keep}} for c in cases]  # fmt: skip
    print_table(rows, list(rows[0]))
    for c in cases:
        flipped = [s for s in c["sites"] if s.get("flips")]
        first = flipped[0] if flipped else None
        print(f"{c['heads']} seed {c['seed']}: {len(flipped)} of {len(c['sites'])} sites flip; "
              f"first flip: {first}")  # fmt: skip
        for m in PERTURBED:
            print(f"  {m}: {c[m]['sites_flipping']} sites flip; first flip: {c[m]['first_flip']}")
        for m in ("port_perturbed_draws", "port_perturbed_attn_draws"):
            if m not in c:
                continue
            agree = [d["argmax_agree"] for d in c[m]]
            mean = [d["mean_abs_dlogp"] for d in c[m]]
            print(f"  {m}, {len(agree)} draws: argmax {min(agree):.3f}-{max(agree):.3f} "
                  f"(mean {sum(agree) / len(agree):.3f}), mean |dlogp| {min(mean):.1e}-"
                  f"{max(mean):.1e} (mean {sum(mean) / len(mean):.1e})")  # fmt: skip
    # the port's directory is a scratch path on one machine: recorded as a placeholder
    payload = {"environment": environment(), "args": {**vars(args), "port": "PORT"}, "cases": cases}
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
