"""What a reuse method's plan gives a request (``ReusePlan``, applied by the engine's scheduler), and the
per-request state a method keeps for itself (``RequestStates``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

S = TypeVar("S")


@dataclass(frozen=True)
class ReusePlan:
    """A request's KV that it need not compute, as the engine lays it out. The empty plan reuses nothing.

    The prompt runs as: own prefill [0, own_prefix_end), then the reused span [own_prefix_end,
    reuse_end) made usable by the method's ``prepare``, then the own tail. Inside the reused span only
    ``own_spans`` need the request's own KV blocks (new text between reused pieces, private copies);
    the rest are holes, read from other contexts. ``blocks`` are leading full blocks already computed
    (prefix-cache hits), referenced for the request: its release drops them.
    """

    cached_tokens: int = 0                         # exact KV it did not compute
    reused_tokens: int = 0                         # KV reused from other contexts, corrected or not
    blocks: tuple[int, ...] = ()
    own_prefix_end: int = 0
    reuse_end: int = 0
    own_spans: tuple[tuple[int, int], ...] = ()


EMPTY_PLAN = ReusePlan()


class RequestStates(Generic[S]):
    """A method's own state of each request it serves, by the request's identity (request ids are the
    caller's and need not be unique): made on first use, dropped when the request lets go (``release``)."""

    def __init__(self, make: Callable[[], S]):
        self._make = make
        self._by_id: dict[int, S] = {}

    def __call__(self, req: Any) -> S:
        """The request's state, made now if it has none."""
        st = self._by_id.get(id(req))
        if st is None:
            st = self._by_id[id(req)] = self._make()
        return st

    def get(self, req: Any) -> S | None:
        return self._by_id.get(id(req))

    def set(self, req: Any, state: S) -> S:
        self._by_id[id(req)] = state
        return state

    def pop(self, req: Any) -> S | None:
        return self._by_id.pop(id(req), None)

    def values(self) -> list[S]:
        """A snapshot (stats read it from other threads while the worker adds and drops)."""
        return list(self._by_id.values())

    def __len__(self) -> int:
        return len(self._by_id)
