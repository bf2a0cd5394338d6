"""One-GPU projection of an expert-parallel deployment: rank 0 of EP=2 V4-Flash and of EP=8
V4.1-Flash, at full size, on one device.

The model is built exactly as rank 0 of an ``--ep N`` deployment builds it (every layer at the
published shapes, dummy weights): attention, dense weights and the shared expert replicated,
the routed experts of rank 0's slots only. The all-to-all is replaced by a loopback: what rank 0
would send to rank j comes back as what rank j sends to rank 0, so rank 0 receives the rows a
balanced deployment gives it (each rank holding the same batch): ``T * k`` rows per step spread
over its ``E / N`` experts, with no network time. V4.1's two Engram tables (about 98 GB each)
live in host memory in a deployment (one copy per node), so here they are built with
``--engram-rows`` rows: a step gathers a few rows whatever the table size.

Prints resident device memory (routed experts, the rest), prefill step time (one sequence of
``--prompt-len`` tokens) and decode step time (``--decode-batch`` sequences, context
``--context``), and writes JSON. ``--tiny`` runs the tiny test configs on the CPU (smoke test).

    python -m benchmarks.parallel.ep_projection --model v4-flash --ep 2 --out bench-out/ep2.json
    python -m benchmarks.parallel.ep_projection --model v41-flash --ep 8 --out bench-out/ep8.json

``--ep 1`` runs the plain single-device model (every expert) as the baseline; with ``--layers
N`` (V4-Flash) both fit one GPU at the layer count of the single-GPU engine runs.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from benchmarks.common import environment, write_json
from benchmarks.model.dummy_forward import v4_flash_config
from deepinfer.engine.checkpoint.dummy import fill_dummy
from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.model.model import build_model
from deepinfer.engine.testing import tiny_v4_config, tiny_v41_config
from deepinfer.engine.testing.simple_runner import SimpleRunner
from deepinfer.parallel import ExpertParallelContext

V4_RATIOS = [0, 0] + [4, 128] * 20 + [4]  # 43 layers
FP8_BLOCK_32 = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
    "expert_dtype": "fp4",
}


class LoopbackComm:
    """Rank 0 of ``world_size`` ranks whose peers mirror it: every all-to-all returns what this
    rank sent (so its receive sizes equal its send sizes), reductions and gathers of replicated
    values are the identity."""

    rank = 0

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None):
        output.copy_(input)

    def all_gather_into_tensor(self, output, input):
        output.copy_(input.repeat(self.world_size, *([1] * (input.dim() - 1))))

    def all_reduce(self, tensor, op="sum"):
        pass

    def barrier(self):
        pass


def v41_flash_config(engram_rows: int) -> dict:
    """V4.1-Flash's text config (spec 1.3), Engram tables cut to about ``engram_rows`` rows."""
    return tiny_v41_config(
        vision=False,
        vocab_size=129280,
        hidden_size=5120,
        num_hidden_layers=40,
        num_attention_heads=64,
        head_dim=512,
        qk_rope_head_dim=64,
        q_lora_rank=1280,
        o_groups=8,
        o_lora_rank=1024,
        sliding_window=128,
        compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
        kv_source_layer_ids=[2, 8, 14, 20],
        index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36],
        candidate_source_layer_id=20,
        candidate_topk_blocks=2048,
        candidate_block_size=8,
        index_n_heads=32,
        index_head_dim=128,
        index_topk=512,
        n_routed_experts=384,
        num_experts_per_tok=6,
        moe_intermediate_size=2304,
        hc_mult=4,
        engram_layer_ids=[1, 14],
        engram_max_ngram_size=4,
        engram_vocab_size=max(engram_rows // 24, 64),
        engram_n_heads=8,
        engram_head_dim=256,
        engram_compressed_vocab_size=99092,
        num_nextn_predict_layers=0,
        dspark_target_layer_ids=[37, 38, 39],
        dspark_n_routed_experts=128,
        dspark_num_experts_per_tok=3,
    ) | {"quantization_config": FP8_BLOCK_32}


def model_config(name: str, tiny: bool, engram_rows: int, layers: int | None = None):
    """``layers``: V4-Flash's first layers only (to compare with single-GPU runs of as many)."""
    if layers is not None and (name != "v4-flash" or tiny or not 1 <= layers <= len(V4_RATIOS)):
        raise ValueError(f"--layers {layers}: expected 1..{len(V4_RATIOS)}, full-size v4-flash")
    if name == "v4-flash":
        ratios = V4_RATIOS[:layers] if layers else V4_RATIOS
        raw = tiny_v4_config(n_routed_experts=8) if tiny else v4_flash_config(ratios)
    else:
        raw = tiny_v41_config(vision=False, n_routed_experts=8)
        raw = raw if tiny else v41_flash_config(engram_rows)
    return parse_config(raw)


