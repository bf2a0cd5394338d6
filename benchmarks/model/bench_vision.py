"""V4.1 images: the vision tower's encode time per image, the CPU preprocessing it overlaps
with, and what image tokens cost in a prefill next to text tokens; prints a table, writes JSON.

    python -m benchmarks.model.bench_vision --out bench-out/vision.json          # CUDA
    python -m benchmarks.model.bench_vision --tiny                               # CPU smoke

The tower is the released one (32 layers, width 1024, 16 heads, patch 14, aligner to 5120)
with dummy bf16 weights; the text model is the V4.1-Flash shape cut to ``--layers`` layers
(dummy weights, no Engram, no DSpark). Images are random pixels of the stated sizes; their
span lengths follow the checkpoint's resize plan (max 1024 tokens). Encode FLOPs count the
linears and the attention's two products; the ceiling is the GPU's dense bf16 peak
(``--peak-tflops``, 989 for an H200 SXM).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
import torch

from benchmarks.common import environment, print_table, time_cuda, write_json
from benchmarks.sweep.models import resolve_model
from deepinfer.engine.checkpoint import load_into
from deepinfer.engine.frontend.images import decode_image, preprocess
from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.model.model import build_model
from deepinfer.engine.model.vision_config import plan_image
from deepinfer.engine.testing import tiny_v41_config
from deepinfer.engine.testing.simple_runner import SimpleRunner

VISION = {
    "model_type": "deepseek_v41_vision", "num_hidden_layers": 32, "hidden_size": 1024,
    "num_attention_heads": 16, "intermediate_size": 2816, "patch_size": 14, "rope_theta": 10000,
    "downsample_ratio": 3, "max_image_tokens": 1024, "min_pixels": 295936, "max_wh_ratio": None,
}  # fmt: skip
SIZES = [(544, 544), (1024, 768), (1920, 1080), (2000, 2000)]


def encode_flops(num_patches: int, c) -> float:
    per_patch = 2 * c.num_layers * (
        4 * c.hidden_size**2 + 3 * c.hidden_size * c.intermediate_size  # qkv+wo, w1+w2
        + 2 * num_patches * c.hidden_size  # q k^T and p v
    )  # fmt: skip
    return per_patch * num_patches


def _timer(device: torch.device):
    if device.type == "cuda":
        return lambda fn: time_cuda(fn, warmup=3, iters=10)

    def wall_ms(fn) -> float:
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return wall_ms


def _model(args, device, dtype):
    if args.tiny:
        raw = tiny_v41_config(engram_layer_ids=[])  # no tokenizer to hash with
    else:
        raw = dict(resolve_model("v41-flash-dummy", args.layers).config, vision_config=VISION)
    model = build_model(parse_config(raw), device=device, dtype=dtype)
    load_into(model, load_format="dummy", seed=0)
    return model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="text layers (V4.1-Flash has 40)")
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--tiny", action="store_true", help="tiny config on the CPU (smoke)")
    parser.add_argument("--out", default=None, help="write JSON here")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    timed = _timer(device)
    model = _model(args, device, dtype)
    c = model.vision_config
    rng = np.random.default_rng(0)
    rows = []
    sizes = [(40, 60), (90, 50)] if args.tiny else SIZES
    for width, height in sizes:
        plan = plan_image(width, height, c)
        patches_np, cpu_ms = _preprocessed(rng, width, height, plan, c)
        patches = torch.from_numpy(patches_np).to(device)
        with torch.no_grad():
            ms = timed(lambda p=patches, g=plan: model.encode_image(p, g.vit_h, g.vit_w))
        tflops = encode_flops(plan.num_patches, c) / (ms * 1e-3) / 1e12
        rows.append({
            "image": f"{width}x{height}", "patches": plan.num_patches, "tokens": plan.num_tokens,
            "cpu_preprocess_ms": cpu_ms, "encode_ms": round(ms, 3),
            "encode_tflops": round(tflops, 1), "of_peak": round(tflops / args.peak_tflops, 3),
        })  # fmt: skip
    print_table(rows, list(rows[0]))
    prefill = _prefill_cost(model, args, device, timed, plan)
    print_table(prefill, list(prefill[0]))
    write_json(args.out, {"environment": environment(), "encode": rows, "prefill": prefill})


def _preprocessed(rng, width: int, height: int, plan, c):
    """(patches, CPU milliseconds of decode + preprocess); random patches and None when
    Pillow is missing (the GPU machine may lack it)."""
    try:
        from PIL import Image
    except ImportError:
        return rng.standard_normal((plan.num_patches, c.patch_dim), dtype=np.float32), None
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    start = time.perf_counter()
    patches = preprocess(decode_image(image), plan, c)
    return patches, round((time.perf_counter() - start) * 1e3, 2)


def _prefill_cost(model, args, device, timed, plan) -> list[dict]:
    """One prefill of ``--prefill-tokens`` tokens, text only vs with the last image's span
    in the middle (its embeddings precomputed: the encode is timed above)."""
    n = 64 if args.tiny else args.prefill_tokens
    span = min(plan.num_tokens, n // 2)
    tokens = [100 + i % 1000 for i in range(n)]
    start = n // 4
    image_id = model.config.image_token_id
    tokens_img = tokens[:start] + [image_id] * span + tokens[start + span :]
    embeds = torch.randn(
        span, model.config.hidden_size, device=device, dtype=model.embed.weight.dtype
    )
    rows = []
    for label, ids, extra in [
        ("text", tokens, {}),
        (
            "with image span",
            tokens_img,
            {
                "image_rows": torch.arange(start, start + span, device=device),
                "image_embeds": embeds,
            },
        ),
    ]:
        runner = SimpleRunner(model, max_seqs=1, max_len=n, block_size=128, device=device)
        batch = runner.batch({0: ids})
        batch = dataclasses.replace(batch, **extra)
        with torch.no_grad():
            ms = timed(lambda b=batch, r=runner: model(b, r.cache))
        rows.append({"prefill": label, "tokens": n, "image_tokens": span if extra else 0,
                     "layers": model.config.num_layers, "ms": round(ms, 3)})  # fmt: skip
    rows[1]["extra_ms"] = round(rows[1]["ms"] - rows[0]["ms"], 3)
    return rows


if __name__ == "__main__":
    main()
