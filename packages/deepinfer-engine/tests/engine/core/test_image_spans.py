"""Prefill chunks stop before an image span rather than inside it; a request whose span
does not fit this step's budget waits (its images reach the executor with the request)."""

from types import SimpleNamespace

from deepinfer.engine.core import ModelRunnerOutput, Request, Scheduler, SchedulerConfig
from deepinfer.engine.core.image_spans import fit_to_image_spans
from deepinfer.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _image(offset: int, num_tokens: int) -> SimpleNamespace:
    return SimpleNamespace(offset=offset, num_tokens=num_tokens)


def test_fit_to_image_spans():
    request = SimpleNamespace(num_computed_tokens=2, images=(_image(5, 6), _image(20, 3)))
    assert fit_to_image_spans(request, 2) == 2  # ends before the span
    assert fit_to_image_spans(request, 3) == 3  # ends at its start
    assert fit_to_image_spans(request, 5) == 3  # would end inside: stop before it
    assert fit_to_image_spans(request, 9) == 9  # ends right after it
    assert fit_to_image_spans(request, 19) == 18  # inside the second span
    request.num_computed_tokens = 5
    assert fit_to_image_spans(request, 4) == 0  # starts at a span the budget cannot hold
    assert fit_to_image_spans(request, 6) == 6


def _step(sched: Scheduler) -> dict[str, int]:
    out = sched.schedule()
    sampled = {
        rid: [3] for rid in out.num_scheduled_tokens
        if sched.requests[rid].num_placeholders or sched.requests[rid].awaits_result
    }  # fmt: skip
    sched.update(out, ModelRunnerOutput(sampled_token_ids=sampled))
    return out.num_scheduled_tokens


def test_the_scheduler_cuts_chunks_at_spans_and_passes_the_images():
    config = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64, num_blocks=33,
        block_size=4, num_state_slots=5, compression_ratios=(1, 2),
    )  # fmt: skip
    sched = Scheduler(config)
    request = Request("a", list(range(20, 34)), GREEDY, seed=1)
    request.images = (_image(3, 7),)  # positions 3..9
    sched.add_request(request)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 3}  # 8 would end inside the span
    assert out.new_requests[0].images == request.images
    sched.update(out, ModelRunnerOutput())
    assert _step(sched) == {"a": 8}  # the whole span and one more
    assert _step(sched) == {"a": 3}  # the rest of the prompt
