"""The sampler's packed per-row parameters: one host buffer, one copy, views per field."""

import numpy as np
import pytest
import torch

from deepinfer.sampling import SamplingParams
from deepinfer.sampling.params import ROW_GREEDY, ROW_PLAIN_GREEDY, ROW_PROCESSED, ROW_UNSEEDED
from deepinfer.sampling.rows import batch_flags, pack_rows


def _params(gen, rows):
    out = []
    for _ in range(rows):
        kind = int(torch.randint(0, 4, (1,), generator=gen))
        seed = None if kind == 3 else int(torch.randint(0, 2**62, (1,), generator=gen))
        out.append(SamplingParams(
            temperature=0.0 if kind == 0 else float(torch.rand(1, generator=gen)) + 0.1,
            top_k=int(torch.randint(-1, 100, (1,), generator=gen)),
            top_p=float(torch.rand(1, generator=gen)) * 0.9 + 0.1,
            min_p=float(torch.rand(1, generator=gen)) * 0.3,
            seq_seed=seed,
            presence_penalty=0.5 if kind == 2 else 0.0,
        ))  # fmt: skip
    return out


@pytest.mark.parametrize("positions_as_tensor", [False, True])
def test_packed_rows_hold_each_rows_parameters(positions_as_tensor):
    gen = torch.Generator().manual_seed(11)
    params = _params(gen, 37)  # odd: the int64 half must still be aligned
    positions = torch.randint(0, 1 << 40, (37,), generator=gen)
    given = positions if positions_as_tensor else positions.tolist()
    rows = pack_rows(params, given, torch.device("cpu"), unseeded=True)
    f32 = np.float32
    assert rows.temperature.tolist() == [float(f32(p.temperature or 1.0)) for p in params]
    assert rows.top_p.tolist() == [float(f32(p.top_p)) for p in params]
    assert rows.min_p.tolist() == [float(f32(p.min_p)) for p in params]
    assert rows.top_k.tolist() == [p.top_k for p in params]
    assert rows.greedy_flags.tolist() == [int(p.temperature == 0.0) for p in params]
    assert rows.positions.tolist() == positions.tolist()
    seeds = rows.seeds.tolist()
    for p, seed in zip(params, seeds):
        if p.seq_seed is not None:
            assert seed == p.seq_seed
    unseeded = [s for p, s in zip(params, seeds) if p.seq_seed is None]
    assert unseeded and len(set(unseeded)) == len(unseeded)  # fresh, distinct draws


def test_batch_flags_are_or_and_over_rows():
    greedy = SamplingParams(temperature=0.0, seq_seed=1)
    penalised = SamplingParams(temperature=0.5, presence_penalty=1.0)
    any_flags, all_flags = batch_flags([greedy, greedy])
    assert all_flags & ROW_PLAIN_GREEDY and all_flags & ROW_GREEDY
    any_flags, all_flags = batch_flags([greedy, penalised])
    assert any_flags & ROW_PROCESSED and any_flags & ROW_UNSEEDED and any_flags & ROW_GREEDY
    assert not all_flags & ROW_GREEDY and not all_flags & ROW_PLAIN_GREEDY
