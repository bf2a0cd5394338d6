"""On the GPU, prefill steps that read float copies of their cache rows (one source format for
the attention and indexer kernels) give the prompt logprobs and greedy tokens of every step
reading the packed cache in place, bit for bit: the V4-Flash-shaped dummy, 4 layers, prompts of
300 to 1,500 tokens.

    python -m pytest benchmarks/tests/test_cache_reads_gpu.py -q -m gpu
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_copied_reads_equal_in_place_reads_on_the_gpu(monkeypatch) -> None:
    import deepinfer.engine.model.metadata as metadata
    from benchmarks.sweep.models import resolve_model
    from deepinfer.engine.frontend.llm import LLM
    from deepinfer.sampling import SamplingParams

    source = resolve_model("v4-flash-dummy", 4)
    llm = LLM(source.path, load_format="dummy", max_num_seqs=8, max_model_len=4096,
              gpu_memory_utilization=0.5)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    vocab = source.config.get("text_config", source.config)["vocab_size"]
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1024, 700, 1500, 300)]
    params = SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, logprobs=0, prompt_logprobs=0
    )

    def run():
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.prompt_logprobs, o.outputs[0].logprobs) for o in outs]

    copied = run()
    monkeypatch.setattr(metadata, "COPY_READS_MIN_ROWS", 10**9)
    in_place = run()
    assert copied == in_place
