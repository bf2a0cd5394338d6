"""The transformers baseline: ``DeepseekV4ForCausalLM`` with the same config (random init, bf16
weights: transformers keeps no FP4 experts in memory from a random init), on the same device,
driven by its own ``generate`` loop with the same prompts and batch sizes as our engine."""

from __future__ import annotations

import time
from typing import Any

import torch

from benchmarks.sweep.measure import Generate

# Keys our configs carry that are not DeepseekV4Config arguments.
_DROP = ("architectures", "quantization_config", "expert_dtype", "model_type", "dtype")


def baseline_skip_reason(is_v4: bool) -> str | None:
    """None when the baseline can run for this model, else why not (printed and recorded)."""
    try:
        import transformers
    except ImportError:
        return "transformers is not installed"
    if not is_v4:
        return (
            f"transformers {transformers.__version__} has no DeepSeek-V4.1 model "
            "(deepseek_v41); the baseline runs only for V4 shapes"
        )
    if not hasattr(transformers, "DeepseekV4ForCausalLM"):
        return f"transformers {transformers.__version__} has no DeepseekV4ForCausalLM"
    return None


def load_baseline(config: dict[str, Any], device: str) -> torch.nn.Module:
    """A randomly initialised ``DeepseekV4ForCausalLM`` of the config's shapes, bf16, eval."""
    import transformers

    kwargs = {k: v for k, v in config.get("text_config", config).items() if k not in _DROP}
    kwargs["num_nextn_predict_layers"] = 0
    hf_config = transformers.DeepseekV4Config(**kwargs)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.DeepseekV4ForCausalLM(hf_config)
    return model.to(torch.bfloat16).eval()


class TokenClock:
    """A ``generate`` streamer that records when each step's tokens reached the host."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def baseline_generate(model: torch.nn.Module) -> Generate:
    """Greedy ``model.generate`` on equal-length prompts (no padding), exactly ``max_tokens``;
    every sequence of the batch gets its tokens at the same steps."""
    device = next(model.parameters()).device

    @torch.inference_mode()
    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[float]]:
        input_ids = torch.tensor(prompts, device=device)
        clock = TokenClock()
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_tokens,
            min_new_tokens=max_tokens, do_sample=False, pad_token_id=2, streamer=clock,
        )  # fmt: skip
        produced = out.shape[1] - input_ids.shape[1]
        token_times = clock.times[1:]  # the first put is the prompt
        # The streamer may report the last step one call late (deferred stop check): only
        # the count of generated tokens is exact, the times are one per reported step.
        if produced != max_tokens or not token_times:
            raise RuntimeError(f"baseline produced {produced} tokens, expected {max_tokens}")
        return [token_times] * len(prompts)

    return generate
