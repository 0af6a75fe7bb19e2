"""Attention over corrected views without materializing them, by three paths that agree (tested):

- ``reference``: ``view_attention`` over a list of pieces, one piece at a time (the torch oracle);
- ``gather``: realigns and corrects keys while gathering them, as paged SDPA gathers anyway (CPU), over
  a view's ``layout`` by the ``dense``, ``lowrank`` or ``compiled`` path;
- ``pack``: the flat descriptor the Triton kernel reads (CUDA).

A request's view is built once per step by its reuse method (``build_view``); attention then calls
``view.attend``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ... import kernels
from ..realign import Realigner
from .gather import GatheredView, build_gathered
from .pack import pack_view, packed_attention, self_check
from .reference import OwnPiece, SegmentPiece, view_attention

VIEW_PATHS: tuple[str, ...] = ("auto", "gather", "query", "triton")


class View(Protocol):
    def attend(self, q: torch.Tensor, q_positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               layer: int, scale: float) -> torch.Tensor:
        """Causal attention of q [Tq, H, D] at ``q_positions`` over the view -> [Tq, H, D]."""
        ...


@dataclass
class PieceView:
    """The reference path's view: the pieces as they are."""

    pieces: list
    realigner: Realigner

    def attend(self, q, q_positions, k_cache, v_cache, layer, scale):
        return view_attention(q, q_positions, self.pieces, k_cache, v_cache, layer, scale, self.realigner)


@dataclass
class PackedView:
    """The Triton kernel's view: a packed descriptor of the pieces."""

    desc: object

    def attend(self, q, q_positions, k_cache, v_cache, layer, scale):
        return packed_attention(q, q_positions, self.desc, k_cache, v_cache, layer, scale)


def resolve_view_path(path: str, device: torch.device) -> str:
    """"auto" -> "triton" on CUDA when Triton is installed, else "gather"; "triton" is checked here."""
    if path not in VIEW_PATHS:
        raise ValueError(f"view_path must be one of {VIEW_PATHS}, got {path!r}")
    if path == "auto":
        return "triton" if device.type == "cuda" and kernels.triton_available() else "gather"
    if path == "triton":
        kernels.require_triton(device.type)
    return path


def choose_view_path(path: str, realigner: Realigner, kv_heads: int, heads: int, head_dim: int,
                     device: torch.device, dtype: torch.dtype) -> tuple[str, str | None]:
    """The path to serve with, and why the kernel was not taken when "auto" picked it but it failed
    its self-check on this device (the torch gather path serves instead)."""
    resolved = resolve_view_path(path, device)
    if path == "auto" and resolved == "triton":
        why = self_check(realigner, kv_heads, heads, head_dim, device, dtype)
        if why is not None:
            return "gather", why
    return resolved, None


def build_view(path: str, pieces: list, realigner: Realigner, device: torch.device, dtype: torch.dtype) -> View:
    """The view of ``pieces`` that ``path`` ("gather", "query" or "triton") attends over."""
    if path == "gather":
        return build_gathered(pieces, realigner, device, dtype)
    if path == "triton":
        return PackedView(pack_view(pieces, realigner, device))
    return PieceView(pieces, realigner)


__all__ = ["VIEW_PATHS", "GatheredView", "OwnPiece", "PackedView", "PieceView", "SegmentPiece", "View",
           "build_gathered", "build_view", "choose_view_path", "resolve_view_path", "view_attention"]
