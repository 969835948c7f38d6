"""The KV cache's bookkeeping: fixed-size blocks, owned by sequences, shared by equal prefixes.

A sequence's KV lives in the blocks of its block table, `block_size` tokens
each, so no memory is spent on padding. A full block is known by a hash of
its tokens and of every token before it; once its KV has been computed it is
registered under that hash, and a later sequence whose prompt starts with the
same tokens takes the block instead of computing it again. A block that holds
an image's placeholder tokens is known by that image's digest too: the same
placeholders stand for any image of that size; a block computed under a LoRA
adapter, by the adapter too. A freed block
keeps its hash, and its KV, until the allocator hands it out anew (oldest
freed first), so a preempted sequence usually finds its own prefix again.

Routers name prompt prefixes without tokens (bus/prefixes.py); a sequence
marks the blocks where its named prefixes end, and the manager reports a
name as cached once such a block's KV is computed, and as gone once that
block is handed out anew.
"""

from __future__ import annotations

from collections import OrderedDict

from workers.engine.sequence import Sequence


def _chain_hash(previous: int, content: tuple) -> int:
    return hash((previous, *content))


def block_content(sequence: Sequence, start: int, end: int) -> tuple:
    """What tells a block of tokens [start, end) apart: its tokens, the digests of images placed there, and the
    LoRA adapter it is computed under (its keys and values are the adapter's: no other sequence may take them)."""
    content = tuple(sequence.tokens(start, end))
    if sequence.images is not None:
        content += sequence.images.digests_between(start, end)
    request = sequence.request
    return content if request.adapter is None else (*content, ("adapter", request.adapter, request.adapter_path))


class _Block:
    __slots__ = ("hash", "ref_count", "tokens")

    def __init__(self) -> None:
        self.ref_count = 0
        self.hash: int | None = None
        self.tokens: tuple = ()  # its content (block_content), kept to rule out hash collisions


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # least recently freed first
        self._by_hash: dict[int, int] = {}
        self.reused_tokens = 0  # prompt tokens whose KV came from the cache, since start
        self._prefixes_of: dict[int, list[int]] = {}  # block id -> prefix hashes it holds the end of
        self._prefixes: set[int] = set()  # every prefix hash held
        self._prefixes_added: list[int] = []  # since drain_prefix_changes
        self._prefixes_removed: list[int] = []

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _cached_prefix(self, sequence: Sequence) -> list[int]:
        """Blocks holding the computed KV of the sequence's first tokens, from other sequences or its own past.

        At least the last token is left out, so that a step still computes the
        logits to sample from (or the hidden state to pool). A request that
        needs every prompt token's hidden state reuses none (Sequence.computes_whole_prompt).
        """
        if sequence.computes_whole_prompt:
            return []
        found: list[int] = []
        previous = 0
        for start in range(0, sequence.num_tokens - 1 - self.block_size + 1, self.block_size):
            content = block_content(sequence, start, start + self.block_size)
            previous = _chain_hash(previous, content)
            block_id = self._by_hash.get(previous)
            if block_id is None or self._blocks[block_id].tokens != content:
                break
            found.append(block_id)
        return found

    def can_allocate(self, sequence: Sequence) -> bool:
        cached = self._cached_prefix(sequence)
        reusable_free = sum(1 for b in cached if self._blocks[b].ref_count == 0)
        needed = self.blocks_for(sequence.num_tokens) - len(cached)
        return needed <= self.free_blocks - reusable_free

    def allocate(self, sequence: Sequence) -> None:
        """Give a sequence blocks for all its tokens, reusing the cached prefix; call can_allocate first."""
        assert not sequence.block_table
        cached = self._cached_prefix(sequence)
        for block_id in cached:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        sequence.block_table = list(cached)
        for index, block_id in enumerate(cached):
            self._hold_prefixes(block_id, sequence.prefix_marks.get(index, ()))
        sequence.num_cached_tokens = len(cached) * self.block_size
        self.reused_tokens += sequence.num_cached_tokens
        while len(sequence.block_table) < self.blocks_for(sequence.num_tokens):
            sequence.block_table.append(self._take_free())

    def _take_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        if block.hash is not None and self._by_hash.get(block.hash) == block_id:
            del self._by_hash[block.hash]  # its old KV is about to be overwritten
        for prefix in self._prefixes_of.pop(block_id, ()):
            self._prefixes.discard(prefix)
            self._prefixes_removed.append(prefix)
        block.hash, block.tokens, block.ref_count = None, (), 1
        return block_id

    def free(self, sequence: Sequence) -> None:
        for block_id in reversed(sequence.block_table):  # a prefix's head outlives its tail
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
        sequence.block_table = []
        sequence.num_cached_tokens = 0

    def can_grow(self, sequence: Sequence, num_tokens: int) -> bool:
        """Whether the sequence's table can cover `num_tokens` tokens."""
        return self.blocks_for(num_tokens) - len(sequence.block_table) <= self.free_blocks

    def grow(self, sequence: Sequence, num_tokens: int) -> None:
        while len(sequence.block_table) < self.blocks_for(num_tokens):
            sequence.block_table.append(self._take_free())

    def shrink(self, sequence: Sequence, num_tokens: int) -> None:
        """Free the blocks of the sequence's table past its first `num_tokens` tokens (rejected proposals':
        speculation.py); nothing registered them, as none was full of computed tokens."""
        while len(sequence.block_table) > self.blocks_for(num_tokens):
            block_id = sequence.block_table.pop()
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    def computed(self, sequence: Sequence, num_cached_tokens: int) -> None:
        """The KV of the sequence's first `num_cached_tokens` tokens now exists: register its full blocks."""
        first_new = sequence.num_cached_tokens // self.block_size
        full = num_cached_tokens // self.block_size
        if full > first_new:  # a block filled up (once every block_size decode steps)
            self._register(sequence, first_new, full)
        sequence.num_cached_tokens = num_cached_tokens

    def _register(self, sequence: Sequence, first: int, end: int) -> None:
        """Register the sequence's full blocks first..end-1 under their chained hashes."""
        previous = self._blocks[sequence.block_table[first - 1]].hash if first else 0
        for index in range(first, end):
            block_id = sequence.block_table[index]
            block = self._blocks[block_id]
            content = block_content(sequence, index * self.block_size, (index + 1) * self.block_size)
            previous = _chain_hash(previous, content)
            if block.hash is None:
                block.hash, block.tokens = previous, content
                self._by_hash.setdefault(previous, block_id)
            self._hold_prefixes(block_id, sequence.prefix_marks.get(index, ()))

    def _hold_prefixes(self, block_id: int, prefixes) -> None:
        for prefix in prefixes:
            if prefix not in self._prefixes:
                self._prefixes.add(prefix)
                self._prefixes_of.setdefault(block_id, []).append(prefix)
                self._prefixes_added.append(prefix)

    def drain_prefix_changes(self) -> tuple[list[int], list[int]]:
        """The prefix hashes cached, and those no longer cached, since the last call."""
        added = [p for p in dict.fromkeys(self._prefixes_added) if p in self._prefixes]
        removed = [p for p in dict.fromkeys(self._prefixes_removed) if p not in self._prefixes]
        self._prefixes_added, self._prefixes_removed = [], []
        return added, removed
