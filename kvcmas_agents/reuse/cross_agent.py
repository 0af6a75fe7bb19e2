"""Cross-agent reuse: plan a prompt into spans served by other contexts' home views, and lay out the
attention view over them. The base of "naive", "kvcmas" and the baselines; "naive" is it alone.

Per request of agent X (docs/method.md):
  plan  - split the prompt into [own prefix] + [segments found in the segment store] + [own tail]; a
          segment X itself computed at the same place is reused exactly, the others as the subclass
          decides (``_classify``); new text between reused spans is computed with them in ``prepare``.
  view  - attention reads realign(home) + corrections, never a materialized copy (``views``).
  homes - once X's prompt is computed, its own segments become home views; its reply's decode KV too.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

import torch

from .base import ReuseMethod, ReuseRequest
from .pieces import MAX_FRAME, ReusePiece
from .plan import ReusePlan, RequestStates
from .recompute import LayerHook, recompute
from .registry import register
from .request_view import CrossAgentState, RequestView, attention_pieces, row_spans
from .segments import HomeView, context_key
from .views import build_view
from .views.dense import gathered_kv
from .views.gather import GatheredView, build_gathered


class CrossAgentMethod(ReuseMethod):
    cross_agent = True

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.states: RequestStates[CrossAgentState] = RequestStates(CrossAgentState)

    def kept_code_bytes(self) -> int:
        """What running requests' kept views hold besides their KV (unpacked correction codes)."""
        # (stats read it from other threads: each state's view base is read once)
        return sum(vb[1].kept_bytes() for st in self.states.values() if (vb := st.view_base) is not None)

    def state_bytes(self) -> int:
        return self.kept_code_bytes()

    # --- planning (at admission) ---------------------------------------------------------------
    def plan(self, req: ReuseRequest) -> ReusePlan:
        ids, agent, segments = req.prompt_ids, req.agent, self.ctx.segments
        segs = [s for s in req.prompt.segments if s.kind != "suffix" and s.length > 0]
        pieces: list[ReusePiece] = []
        own_prefix_end = 0
        contexts: dict[int, int] = {}          # context_key by start: a hash over the prompt up to it

        def context(start: int) -> int:
            if start not in contexts:
                contexts[start] = context_key(agent, ids, start)
            return contexts[start]
        parts = (part for seg in segs
                 for part in self._parts(ids, seg.start, seg.end, req.arrival, agent, context(seg.start)))
        for start, end, home, frame in parts:
            ctx = context(start)
            if home is None:
                if not pieces:
                    own_prefix_end = end           # e.g. this agent's new system prompt
                else:                              # new text between reused ones: computed in prepare
                    pieces.append(ReusePiece(None, start, end, ctx, pending=True))
                continue
            piece = ReusePiece(home, start, end, ctx, frame=frame)
            if piece.delta == 0 and (start == 0 or (home.agent == agent and home.context == ctx)):
                piece.exact = True                 # same tokens under the same view: KV is identical
            else:
                self._classify(req, piece, tuple(ids[start:end]))
            pieces.append(piece)
        if pieces and pieces[-1].end >= len(ids):
            pieces.pop()                           # keep at least one token to prefill for logits
        while pieces and pieces[-1].home is None:
            pieces.pop()                           # trailing new text belongs to the own tail
        st = self.states.set(req, CrossAgentState(pieces, own_prefix_end, pieces[-1].end if pieces else own_prefix_end))
        for p in pieces:
            if p.home is not None:
                segments.pin(p.home)
        return ReusePlan(cached_tokens=sum(p.end - p.start for p in pieces if p.exact),
                         reused_tokens=sum(p.end - p.start for p in pieces if p.home is not None and not p.exact),
                         own_prefix_end=st.own_prefix_end, reuse_end=st.reuse_end, own_spans=st.own_spans())

    def _classify(self, req: ReuseRequest, piece: ReusePiece, tokens: tuple[int, ...]) -> None:
        """Decide how a piece reused from another context is served; naive reuse leaves it as it is
        (realigned, uncorrected)."""

    def _parts(self, ids: list[int], start: int, end: int, arrival: float, agent: str,
               context: int) -> list[tuple[int, int, Any, bool]]:
        """A message segment as (start, end, home, frame) parts: the whole segment's home view; else a
        decoded reply found inside it, between header and trailer (frame) parts; else new text. First,
        the agent's own home at the same place after ``context`` (the segment start's context_key;
        ``SegmentStore.register_own``): its reply with the generation prompt it was decoded from
        (``on_finish``), then followed by the trailer as a frame,
        or the whole message once a request computed that trailer (``on_computed``); so a tool loop's
        next turns recompute no header or trailer.

        Only home views registered before the request arrived count, so what a request reuses does not
        depend on when the worker admits it: concurrent siblings (a fan-out) each compute the new text
        they share, as when admitted in one step, instead of reusing whichever one ran first."""
        segments = self.ctx.segments
        tokens = tuple(ids[start:end])
        own = segments.lookup_own(tokens, agent, start, context, arrival)
        if own is not None and len(tokens) - len(own.key) <= MAX_FRAME:
            mid = start + len(own.key)
            return [(start, mid, own, False)] + ([(mid, end, segments.lookup(tokens[mid - start:], arrival), True)]
                                                 if mid < end else [])
        home = segments.lookup(tokens, arrival)
        if home is not None:
            return [(start, end, home, False)]
        found = segments.find_decoded(tokens, arrival)
        # Only a reply decoded (almost) whole: a partial one would leave most of the message as new
        # text that every later agent computes again under its partly corrected view.
        if found is None or len(tokens) - len(found[1].key) > MAX_FRAME:
            return [(start, end, None, False)]
        offset, home = found
        a, b = start + offset, start + offset + len(home.key)
        # The header and trailer around the reply reuse the home of the same frame tokens (registered by
        # the first request that computed them), so no agent recomputes every message's frame each turn.
        return [(s, e, home, False) if s == a else (s, e, segments.lookup(tuple(ids[s:e]), arrival), True)
                for s, e in ((start, a), (a, b), (b, end)) if e > s]

    def release(self, req: ReuseRequest) -> None:
        st = self.states.pop(req)
        if st is not None:
            self._let_go(st)

    def _let_go(self, st: CrossAgentState) -> None:
        """Unpin what the plan's pieces read: the request reads no reused KV from now on."""
        for p in st.pieces:
            if p.home is not None:
                self.ctx.segments.unpin(p.home)
        st.pieces = []
        st.view_base = None

    # --- preparing: new text between reused spans ------------------------------------------------
    def pending(self, req: ReuseRequest) -> bool:
        st = self.states.get(req)
        return st is not None and any(p.pending for p in st.pieces)

    def prepare(self, req: ReuseRequest) -> None:
        st = self.states(req)
        new = [p for p in st.pieces if p.home is None]
        if new:
            self.recompute_over_view(req, st, {id(p): torch.arange(p.end - p.start) for p in new})
            for p in new:
                p.pending = False

    def request_view(self, req: ReuseRequest, select_from: int | None = None) -> RequestView:
        """The request's plan as correction and selection read it, with this method's recompute loop
        (``select_from``: an ahead-of-time correction's first selection query)."""
        st = self.states(req)
        return RequestView(req, self.ctx, st, partial(self.recompute_over_view, req, st), select_from)

    def recompute_over_view(self, req: ReuseRequest, st: CrossAgentState, rows: dict[int, torch.Tensor],
                            on_layer: LayerHook | None = None) -> dict[int, slice]:
        """Recompute ``rows`` (local to each piece, by the piece's id) layer by layer over the request's
        view of [0, reuse_end). New text's KV is written to the request's own blocks; ``on_layer`` sees
        every recomputed row's old (view) and new KV at each layer, the pieces' rows at the slices
        returned, in position order."""
        ctx, dev = self.ctx, self.ctx.device
        order = [p for p in st.pieces if id(p) in rows]                        # position order
        spans = row_spans(st.pieces, rows)
        positions = torch.cat([p.start + rows[id(p)].to(dev) for p in order])
        new = [(ctx.store.slots(req.blocks, p.start, p.end), spans[id(p)]) for p in order if p.home is None]
        view = build_gathered(attention_pieces(req, st, ctx, st.reuse_end), ctx.realigner, dev, ctx.store.k.dtype)

        def hook(layer, pos, k_old, v_old, k_new, v_new):
            for slots, span in new:                         # new text: exact, kept in own blocks
                ctx.store.write(layer, slots, k_new[span], v_new[span])
            if on_layer is not None:
                on_layer(layer, pos, k_old, v_old, k_new, v_new)
            return None

        with req.timings.phase("recompute"):
            recompute(ctx.model, torch.tensor(req.prompt_ids), positions,
                      lambda layer: gathered_kv(view, ctx.store.k[layer], ctx.store.v[layer], layer), hook)
        return spans

    # --- attention layout ------------------------------------------------------------------------
    def view(self, req: ReuseRequest, end: int) -> Any:
        st = self.states.get(req)
        if st is None or not st.pieces or end <= st.own_prefix_end:
            return None
        if self.ctx.view_path == "gather":
            return self.gathered_view(req, st, end)
        return build_view(self.ctx.view_path, attention_pieces(req, st, self.ctx, end), self.ctx.realigner,
                          self.ctx.device, self.ctx.store.k.dtype)

    def gathered_view(self, req: ReuseRequest, st: CrossAgentState, end: int) -> GatheredView:
        """The gather path's layout of a request's context [0, end). The reused part [0, reuse_end) is
        laid out once and kept in the request's state, so a decode step only appends its own tail's slots."""
        ctx, b = self.ctx, st.reuse_end
        if end <= b:
            return build_gathered(attention_pieces(req, st, ctx, end), ctx.realigner, ctx.device, ctx.store.k.dtype)
        key = (b, st.own_prefix_end, tuple((p.start, p.end, len(p.chain), p.pending, p.private) for p in st.pieces))
        if st.view_base is None or st.view_base[0] != key:
            view = replace(build_gathered(attention_pieces(req, st, ctx, b), ctx.realigner, ctx.device,
                                          ctx.store.k.dtype), keep=True)
            st.view_base = (key, view)
        return st.view_base[1].extend(ctx.store.slots(req.blocks, b, end))

    def copy_view(self, req: ReuseRequest) -> bool:
        """Write the request's view of [0, reuse_end) (realigned, corrected) into blocks of its own, so that
        its decode steps read plain paged KV instead of the view. The blocks are the request's: counted in
        KV memory and freed when it ends. False (nothing changed) when they do not fit the budget."""
        ctx, st = self.ctx, self.states.get(req)
        if st is None or not st.pieces or st.reuse_end == 0:
            return False
        if not ctx.own_holes(req):            # (the view below reads none of the holes' new blocks)
            return False
        store, b = ctx.store, st.reuse_end
        view = build_gathered(attention_pieces(req, st, ctx, b), ctx.realigner, ctx.device, store.k.dtype)
        dst = store.slots(req.blocks, 0, b)
        for layer in range(ctx.model.args.num_layers):
            k, v = gathered_kv(view, store.k[layer], store.v[layer], layer)     # a fresh gather: safe to write back
            store.write(layer, dst, k, v)
        self._let_go(st)                      # the homes are no longer read: unpinned
        st.own_prefix_end = b                 # all of [0, reuse_end) is the request's own KV now
        return True

    # --- home views ------------------------------------------------------------------------------
    def on_computed(self, req: ReuseRequest) -> None:
        """Once the prompt is computed, its own (non-reused) segments become home views."""
        st = self.states(req)
        if st.registered or req.in_prefill:
            return
        st.registered = True
        ids = req.prompt_ids
        spans = [(seg.start, seg.end) for seg in req.prompt.segments
                 if seg.kind != "suffix" and seg.length > 0 and st.owns(seg.start, seg.end)]
        spans += [(p.start, p.end) for p in st.pieces if p.home is None]   # frames around reused replies
        for start, end in spans:
            self.ctx.segments.register(tuple(ids[start:end]), req.agent, start, context_key(req.agent, ids, start),
                                       req.blocks)
        for seg in req.prompt.segments:
            exact = self._held_exactly(st, seg.start, seg.end) if seg.kind != "suffix" else None
            if exact:
                self.ctx.segments.register_own(tuple(ids[seg.start:seg.end]), req.agent, seg.start,
                                               context_key(req.agent, ids, seg.start), req.blocks, exact)

    @staticmethod
    def _held_exactly(st: CrossAgentState, start: int, end: int) -> list[tuple[int, int, HomeView]] | None:
        """The exact pieces [a, b) (with their homes) of a segment the request holds exactly in parts:
        some of it read exactly from home views, the rest computed by the request. None when part of it
        is reused from another context, or it is one home view already, or all the request's own."""
        exact = []
        for p in st.pieces:
            if p.end <= start or p.start >= end or p.home is None:
                continue
            if not p.exact or p.private:
                return None
            exact.append((max(p.start, start), min(p.end, end), p.home))
        if not exact or (len(exact) == 1 and exact[0][:2] == (start, end)):
            return None
        return exact

    def on_finish(self, req: ReuseRequest, reason: str) -> None:
        """A finished reply's generated tokens with KV become a home view (its decode's own KV)."""
        if reason not in ("stop", "length") or not req.prompt.prefix_stable:
            return
        begin, store = len(req.prompt_ids), self.ctx.store
        n = req.num_computed - begin              # the last sampled token was never fed: no KV
        last = req.prompt.segments[-1] if req.prompt.segments else None
        g = last.start if last is not None and last.kind == "suffix" and last.end == begin else begin
        if n <= 0 or not req.blocks or min(req.blocks[g // store.block_size:], default=0) < 0:
            return
        segments, ids = self.ctx.segments, req.all_ids
        reply = segments.register_decoded(tuple(ids[begin:begin + n]), req.agent, begin,
                                          context_key(req.agent, ids, begin), req.blocks)
        # With the generation prompt, as the agent's own next message renders it (``_parts``): sharing the
        # reply's slots, it holds only the prompt's few packed slots more. A reply whose tokens already
        # had a home keeps none (its own copy would be a second one).
        if reply is not None and g < begin:
            segments.register_own(tuple(ids[g:begin + n]), req.agent, g, context_key(req.agent, ids, g), req.blocks,
                                  [(begin, begin + n, reply)])


@register
class NaiveReuse(CrossAgentMethod):
    """Other agents' segment KV, RoPE-realigned and not corrected: the fidelity floor."""

    name = "naive"
