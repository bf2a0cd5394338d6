"""Loading an expert-parallel rank: it builds and reads only its slots' routed experts, so its
resident routed-expert bytes are total / EP plus its redundant slots and no step of the load
ever holds another rank's expert."""

from __future__ import annotations

import re

import pytest
import torch

from deepinfer.engine.checkpoint import loader
from deepinfer.engine.model.config_parsing import load_config
from deepinfer.engine.model.model import build_model
from deepinfer.engine.testing import make_random_checkpoint, tiny_v4_config
from deepinfer.parallel import ExpertParallelContext

NUM_EXPERTS, EP, REDUNDANT = 8, 4, 1
ROUTED = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.")


class _NoCollectives:
    """A communicator of rank ``rank`` in a world of ``world_size``: loading runs no collective."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def __getattr__(self, name):
        raise AssertionError(f"loading ran a collective ({name})")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = tiny_v4_config(n_routed_experts=NUM_EXPERTS, num_experts_per_tok=3)
    return make_random_checkpoint(tmp_path_factory.mktemp("ep"), config, quantized=True)


@pytest.mark.parametrize("rank", [0, 3])
def test_rank_reads_and_holds_only_its_slots(checkpoint, rank, monkeypatch):
    config = load_config(checkpoint)
    full = build_model(config, device="meta").state_dict()
    total = sum(_nbytes(t) for n, t in full.items() if ROUTED.match(n))

    reads = []
    real_read = loader._read
    monkeypatch.setattr(
        loader, "_read", lambda f, entry: reads.append(entry) or real_read(f, entry)
    )
    ctx = ExpertParallelContext(_NoCollectives(rank, EP), num_redundant_experts=REDUNDANT)
    model = build_model(config, device="cpu", expert_parallel=ctx)
    built = sum(_nbytes(t) for n, t in model.state_dict().items() if ROUTED.match(n))
    report = loader.load_into(model, checkpoint, config=config, progress=False)

    slots = ctx.placement(NUM_EXPERTS).local_experts(rank)
    assert len(set(slots)) == NUM_EXPERTS // EP + REDUNDANT
    expected = total * (NUM_EXPERTS // EP + REDUNDANT) // NUM_EXPERTS
    resident = sum(_nbytes(t) for n, t in model.state_dict().items() if ROUTED.match(n))
    assert built == resident == expected  # never more, from construction on
    read_experts = {
        (int(m.group(1)), int(m.group(2))) for m in (ROUTED.match(e.key) for e in reads) if m
    }
    assert read_experts == {(layer, e) for layer in range(config.num_layers) for e in slots}
    skipped = report.skipped["routed experts held by other EP ranks"]
    assert {int(ROUTED.match(n).group(2)) for n in skipped} == set(range(NUM_EXPERTS)) - set(slots)
    # what was loaded is the checkpoint's, under the checkpoint's names
    name = f"layers.1.ffn.experts.{slots[-1]}.w2.weight"
    stored = loader.read_tensors(checkpoint, [name])[name]
    assert torch.equal(model.state_dict()[name].view(torch.uint8), stored.view(torch.uint8))


def test_a_layout_that_does_not_divide_the_experts_is_refused(checkpoint):
    config = load_config(checkpoint)
    ctx = ExpertParallelContext(_NoCollectives(0, 3))
    with pytest.raises(ValueError, match="expert_parallel_size=3: expected a divisor"):
        build_model(config, device="meta", expert_parallel=ctx)
