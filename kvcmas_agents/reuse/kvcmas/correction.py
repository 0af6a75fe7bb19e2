"""KVCMAS correction of one request: recompute the selected rows of its reused segments under its own
context, and keep their deviation from the reference view in compact form.

Per request of agent X, once X's own prefix is computed:
  reference - the realigned home view ("home"), or X's graph predecessor's corrected view ("chain");
  select    - rows ranked by the attention mass of X's tail (``select.py``);
  recompute - the selected rows (and any new text between reused spans) layer by layer under X's
              context, through the method's loop (``RequestView.recompute``);
  compress  - their deviation as a rank-r truncated SVD per layer and KV head (or quantized rows),
              stored as ``StorageSpec`` says, from the first layer that holds a real share of it.
Corrections persist: X never re-corrects a segment at the same place and context.
"""
from __future__ import annotations


import torch

from ..base import ReuseContext, ReuseRequest
from ..pieces import ReusePiece
from ..request_view import RequestView
from ..segments import Correction
from ..storage.codec import Format, compress, compress_joint
from ..storage.delta import LowRankDelta
from ..storage.deviation import faint_layers, strongest_rows
from ..storage.spec import StorageSpec
from .select import select_rows


# Layer 0's keys and values depend only on the token and its position, so its deviation is only the
# rounding of the model's RoPE tables against the realigner's rotation: states do not store it. A
# recompute ratio of 1.0 keeps every layer, so that it stays exact.
UNCORRECTED_LAYERS = 1


def products_dtype(setting: str, model) -> torch.dtype:
    """The dtype a KVCMASConfig.recompute_dtype setting gives the recompute's products on ``model``."""
    if setting == "auto":
        fast = model.device.type == "cpu" and torch.cpu._is_amx_tile_supported()
        return torch.bfloat16 if fast and model.dtype == torch.float32 else model.dtype
    return model.dtype if setting == "model" else getattr(torch, setting)


class Corrector:
    """Computes and stores the corrections of a KVCMAS method's requests; counts what it left out."""

    def __init__(self, ctx: ReuseContext, storage: StorageSpec, newest_whole: bool, recompute_dtype: str = "model"):
        self.ctx = ctx
        self.products = products_dtype(recompute_dtype, ctx.model)
        self.storage, self.fmt = storage, storage.format()
        self.newest_whole = newest_whole
        self.layers_dropped = 0        # leading layers past UNCORRECTED_LAYERS not stored, summed over requests
        self.rows_dropped = 0          # recomputed rows whose deviation was too faint to store
        self.selections_capped = 0     # selection passes cut to the prompt's last SELECT_MAX tokens
        self.selections_skipped = 0    # passes not run: they would have spared fewer rows than they cost

    @torch.inference_mode()
    def correct(self, view: RequestView) -> None:
        """Correct the request's pending pieces and compute its new text (``view``: its plan)."""
        req = view.req
        pending = [p for p in view.pieces if p.pending and p.home is not None]
        new = [p for p in view.pieces if p.home is None]
        if not (pending or new):
            return
        for p in pending:
            p.chain = self._reference_chain(req, p)
        rows: list[torch.Tensor] = []
        exact = req.options.recompute_ratio >= 1.0
        with self.ctx.model.products(None if exact else self.products):
            if pending:
                with req.timings.phase("select"):
                    rows, how = select_rows(view, pending, self.newest_whole)
                self.selections_capped += how == "capped"
                self.selections_skipped += how == "skipped"
            self._recompute(view, pending, rows, new)

    def _reference_chain(self, req: ReuseRequest, piece: ReusePiece) -> list[LowRankDelta]:
        if req.options.reference != "chain":
            return []
        for pred in self.ctx.predecessors(req.agent):
            for corr in self.ctx.segments.corrections_of(pred, piece.home.key):
                shift = piece.start - corr.start
                return [self.ctx.realigner.rotate_delta(d, shift) for d in corr.chain]
        return []

    def _recompute(self, view: RequestView, pending: list[ReusePiece], rows: list[torch.Tensor],
                   new: list[ReusePiece]) -> None:
        """Recompute the selected rows of pending pieces and every row of new spans; compress and store
        the pending pieces' deviations."""
        req, m = view.req, self.ctx.model
        sel = {id(p): r for p, r in zip(pending, rows)}
        sel.update({id(p): torch.arange(p.end - p.start) for p in new})
        if sum(r.numel() for r in sel.values()) == 0:
            for p in pending:
                self._store(req, p, LowRankDelta.empty(m.args.num_layers, m.args.num_kv_heads, m.args.head_dim,
                                                        m.dtype, m.device), 0)
            return
        spans = view.row_spans(sel)
        dks: dict[int, list] = {id(p): [] for p in pending}
        dvs: dict[int, list] = {id(p): [] for p in pending}

        def capture(layer, pos, k_old, v_old, k_new, v_new):
            for p in pending:
                s = spans[id(p)]
                dks[id(p)].append((k_new[s] - k_old[s]).permute(1, 0, 2))
                dvs[id(p)].append((v_new[s] - v_old[s]).permute(1, 0, 2))

        view.recompute(sel, capture)
        for p in new:
            p.pending = False
        if pending:
            with req.timings.phase("compress"):
                self._compress(req, pending, rows, dks, dvs)

    def _compress(self, req: ReuseRequest, pending: list[ReusePiece], rows: list[torch.Tensor],
                  dks: dict[int, list], dvs: dict[int, list]) -> None:
        """Store each pending piece's deviation (per layer [KVH, R, D]) as StorageSpec says."""
        m = self.ctx.model
        full = req.options.recompute_ratio >= 1.0
        rank = m.args.head_dim if full else req.options.rank            # ratio 1.0 keeps the exact deviation
        dk = [torch.stack(dks[id(p)]) for p in pending]                 # [L, KVH, R_i, D] each
        dv = [torch.stack(dvs[id(p)]) for p in pending]
        rows_of = [r.to(m.device) for r in rows]
        keep = self.storage.correction_energy
        if not full and keep < 1.0:
            masks = strongest_rows(dk, dv, keep)
            self.rows_dropped += sum(int((~mk).sum()) for mk in masks)
            dk = [x[:, :, mk] for x, mk in zip(dk, masks)]
            dv = [x[:, :, mk] for x, mk in zip(dv, masks)]
            rows_of = [r[mk.to(r.device)] for r, mk in zip(rows_of, masks)]
        fmt = Format() if full else self.fmt
        first = 0 if full else min(max(UNCORRECTED_LAYERS, faint_layers(dk, dv, self.storage.uncorrected_energy)),
                                   m.args.num_layers - 1)
        self.layers_dropped += max(0, first - UNCORRECTED_LAYERS)
        if self.storage.joint_basis and len(pending) > 1 and not full:
            states = compress_joint(dk, dv, rows_of, rank, fmt, first)
        else:
            states = [compress(k, v, r, rank, fmt, first) for k, v, r in zip(dk, dv, rows_of)]
        for p, state, r in zip(pending, states, rows):
            self._store(req, p, state, r.numel())     # recomputed, whether stored or not

    def _store(self, req: ReuseRequest, p: ReusePiece, own: LowRankDelta, recomputed: int) -> None:
        ref = "home" if not p.chain else "chain"
        p.chain = p.chain + [own]
        p.pending = False
        req.recomputed_tokens += recomputed
        p.correction = Correction(req.agent, p.start, list(p.chain), own, ref, recomputed, users=1)
        self.ctx.segments.add_correction(p.home.key, p.context, p.correction)
