"""One request's reuse plan as correction, selection and ahead-of-time work read it (``RequestView``).

A cross-agent method builds the view once per request it prepares (``CrossAgentMethod.request_view``);
what reads it then calls no method back: the view lays the plan's pieces out for attention, says where
recomputed rows sit, and carries the method's recompute loop as a plain callable.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

import torch

from .base import ReuseContext, ReuseRequest
from .pieces import ReusePiece
from .recompute import LayerHook
from .views.reference import OwnPiece, SegmentPiece

ViewPiece = Union[OwnPiece, SegmentPiece]
# recompute(rows by piece id, on_layer) -> each piece's rows among all recomputed ones (RequestView.recompute)
Recompute = Callable[[dict[int, torch.Tensor], "LayerHook | None"], dict[int, slice]]


def own_piece(req: ReuseRequest, ctx: ReuseContext, start: int, end: int) -> OwnPiece:
    """The request's own KV of positions [start, end), in its blocks."""
    return OwnPiece(ctx.store.slots(req.blocks, start, end), torch.arange(start, end, device=ctx.device))


def attention_pieces(req: ReuseRequest, ctx: ReuseContext, end: int, include_new: bool = True) -> list[ViewPiece]:
    """The view-attention pieces of a request's context [0, end); include_new=False leaves out new spans
    between reused ones (their KV is not computed yet). Segment pieces read each piece's chain as it
    stands now."""
    out: list[ViewPiece] = []
    a, b = req.own_prefix_end, req.reuse_end
    if a > 0:
        out.append(own_piece(req, ctx, 0, min(a, end)))
    for p in req.pieces:
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
    """A request's plan (``req.pieces``), the context it runs in, and its method's recompute loop.

    recompute(rows, on_layer): recompute ``rows`` (local to each piece, by the piece's id) layer by
    layer over the request's view of [0, reuse_end); ``on_layer`` sees each layer's old and new KV of
    the rows, which sit at the returned slices (``row_spans``).
    """

    req: ReuseRequest
    ctx: ReuseContext
    recompute: Recompute

    def attention_pieces(self, end: int, include_new: bool = True) -> list[ViewPiece]:
        return attention_pieces(self.req, self.ctx, end, include_new)

    def own_piece(self, start: int, end: int) -> OwnPiece:
        return own_piece(self.req, self.ctx, start, end)

    def row_spans(self, rows: dict[int, torch.Tensor]) -> dict[int, slice]:
        return row_spans(self.req.pieces, rows)
