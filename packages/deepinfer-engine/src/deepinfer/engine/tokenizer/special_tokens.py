"""The DeepSeek-V4 special tokens: their spellings, and their ids in a given vocabulary.

Spellings follow spec deepseek-v4.md section 5. The real checkpoints put BOS / EOS / PAD at
ids 0 / 1 / 2 and the chat-markup tokens near 128,800; we never hard-code the latter, we read
them from the tokenizer's vocabulary (spec C10: only 0/1/2 are confirmed).

Tokenizers we train ourselves (the tiny model, ``testing_tokenizer()``) place the tokens of
``V4_SPECIAL_TOKENS`` at ids ``0 .. len(V4_SPECIAL_TOKENS) - 1`` in that order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
THINK_START_TOKEN = "<think>"
THINK_END_TOKEN = "</think>"
DSML_TOKEN = "｜DSML｜"
LATEST_REMINDER_TOKEN = "<｜latest_reminder｜>"
IMAGE_TOKEN = "<｜deepseek_image｜>"
# The DSpark draft slots are filled with `dspark_noise_token_id` (128799 in the released
# configs). Two public id tables spell id 128799 `<｜System｜>`; the V4 chat encoding never
# emits it, so it is free to serve as the filler. The engine should still prefer the id in
# the checkpoint's config when it has one.
DRAFT_NOISE_TOKEN = "<｜System｜>"

# "Quick instruction" task tokens, appended after a message that carries `task`.
TASK_TOKENS: dict[str, str] = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

V4_SPECIAL_TOKENS: tuple[str, ...] = (
    BOS_TOKEN,  # 0
    EOS_TOKEN,  # 1
    PAD_TOKEN,  # 2
    USER_TOKEN,
    ASSISTANT_TOKEN,
    THINK_START_TOKEN,
    THINK_END_TOKEN,
    DSML_TOKEN,
    LATEST_REMINDER_TOKEN,
    *TASK_TOKENS.values(),
    IMAGE_TOKEN,
    DRAFT_NOISE_TOKEN,
)
"""Special tokens of the tokenizers we train, in id order (BOS 0, EOS 1, PAD 2, ...)."""


@dataclass(frozen=True)
class SpecialTokenIds:
    """Ids of the V4 special tokens in one vocabulary; ``None`` where the vocabulary lacks one.

    ``bos`` and ``eos`` are always present (the loader refuses a tokenizer without them).
    """

    bos: int
    eos: int
    pad: int | None
    user: int | None
    assistant: int | None
    think_start: int | None
    think_end: int | None
    dsml: int | None
    latest_reminder: int | None
    image: int | None
    draft_noise: int | None
    tasks: tuple[tuple[str, int], ...]

    @property
    def has_chat_tokens(self) -> bool:
        """True when every token the chat encoding emits has an id."""
        chat_ids = (self.user, self.assistant, self.think_start, self.think_end, self.dsml)
        return all(token_id is not None for token_id in chat_ids)


def resolve_special_token_ids(
    token_to_id: Callable[[str], int | None],
    *,
    bos_token: str = BOS_TOKEN,
    eos_token: str = EOS_TOKEN,
    pad_token: str | None = PAD_TOKEN,
) -> SpecialTokenIds:
    """Look up every V4 special token with ``token_to_id`` (``None`` for an unknown token).

    Raises ``ValueError`` naming the token when BOS or EOS is missing.
    """
    bos, eos = token_to_id(bos_token), token_to_id(eos_token)
    for field_name, spelling, token_id in (("bos", bos_token, bos), ("eos", eos_token, eos)):
        if token_id is None:
            raise ValueError(
                f"{field_name}_token {spelling!r} is not in the tokenizer's vocabulary; "
                "expected a DeepSeek-V4 tokenizer that defines it"
            )
    tasks = tuple(
        (task, token_id)
        for task, spelling in TASK_TOKENS.items()
        if (token_id := token_to_id(spelling)) is not None
    )
    return SpecialTokenIds(
        bos=bos,
        eos=eos,
        pad=token_to_id(pad_token) if pad_token is not None else None,
        user=token_to_id(USER_TOKEN),
        assistant=token_to_id(ASSISTANT_TOKEN),
        think_start=token_to_id(THINK_START_TOKEN),
        think_end=token_to_id(THINK_END_TOKEN),
        dsml=token_to_id(DSML_TOKEN),
        latest_reminder=token_to_id(LATEST_REMINDER_TOKEN),
        image=token_to_id(IMAGE_TOKEN),
        draft_noise=token_to_id(DRAFT_NOISE_TOKEN),
        tasks=tasks,
    )
