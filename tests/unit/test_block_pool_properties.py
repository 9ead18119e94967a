"""Invariants of the block pool and prefix cache under random admit / grow / commit / free."""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.kv.cache.block_manager import BlockManager
from engine.kv.cache.block_table import BlockTable
from engine.kv.cache.prefix_cache import BlockHashChain

BLOCK_SIZE = 2
NUM_BLOCKS = 12
# A tiny alphabet so that random prompts share prefixes and hit the cache often.
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=10)


class _Seq:
    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids
        self.table = BlockTable()
        self.chain = BlockHashChain(BLOCK_SIZE)
        self.num_computed = 0


class KVMachine(RuleBasedStateMachine):
    @initialize(caching=st.booleans())
    def start(self, caching: bool) -> None:
        self.kv = BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=caching)
        self.seqs: list[_Seq] = []
        # What each block's KV holds: the whole token prefix up to the end of the block.
        self.contents: dict[int, tuple[int, ...]] = {}

    @rule(token_ids=tokens, share_from=st.integers(0, 10))
    def admit(self, token_ids: list[int], share_from: int) -> None:
        seq = _Seq(token_ids)
        prefix = self.kv.cached_prefix(seq.chain, token_ids)
        # Alternatively share a live sequence's committed blocks (as siblings of a request do)
        # when they hold the same tokens.
        if self.seqs:
            other = self.seqs[share_from % len(self.seqs)]
            count = min(other.table.num_committed_blocks, (len(token_ids) - 1) // BLOCK_SIZE)
            while (
                count and other.token_ids[: count * BLOCK_SIZE] != token_ids[: count * BLOCK_SIZE]
            ):
                count -= 1
            if count > len(prefix):
                prefix = other.table.block_ids[:count]
        for index, block in enumerate(prefix):
            assert self.contents[block] == tuple(token_ids[: (index + 1) * BLOCK_SIZE])
        computed = len(prefix) * BLOCK_SIZE
        assert computed < len(token_ids), "at least one token is always left to compute"
        if self.kv.admit(seq.table, prefix, len(token_ids)):
            seq.num_computed = computed
            self.seqs.append(seq)
        else:
            assert not seq.table.block_ids

    @precondition(lambda self: self.seqs)
    @rule(which=st.integers(0, 100))
    def compute_all(self, which: int) -> None:
        seq = self.seqs[which % len(self.seqs)]
        for index in range(seq.num_computed // BLOCK_SIZE, len(seq.token_ids) // BLOCK_SIZE):
            self.contents[seq.table.block_ids[index]] = tuple(
                seq.token_ids[: (index + 1) * BLOCK_SIZE]
            )
        seq.num_computed = len(seq.token_ids)
        self.kv.commit(seq.table, seq.chain, seq.token_ids, seq.num_computed)

    @precondition(lambda self: self.seqs)
    @rule(which=st.integers(0, 100), more=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def grow(self, which: int, more: list[int]) -> None:
        seq = self.seqs[which % len(self.seqs)]
        if seq.num_computed < len(seq.token_ids):
            return  # only computed sequences generate
        free_before = self.kv.num_free_blocks
        if self.kv.grow(seq.table, len(seq.token_ids) + len(more)):
            seq.token_ids.extend(more)
        else:
            assert self.kv.num_free_blocks == free_before

    @precondition(lambda self: self.seqs)
    @rule(which=st.integers(0, 100))
    def free(self, which: int) -> None:
        seq = self.seqs.pop(which % len(self.seqs))
        self.kv.free(seq.table)

    @rule()
    def forget_cache(self) -> None:
        self.kv.reset_prefix_cache()

    @invariant()
    def bookkeeping_is_consistent(self) -> None:
        pool = self.kv.pool
        pool.check_invariants()  # refcounts >= 0, free xor owned, index entries -> owners
        holders = Counter(block for seq in self.seqs for block in seq.table.block_ids)
        for block in range(NUM_BLOCKS):
            assert pool.ref_counts[block] == holders[block]
        for seq in self.seqs:
            assert len(seq.table.block_ids) == self.kv.blocks_for(len(seq.token_ids))

    def teardown(self) -> None:
        for seq in self.seqs:
            self.kv.free(seq.table)
        assert self.kv.num_free_blocks == NUM_BLOCKS
        assert self.kv.usage == 0.0
        self.kv.pool.check_invariants()


KVMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_kv_bookkeeping_invariants = KVMachine.TestCase
