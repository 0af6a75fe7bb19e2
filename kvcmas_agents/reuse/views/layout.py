"""A gathered view's layout: its keys' slots and rotations, and its corrections in ``Stack``s.

Every gathered attention path (``dense``, ``lowrank``, ``compiled``) reads a view through these:
corrections of states that share a basis form a group, and groups stored alike form a stack, read
together (one unpack of U and one read of the bases per layer for all of them), with the codes a
view kept for its decode unpacked once (``Stack.kept``).
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field, replace

import torch

from ...kernels import cpu_view
from ...switches import SWITCHES
from ..storage.readers import Basis, Coeffs, KeptCodes


Group = tuple[list[Coeffs], Basis, list[Coeffs], Basis]      # (U_k's, B_k, U_v's, B_v) sharing one basis


# Whether views kept for a decode keep their unpacked codes (``Stack.coefficients``) is
# ``switches.keep_codes`` (off only to measure what keeping them buys, kvcmas bench decode-rate).


@dataclass
class Stack:
    """Groups of a view stored alike (same code format, basis storage and rank), read together: one
    unpack of U and one read of the bases per layer for all of them (on CPU a few ops per group and
    layer cost more than the products; a decode step reads every group in every layer)."""

    groups: list[Group]          # by first stored layer
    firsts: list[int]            # each group's first stored layer, ascending
    ends: list[int]              # each group's end in ``rows``
    rows: torch.Tensor           # [R] their key rows in the view, group by group

    def active(self, layer: int) -> int:
        """How many (leading) groups store ``layer``."""
        return bisect_right(self.firsts, layer)

    # (side, groups, layer) -> the leading groups' U of that side (0 keys, 2 values), kept unpacked
    unpacked: dict[tuple[int, int, int], KeptCodes] = field(default_factory=dict)

    def leading_rows(self, groups: int) -> torch.Tensor:
        """The key rows of the leading ``groups`` groups (a prefix of ``rows``)."""
        return self.rows[:self.ends[groups - 1]]

    def loop_rows(self, groups: int) -> torch.Tensor:
        """``leading_rows`` as the compiled loops index keys: their places in the view's ``KeyOrder``
        where it has one."""
        return (self.rows if self.ordered is None else self.ordered)[:self.ends[groups - 1]]

    def spans(self, groups: int) -> list[tuple[int, int]]:
        """Where each of the leading ``groups`` groups' rows lie in ``rows``."""
        return list(zip([0] + self.ends[:groups - 1], self.ends[:groups]))

    def coefficients(self, side: int, groups: int, layer: int, dtype: torch.dtype,
                     keep: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The leading ``groups`` groups' U of one side for the low-rank terms (``_coefficients``), read
        from their kept codes when ``keep`` (``read_kept``)."""
        u = self.read_kept(side, groups, layer, dtype, keep)
        return (u, None) if u is not None else _coefficients(self.coeffs(side, groups), layer, dtype)

    def read_kept(self, side: int, groups: int, layer: int, dtype: torch.dtype, keep: bool) -> torch.Tensor | None:
        """U [KVH, R, r] of the leading ``groups`` groups of one side from their kept codes, for a view kept
        for its request (``keep``); None when not kept or the codes cannot be kept."""
        kept = self.kept(side, groups, layer) if keep and SWITCHES.keep_codes else None
        return kept.read(dtype) if kept is not None else None

    def kept(self, side: int, groups: int, layer: int) -> KeptCodes | None:
        """The leading ``groups`` groups' U of one side, its packed 6- and 4-bit codes unpacked once per
        layer and kept as int8 (with quantized rows' scales), so each later decode step over the same view
        casts them instead of unpacking them again, which took a third of a decode step on CPU. The kept
        bytes count as the request's state. None for codes that cannot be kept (float factors, states
        that leave the layer out)."""
        key = (side, groups, layer)
        kept = self.unpacked.get(key)
        if kept is None:
            kept = Coeffs.exact_codes(self.coeffs(side, groups), layer)
            if kept is not None:
                self.unpacked[key] = kept
        return kept

    def coeffs(self, side: int, groups: int) -> list[Coeffs]:
        """The leading ``groups`` groups' U factors of one side (0 keys, 2 values), group by group."""
        return [u for g in self.groups[:groups] for u in g[side]]

    def kept_bytes(self) -> int:
        """Bytes of kept codes, with the fp32 copies of their scales the compiled loops keep."""
        copies = {t.data_ptr(): t.numel() * t.element_size() for c in self.compiled.values()
                  for t in (c.scale, c.channels, c.row_state) if t is not None}
        shared = {t.data_ptr() for k in self.unpacked.values() for t in (k.scale, k.channels, k.row_state)
                  if t is not None}
        return sum(k.nbytes for k in self.unpacked.values()) + sum(n for i, n in copies.items() if i not in shared)

    def row_groups(self, groups: int) -> torch.Tensor:
        """Each of the leading ``groups`` groups' rows' group index [R] (int32), for the compiled loops."""
        if self._row_group is None:
            sizes = torch.tensor([b - a for a, b in self.spans(len(self.groups))])
            self._row_group = torch.repeat_interleave(torch.arange(len(self.groups), dtype=torch.int32), sizes)
        return self._row_group[:self.ends[groups - 1]]

    _row_group: torch.Tensor | None = None
    ordered: torch.Tensor | None = None     # [R] its rows' places in the view's KeyOrder (consecutive)
    # (side, groups, layer) -> the kept codes as the compiled loops take them (views of ``unpacked``),
    # and the bases as they read them (pointers to the stored ones)
    compiled: dict[tuple[int, int, int], cpu_view.Coeffs] = field(default_factory=dict)
    bases: dict[tuple[int, int, int], cpu_view.Bases | None] = field(default_factory=dict)
    # (groups, layer) -> both sides packed for one call of the loops, and what the table points at
    tables: dict[tuple[int, int], tuple[torch.Tensor, tuple]] = field(default_factory=dict)


@dataclass
class KeyOrder:
    """A view's keys in the order the compiled loops read them: every stack's rows first, stack by
    stack, then the other keys in position order (the newest stay last, as causal masking needs), so
    that each run of a group's rows is consecutive keys and the loops add its score terms and read its
    probabilities as whole vectors. Attention does not depend on the keys' order; only the rounding of
    its sums does. Made only where no key is corrected twice (a chain keeps the view's own order)."""

    slots: torch.Tensor          # [N] the view's slots in this order
    key_class: torch.Tensor      # [N] their rotation classes

    @staticmethod
    def of(slots: torch.Tensor, key_class: torch.Tensor, stacks: list[Stack]) -> "KeyOrder | None":
        """The order for a view's keys, setting each stack's ``ordered`` rows; None where a key is in
        more than one group."""
        if not stacks:
            return None
        rows = torch.cat([st.rows for st in stacks]).to(slots.device)
        if torch.unique(rows).numel() != rows.numel():
            return None
        rest = torch.ones(slots.numel(), dtype=torch.bool, device=slots.device)
        rest[rows] = False
        order = torch.cat([rows, torch.nonzero(rest).flatten()])
        at = 0
        for st in stacks:
            st.ordered = torch.arange(at, at + st.rows.numel(), device=st.rows.device)
            at += st.rows.numel()
        return KeyOrder(slots[order], key_class[order])

    def extend(self, slots: torch.Tensor) -> "KeyOrder":
        """The same order followed by plain own keys."""
        return KeyOrder(torch.cat([self.slots, slots]),
                        torch.cat([self.key_class, self.key_class.new_zeros(slots.numel())]))


@dataclass
class GatheredLayout:
    """What a gathered view holds, as its attention paths read it: its keys' slots and rotation
    tables, and its corrections in stacks (``GatheredView`` attends over it)."""

    slots: torch.Tensor                          # [N] store slots of all keys, in position order
    # [M, 1, D], rotate-half tables (sin signed, ``rope.rotate_``): rows [0, M) are rotated (identity
    # where not reused)
    cos: torch.Tensor
    sin: torch.Tensor
    # The corrections: groups (U_k's, B_k, U_v's, B_v) of states that share one basis (and shift), so
    # that each layer needs one product per basis (none for the identity of full-rank rows), in stacks
    # of groups stored alike.
    stacks: list[Stack]
    first_layer: int                             # layers before it have no corrections (states leave them out)
    # Query-side realignment for few queries: rotation class [N] of every key (0: not rotated, c: by the
    # c-th distinct delta), and the rotate-half tables [C, D] that move a query by minus each delta
    # (row 0 the identity).
    key_class: torch.Tensor
    q_cos: torch.Tensor
    q_sin: torch.Tensor
    # Keep unpacked codes for later steps (``Stack.coefficients``): set on a request's view kept for its
    # decode; views built for one call leave it off.
    keep: bool = False
    widest: int | None = None       # the widest rank the compiled loops would read (once known)
    order: KeyOrder | None = None   # the keys as the compiled loops read them (``KeyOrder``)

    def kept_bytes(self) -> int:
        """Bytes of unpacked codes this view keeps (``keep``)."""
        return sum(st.kept_bytes() for st in self.stacks)

    def extend(self, slots: torch.Tensor) -> "GatheredLayout":
        """The same view followed by plain own keys (a request's tail as it grows)."""
        slots = slots.to(self.slots.device)
        return replace(self, slots=torch.cat([self.slots, slots]),
                       key_class=torch.cat([self.key_class, self.key_class.new_zeros(slots.numel())]),
                       order=None if self.order is None else self.order.extend(slots))


def _coefficients(us: list[Coeffs], layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Several groups' U for the low-rank terms: (U [KVH, R, r], None), or for packed codes their
    features and map (F, M) with U = F @ M (``code_features``), which spare few queries the unpack."""
    packed = Coeffs.features(us, layer)
    return packed if packed is not None else (Coeffs.joined(us, layer, dtype), None)
