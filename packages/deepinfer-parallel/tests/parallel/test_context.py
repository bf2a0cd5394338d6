"""The mirror split of context parallelism: coverage, balance of the counted attention work,
and the layout checks."""

import pytest
import torch

from deepinfer.parallel.context import (
    AttentionShape,
    attention_flops,
    balanced_split,
    check_context_parallel,
    mirror_pieces,
    rank_attention_flops,
    rank_positions,
)

# V4-Flash (spec deepseek-v4.md section 1): 43 layers [0, 0] + [4, 128] * 20 + [4], window 128,
# top-512 CSA, 64 heads of 512, indexer 64 x 128.
V4_FLASH = AttentionShape(
    window=128,
    compress_ratios=(0, 0) + (4, 128) * 20 + (4,),
    index_topk=512,
    heads=64,
    head_dim=512,
    index_heads=64,
    index_head_dim=128,
)
# V4.1-Flash: 40 layers [0, 0] + [128] * 18 + [4] * 20, indexer 32 x 128.
V41_FLASH = AttentionShape(
    window=128,
    compress_ratios=(0, 0) + (128,) * 18 + (4,) * 20,
    index_topk=512,
    heads=64,
    head_dim=512,
    index_heads=32,
    index_head_dim=128,
)


@pytest.mark.parametrize("num_tokens", [0, 1, 7, 64, 1000, 4001])
@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_the_ranks_cover_every_position_once(num_tokens, cp):
    positions = torch.cat([rank_positions(num_tokens, cp, r) for r in range(cp)])
    assert torch.equal(positions.sort().values, torch.arange(num_tokens))
    sizes = [len(rank_positions(num_tokens, cp, r)) for r in range(cp)]
    if num_tokens % (2 * cp) == 0:
        assert len(set(sizes)) == 1


@pytest.mark.parametrize("num_tokens", [0, 5, 4000, 4096])
@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_the_balanced_split_covers_every_position_once_with_equal_counts(num_tokens, cp):
    split = balanced_split(num_tokens, cp, V41_FLASH)
    assert torch.equal(torch.cat(split).sort().values, torch.arange(num_tokens))
    assert all(torch.equal(p, p.sort().values) for p in split)
    if num_tokens % (16 * cp) == 0:
        assert len({len(p) for p in split}) == 1


def test_one_round_deals_the_mirror_pairs():
    for cp in (2, 4):
        split = balanced_split(64 * cp, cp, V4_FLASH, rounds=1)
        mirror = [rank_positions(64 * cp, cp, r) for r in range(cp)]
        assert sorted(p.tolist() for p in split) == sorted(p.tolist() for p in mirror)


def test_the_plain_mirror_split_falls_short_where_the_window_and_top_k_saturate():
    """Why the balanced split deals finer pieces: 32k over 8 ranks, mirror pairs, > 10% apart."""
    flops = [attention_flops(rank_positions(32 * 1024, 8, r), V4_FLASH) for r in range(8)]
    assert max(flops) / min(flops) > 1.10


def test_rank_r_takes_pieces_r_and_its_mirror():
    assert mirror_pieces(16, 2) == [((0, 4), (12, 16)), ((4, 8), (8, 12))]
    assert torch.equal(rank_positions(16, 2, 1), torch.arange(4, 12))


@pytest.mark.parametrize("shape", [V4_FLASH, V41_FLASH], ids=["v4-flash", "v41-flash"])
@pytest.mark.parametrize("num_tokens", [32 * 1024, 128 * 1024])
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_counted_attention_work_is_within_5_percent_across_ranks(shape, num_tokens, cp):
    flops = rank_attention_flops(num_tokens, cp, shape)
    assert sum(flops) == attention_flops(torch.arange(num_tokens), shape)
    assert max(flops) / min(flops) <= 1.05, flops


def test_a_plain_split_is_not_balanced_so_the_check_can_fail():
    """The same count over contiguous runs: the last rank's share is far above the first's."""
    n, cp = 128 * 1024, 4
    runs = [torch.arange(r * n // cp, (r + 1) * n // cp) for r in range(cp)]
    flops = [attention_flops(p, V4_FLASH) for p in runs]
    assert max(flops) / min(flops) > 1.5


def test_attention_flops_counts_window_topk_and_scored_entries():
    shape = AttentionShape(
        window=4,
        compress_ratios=(0, 4, 8),
        index_topk=2,
        heads=1,
        head_dim=1,
        index_heads=1,
        index_head_dim=1,
    )
    # query at position 15: window 4 rows per layer; ratio-4 layer: 4 visible, 2 selected,
    # 4 scored; ratio-8 layer: all 2 visible entries.
    per_row, per_score = 4, 2
    expected = per_row * (4 * 3 + 2 + 2) + per_score * 4
    assert attention_flops(torch.tensor([15]), shape) == expected


def test_bad_layouts_fail_with_one_line_naming_the_field():
    with pytest.raises(ValueError, match=r"context_parallel_size=3: expected a divisor of the 4"):
        check_context_parallel(3, 4, [0, 4])
    with pytest.raises(ValueError, match=r"context_parallel_size=2: .*no compressed-attention"):
        check_context_parallel(2, 2, [0, 0, 0])
    with pytest.raises(ValueError, match=r"context_parallel_size=0: expected at least 1"):
        mirror_pieces(10, 0)
    check_context_parallel(2, 4, [0, 4, 128])
    check_context_parallel(1, 1, [0, 0])
