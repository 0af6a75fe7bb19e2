"""Where a segment's deviations hold their energy: the strongest rows, and the faint leading layers.

What the corrector stores is chosen from these (``strongest_rows``, ``faint_layers``), before the codec runs.
"""
from __future__ import annotations

import torch


def strongest_rows(dks: list[torch.Tensor], dvs: list[torch.Tensor], keep: float) -> list[torch.Tensor]:
    """Boolean masks [R_i] over several segments' rows (deviations [L, KVH, R_i, D] each): the fewest
    rows, strongest first, that hold at least ``keep`` of the summed squared deviation (K and V, all
    layers and heads). A row outside them deviates little from its reference, so storing it costs U
    bytes for almost no correction; ``keep`` >= 1 keeps every row."""
    energy = [(k.float() ** 2).sum((0, 1, 3)) + (v.float() ** 2).sum((0, 1, 3)) for k, v in zip(dks, dvs)]
    if keep >= 1.0 or not energy:
        return [torch.ones_like(e, dtype=torch.bool) for e in energy]
    flat = torch.cat(energy)
    order = flat.argsort(descending=True)
    before = flat[order].cumsum(0) - flat[order]          # energy of the stronger rows
    chosen = torch.zeros_like(flat, dtype=torch.bool)
    chosen[order[before < keep * flat.sum()]] = True
    return list(chosen.split([e.numel() for e in energy]))


def layer_energy(ds: list[torch.Tensor]) -> torch.Tensor:
    """Squared deviation per layer [L] (fp64), summed over several segments' deviations [L, KVH, R_i, D]."""
    return sum((d.float() ** 2).sum((1, 2, 3)) for d in ds).double()


def faint_layers(dks: list[torch.Tensor], dvs: list[torch.Tensor], share: float) -> int:
    """How many leading layers of several segments' deviations (each [L, KVH, R_i, D]) hold together at
    most ``share`` of the keys' squared deviation and at most ``share`` of the values' (each side
    against its own total, summed over the segments). Deviations grow with depth (a few hundredths of a
    percent of the energy in layer 1, most of it past the middle), so the first layers' corrections
    cost as many bytes as the last ones' for far less correction."""
    if share <= 0.0 or not dks:
        return 0
    per_layer = [layer_energy(dks), layer_energy(dvs)]
    within = [(e.cumsum(0) <= share * e.sum()) for e in per_layer]
    ok = (within[0] & within[1]).long()
    return int(ok.cumprod(0).sum())                     # the leading run of layers within the share
