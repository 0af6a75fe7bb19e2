"""One request's reuse plan as a cross-agent method keeps it (``CrossAgentState``), and as correction,
selection and ahead-of-time work read it (``RequestView``).

A cross-agent method builds the view once per request it prepares (``CrossAgentMethod.request_view``);
what reads it then calls no method back: the view lays the plan's pieces out for attention, says where
recomputed rows sit, and carries the method's recompute loop as a plain callable.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Union

import torch

from .base import ReuseContext, ReuseRequest
from .pieces import ReusePiece
from .recompute import LayerHook
from .views.reference import OwnPiece, SegmentPiece

ViewPiece = Union[OwnPiece, SegmentPiece]
# recompute(rows by piece id, on_layer) -> each piece's rows among all recomputed ones (RequestView.recompute)
Recompute = Callable[[dict[int, torch.Tensor], "LayerHook | None"], dict[int, slice]]


@dataclass
class CrossAgentState:
    """A cross-agent method's own state of one request: the pieces its plan reuses, between the own
    prefix [0, own_prefix_end) and the own tail from reuse_end on, and what the method did since."""

    pieces: list[ReusePiece] = field(default_factory=list)
    own_prefix_end: int = 0
    reuse_end: int = 0
    registered: bool = False            # the home views of its own segments are registered
    view_base: Any = None               # (layout key, GatheredView of [0, reuse_end)), kept while it decodes

    def owns(self, start: int, end: int) -> bool:
        """True when the request computes the KV of positions [start, end) itself."""
        if end <= self.own_prefix_end or start >= self.reuse_end:
            return True
        return any(p.home is None and p.start <= start and end <= p.end for p in self.pieces)

    def own_spans(self) -> tuple[tuple[int, int], ...]:
        """Spans inside the reused part that need the request's own KV (new text, private copies)."""
        return tuple((p.start, p.end) for p in self.pieces if p.home is None or p.private)


def own_piece(req: ReuseRequest, ctx: ReuseContext, start: int, end: int) -> OwnPiece:
    """The request's own KV of positions [start, end), in its blocks."""
    return OwnPiece(ctx.store.slots(req.blocks, start, end), torch.arange(start, end, device=ctx.device))


def attention_pieces(req: ReuseRequest, st: CrossAgentState, ctx: ReuseContext, end: int,
                     include_new: bool = True) -> list[ViewPiece]:
    """The view-attention pieces of a request's context [0, end) under its plan ``st``; include_new=False
    leaves out new spans between reused ones (their KV is not computed yet). Segment pieces read each
    piece's chain as it stands now."""
    out: list[ViewPiece] = []
    a, b = st.own_prefix_end, st.reuse_end
    if a > 0:
        out.append(own_piece(req, ctx, 0, min(a, end)))
    for p in st.pieces:
        if p.home is None or p.private:
            if p.start < end and (include_new or p.private):
                out.append(own_piece(req, ctx, p.start, min(p.end, end)))
            continue
        out.append(SegmentPiece(p.home.slots, torch.arange(p.start, p.end, device=ctx.device), p.delta, p.chain))
    if end > b:
        out.append(own_piece(req, ctx, b, end))
    return out


def row_spans(pieces: list[ReusePiece], rows: dict[int, torch.Tensor]) -> dict[int, slice]:
    """Where each piece's rows (by the piece's id) sit among all recomputed rows, pieces in position order."""
    spans, offset = {}, 0
    for p in pieces:
        if id(p) in rows:
            spans[id(p)] = slice(offset, offset + rows[id(p)].numel())
            offset += rows[id(p)].numel()
    return spans


@dataclass(frozen=True)
class RequestView:
    """A request, its plan (``state``), the context it runs in, and its method's recompute loop.

    recompute(rows, on_layer): recompute ``rows`` (local to each piece, by the piece's id) layer by
    layer over the request's view of [0, reuse_end); ``on_layer`` sees each layer's old and new KV of
    the rows, which sit at the returned slices (``row_spans``). select_from: where the selection pass's
    queries start (an ahead-of-time correction's stand-in tail; None: reuse_end).
    """

    req: ReuseRequest
    ctx: ReuseContext
    state: CrossAgentState
    recompute: Recompute
    select_from: int | None = None

    @property
    def pieces(self) -> list[ReusePiece]:
        return self.state.pieces

    @property
    def own_prefix_end(self) -> int:
        return self.state.own_prefix_end

    @property
    def reuse_end(self) -> int:
        return self.state.reuse_end

    def attention_pieces(self, end: int, include_new: bool = True) -> list[ViewPiece]:
        return attention_pieces(self.req, self.state, self.ctx, end, include_new)

    def own_piece(self, start: int, end: int) -> OwnPiece:
        return own_piece(self.req, self.ctx, start, end)

    def row_spans(self, rows: dict[int, torch.Tensor]) -> dict[int, slice]:
        return row_spans(self.state.pieces, rows)
