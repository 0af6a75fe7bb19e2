"""KVCMAS selection: which reused rows a request recomputes.

The prompt's tail runs over the realigned (and already corrected) view; each reused token is ranked by
the attention mass the tail's queries put on it, summed over layers and heads, and the top
``recompute_ratio`` are recomputed. Frames, and the newest reused message, are recomputed whole.
"""
from __future__ import annotations


import torch

from ..base import ReuseContext
from ..pieces import MAX_FRAME, ReusePiece
from ..request_view import RequestView, ViewPiece
from ..views.dense import gathered_mass_attention
from ..views.gather import build_gathered
from ..views.reference import SegmentPiece


# How far back from the tail rows are recomputed whole as the newest reused message (and the reply
# before a hand-off). Past it a long newest message (a pasted document, a long code block) is ranked by
# attention mass like older history: recomputing it whole would cost as much as prefilling it.
NEWEST_SPAN = 256
# Selection queries are at most the prompt's last SELECT_MAX tokens. A long new message as the tail (a
# tool's output, a pasted document) would otherwise make selection a second pass over all of it, with
# every query's attention mass kept. A cut tail's last tokens then attend to the reused view and to
# themselves, not to the tail's start: a stand-in, as an ahead-of-time correction's queries are.
SELECT_MAX = 512


def select_rows(view: RequestView, pending: list[ReusePiece], newest_whole: bool) -> tuple[list[torch.Tensor], str]:
    """Rows (local to each pending piece) to recompute, and how they were chosen: "ratio" (the pass ran),
    "capped" (it ran on the prompt's last SELECT_MAX tokens), "all" (the ratio and the forced rows leave
    none out), "skipped" (every row: the pass would cost more than it spares) or "none".

    Frames are recomputed whole on top of the ratio: they were new text, computed in full, before they
    had homes, and are few tokens. So is the newest reused message, up to NEWEST_SPAN tokens back from
    the tail (``forced_rows``). The pass is a forward of its queries over the whole view, and a query
    costs about what a recomputed row costs; so when it would spare no more rows than it has queries
    (a short new segment corrected ahead of time at a high ratio), every row is recomputed instead:
    cheaper, and every row recomputed rather than a share of them."""
    req = view.req
    total = sum(p.end - p.start for p in pending)
    whole = newest_pieces(view, pending) if newest_whole and req.options.recompute_ratio > 0 else set()
    forced_of = [forced_rows(view.reuse_end, p, id(p) in whole) for p in pending]
    forced = sum(int(f.sum()) for f in forced_of)
    k = round(req.options.recompute_ratio * (total - forced)) + forced
    if k == 0:
        return [torch.arange(0) for _ in pending], "none"
    if k >= total:
        return [torch.arange(p.end - p.start) for p in pending], "all"
    qs, _ = selection_queries(view)
    if total - k <= len(req.prompt_ids) - qs:
        return [torch.arange(p.end - p.start) for p in pending], "skipped"
    mass, capped = attention_mass(view, pending)
    mass = torch.cat([m.masked_fill(f.to(m.device), float("inf")) for m, f in zip(mass, forced_of)])
    top = torch.topk(mass, k).indices.sort().values
    out, offset = [], 0
    for p in pending:
        size = p.end - p.start
        out.append((top[(top >= offset) & (top < offset + size)] - offset).cpu())
        offset += size
    return out, "capped" if capped else "ratio"


def forced_rows(reuse_end: int, piece: ReusePiece, newest: bool) -> torch.Tensor:
    """Mask [n] of a pending piece's rows recomputed whatever their mass: all of a frame's, and a newest
    piece's within NEWEST_SPAN tokens of the reused part's end."""
    n = piece.end - piece.start
    if piece.frame:
        return torch.ones(n, dtype=torch.bool)
    if not newest:
        return torch.zeros(n, dtype=torch.bool)
    return torch.arange(piece.start, piece.end) >= reuse_end - NEWEST_SPAN


