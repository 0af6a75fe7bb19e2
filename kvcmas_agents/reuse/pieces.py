"""The unit of a reuse plan: a prompt span served by a home view (or new text between such spans)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .segments import Correction, HomeView
from .storage.delta import LowRankDelta

MAX_FRAME = 16          # tokens of role header and trailer around a decoded reply inside its message


@dataclass
class ReusePiece:
    """A prompt span [start, end) served by a home view instead of the request's own prefill."""

    home: HomeView | None                                     # None: new text, computed by this request
    start: int
    end: int
    context: int
    chain: list[LowRankDelta] = field(default_factory=list)   # corrections applied on the realigned home
    exact: bool = False                                       # the request's own exact view: no correction
    pending: bool = False                                     # a correction must be computed first
    private: bool = False                                     # served from a copy in the request's own blocks
    frame: bool = False           # role header/trailer around a reused reply: recomputed whole when corrected
    correction: Correction | None = None                      # the stored correction it reads (pinned meanwhile)

    @property
    def delta(self) -> int:
        return self.start - self.home.start
