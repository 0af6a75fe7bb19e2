"""The engine's worker: one thread owns all torch work. Each step reads

    take the inbox -> schedule (admit, prepare, plan: ``Scheduler.schedule``) -> run -> postprocess

then, when nothing waits or prefills, one unit of idle work (ahead-of-time corrections,
``Scheduler.idle``). A failing step is retried request by request, so that only the culprit fails. No
request fails because an optimization did: a request whose correction or reused view fails is served
again as an exact prefill (``Scheduler.fall_back``), and failing work off the critical path is dropped.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any

import torch

from ..chat.token_bytes import TokenTexts
from ..chat.tools import parse_tool_calls
from ..errors import EngineClosedError, EngineError
from ..model.sampling import Sampler
from ..reuse.base import ReuseMethod
from .budget import KVBudget
from .handoffs import HandOffs
from .jump import jump_forward
from .logprobs import Logprob, logprob_entry
from .outputs import RequestOutput, StreamDelta, Usage
from .request import Request
from .runner import ModelRunner
from .scheduler import Scheduler, StepItem
from .stats import Counters

ADD, ABORT, CLOSE = "add", "abort", "close"


class Worker:
    def __init__(self, scheduler: Scheduler, budget: KVBudget, handoffs: HandOffs, runner: ModelRunner,
                 tokenizer: Any, tok_lock: threading.Lock, stop_token_ids: set[int], counters: Counters,
                 inbox: "queue.Queue[tuple[str, Any]]"):
        self.scheduler, self.budget, self.handoffs, self.runner = scheduler, budget, handoffs, runner
        self.sampler = Sampler()
        self.token_texts = TokenTexts(tokenizer, tok_lock)
        self.tokenizer, self.tok_lock, self.stop_token_ids = tokenizer, tok_lock, stop_token_ids
        self.counters, self.inbox = counters, inbox

    def method(self, req: Request) -> ReuseMethod:
        return self.scheduler.method_of(req)

    # --- the loop ------------------------------------------------------------------------------
    def loop(self) -> None:
        sched = self.scheduler
        idle_work = False                               # sched.idle() had work: come back without sleeping
        while True:
            try:
                if not self._take_inbox(block=not (sched.has_work() or idle_work)):
                    break
                items = sched.schedule()
                self._fail_unservable()
                if items:
                    self._postprocess(self._run(items))
                    self.budget.charge_state()          # what finished no longer pins its state
                idle_work = sched.idle()
            except Exception as exc:     # a bug outside any one request: fail everything in flight
                self._fail_unservable()
                for req in list(sched.running) + list(sched.waiting):
                    self.fail(req, EngineError(f"engine step failed: {exc!r}"))
        self._fail_unservable()
        for req in list(sched.running) + list(sched.waiting):
            self.fail(req, EngineClosedError("engine closed while the request was pending"))

    def _take_inbox(self, block: bool) -> bool:
        """Apply queued commands; returns False on close."""
        try:
            cmd, arg = self.inbox.get(block=block)
        except queue.Empty:
            return True
        while True:
            if cmd == CLOSE:
                return False
            if cmd == ADD:
                if not arg.declare:
                    self.handoffs.arrived(arg.agent)
                self.scheduler.add(arg)
            elif cmd == ABORT and arg.finish_reason is None:
                arg.aborted = True
                self.retire(arg, "aborted")
            try:
                cmd, arg = self.inbox.get_nowait()
            except queue.Empty:
                return True

    def _fail_unservable(self) -> None:
        """Fail what the scheduler could never serve (e.g. larger than the budget with nothing else running)."""
        for req, exc in self.scheduler.take_failed():
            self.fail(req, exc)

    def fall_back(self, req: Request, where: str, exc: BaseException) -> None:
        """A request whose step failed is served again as an exact prefill (``Scheduler.fall_back``);
        one with nothing to fall back from fails alone."""
        if req.finish_reason is not None:
            return
        error = self.scheduler.fall_back(req, where, exc)
        if error is not None:
            self.fail(req, error)

    # --- one step ------------------------------------------------------------------------------
    def _run(self, items: list[StepItem]) -> list[tuple[list[StepItem], torch.Tensor]]:
        """The step's forward: its items' logits, by group of items run together."""
        t0 = time.perf_counter()
        waiting_first = [it.request for it in items if it.request.first_token_at is None]
        try:
            results = [(items, self.runner.run(items))]
        except Exception:
            # Isolate: rerun each request alone; rewriting the same KV slots is harmless.
            results = []
            for item in items:
                try:
                    results.append(([item], self.runner.run([item])))
                except Exception as exc:
                    self.fall_back(item.request, "forward", exc)
        dt = time.perf_counter() - t0
        for req in waiting_first:             # the step's forward, before sampling may finish them
            req.timings.add("forward", dt)
        self.counters.add("steps")
        self.counters.raise_to("max_batch_seqs", len(items))
        return results

    def _postprocess(self, results: list[tuple[list[StepItem], torch.Tensor]]) -> None:
        """Record the KV the step wrote, then sample the requests it brought to their next token."""
        for group, logits in results:
            sampling = [it.request for it in group if it.samples]   # decided before committing
            for item in group:
                try:
                    self.scheduler.committed(item)
                except Exception as exc:     # the reuse method's bookkeeping (home views, prefetch queue)
                    self.fall_back(item.request, "bookkeeping", exc)
            running = [i for i, r in enumerate(sampling) if r in self.scheduler.running]
            if len(running) < len(sampling):         # fell back: it samples again once recomputed
                sampling, logits = [sampling[i] for i in running], logits[running]
            if sampling:
                self._sample(sampling, logits)

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> None:
        try:
            picked = self.sampler.sample(logits, [r.sampling for r in reqs], [r.generator for r in reqs],
                                         [r.grammar for r in reqs], [r.output_ids for r in reqs])
            tokens, steps = picked.tokens.tolist(), [(picked.logprobs, i) for i in range(len(reqs))]
        except Exception:
            tokens, steps = [], []
            for i, r in enumerate(reqs):
                try:
                    alone = self.sampler.sample(logits[i:i + 1], [r.sampling], [r.generator], [r.grammar],
                                                [r.output_ids])
                    tokens.append(int(alone.tokens[0]))
                    steps.append((alone.logprobs, 0))
                except Exception as exc:
                    self.fail(r, EngineError(f"sampling failed: {exc!r}"))
                    tokens.append(None)
                    steps.append((None, 0))
        for i, (req, tok) in enumerate(zip(reqs, tokens)):
            if tok is None or req.finish_reason is not None:
                continue
            if req.sampling.return_logits:
                req.logits.append(logits[i].detach().to("cpu", copy=True))
            forced = req.sampling.forced_tokens
            if forced is not None and len(req.output_ids) < len(forced):
                tok = int(forced[len(req.output_ids)])
            try:
                step, row = steps[i]
                entry = step.get(row, tok) if step is not None else None
                if entry is not None:    # a stopping EOS's entry is cut off later: logprobs follow output_ids
                    req.logprobs.append(logprob_entry(entry, self.token_texts))
                self._append_token(req, tok)
            except Exception as exc:
                self.fail(req, EngineError(f"post-processing failed: {exc!r}"))

    def _append_token(self, req: Request, tok: int) -> None:
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
        if req.grammar is not None and not req.grammar.accept(tok):
            raise EngineError(f"token {tok} breaks the request's output grammar")
        if tok in self.stop_token_ids and not req.sampling.ignore_eos:
            req.stop_reason = self.tokenizer.convert_ids_to_tokens(tok)
            return self.retire(req, "stop")
        req.output_ids.append(tok)
        with self.tok_lock:
            text = req.detok.push(tok)
        if req.detok.stopped:
            req.stop_reason = req.detok.matched_stop
            return self.retire(req, "stop", text, [tok])
        if len(req.output_ids) >= req.max_new_tokens:
            return self.retire(req, "length", text, [tok])
        jump = jump_forward(req, self.tok_lock)       # tokens the grammar forces next, appended unsampled
        if req.sampling.logprobs:                     # forced: the grammar leaves them probability 1
            for t in jump.token_ids:
                text_t, raw_bytes = self.token_texts(t)
                req.logprobs.append(Logprob(t, text_t, 0.0, raw_bytes))
        if jump.finish_reason is not None:
            return self.retire(req, jump.finish_reason, text + jump.text, [tok, *jump.token_ids])
        self.emit(req, StreamDelta(text=text + jump.text, token_ids=[tok, *jump.token_ids]))

    # --- the end of a request ------------------------------------------------------------------
    def emit(self, req: Request, event: Any) -> None:
        if req.sampling.logprobs and isinstance(event, StreamDelta):
            end = len(req.output_ids)
            event.logprobs, req.logprobs_sent = req.logprobs[req.logprobs_sent:end], end
        try:
            req.sink(event)
        except RuntimeError:     # the caller's event loop is gone: nobody is listening
            if req.finish_reason is None:
                req.aborted = True
                self.retire(req, "aborted")

    def retire(self, req: Request, reason: str, text: str = "", token_ids: list[int] | None = None) -> None:
        """Finish a request: free its KV, record stats, and send the final event (with the last token's
        text and id, when it ends on one)."""
        req.finish_reason = reason
        try:    # e.g. the reply's decode KV becomes its home view; an error here costs only the reuse
            self.method(req).on_finish(req, reason)
        except Exception:
            pass
        self.scheduler.finish(req)
        if req.declare:      # no output: count it, and wake a waiting declare_agent
            self.counters.add("declared" if reason in ("stop", "length") else "declare_failed")
            if reason != "error":        # fail() sends the error itself
                self.emit(req, StreamDelta(text="", token_ids=[], finish_reason=reason))
            return
        self.handoffs.finished(req.agent, reason not in ("aborted", "error"))
        if reason in ("aborted", "error"):
            self.counters.add("aborted" if reason == "aborted" else "failed")
            return
        with self.tok_lock:
            text += req.detok.finish()
        out = self._output(req)
        self.counters.record(req.agent, out.usage, out.ttft_s)
        self.emit(req, StreamDelta(text=text, token_ids=token_ids or [], finish_reason=out.finish_reason, output=out))

    def fail(self, req: Request, exc: BaseException) -> None:
        if req.finish_reason is not None:
            return
        self.retire(req, "error")
        self.emit(req, exc)

    def _output(self, req: Request) -> RequestOutput:
        text = req.detok.text
        cut = req.finish_reason == "length"         # a cut call stays in the content
        parsed = parse_tool_calls(text, req.tool_names, cut) if req.tool_names else None
        reason = req.finish_reason
        if parsed is not None and parsed.tool_calls:
            reason = "tool_calls"
        now = time.perf_counter()
        recomputed_reused = req.recomputed_tokens if self.method(req).recomputes_reused else 0
        usage = Usage(prompt_tokens=len(req.prompt_ids), completion_tokens=len(req.output_ids),
                      cached_tokens=req.cached_tokens, reused_tokens=req.reused_tokens,
                      recomputed_tokens=req.recomputed_tokens,
                      kept_tokens=req.cached_tokens + req.reused_tokens - recomputed_reused,
                      exact_fallback=req.exact_fallback)
        return RequestOutput(
            request_id=req.request_id, agent=req.agent, text=text, token_ids=list(req.output_ids),
            finish_reason=reason, ttft_s=(req.first_token_at or now) - req.arrival, latency_s=now - req.arrival,
            usage=usage, content=parsed.content if parsed else text,
            tool_calls=parsed.tool_calls if parsed else [],
            invalid_tool_calls=parsed.invalid_tool_calls if parsed else [],
            stop_reason=req.stop_reason,
            reuse=req.options.reuse if req.prompt.prefix_stable and not req.exact_fallback else "none",
            fallback=req.fallback,
            prefix_stable=req.prompt.prefix_stable,
            logits=req.logits if req.sampling.return_logits else None, timings=dict(req.timings),
            logprobs=req.logprobs[:len(req.output_ids)] if req.sampling.logprobs else None)
