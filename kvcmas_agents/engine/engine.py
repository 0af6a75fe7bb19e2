"""The embedded engine: one per model per process, driven by a background worker thread.

Callers on any event loop or thread submit requests and get awaitable streams. The worker
(``worker.py``) owns all torch work: each step it takes the inbox, has the scheduler admit, prepare and
plan (``scheduler.py``), runs the model, samples, and posts events back. One KV budget (``budget.py``)
covers blocks and the state reuse methods hold outside them.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
import weakref
from functools import cached_property
from typing import Any, AsyncIterator, Iterable

import torch

from ..cache.kv_store import KVStore
from ..cache.prefix_cache import PrefixCache, PrefixIndex
from ..chat.template import ChatFormatter
from ..chat.tools import TOOL_CALL_OPEN
from ..errors import ConfigError, EngineClosedError, EngineError, InvalidRequestError, RequestTimeoutError
from ..kernels import cpu_view
from ..model.blocks import choose as choose_blocks
from ..model.grammar import Grammars
from ..model.llama import LlamaModel
from ..model.loader import load_model
from ..reuse import ReuseContext, ReuseMethod, ReuseOptions, method_class, names
from ..reuse.realign import Realigner, refuses
from ..reuse.segments import SegmentStore
from ..reuse.views import choose_view_path
from .blocks import RequestBlocks
from .budget import KVBudget
from .config import EngineConfig, SamplingParams
from .edges import EdgeOrder
from .handoffs import HandOffs
from .intake import Intake, is_number, side_request
from .lifecycle import serve, stop_worker
from .outputs import RequestOutput, StreamDelta
from .request import Request
from .runner import ModelRunner
from .scheduler import Scheduler
from .sinks import LoopSink, ThreadSink
from .stats import Counters
from .tool_decision import ToolDecision
from .worker import ABORT, ADD, Worker


class Engine:
    """An embedded LLM engine shared by every agent in the process.

    >>> engine = Engine(EngineConfig(reuse="prefix"))
    >>> out = await engine.generate(messages, agent="reviewer", sampling=SamplingParams(max_tokens=64))
    """

    def __init__(self, config: EngineConfig | None = None, **overrides: Any):
        self.config = config or EngineConfig(**overrides)
        if not isinstance(self.config, EngineConfig):
            raise ConfigError(f"config must be an EngineConfig, got {type(self.config).__name__}")
        threads = self.config.num_threads or torch.get_num_threads()
        built: dict[str, BaseException] = {}
        ready = threading.Event()
        self._handoffs = HandOffs()          # learned by the worker, read by the edge order while none are set
        self._order = EdgeOrder(self._handoffs)
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._closed = False
        # The worker thread holds no reference to the engine once built, so an engine dropped without
        # close() is collected: the finalizer stops its worker (also at interpreter exit).
        self._thread = threading.Thread(target=serve, args=(weakref.ref(self), threads, ready, built),
                                        name="kvcmas-engine", daemon=True)
        self._thread.start()
        ready.wait()
        if "error" in built:
            self._thread.join()
            raise built.pop("error")
        self._stop = weakref.finalize(self, stop_worker, self._inbox, self._thread)

    def _build(self) -> None:
        """Load the model and build the engine's parts (on the worker thread, see ``_serve``)."""
        cfg = self.config
        loaded = load_model(cfg.model, cfg.device, cfg.dtype, cfg.cache_dir)
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.args = loaded.args
        self.max_context = min(cfg.max_context or loaded.args.max_position_embeddings,
                               loaded.args.max_position_embeddings)
        blocks, self.weights = choose_blocks(cfg.weights, loaded.config.get("_name_or_path"), loaded.args,
                                             loaded.weights)
        self.model = LlamaModel(loaded.args, loaded.weights, self.max_context, blocks)
        self.device = self.model.device
        index = PrefixIndex()           # told by the store of each cached block it evicts
        self.store = KVStore(loaded.args.num_layers, loaded.args.num_kv_heads, loaded.args.head_dim,
                             cfg.block_size, cfg.kv_budget_bytes, self.device, self.model.dtype, index.forget)
        prefix = PrefixCache(self.store, index)
        self.segments = SegmentStore(self.store, prefix.is_cached)
        self.realign_refused = refuses(loaded.args.rope_scaling)
        realigner = Realigner.from_rope(self.model.rope)
        a = loaded.args
        self.view_path, self.view_fallback = choose_view_path(cfg.view_path, realigner, a.num_kv_heads, a.num_heads,
                                                         a.head_dim, self.device, self.store.k.dtype)
        self.attention_loops = cpu_view.status(self.device, self.store.k.dtype)
        # The reuse methods come first: their block services are the request blocks', which know no method;
        # the budget and the scheduler then get them built.
        blocks = RequestBlocks(self.store, prefix)
        ctx = ReuseContext(self.model, self.store, prefix, self.segments, realigner, self.view_path,
                           self._order.predecessors, self._order.successors, side_request,
                           blocks.apply_plan, blocks.reserve, blocks.free, blocks.own_holes)
        methods: dict[str, ReuseMethod] = {}
        for name in names():
            cls = method_class(name)
            methods[name] = cls(ctx, cls.settings_of(cfg))
        self.methods = methods
        self.counters = Counters()
        self.budget = KVBudget(self.store, methods, self.segments.evict_one)
        self.scheduler = Scheduler(cfg, blocks, methods, self.budget, self.counters)
        # Callbacks close over parts, never over the engine (see __init__).
        self.runner = ModelRunner(self.model, self.store, lambda req, end: methods[req.options.reuse].view(req, end))
        self.formatter = ChatFormatter(self.tokenizer, self.max_context)
        self.stop_token_ids = self.formatter.stop_token_ids | set(loaded.args.eos_token_ids)
        self.grammars = Grammars(self.tokenizer, loaded.args.vocab_size, self.stop_token_ids)
        self._tok_lock = threading.Lock()     # HF fast tokenizers are not safe to share across threads
        self.intake = Intake(cfg, loaded.args, self.formatter, self.tokenizer, self._tok_lock, self.grammars,
                             self.scheduler, self.counters, self.max_context, self.device, self.realign_refused)
        self.worker = Worker(self.scheduler, self.budget, self._handoffs, self.runner, self.tokenizer, self._tok_lock,
                             self.stop_token_ids, self.counters, self._inbox)
        self.num_threads = torch.get_num_threads()     # (built on the worker thread, which set them)

    # --- public API ------------------------------------------------------------------------
    async def generate(self, messages: list[dict], agent: str = "default",
                       sampling: SamplingParams | None = None, tools: list[dict] | None = None,
                       tool_choice: Any = None, request_id: str | None = None,
                       reuse_options: ReuseOptions | None = None,
                       tool_decision: ToolDecision | None = None) -> RequestOutput:
        """Run one chat request to completion and return its output.

        reuse_options overrides the engine's reuse mode / recompute_ratio / rank / reference for this request.
        tool_decision: with tools and tool_choice "auto", a decision step first scores whether the reply
        should be a tool call, and if so constrains it to one (engine/tool_decision.py); None: free decoding.
        """
        async for delta in self.stream(messages, agent, sampling, tools, tool_choice, request_id, reuse_options,
                                       tool_decision):
            if delta.output is not None:
                return delta.output
        raise EngineError("stream ended without an output")  # unreachable: the worker always finishes

    async def stream(self, messages: list[dict], agent: str = "default",
                     sampling: SamplingParams | None = None, tools: list[dict] | None = None,
                     tool_choice: Any = None, request_id: str | None = None,
                     reuse_options: ReuseOptions | None = None,
                     tool_decision: ToolDecision | None = None) -> AsyncIterator[StreamDelta]:
        """Stream a chat request: text deltas, then a final delta carrying finish_reason and output.

        Cancelling the consumer (or leaving the loop early) aborts the request and frees its KV.
        """
        call = None
        if tool_decision is not None and tool_decision.applies(tools, tool_choice):
            call = tool_decision.scores(messages) and tool_decision.calls(tool_decision.score(await self.generate(
                messages, agent, tool_decision.scoring(self.call_open_ids), tools, "auto", None, reuse_options),
                self.call_open_ids))
        sink = LoopSink(asyncio.get_running_loop())
        req = self._make_request(messages, agent, sampling, tools, "required" if call else tool_choice, request_id,
                                 sink, reuse_options)
        self._decided(req, call)
        self._submit(req)
        done = False
        try:
            while True:
                event = await sink.get()
                if isinstance(event, BaseException):
                    done = True
                    raise event
                done = event.output is not None
                yield event
                if done:
                    return
        finally:
            if not done:
                self._inbox.put((ABORT, req))

    def generate_sync(self, messages: list[dict], agent: str = "default",
                      sampling: SamplingParams | None = None, tools: list[dict] | None = None,
                      tool_choice: Any = None, request_id: str | None = None,
                      reuse_options: ReuseOptions | None = None, timeout: float | None = None,
                      tool_decision: ToolDecision | None = None) -> RequestOutput:
        """Blocking ``generate`` for synchronous callers (any thread, no event loop needed).

        timeout: seconds to wait for the whole request; past it the request is aborted (its KV freed) and
        RequestTimeoutError is raised. None waits as long as it takes.
        """
        if timeout is not None and not (is_number(timeout) and timeout > 0):
            raise InvalidRequestError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
        call = None
        if tool_decision is not None and tool_decision.applies(tools, tool_choice):
            call = tool_decision.scores(messages) and tool_decision.calls(tool_decision.score(self.generate_sync(
                messages, agent, tool_decision.scoring(self.call_open_ids), tools, "auto", None, reuse_options,
                timeout), self.call_open_ids))
        sink = ThreadSink()
        req = self._make_request(messages, agent, sampling, tools, "required" if call else tool_choice, request_id,
                                 sink, reuse_options)
        self._decided(req, call)
        deadline = None if timeout is None else time.monotonic() + timeout
        self._submit(req)
        try:
            while True:
                try:
                    event = sink.get(None if deadline is None else max(deadline - time.monotonic(), 0.0))
                except queue.Empty:
                    raise RequestTimeoutError(f"request {req.request_id} did not finish within {timeout} s; "
                                              "it was aborted") from None
                if isinstance(event, BaseException):
                    raise event
                if event.output is not None:
                    return event.output
        except BaseException:
            self._inbox.put((ABORT, req))
            raise

    @cached_property
    def call_open_ids(self) -> list[int]:
        """The tokens of the tool-call tag, as the model writes it (scored by ``ToolDecision``)."""
        with self._tok_lock:
            return list(self.tokenizer.encode(TOOL_CALL_OPEN, add_special_tokens=False))

    def set_edges(self, edges: Iterable[tuple[str, str]]) -> None:
        """Register the agent pipeline's edge order (predecessor, successor), e.g. from a LangGraph graph.

        Replaces any earlier registration. Shown in ``stats()["edges"]``; cross-agent reuse uses it to
        pick each agent's reference view and to correct ahead of time. Until edges are registered, the
        engine uses the hand-offs it has seen instead (``stats()["learned_edges"]``, engine/handoffs.py).
        """
        self._order.set(edges)

    @property
    def edges(self) -> list[tuple[str, str]]:
        return self._order.edges

    def predecessors(self, agent: str) -> list[str]:
        """Agents with an edge into ``agent``, in registration (else learning) order."""
        return self._order.predecessors(agent)

    def successors(self, agent: str) -> list[str]:
        """Agents with an edge from ``agent``, in registration (else learning) order."""
        return self._order.successors(agent)

    def declare_agent(self, agent: str, system: str | list[dict], tools: list[dict] | None = None,
                      wait: bool = True) -> int:
        """Declare an agent's system message(s) before its first request; returns the prefix's tokens.

        The engine prefills them now (a one-token side request, counted in ``stats()["counters"]["declared"]``,
        not in ``requests``), so the agent's first request finds its own prefix computed. With
        ``reuse="kvcmas"`` and registered edges, its graph predecessors then correct the shared
        history for it ahead of time even before it first speaks, as they do for later turns
        (reuse/kvcmas/prefetch.py). Give exactly the system message(s) and tools its requests carry: a
        declaration that does not match them is never used. ``wait`` blocks until the prefill is done
        (and raises its error); else it runs in the background. Returns 0, declaring nothing, when the
        engine's reuse mode reuses nothing ("none") or the chat template is not prefix-stable.
        """
        if not isinstance(agent, str) or not agent:
            raise InvalidRequestError("agent must be a non-empty string")
        messages = [{"role": "system", "content": system}] if isinstance(system, str) else system
        if any(m["role"] != "system" for m in self.formatter.normalize(messages)):
            raise InvalidRequestError("system must be a string or a non-empty list of system messages")
        if not method_class(self.config.reuse).reuses:
            return 0
        sink = ThreadSink() if wait else (lambda event: None)
        req = self._make_request(messages, agent, SamplingParams(max_tokens=1), tools, None,
                                 f"declare-{agent}-{next(self.intake.ids)}", sink)
        segments = req.prompt.segments
        if not req.prompt.prefix_stable or segments[0].kind != "prefix" or segments[-1].kind != "suffix":
            return 0
        req.declare = True
        self._submit(req)
        while wait:
            event = sink.get()
            if isinstance(event, BaseException):
                raise event
            wait = event.finish_reason is None
        return segments[-1].start

    def count_tokens(self, messages: list[dict], tools: list[dict] | None = None) -> int:
        """Prompt tokens these messages render to (with the generation prompt)."""
        with self._tok_lock:
            return len(self.formatter.render(messages, tools).token_ids)

    def tokenize(self, text: str) -> list[int]:
        """The model's token ids for plain ``text`` (no chat template, no special tokens)."""
        with self._tok_lock:
            return list(self.tokenizer.encode(text, add_special_tokens=False))

    def stats(self) -> dict[str, Any]:
        """A snapshot, grouped (docs/stats.md):

        engine: what runs (model, device, dtype, default reuse mode, threads, attention path);
        memory: KV blocks and bytes (active, cached, peak), home views, state held outside blocks
            (corrections, anchors), and their totals (``total_bytes_peak`` is the benchmarks' peak);
        counters: requests by outcome, tokens, steps, fallbacks, and the queue;
        reuse: home views, and each reuse method's own figures by name (e.g. "kvcmas", "kvcomm");
        agents: per-agent usage and TTFT; edges: the registered edge order; learned_edges: the hand-offs
            seen in traffic, used while no edges are registered.
        """
        kv, home = self.store.stats(), self.segments.stats()
        counts, agents = self.counters.snapshot()
        state = self.budget.state_bytes()
        home_bytes = len(self.segments.home_blocks) * kv.block_bytes
        return {
            "engine": {"model": self.model_name, "device": str(self.device),
                       "dtype": str(self.model.dtype).replace("torch.", ""), "reuse": self.config.reuse,
                       "num_threads": self.num_threads, "view_path": self.view_path,
                       "view_path_fallback": self.view_fallback, "attention_loops": self.attention_loops,
                       "weights": self.weights,
                       "realign_refused": self.realign_refused,
                       "block_size": self.store.block_size, "max_context": self.max_context},
            "memory": {"kv_budget_bytes": self.config.kv_budget_bytes, "block_bytes": kv.block_bytes,
                       "blocks_total": kv.blocks_total, "blocks_in_use": kv.blocks_active,
                       "blocks_cached": kv.blocks_cached, "kv_bytes": kv.kv_bytes,
                       "kv_bytes_active": kv.blocks_active * kv.block_bytes,
                       "kv_bytes_cached": kv.blocks_cached * kv.block_bytes, "kv_bytes_peak": kv.kv_bytes_peak,
                       "home_view_bytes": home_bytes, "state_bytes": state, "total_bytes": kv.kv_bytes + state,
                       "total_bytes_peak": max(self.budget.peak_total, kv.kv_bytes + state),
                       "state_over_budget_bytes": self.budget.state_over_budget},
            "counters": {**counts, "budget_fallbacks": self.scheduler.budget_fallbacks,
                         "num_running": len(self.scheduler.running),
                         "num_waiting": len(self.scheduler.waiting)},
            "reuse": {"home_views": {"count": home.homes, "tokens": home.home_tokens, "bytes": home_bytes,
                                     "evicted": home.evicted},
                      **{name: st for name, m in self.methods.items() if (st := m.stats())}},
            "agents": agents,
            "edges": list(self.edges),
            "learned_edges": list(self._handoffs.edges),
        }

    def reset_peak(self) -> None:
        """Restart peak KV accounting from the current level (for benchmarks)."""
        self.budget.reset_peak()

    async def aclose(self) -> None:
        """Stop the worker; pending requests fail with EngineClosedError."""
        if self._closed:
            return
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(None, self._stop)

    def close(self) -> None:
        """Synchronous ``aclose``."""
        if not self._closed:
            self._closed = True
            self._stop()

    # --- request intake (caller thread) ------------------------------------------------------
    def _make_request(self, messages: Any, agent: str, sampling: SamplingParams | None,
                      tools: list[dict] | None, tool_choice: Any, request_id: str | None, sink: Any,
                      reuse_options: ReuseOptions | None = None) -> Request:
        if self._closed:
            raise EngineClosedError("engine is closed")
        return self.intake.make(messages, agent, sampling, tools, tool_choice, request_id, sink, reuse_options)

    def _decided(self, req: Request, call: bool | None) -> None:
        self.intake.decided(req, call)

    def _submit(self, req: Request) -> None:
        if self._closed:
            raise EngineClosedError("engine is closed")
        self.counters.add("requests", int(not req.declare))
        if not req.prompt.prefix_stable:
            self.counters.add("template_fallbacks")
        self._inbox.put((ADD, req))

    # --- context manager sugar ---------------------------------------------------------------
    async def __aenter__(self) -> "Engine":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
