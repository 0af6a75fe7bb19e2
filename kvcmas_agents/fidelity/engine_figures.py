"""The engine figures that the fidelity and bench reports keep, read from the grouped ``Engine.stats()``
under the flat names the reports use."""
from __future__ import annotations

from typing import Any


def engine_figures(stats: dict[str, Any]) -> dict[str, Any]:
    mem, counters, reuse = stats["memory"], stats["counters"], stats["reuse"]
    kvcmas, kvcomm = reuse.get("kvcmas", {}), reuse.get("kvcomm", {})
    settings = kvcmas.get("settings", {})
    storage = settings.get("storage", {})
    return {
        "reuse": stats["engine"]["reuse"],
        "recompute_ratio": settings.get("recompute_ratio"), "rank": settings.get("rank"),
        "reference": settings.get("reference"), "prefetch_ratio": settings.get("prefetch_ratio"),
        "correction_dtype": storage.get("dtype"), "u8_components": storage.get("u8_components"),
        "small_row_bits": storage.get("small_row_bits"), "u_head_bits": storage.get("u_head_bits"),
        "uncorrected_energy": storage.get("uncorrected_energy"),
        "declared": counters["declared"], "template_fallbacks": counters["template_fallbacks"],
        "realign_refusals": counters["realign_refusals"],
        "home_views": reuse["home_views"]["count"], "home_view_bytes": mem["home_view_bytes"],
        "kv_bytes_peak": mem["kv_bytes_peak"], "kv_bytes_total_peak": mem["total_bytes_peak"],
        "corrections": kvcmas.get("corrections", 0), "correction_bytes": kvcmas.get("correction_bytes", 0),
        "correction_basis_bytes": kvcmas.get("correction_basis_bytes", 0),
        "correction_rows_dropped": kvcmas.get("rows_dropped", 0),
        "correction_layers_dropped": kvcmas.get("layers_dropped", 0),
        "selections_capped": kvcmas.get("selections_capped", 0),
        "selections_skipped": kvcmas.get("selections_skipped", 0), "prefetch": kvcmas.get("prefetch"),
        "anchors": kvcomm.get("anchors", 0), "anchor_bytes": kvcomm.get("anchor_bytes", 0),
        "anchor_hits": kvcomm.get("hits", 0), "anchor_misses": kvcomm.get("misses", 0),
    }