def attention_mass(view: RequestView, pending: list[ReusePiece]) -> tuple[list[torch.Tensor], bool]:
    """The attention mass [n] each pending piece's tokens get from the selection queries, and whether
    those were cut to the prompt's last SELECT_MAX tokens."""
    req, ctx = view.req, view.ctx
    b, n = view.reuse_end, len(req.prompt_ids)
    qs, capped = selection_queries(view)
    tail = max(qs, b)                          # own keys [tail, n) follow the reused view [0, b)
    pieces = view.attention_pieces(b, include_new=False) + ([view.own_piece(tail, n)] if n > tail else [])
    spans, offset = [], 0                      # where each pending piece's keys sit in the view
    starts = {p.start for p in pending}
    for pc in pieces:
        size = pc.slots.numel()
        if isinstance(pc, SegmentPiece) and pc.positions[0].item() in starts:
            spans.append((offset, offset + size))
        offset += size
    positions = torch.arange(qs, n, device=ctx.device)
    backend = MassBackend(ctx, pieces, ctx.store.slots(req.blocks, tail, n), positions, spans, skip=tail - qs)
    ctx.model.forward(torch.tensor(req.prompt_ids[qs:n], device=ctx.device), positions, backend)
    return backend.mass, capped


def selection_queries(view: RequestView) -> tuple[int, bool]:
    """Where the selection queries start, and whether they were cut to the prompt's last SELECT_MAX
    tokens. They are the own tail, or from view.select_from on (an ahead-of-time correction also queries
    the last reused message, since the real tail is not known yet)."""
    b, n = view.reuse_end, len(view.req.prompt_ids)
    qs = min(view.select_from, b) if view.select_from is not None else b
    return (n - SELECT_MAX, True) if qs < n - SELECT_MAX else (qs, False)


def newest_pieces(view: RequestView, pending: list[ReusePiece]) -> set[int]:
    """ids of the pending pieces recomputed whole (up to NEWEST_SPAN tokens back, ``forced_rows``): the
    newest reused message, the one right before the own tail (at most a frame's tokens between), and
    back to the newest reused reply when that starts within NEWEST_SPAN tokens of the tail (a hand-off
    line often follows it). No ahead-of-time correction can cover that reply: it was still being decoded."""
    if view.select_from is not None:
        return set()        # ahead of time: the real request's newest message (a reply) is not known yet
    b = view.reuse_end
    last = next((i for i in range(len(pending) - 1, -1, -1) if not pending[i].frame), None)
    if last is None or b - pending[last].end > MAX_FRAME:
        return set()
    reply = next((i for i in range(last, -1, -1) if pending[i].home.decoded), None)
    if reply is not None and b - pending[reply].start <= NEWEST_SPAN:
        last = min(last, reply)           # (its frames are recomputed whole anyway)
    return {id(p) for p in pending[last:]}


class MassBackend:
    """Attention for the selection pass: writes the tail's KV, attends over the gathered view and sums
    the mass that lands on the pending pieces' keys."""

    def __init__(self, ctx: ReuseContext, pieces: list[ViewPiece], write_slots: torch.Tensor,
                 q_positions: torch.Tensor, spans: list[tuple[int, int]], skip: int = 0):
        self.ctx, self.write_slots, self.q_positions, self.spans = ctx, write_slots, q_positions, spans
        self.skip = skip          # leading queries that sit inside reused pieces: their KV is not written
        dev = q_positions.device
        self.view = build_gathered(pieces, ctx.realigner, dev, ctx.store.k.dtype)
        self.key_positions = torch.cat([p.positions for p in pieces]).to(dev)
        self.mass = [torch.zeros(b - a, device=dev) for a, b in spans]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        store = self.ctx.store
        store.write(layer, self.write_slots, k[self.skip:], v[self.skip:])
        out, mass = gathered_mass_attention(q, self.q_positions, self.key_positions, self.view,
                                            store.k[layer], store.v[layer], layer, self.ctx.model.scale)
        for acc, (a, b) in zip(self.mass, self.spans):
            acc += mass[a:b]
        return out
