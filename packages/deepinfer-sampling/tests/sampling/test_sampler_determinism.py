"""A row's draw depends only on (logits, params, seed, position, stream)."""

import pytest
import torch

from deepinfer.kernels.reference.sampling import gumbel_noise
from deepinfer.sampling import SamplingParams, graphs, rng, sample

VOCAB = 300
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
        ],
    ),
]


def _batch(gen, rows):
    logits = torch.randn(rows, VOCAB, generator=gen) * 2.0
    kinds = [
        {"temperature": 0.9},
        {"temperature": 0.7, "top_k": 20},
        {"temperature": 1.1, "top_p": 0.85},
        {"temperature": 1.0, "min_p": 0.05},
        {"temperature": 0.0},
    ]
    params = [SamplingParams(seq_seed=int(torch.randint(0, 2**62, (1,), generator=gen)),
                             **kinds[i % len(kinds)]) for i in range(rows)]  # fmt: skip
    positions = torch.randint(0, 10_000, (rows,), generator=gen).tolist()
    return logits, params, positions


@pytest.mark.parametrize("device", DEVICES)
def test_row_is_identical_alone_and_at_every_index_of_a_batch_of_64(device):
    gen = torch.Generator().manual_seed(0)
    logits, params, positions = _batch(gen, 64)
    logits = logits.to(device)
    batched = sample(logits, params, positions).token_ids
    for index in range(64):
        alone = sample(logits[index : index + 1], [params[index]], [positions[index]]).token_ids
        assert alone.item() == batched[index].item()
    # the same row moved to every index of a shuffled batch draws the same token
    probe = 5
    for index in range(0, 64, 7):
        order = torch.randperm(64, generator=gen).tolist()
        order.remove(probe)
        order.insert(index, probe)
        shuffled = sample(logits[order], [params[i] for i in order], [positions[i] for i in order])
        assert shuffled.token_ids[index].item() == batched[probe].item()


def test_seed_position_and_stream_each_change_the_stream():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, VOCAB, generator=gen).expand(256, VOCAB)

    def draws(seed=11, position_offset=0, stream=rng.STREAM_SAMPLE):
        params = [SamplingParams(seq_seed=seed) for _ in range(256)]
        positions = [p + position_offset for p in range(256)]
        return sample(logits, params, positions, stream=stream).token_ids

    base = draws()
    assert torch.equal(base, draws())  # same seed: same stream
    for other in (draws(seed=12), draws(position_offset=1), draws(stream=rng.STREAM_DRAFT)):
        assert (other != base).float().mean() > 0.5


def test_greedy_takes_lowest_index_on_ties_and_ignores_seed():
    logits = torch.randn(3, VOCAB)
    logits[:, 10] = 50.0
    logits[:, 200] = 50.0
    params = [SamplingParams(temperature=0, seq_seed=s) for s in (1, 2, 3)]
    assert sample(logits, params, [0, 1, 2]).token_ids.tolist() == [10, 10, 10]


def test_draw_is_gumbel_argmax_of_the_hash_noise():
    """The token equals argmax(s + g) with g from deepinfer.sampling.rng (the documented rule)."""
    gen = torch.Generator().manual_seed(2)
    logits, params, positions = _batch(gen, 32)
    params = [SamplingParams(temperature=0.8, seq_seed=p.seq_seed) for p in params]
    seeds = torch.tensor([p.seq_seed for p in params])
    noise = rng.gumbel(seeds, torch.tensor(positions), rng.STREAM_SAMPLE, VOCAB)
    want = torch.argmax(logits * (1.0 / torch.tensor(0.8)) + noise, dim=-1)
    assert torch.equal(sample(logits, params, positions).token_ids, want)


@pytest.mark.parametrize("stream", [rng.STREAM_SAMPLE, rng.STREAM_DRAFT, rng.STREAM_ACCEPT, 7])
def test_rng_module_and_kernel_reference_hash_agree(stream):
    seeds = torch.randint(0, 2**62, (5,))
    positions = torch.randint(0, 2**40, (5,))
    assert torch.equal(
        rng.gumbel(seeds, positions, stream, 77), gumbel_noise(seeds, positions, stream, 77)
    )
    u = rng.uniform(seeds, positions, stream, 1000)
    assert u.min() > 0.0 and u.max() < 1.0 and abs(u.mean().item() - 0.5) < 0.02


def test_unset_seed_still_samples():
    logits = torch.randn(2, VOCAB)
    tokens = sample(logits, [SamplingParams(), SamplingParams()], [0, 0]).token_ids
    assert tokens.shape == (2,) and tokens.dtype == torch.int64


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cpu_and_gpu_draw_the_same_tokens():
    gen = torch.Generator().manual_seed(3)
    logits, params, positions = _batch(gen, 512)
    logits = torch.round(logits * 64) / 64  # exactly representable, same processed values
    cpu = sample(logits, params, positions).token_ids
    gpu = sample(logits.cuda(), params, positions).token_ids.cpu()
    # within the documented tie rule: a flip needs two perturbed scores within an ulp
    assert (cpu != gpu).sum().item() <= 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_sample_makes_no_host_device_sync():
    gen = torch.Generator().manual_seed(4)
    logits, params, positions = _batch(gen, 64)
    params = [
        SamplingParams(temperature=0.8, top_k=30, top_p=0.9, min_p=0.01, seq_seed=i,
                       repetition_penalty=1.1, logit_bias={3: 1.0}, logprobs=2)
        for i in range(64)
    ]  # fmt: skip
    logits = logits.cuda()
    outputs = [[1, 2, 3]] * 64
    sample(logits, params, positions, output_token_ids=outputs)  # warm-up (kernel compile)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sample(logits, params, positions, output_token_ids=outputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_plain_top_k_top_p_sample_makes_no_host_device_sync():
    logits = torch.randn(64, VOCAB, device="cuda")
    params = [SamplingParams(temperature=0.8, top_k=30, top_p=0.9, seq_seed=i) for i in range(64)]
    positions = list(range(64))
    graphs.reset()
    sample(logits, params, positions)  # warm-up: kernel compile (eager)
    sample(logits, params, positions)  # warm-up: the CUDA graph capture (synchronises)
    assert len(graphs._policy.captured) == 1
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sample(logits, params, positions)  # a replay
        params = [SamplingParams(temperature=0.5, top_p=0.8, seq_seed=i) for i in range(64)]
        sample(logits, params, positions)  # another replay (new parameters, same buffers)
    finally:
        torch.cuda.set_sync_debug_mode("default")
