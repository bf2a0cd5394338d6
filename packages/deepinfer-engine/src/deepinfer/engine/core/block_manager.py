"""Tensor-free manager of the paged KV arena: ref-counted block ids and a free list.

A block holds ``block_size`` sequence tokens. The model's arena stores, for a layer of
compression ratio ``r``, ``block_size / r`` compressed entries per block; this manager knows
nothing of layers: it hands out integer ids, one block table per sequence.

Block 0 is reserved as the null block (the padding target of CUDA graphs and of unused
block-table entries); it is never handed out, so ``num_usable_blocks == num_blocks - 1``.

Sharing: ``n > 1`` samples share the prompt's blocks by reference count (:meth:`share`). A block
whose count is above one is never written; a sequence about to write into one first takes a
private copy (:meth:`copy_on_write`), and the runner copies the block's contents.
"""

from __future__ import annotations

from collections import deque

NULL_BLOCK_ID = 0


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


class BlockManager:
    """Ref-counted block ids ``1 .. num_blocks - 1`` with a FIFO free list."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: expected >= 2 (block 0 is reserved)")
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: expected >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """Fraction of usable blocks in use, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` sequence tokens."""
        return cdiv(num_tokens, self.block_size)

    def can_allocate(self, num_new_blocks: int) -> bool:
        return num_new_blocks <= self.num_free_blocks

    def allocate(self, num_new_blocks: int) -> list[int]:
        """Take ``num_new_blocks`` free blocks (ref count 1 each)."""
        if not self.can_allocate(num_new_blocks):
            raise RuntimeError(
                f"allocate({num_new_blocks}): only {self.num_free_blocks} free blocks"
            )
        block_ids = [self._free.popleft() for _ in range(num_new_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def share(self, block_ids: list[int]) -> list[int]:
        """Add one reference to each block (a forked sequence shares them); returns the ids."""
        for block_id in block_ids:
            self._check_owned(block_id)
            self._ref_counts[block_id] += 1
        return list(block_ids)

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero return to the free list.

        Freed in reverse order so a sequence's tail blocks are reused last-in first-out
        relative to each other (no semantic effect; keeps the free list tidy).
        """
        for block_id in reversed(block_ids):
            self._check_owned(block_id)
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)

    def copy_on_write(self, block_id: int) -> int | None:
        """A private block to write into in place of ``block_id``.

        Returns ``None`` when ``block_id`` is already private (ref count 1). Otherwise takes a
        free block, drops one reference from ``block_id`` and returns the new id; the caller
        must make the runner copy the contents. Raises if no block is free.
        """
        self._check_owned(block_id)
        if self._ref_counts[block_id] == 1:
            return None
        (new_block,) = self.allocate(1)
        self._ref_counts[block_id] -= 1
        return new_block

    def _check_owned(self, block_id: int) -> None:
        if not 0 < block_id < self.num_blocks or self._ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} is not allocated")