def _bytes(model, routed: bool) -> int:
    return sum(
        t.numel() * t.element_size()
        for n, t in model.state_dict().items()
        if (".ffn.experts." in n) == routed
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _forward(model, runner, chunks) -> None:
    """One forward of ``chunks`` computing only each sequence's last-token logits."""
    batch = runner.batch(chunks)
    model(replace(batch, logits_indices=batch.cu_seqlens_q[1:].long() - 1), runner.cache)


def _step_seconds(model, runner, chunks, device, repeats: int) -> float:
    """Median seconds of one forward of ``chunks``; the same cache rows are rewritten."""
    times = []
    for _ in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        _forward(model, runner, chunks)
        _sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]  # the first run warms up


@torch.inference_mode()
def run(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if args.tiny:
        torch.set_num_threads(1)  # tiny shapes: a thread pool spins longer than it computes
    config = model_config(args.model, args.tiny, args.engram_rows, args.layers)
    # EP 1: the plain single-device model, the baseline
    ctx = None
    if args.ep > 1:
        ctx = ExpertParallelContext(LoopbackComm(args.ep), args.num_redundant_experts)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    model = build_model(config, device=device, dtype=dtype, expert_parallel=ctx).eval()
    fill_dummy(model, seed=0)
    if config.engram_layer_ids:
        token_map = torch.arange(config.vocab_size) % config.engram_compressed_vocab_size
        model.bind_engram(token_map)
    resident = torch.cuda.memory_allocated(device) - before if device.type == "cuda" else None
    prompt, batch, context = args.prompt_len, args.decode_batch, args.context
    block = 128
    runner = SimpleRunner(model, max_seqs=batch + 1, max_len=max(prompt, context + 1),
                          block_size=block, dtype=dtype, device=device)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, config.vocab_size, (prompt,), generator=gen).tolist()
    prefill_s = _step_seconds(model, runner, {batch: tokens}, device, args.repeats)
    for seq in range(batch):  # decode contexts: write `context` tokens per sequence once
        chunk = {seq: torch.randint(3, config.vocab_size, (context,), generator=gen).tolist()}
        _forward(model, runner, chunk)
        runner.lengths[seq] = context
    chunks = {seq: [int(torch.randint(3, config.vocab_size, (1,), generator=gen))]
              for seq in range(batch)}  # fmt: skip
    decode_s = _step_seconds(model, runner, chunks, device, args.repeats)
    return {
        "model": args.model, "ep": args.ep, "num_redundant_experts": args.num_redundant_experts,
        "rank": 0, "layers": config.num_layers, "device": str(device), "tiny": args.tiny,
        "routed_expert_bytes": _bytes(model, True), "other_weight_bytes": _bytes(model, False),
        "resident_device_bytes": resident,
        "peak_device_bytes": torch.cuda.max_memory_allocated(device) if resident else None,
        "engram_rows": args.engram_rows if config.engram_layer_ids else None,
        "prefill_tokens": prompt, "prefill_step_s": prefill_s,
        "decode_batch": batch, "decode_context": context, "decode_step_s": decode_s,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["v4-flash", "v41-flash"], default="v4-flash")
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--num-redundant-experts", type=int, default=0)
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engram-rows", type=int, default=1 << 21)
    parser.add_argument("--layers", type=int, default=None, help="v4-flash: first N layers")
    parser.add_argument("--tiny", action="store_true", help="tiny configs on the CPU")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.ep < 1:
        parser.error(f"--ep {args.ep}: expected >= 1")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: expected >= 1 (timed runs after a warm-up)")
    result = {"env": environment() if torch.cuda.is_available() else None, **run(args)}
    gib = 2**30
    print(
        f"{args.model} rank 0 of EP={args.ep} ({result['layers']} layers, {result['device']}): "
        f"routed experts {result['routed_expert_bytes'] / gib:.2f} GiB, "
        f"other weights {result['other_weight_bytes'] / gib:.2f} GiB, resident "
        + (
            f"{result['resident_device_bytes'] / gib:.2f} GiB"
            if result["resident_device_bytes"]
            else "n/a (CPU)"
        )  # fmt: skip
        + f"; prefill {args.prompt_len} tokens {result['prefill_step_s'] * 1e3:.1f} ms; "
        f"decode batch {args.decode_batch} {result['decode_step_s'] * 1e3:.2f} ms/step"
    )
    write_json(args.out, result)


if __name__ == "__main__":
    main()
