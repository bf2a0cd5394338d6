"""The progress bar of ``LLM.generate``: finished requests, with token throughput."""

from __future__ import annotations

import time

from deepinfer.engine.frontend.outputs import RequestOutput


class ThroughputBar:
    """A tqdm bar over finished requests, showing input and output tokens per second."""

    def __init__(self, total: int, *, enabled: bool) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(
            total=total, desc="Processed prompts", unit="req", disable=not enabled, leave=True
        )
        self._start = time.perf_counter()
        self._num_input = 0
        self._num_output = 0

    def finished(self, output: RequestOutput) -> None:
        self._num_input += len(output.prompt_token_ids)
        self._num_output += sum(len(c.token_ids) for c in output.outputs)
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        self._bar.set_postfix_str(
            f"input {self._num_input / elapsed:.1f} tok/s, "
            f"output {self._num_output / elapsed:.1f} tok/s",
            refresh=False,
        )
        self._bar.update(1)

    @property
    def output_tokens_per_second(self) -> float:
        return self._num_output / max(time.perf_counter() - self._start, 1e-9)

    def close(self) -> None:
        self._bar.close()
