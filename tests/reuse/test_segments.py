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


def test_a_reply_with_its_generation_prompt_shares_the_replys_slots_and_holds_its_own_references():
    seg = _store()
    blocks = _blocks(seg, 8)
    prompt, reply = (1, 2, 3), tuple(range(100, 112))
    home = seg.register_decoded(reply, "coder", start=9, context=1, blocks=blocks)
    own = seg.register_own(prompt + reply, "coder", 6, 7, blocks, [(9, 21, home)])
    assert torch.equal(own.slots[3:], home.slots)                    # one copy of the reply's KV
    message = prompt + reply + (8, 9)                                  # + a trailer
    assert seg.lookup_own(message, "coder", 6, 7) is own              # the longest own home it begins with
    assert seg.find_decoded((5,) + message) == (4, home)              # other agents still find the reply
    seg.lookup_own(message, "coder", 6, 7)                             # (most recently used)
    for b in blocks:
        seg.store.decref(b, cached=False)
    assert seg.evict_one() and seg.find_decoded(message) is None       # the reply went first (LRU)
    assert seg.lookup_own(message, "coder", 6, 7) is own and seg.store.stats().blocks_active > 0
    assert seg.evict_one() and seg.store.stats().blocks_active == 0    # each held its own references
    assert seg.lookup_own(message, "coder", 6, 7) is None


def test_an_agents_own_home_joins_exact_homes_and_its_own_blocks_and_only_it_finds_it():
    seg = _store()
    blocks = _blocks(seg, 8)
    seg.store.k.copy_(torch.randn_like(seg.store.k))
    header_reply = seg.register(tuple(range(100, 110)), "coder", 4, 1, blocks)    # positions [4, 14)
    message = tuple(range(100, 110)) + (7, 8)                                    # + a trailer [14, 16)
    part = seg.register_own(message[:10], "coder", 4, 1, blocks, [(4, 14, header_reply)])
    own = seg.register_own(message, "coder", 4, 1, blocks, [(4, 14, header_reply)])
    assert own is not None and own.own and own.slots.numel() == len(message) and part is not None
    assert torch.equal(own.slots[:10], header_reply.slots)
    trailer = seg.store.k[:, own.slots[10:]]                           # the request's own KV (packed)
    assert torch.equal(trailer, seg.store.k[:, seg.store.slots(blocks, 14, 16)])
    assert seg.lookup_own(message, "coder", 4, 1) is own
    assert seg.lookup_own(message[:10] + (99,), "coder", 4, 1) is part       # a whole home before a slice
    assert seg.lookup(message) is None                                 # never offered to other agents
    assert seg.lookup_own(message, "tester", 4, 1) is None and seg.lookup_own(message, "coder", 5, 1) is None
    assert seg.lookup_own(message, "coder", 4, 2) is None
    assert seg.lookup_own(message[:MIN_DECODED - 1], "coder", 4, 1) is None           # too short a run
    assert seg.register_own(message, "coder", 4, 1, blocks, [(4, 14, header_reply)]) is None
    for b in blocks:
        seg.store.decref(b, cached=False)
    while seg.evict_one():
        pass
    assert seg.store.stats().blocks_active == 0                        # every reference went back


def test_an_own_home_whose_last_tokens_differ_serves_the_run_before_them_as_a_slice():
    """A reply re-encoded from its text can end in other tokens than the model emitted (merged braces
    of a tool call): the run before them is still exact, as a slice sharing the home's slots."""
    seg = _store()
    blocks = _blocks(seg, 8)
    emitted = tuple(range(100, 120))
    own = seg.register_own(emitted, "coder", 4, 1, blocks, [])
    rendered = emitted[:16] + (7, 9)                                    # the last 4 tokens merged into 2
    part = seg.lookup_own(rendered + (5,), "coder", 4, 1)
    assert part is not None and part.own and part.key == emitted[:16] and part is not own
    assert torch.equal(part.slots, own.slots[:16])
    assert seg.lookup_own(rendered, "coder", 4, 1) is part                # made once, then found whole
    assert seg.lookup_own(emitted[:MIN_DECODED - 1] + (7,), "coder", 4, 1) is None
    for b in blocks:
        seg.store.decref(b, cached=False)
    while seg.evict_one():
        pass
    assert seg.store.stats().blocks_active == 0


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
