"""Home views keep whole blocks in place and pack the tokens of their partial blocks."""
from __future__ import annotations

import torch

from kvcmas_agents.cache.kv_store import KVStore
from kvcmas_agents.reuse.segments import SegmentStore

BS = 4


def _filled() -> tuple[SegmentStore, list[int]]:
    kv = KVStore(num_layers=2, num_kv_heads=1, head_dim=3, block_size=BS, budget_bytes=2 * 2 * BS * 3 * 4 * 32,
                 device=torch.device("cpu"), dtype=torch.float32)
    blocks = [kv.allocate() for _ in range(8)]          # a request's blocks, positions [0, 32)
    slots = kv.slots(blocks, 0, 8 * BS)
    kv.k[:, slots] = torch.randn(2, slots.numel(), 1, 3)
    kv.v[:, slots] = torch.randn(2, slots.numel(), 1, 3)
    return SegmentStore(kv), blocks


def _end_request(seg: SegmentStore, blocks: list[int]) -> None:
    for b in blocks:
        seg.store.decref(b, cached=False)


def test_partial_blocks_are_packed_with_their_kv_and_whole_blocks_stay():
    seg, blocks = _filled()
    kv = seg.store
    original = kv.slots(blocks, 0, 8 * BS)
    want_k, want_v = kv.k[:, original].clone(), kv.v[:, original].clone()
    a = seg.register((1, 2, 3), "planner", 5, 0, blocks)              # inside block 1
    b = seg.register(tuple(range(10, 23)), "planner", 9, 1, blocks)   # [9, 22): blocks 3, 4 whole
    assert blocks[3] in b.blocks and blocks[4] in b.blocks
    assert blocks[1] not in a.blocks and blocks[2] not in b.blocks and blocks[5] not in b.blocks
    _end_request(seg, blocks)
    for home, start in ((a, 5), (b, 9)):
        n = len(home.key)
        assert torch.equal(kv.k[:, home.slots], want_k[:, start:start + n])
        assert torch.equal(kv.v[:, home.slots], want_v[:, start:start + n])
    # 3 + 3 + 2 packed tokens share two pack blocks; with the two whole blocks that is 4 (was 6).
    assert kv.stats().blocks_active == len(seg.home_blocks) == 4


def test_evicting_every_home_returns_to_baseline_and_packing_starts_afresh():
    seg, blocks = _filled()
    seg.register((1, 2), "a", 1, 0, blocks)
    seg.register((3, 4), "b", 13, 0, blocks)
    _end_request(seg, blocks)
    assert seg.store.stats().blocks_active == 1                      # both share one pack block
    seg.clear()
    assert seg.store.stats().blocks_active == 0
    blocks = [seg.store.allocate() for _ in range(2)]
    home = seg.register((6, 7), "c", 1, 0, blocks)
    _end_request(seg, blocks)
    assert seg.store.ref[home.blocks[0]] == 1 and seg.store.stats().blocks_active == 1


def test_without_room_for_a_pack_block_the_partial_block_is_held_in_place():
    seg, blocks = _filled()
    seg.packer.can_allocate = lambda: False
    home = seg.register((1, 2, 3), "a", 5, 0, blocks)
    assert home.blocks == [blocks[1]]
    assert torch.equal(home.slots, seg.store.slots(blocks, 5, 8))
