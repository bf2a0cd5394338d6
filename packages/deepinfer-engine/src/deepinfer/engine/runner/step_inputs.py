"""A planned step's model inputs on the device (:func:`step_batch`), built from the plan's host
lists without reading anything back."""

from __future__ import annotations

from typing import Any

import torch

from deepinfer.engine.model.metadata import ForwardBatch
from deepinfer.engine.runner.batch_plan import StepPlan


def step_batch(
    plan: StepPlan, rows: list[int], device, prompt_lens: list[int] | None = None, **extra: Any
) -> ForwardBatch:
    """``plan``'s model inputs on ``device``, logits for ``rows`` (``prompt_lens``: each
    sequence's known tokens; ``extra``: further :class:`ForwardBatch` fields, images). Copied
    without waiting for the device, and the fields the host reads (the index lists', YoCo's
    prompt lengths) kept on the host beside them (``ForwardBatch.host``), so building a step
    reads nothing back."""
    host = {
        "positions": torch.tensor(plan.positions, dtype=torch.long),
        "cu_seqlens_q": torch.tensor(plan.cu_seqlens_q, dtype=torch.int32),
        "seq_lens": torch.tensor(plan.seq_lens, dtype=torch.long),
        "block_tables": torch.tensor(plan.block_tables, dtype=torch.int32),
        "state_slots": torch.tensor(plan.state_slots, dtype=torch.long),
    }
    if prompt_lens is not None:
        host["prompt_lens"] = torch.tensor(prompt_lens, dtype=torch.long)
    moved = {name: t.to(device, non_blocking=True) for name, t in host.items()}
    return ForwardBatch(
        input_ids=torch.tensor(plan.input_ids, dtype=torch.long).to(device, non_blocking=True),
        logits_indices=torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True),
        **moved,
        **extra,
        host=host,
    )
