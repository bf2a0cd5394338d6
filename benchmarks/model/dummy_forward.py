"""V4-Flash-shaped model with dummy weights: build, fill, one prefill forward and one decode
step on CUDA; prints a table of peak memory and time and writes JSON.

    python -m benchmarks.model.dummy_forward                 # 2 layers (CSA, HCA), 1024 tokens
    python -m benchmarks.model.dummy_forward --tokens 4096 --ratios 0,4 --json out.json

The config is the published V4-Flash ``config.json`` (FP8 128x128 blocks, FP4 experts) with
``num_hidden_layers`` cut to ``len(--ratios)`` and no MTP block. Weights come from
``load_into(..., load_format="dummy")``: nothing is read from disk.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from deepinfer.engine.checkpoint import load_into
from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.model.model import build_model
from deepinfer.engine.testing import tiny_v4_config
from deepinfer.engine.testing.simple_runner import SimpleRunner

GIB = 1024**3


def v4_flash_config(ratios: list[int]) -> dict:
    return tiny_v4_config(
        vocab_size=129280,
        hidden_size=4096,
        num_hidden_layers=len(ratios),
        num_attention_heads=64,
        head_dim=512,
        qk_rope_head_dim=64,
        q_lora_rank=1024,
        o_groups=8,
        o_lora_rank=1024,
        sliding_window=128,
        compress_ratios=ratios,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=512,
        n_routed_experts=256,
        num_experts_per_tok=6,
        moe_intermediate_size=2048,
        num_hash_layers=1,
        hc_mult=4,
        num_nextn_predict_layers=0,
        expert_dtype="fp4",
        quantization_config={
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128],
        },
    )


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratios", default="4,128", help="compress ratio per layer")
    parser.add_argument("--tokens", type=int, default=1024, help="prefill length")
    parser.add_argument("--numerics", choices=("model", "float"), default="model")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    ratios = [int(r) for r in args.ratios.split(",")]
    config = parse_config(v4_flash_config(ratios), numerics=args.numerics)
    device = torch.device("cuda")
    torch.cuda.reset_peak_memory_stats()
    model, build_s = timed(lambda: build_model(config, device=device, dtype=torch.bfloat16))
    _, fill_s = timed(lambda: load_into(model, None, load_format="dummy", seed=0))
    weights_gib = torch.cuda.memory_allocated() / GIB
    runner = SimpleRunner(model, max_seqs=1, max_len=args.tokens + 8, device=device)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, config.vocab_size, (args.tokens,), generator=gen).tolist()
    logits, prefill_s = timed(lambda: runner.step({0: prompt}))
    finite = bool(torch.isfinite(logits[0]).all())
    next_token = int(logits[0][-1].argmax())
    _, decode_s = timed(lambda: runner.step({0: [next_token]}))
    results = {
        "gpu": torch.cuda.get_device_name(0),
        "layers": ratios,
        "tokens": args.tokens,
        "numerics": args.numerics,
        "build_s": round(build_s, 3),
        "dummy_fill_s": round(fill_s, 3),
        "prefill_s": round(prefill_s, 3),
        "decode_s": round(decode_s, 3),
        "weights_gib": round(weights_gib, 2),
        "peak_gib": round(torch.cuda.max_memory_allocated() / GIB, 2),
        "logits_finite": finite,
    }
    width = max(len(k) for k in results)
    for key, value in results.items():
        print(f"{key:<{width}}  {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
