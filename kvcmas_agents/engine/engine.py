"""The embedded engine: one per model per process, driven by a background worker thread.

Callers on any event loop or thread submit requests and get awaitable streams. The worker owns all
torch work: it admits requests, plans mixed prefill/decode steps, runs them, samples, and posts
events back. A failing step is retried request by request so that only the culprit fails.
"""
from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import asdict
from typing import Any, AsyncIterator, Iterable

import torch

from .anchors import AnchorPool
from .chat import ChatFormatter
from .config import EngineConfig, ReuseOptions, SamplingParams
from .correction import CROSS_AGENT_MODES, Corrector
from .realign import Realigner, refuses
from .detokenize import IncrementalDetokenizer
from .errors import EngineClosedError, EngineError, InvalidRequestError
from .kv_store import KVStore
from .loader import load_model
from .model import LlamaModel
from .outputs import RequestOutput, StreamDelta, Usage
from .prefetch import Prefetcher
from .request import Request
from .runner import ModelRunner
from .sampling import Sampler, make_generator
from .scheduler import Scheduler, StepItem
from .sinks import LoopSink, ThreadSink
from .tools import parse_tool_calls

_ABORT, _CLOSE = "abort", "close"


class Engine:
    """An embedded LLM engine shared by every agent in the process.

    >>> engine = Engine(EngineConfig(reuse="prefix"))
    >>> out = await engine.generate(messages, agent="reviewer", sampling=SamplingParams(max_tokens=64))
    """

    def __init__(self, config: EngineConfig | None = None, **overrides: Any):
        self.config = config or EngineConfig(**overrides)
        threads = self.config.num_threads or torch.get_num_threads()
        built: dict[str, BaseException] = {}
        ready = threading.Event()
        self._worker = threading.Thread(target=self._run, args=(threads, ready, built), name="kvcmas-engine",
                                        daemon=True)
        self._worker.start()
        ready.wait()
        if "error" in built:
            self._worker.join()
            raise built["error"]

    def _build(self) -> None:
        """Load the model and build the engine's parts (on the worker thread, see ``_run``)."""
        loaded = load_model(self.config.model, self.config.device, self.config.dtype, self.config.cache_dir)
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.args = loaded.args
        self.max_context = min(self.config.max_context or loaded.args.max_position_embeddings,
                               loaded.args.max_position_embeddings)
        self.model = LlamaModel(loaded.args, loaded.weights, self.max_context)
        self.device = self.model.device
        self.store = KVStore(loaded.args.num_layers, loaded.args.num_kv_heads, loaded.args.head_dim,
                             self.config.block_size, self.config.kv_budget_bytes, self.device, self.model.dtype)
        self.scheduler = Scheduler(self.config, self.store)
        self.realign_refused = refuses(loaded.args.rope_scaling)
        self.corrector = Corrector(self.model, self.store, self.scheduler.segments,
                                   Realigner.from_rope(self.model.rope), self.predecessors,
                                   AnchorPool(self.config.kvcomm_anchors, self.config.kvcomm_threshold))
        self.scheduler.corrector = self.corrector
        self.corrector.joint_basis = self.config.basis == "request"
        self.corrector.newest_whole = self.config.recompute_newest
        self.corrector.keep_energy = self.config.correction_energy
        if self.config.correction_dtype != "kv":
            self.corrector.state_dtype = getattr(torch, self.config.correction_dtype.removesuffix("_basis"))
        self.corrector.int8_basis = self.config.correction_dtype == "int8_basis"
        self.corrector.value_bits = self.config.value_bits
        self.corrector.key_bits = self.config.key_bits
        self.corrector.small_rows = self.config.small_rows
        self.corrector.small_bits = self.config.small_row_bits
        self.corrector.u8 = self.config.u8_components
        self.corrector.head_bits = self.config.u_head_bits
        self.corrector.faint_energy = self.config.uncorrected_energy
        self.prefetcher = (Prefetcher(self.scheduler, self.corrector, self.successors, self.config.prefetch_ratio)
                           if self.config.prefetch else None)
        self.runner = ModelRunner(self.model, self.store, self.corrector, self.config.view_path)
        self.sampler = Sampler()
        self.formatter = ChatFormatter(self.tokenizer, self.max_context)
        self.stop_token_ids = self.formatter.stop_token_ids | set(loaded.args.eos_token_ids)
        self._tok_lock = threading.Lock()     # HF fast tokenizers are not safe to share across threads
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._ids = itertools.count()
        self._closed = False
        self._counters: dict[str, int] = defaultdict(int)
        self._agents: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._stats_lock = threading.Lock()
        self.edges: list[tuple[str, str]] = []
        self._peak_total = 0

    # --- public API ------------------------------------------------------------------------
    async def generate(self, messages: list[dict], agent: str = "default",
                       sampling: SamplingParams | None = None, tools: list[dict] | None = None,
                       tool_choice: Any = None, request_id: str | None = None,
                       reuse_options: ReuseOptions | None = None) -> RequestOutput:
        """Run one chat request to completion and return its output.

        reuse_options overrides the engine's reuse mode / recompute_ratio / rank / reference for this request.
        """
        async for delta in self.stream(messages, agent, sampling, tools, tool_choice, request_id, reuse_options):
            if delta.output is not None:
                return delta.output
        raise EngineError("stream ended without an output")  # unreachable: the worker always finishes

    async def stream(self, messages: list[dict], agent: str = "default",
                     sampling: SamplingParams | None = None, tools: list[dict] | None = None,
                     tool_choice: Any = None, request_id: str | None = None,
                     reuse_options: ReuseOptions | None = None) -> AsyncIterator[StreamDelta]:
        """Stream a chat request: text deltas, then a final delta carrying finish_reason and output.

        Cancelling the consumer (or leaving the loop early) aborts the request and frees its KV.
        """
        sink = LoopSink(asyncio.get_running_loop())
        req = self._make_request(messages, agent, sampling, tools, tool_choice, request_id, sink, reuse_options)
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
                self._inbox.put((_ABORT, req))

    def generate_sync(self, messages: list[dict], agent: str = "default",
                      sampling: SamplingParams | None = None, tools: list[dict] | None = None,
                      tool_choice: Any = None, request_id: str | None = None,
                      reuse_options: ReuseOptions | None = None) -> RequestOutput:
        """Blocking ``generate`` for synchronous callers (any thread, no event loop needed)."""
        sink = ThreadSink()
        req = self._make_request(messages, agent, sampling, tools, tool_choice, request_id, sink, reuse_options)
        self._submit(req)
        try:
            while True:
                event = sink.get()
                if isinstance(event, BaseException):
                    raise event
                if event.output is not None:
                    return event.output
        except BaseException:
            self._inbox.put((_ABORT, req))
            raise

    def set_edges(self, edges: Iterable[tuple[str, str]]) -> None:
        """Register the agent pipeline's edge order (predecessor, successor), e.g. from a LangGraph graph.

        Replaces any earlier registration. Shown in ``stats()["edges"]``; cross-agent reuse uses it to
        pick each agent's reference view.
        """
        clean = []
        for edge in edges:
            if not (isinstance(edge, (tuple, list)) and len(edge) == 2 and all(isinstance(a, str) and a for a in edge)):
                raise InvalidRequestError(f"edges must be (source, target) pairs of agent names, got {edge!r}")
            clean.append((edge[0], edge[1]))
        with self._stats_lock:
            self.edges = clean

    def predecessors(self, agent: str) -> list[str]:
        """Agents with an edge into ``agent``, in registration order."""
        with self._stats_lock:
            return [a for a, b in self.edges if b == agent]

    def successors(self, agent: str) -> list[str]:
        """Agents with an edge from ``agent``, in registration order."""
        with self._stats_lock:
            return [b for a, b in self.edges if a == agent and b != agent]

    def declare_agent(self, agent: str, system: str | list[dict], tools: list[dict] | None = None,
                      wait: bool = True) -> int:
        """Declare an agent's system message(s) before its first request; returns the prefix's tokens.

        The engine prefills them now (a one-token side request, counted in ``stats()["declared"]``,
        not in ``requests``), so the agent's first request finds its own prefix computed. With
        ``reuse="kvcmas"`` and registered edges, its graph predecessors then correct the shared
        history for it ahead of time even before it first speaks, as they do for later turns
        (engine/prefetch.py). Give exactly the system message(s) and tools its requests carry: a
        declaration that does not match them is never used. ``wait`` blocks until the prefill is done
        (and raises its error); else it runs in the background. Returns 0, declaring nothing, when the
        engine's reuse mode is "none" or the chat template is not prefix-stable.
        """
        if not isinstance(agent, str) or not agent:
            raise InvalidRequestError("agent must be a non-empty string")
        messages = [{"role": "system", "content": system}] if isinstance(system, str) else system
        if any(m["role"] != "system" for m in self.formatter.normalize(messages)):
            raise InvalidRequestError("system must be a string or a non-empty list of system messages")
        if self.config.reuse == "none":
            return 0
        sink = ThreadSink() if wait else (lambda event: None)
        req = self._make_request(messages, agent, SamplingParams(max_tokens=1), tools, None,
                                 f"declare-{agent}-{next(self._ids)}", sink)
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

    def stats(self) -> dict[str, Any]:
        """A snapshot of KV memory, cache hits and per-agent usage."""
        kv = self.store.stats()
        seg = self.scheduler.segments.stats()
        home_bytes = len(self.scheduler.segments.home_blocks) * kv.block_bytes
        anchors = self.corrector.anchors.stats()
        extra = seg.correction_bytes + anchors.anchor_bytes     # persistent non-block state
        with self._stats_lock:
            agents = {a: dict(v) for a, v in self._agents.items()}
            counters = dict(self._counters)
        for a in agents.values():
            if a.get("requests"):
                a["ttft_s_mean"] = a.get("ttft_s_total", 0.0) / a["requests"]
        return {
            "model": self.model_name, "device": str(self.device), "dtype": str(self.model.dtype).replace("torch.", ""),
            "reuse": self.config.reuse, "block_size": self.store.block_size, "block_bytes": kv.block_bytes,
            "kv_budget_bytes": self.config.kv_budget_bytes,
            "kv_bytes": kv.kv_bytes, "kv_bytes_active": kv.blocks_active * kv.block_bytes,
            "kv_bytes_cached": kv.blocks_cached * kv.block_bytes, "kv_bytes_peak": kv.kv_bytes_peak,
            "blocks_total": kv.blocks_total, "blocks_in_use": kv.blocks_active, "blocks_cached": kv.blocks_cached,
            "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
            "prefix_hit_tokens": counters.get("cached_tokens", 0),
            "template_fallbacks": counters.get("template_fallbacks", 0),
            **{k: counters.get(k, 0) for k in ("requests", "declared", "declare_failed", "completed", "failed", "aborted",
                                                "prompt_tokens", "completion_tokens", "steps", "max_batch_seqs")},
            "agents": agents,
            "edges": list(self.edges),
            "recompute_ratio": self.config.recompute_ratio, "rank": self.config.rank,
            "reference": self.config.reference, "basis": self.config.basis, "prefetch_ratio": self.config.prefetch_ratio,
            "home_views": seg.homes, "home_view_tokens": seg.home_tokens, "home_view_bytes": home_bytes,
            "corrections": seg.corrections, "correction_bytes": seg.correction_bytes,
            "correction_basis_bytes": seg.basis_bytes, "correction_bytes_by_agent": seg.by_agent, "home_views_evicted": seg.evicted,
            "correction_dtype": self.config.correction_dtype, "value_bits": self.config.value_bits,
            "key_bits": self.config.key_bits, "small_rows": self.config.small_rows,
            "small_row_bits": self.config.small_row_bits,
            "u8_components": self.config.u8_components, "u_head_bits": self.config.u_head_bits,
            "num_threads": self.num_threads,
            "correction_energy": self.config.correction_energy,
            "correction_rows_dropped": self.corrector.rows_dropped,
            "selections_capped": self.corrector.selections_capped,
            "uncorrected_energy": self.config.uncorrected_energy,
            "correction_layers_dropped": self.corrector.layers_dropped,
            "blend_ratio": self.config.blend_ratio, "kvcomm_anchors": self.config.kvcomm_anchors,
            "kvcomm_threshold": self.config.kvcomm_threshold,
            "anchors": anchors.anchors, "anchor_bytes": anchors.anchor_bytes,
            "anchor_bytes_by_agent": anchors.by_agent, "anchor_hits": anchors.hits,
            "anchor_misses": anchors.misses, "anchors_evicted": anchors.evicted,
            "kv_bytes_total": kv.kv_bytes + extra,
            "kv_bytes_total_peak": max(self._peak_total, kv.kv_bytes + extra),
            "view_path": self.runner.view_path, "view_path_fallback": self.runner.view_fallback,
            "realign_refused": self.realign_refused,
            "realign_refusals": counters.get("realign_refusals", 0),
            "prefetch": asdict(self.prefetcher.stats) if self.prefetcher is not None else None,
        }

    def reset_peak(self) -> None:
        """Restart peak KV accounting from the current level (for benchmarks)."""
        self.store.reset_peak()
        self._peak_total = 0

    async def aclose(self) -> None:
        """Stop the worker; pending requests fail with EngineClosedError."""
        if self._closed:
            return
        self._closed = True
        self._inbox.put((_CLOSE, None))
        await asyncio.get_running_loop().run_in_executor(None, self._worker.join)

    def close(self) -> None:
        """Synchronous ``aclose``."""
        if not self._closed:
            self._closed = True
            self._inbox.put((_CLOSE, None))
            self._worker.join()

    # --- request intake (caller thread) ------------------------------------------------------
    def _make_request(self, messages: Any, agent: str, sampling: SamplingParams | None,
                      tools: list[dict] | None, tool_choice: Any, request_id: str | None, sink: Any,
                      reuse_options: ReuseOptions | None = None) -> Request:
        if self._closed:
            raise EngineClosedError("engine is closed")
        if not isinstance(agent, str) or not agent:
            raise InvalidRequestError("agent must be a non-empty string")
        sampling = sampling or SamplingParams()
        options = reuse_options or ReuseOptions()
        try:
            sampling.validate()
            options.validate()
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from exc
        options = options.resolve(self.config)
        if options.reuse in CROSS_AGENT_MODES and self.realign_refused:
            options.reuse = "prefix"       # cannot realign this rope scaling; counted in stats
            with self._stats_lock:
                self._counters["realign_refusals"] += 1
        with self._tok_lock:
            prompt = self.formatter.render(messages, tools, tool_choice=tool_choice)
            detok = IncrementalDetokenizer(self.tokenizer, sampling.stop, prompt.token_ids)
        max_new = min(sampling.max_tokens, self.max_context - len(prompt.token_ids))
        req = Request(request_id=request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}", agent=agent,
                      prompt=prompt, sampling=sampling, max_new_tokens=max_new, detok=detok, sink=sink,
                      generator=make_generator(sampling.seed, self.device) if sampling.temperature > 0 else None,
                      options=options)
        if tools:
            req.tool_names = {t.get("function", t).get("name") for t in tools if isinstance(t, dict)}
        need = self.scheduler.blocks_for(req.max_total_tokens)
        if need > self.store.num_blocks:
            raise InvalidRequestError(
                f"request needs {need} KV blocks ({len(prompt.token_ids)} prompt + {max_new} new tokens) but "
                f"kv_budget_bytes={self.config.kv_budget_bytes} holds only {self.store.num_blocks}")
        return req

    def _submit(self, req: Request) -> None:
        if self._closed:
            raise EngineClosedError("engine is closed")
        with self._stats_lock:
            self._counters["requests"] += not req.declare
            if not req.prompt.prefix_stable:
                self._counters["template_fallbacks"] += 1
        self._inbox.put(("add", req))

    # --- worker thread --------------------------------------------------------------------
    def _run(self, threads: int, ready: threading.Event, built: dict[str, BaseException]) -> None:
        """The worker: builds the engine, then serves. All torch work stays on this one thread, so the
        engine does not leave an OpenMP team behind on the caller's thread (see EngineConfig.num_threads)."""
        try:
            torch.set_num_threads(threads)
            self._build()
            self.num_threads = torch.get_num_threads()
        except BaseException as exc:        # re-raised by __init__ in the caller's thread
            built["error"] = exc
            return
        finally:
            ready.set()
        self._loop()

    def _loop(self) -> None:
        while True:
            try:
                prefetching = self.prefetcher is not None and self.prefetcher.has_work()
                if not self._drain_inbox(block=not (self.scheduler.has_work() or prefetching)):
                    break
                if self.prefetcher is not None:   # an agent's own queued prefetch runs before its request
                    self.prefetcher.run_for({r.agent for r in self.scheduler.waiting})
                self._correct_one()
                items = self.scheduler.schedule()
                # Peak: this step's blocks and fresh corrections, before the step retires anything (a step
                # only writes into blocks planned here; a prefetch samples its own).
                self._track_peak()
                if items:
                    self._step(items)
                self._prefetch_when_quiet()
            except Exception as exc:     # a bug outside any one request: fail everything in flight
                for req in list(self.scheduler.running) + list(self.scheduler.waiting):
                    self._fail(req, EngineError(f"engine step failed: {exc!r}"))
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            self._fail(req, EngineClosedError("engine closed while the request was pending"))

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued commands; returns False on close."""
        try:
            cmd, arg = self._inbox.get(block=block)
        except queue.Empty:
            return True
        while True:
            if cmd == _CLOSE:
                return False
            if cmd == "add":
                self.scheduler.add(arg)
            elif cmd == _ABORT and arg.finish_reason is None:
                arg.aborted = True
                self._retire(arg, "aborted")
            try:
                cmd, arg = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _correct_one(self) -> None:
        """Run the KVCMAS correction of the oldest request whose own prefix is computed. One per engine
        step, before it is planned: the corrected request's tail joins that step, and concurrent
        requests keep prefilling and decoding between corrections instead of waiting for all of them.
        Requests with nothing to compute there (every reused piece exact or already corrected) pass
        at once, so concurrent ones still prefill their tails in one step."""
        busy = False
        for req in list(self.scheduler.running):
            if req.finish_reason is None and req.needs_correction:
                work = any(p.pending for p in req.pieces)
                if work and busy:
                    continue
                busy = busy or work
                try:
                    self.scheduler.ensure_blocks(req, len(req.prompt_ids))
                    self.corrector.correct(req)
                except Exception as exc:
                    self._fail(req, EngineError(f"correction failed for {req.request_id}: {exc!r}"))

    def _prefetch_when_quiet(self) -> None:
        """Ahead-of-time corrections run only while nothing waits and nobody is prefilling (e.g. during
        decode), so they never delay a first token; a decode step waits for one at most."""
        p = self.prefetcher
        if p is None or not p.has_work() or self.scheduler.waiting:
            return
        if any(r.in_prefill for r in self.scheduler.running):
            return
        p.run_one({r.agent for r in self.scheduler.running})
        self._track_peak()

    def _track_peak(self) -> None:
        total = (self.store.stats().kv_bytes + self.scheduler.segments.correction_bytes
                 + self.corrector.anchors.nbytes)
        if total > self._peak_total:
            self._peak_total = total

    def _step(self, items: list[StepItem]) -> None:
        try:
            logits = self.runner.run(items)
            results = [(items, logits)]
        except Exception:
            # Isolate: rerun each request alone; rewriting the same KV slots is harmless.
            results = []
            for item in items:
                try:
                    results.append(([item], self.runner.run([item])))
                except Exception as exc:
                    self._fail(item.request, EngineError(f"forward failed for {item.request.request_id}: {exc!r}"))
        with self._stats_lock:
            self._counters["steps"] += 1
            self._counters["max_batch_seqs"] = max(self._counters["max_batch_seqs"], len(items))
        for group, logits in results:
            sampling = [it.request for it in group if it.samples]   # decided before committing
            for item in group:
                self.scheduler.committed(item)
                req = item.request
                if req.options.reuse in CROSS_AGENT_MODES and not req.registered and not req.in_prefill:
                    self.corrector.register_homes(req)
                    if self.prefetcher is not None:
                        self.prefetcher.observe(req)
            if sampling:
                self._sample(sampling, logits)

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> None:
        try:
            tokens = self.sampler(logits, [r.sampling for r in reqs], [r.generator for r in reqs]).tolist()
        except Exception:
            tokens = []
            for i, r in enumerate(reqs):
                try:
                    tokens.append(int(self.sampler(logits[i:i + 1], [r.sampling], [r.generator])[0]))
                except Exception as exc:
                    self._fail(r, EngineError(f"sampling failed: {exc!r}"))
                    tokens.append(None)
        for i, (req, tok) in enumerate(zip(reqs, tokens)):
            if tok is None or req.finish_reason is not None:
                continue
            if req.sampling.return_logits:
                req.logits.append(logits[i].detach().to("cpu", copy=True))
            forced = req.sampling.forced_tokens
            if forced is not None and len(req.output_ids) < len(forced):
                tok = int(forced[len(req.output_ids)])
            try:
                self._append_token(req, tok)
            except Exception as exc:
                self._fail(req, EngineError(f"post-processing failed: {exc!r}"))

    def _append_token(self, req: Request, tok: int) -> None:
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
        if tok in self.stop_token_ids and not req.sampling.ignore_eos:
            req.stop_reason = self.tokenizer.convert_ids_to_tokens(tok)
            return self._retire(req, "stop")
        req.output_ids.append(tok)
        with self._tok_lock:
            text = req.detok.push(tok)
        if req.detok.stopped:
            req.stop_reason = req.detok.matched_stop
            return self._retire(req, "stop", text)
        if len(req.output_ids) >= req.max_new_tokens:
            return self._retire(req, "length", text)
        self._emit(req, StreamDelta(text=text, token_ids=[tok]))

    def _emit(self, req: Request, event: Any) -> None:
        try:
            req.sink(event)
        except RuntimeError:     # the caller's event loop is gone: nobody is listening
            if req.finish_reason is None:
                req.aborted = True
                self._retire(req, "aborted")

    def _retire(self, req: Request, reason: str, text: str = "") -> None:
        """Finish a request: free its KV, record stats, and send the final event."""
        req.finish_reason = reason
        if reason in ("stop", "length") and req.options.reuse in CROSS_AGENT_MODES and req.prompt.prefix_stable:
            try:    # the reply's decode KV becomes its home view; an error here costs only the reuse
                self.corrector.register_decoded(req)
            except Exception:
                pass
        self.scheduler.finish(req)
        if req.declare:      # no output: count it, and wake a waiting declare_agent
            with self._stats_lock:
                self._counters["declared" if reason in ("stop", "length") else "declare_failed"] += 1
            if reason != "error":        # _fail sends the error itself
                self._emit(req, StreamDelta(text="", token_ids=[], finish_reason=reason))
            return
        if reason in ("aborted", "error"):
            with self._stats_lock:
                self._counters["aborted" if reason == "aborted" else "failed"] += 1
            return
        with self._tok_lock:
            text += req.detok.finish()
        out = self._output(req)
        self._record(req, out)
        self._emit(req, StreamDelta(text=text, token_ids=[], finish_reason=out.finish_reason, output=out))

    def _fail(self, req: Request, exc: BaseException) -> None:
        if req.finish_reason is not None:
            return
        self._retire(req, "error")
        self._emit(req, exc)

    def _output(self, req: Request) -> RequestOutput:
        text = req.detok.text
        parsed = parse_tool_calls(text, req.tool_names) if req.tool_names else None
        reason = req.finish_reason
        if parsed is not None and parsed.tool_calls:
            reason = "tool_calls"
        now = time.perf_counter()
        usage = Usage(prompt_tokens=len(req.prompt_ids), completion_tokens=len(req.output_ids),
                      cached_tokens=req.cached_tokens, reused_tokens=req.reused_tokens,
                      recomputed_tokens=req.recomputed_tokens)
        return RequestOutput(
            request_id=req.request_id, agent=req.agent, text=text, token_ids=list(req.output_ids),
            finish_reason=reason, ttft_s=(req.first_token_at or now) - req.arrival, latency_s=now - req.arrival,
            usage=usage, content=parsed.content if parsed else text,
            tool_calls=parsed.tool_calls if parsed else [],
            invalid_tool_calls=parsed.invalid_tool_calls if parsed else [],
            stop_reason=req.stop_reason,
            reuse=req.options.reuse if req.prompt.prefix_stable else "none",
            prefix_stable=req.prompt.prefix_stable,
            logits=req.logits if req.sampling.return_logits else None)

    def _record(self, req: Request, out: RequestOutput) -> None:
        u = out.usage
        with self._stats_lock:
            c = self._counters
            c["completed"] += 1
            c["prompt_tokens"] += u.prompt_tokens
            c["completion_tokens"] += u.completion_tokens
            c["cached_tokens"] += u.cached_tokens
            a = self._agents[req.agent]
            a["requests"] += 1
            a["ttft_s_total"] += out.ttft_s
            for k in ("prompt_tokens", "completion_tokens", "cached_tokens", "reused_tokens", "recomputed_tokens"):
                a[k] += getattr(u, k)

    # --- context manager sugar ---------------------------------------------------------------
    async def __aenter__(self) -> "Engine":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
