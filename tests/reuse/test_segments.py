"""Segment store: home views by exact tokens, and decoded replies found inside message segments."""
from __future__ import annotations

import torch

from kvcmas_agents.cache.kv_store import KVStore
from kvcmas_agents.reuse.segments import MIN_DECODED, SegmentStore


def _store() -> SegmentStore:
    kv = KVStore(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, budget_bytes=2 * 4 * 4 * 4 * 64,
                 device=torch.device("cpu"), dtype=torch.float32)
    return SegmentStore(kv)


def _blocks(seg: SegmentStore, n: int) -> list[int]:
    return [seg.store.allocate() for _ in range(n)]


def test_a_decoded_reply_is_found_inside_a_longer_message():
    seg = _store()
    reply = tuple(range(100, 112))
    blocks = _blocks(seg, 8)
    home = seg.register_decoded(reply, "coder", start=9, context=1, blocks=blocks)
    assert home is not None and home.decoded and home.slots.numel() == len(reply)
    message = (1, 2, 3) + reply + (7, 8)               # a role header and a trailer around the reply
    assert seg.find_decoded(message) == (3, home)
    assert seg.find_decoded(message[:-3]) is None      # the reply must occur whole
    assert seg.lookup(message) is None                 # whole-segment lookup is unchanged


def test_the_longest_decoded_reply_wins_and_short_ones_are_not_kept():
    seg = _store()
    blocks = _blocks(seg, 16)
    short = seg.register_decoded(tuple(range(200, 200 + MIN_DECODED)), "a", 0, 1, blocks)
    longer = seg.register_decoded(tuple(range(200, 200 + MIN_DECODED + 4)), "b", 20, 2, blocks)
    assert seg.register_decoded(tuple(range(300, 300 + MIN_DECODED - 1)), "c", 40, 3, blocks) is None
    message = (5,) + tuple(range(200, 200 + MIN_DECODED + 4))
    assert seg.find_decoded(message) == (1, longer) and short is not None


def test_evicting_a_decoded_home_removes_it_from_the_search():
    seg = _store()
    blocks = _blocks(seg, 8)
    reply = tuple(range(100, 110))
    seg.register_decoded(reply, "coder", 0, 1, blocks)
    for b in blocks:
        seg.store.decref(b, cached=False)
    assert seg.evict_one()
    assert seg.find_decoded((1,) + reply) is None
    assert seg.store.stats().blocks_active == 0          # its blocks went back with it


def test_homes_registered_after_a_request_arrived_are_not_offered_to_it():
    seg = _store()
    blocks = _blocks(seg, 8)
    segment, reply = tuple(range(10, 20)), tuple(range(100, 112))
    home = seg.register(segment, "a", 0, 1, blocks)
    decoded = seg.register_decoded(reply, "a", 20, 2, blocks)
    assert seg.lookup(segment, before=home.born) is home and seg.lookup(segment) is home
    assert seg.lookup(segment, before=home.born - 1e-6) is None
    assert seg.find_decoded((1,) + reply, before=decoded.born) == (1, decoded)
    assert seg.find_decoded((1,) + reply, before=decoded.born - 1e-6) is None


def _correction(agent: str, start: int = 0) -> "Correction":
    from kvcmas_agents.reuse.segments import Correction
    return Correction(agent, start, chain=[], own=None, reference="home", recomputed=0)


def test_corrections_are_evicted_least_recently_used_first_and_never_while_read():
    seg = _store()
    a, b, c = _correction("a"), _correction("b"), _correction("c")
    for corr in (a, b, c):
        seg.add_correction((1, 2), 7, corr)
    assert seg.correction("a", (1, 2), 0, 7) is a          # a is now the most recently used
    b.users = 1                                             # a request reads b
    assert seg.evict_correction()                           # c: least recently used of those not read
    assert seg.correction("c", (1, 2), 0, 7) is None and seg.correction("b", (1, 2), 0, 7) is b
    assert seg.evict_correction()                           # a (b is read)
    assert not seg.evict_correction()
    assert seg.corrections_evicted == 2 and list(seg.held_corrections().values()) == [b]
