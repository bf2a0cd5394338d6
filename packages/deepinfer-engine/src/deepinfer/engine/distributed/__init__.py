"""Attention data parallelism (and the process side of expert parallelism) for ``LLM``.

``LLM(model, data_parallel_size=N, expert_parallel_size=N or 1)`` starts N ranks, each with its
own requests, KV cache and state slots, stepping in lockstep: :mod:`.core` (one scheduler per
rank, requests spread by load), :mod:`.spawned` (worker processes on this node, with bounded
waits and clean failure), :mod:`.torchrun` (ranks started by ``torchrun``), :mod:`.worker` (a
rank's loop), :mod:`.start` (layout checks, start-up, the core). ``data_parallel_size=1`` never
reaches this package.
"""
