"""One engine thread behind many concurrent HTTP requests (chapter 08).

`LLMEngine` is synchronous: `step()` runs one forward pass over everything scheduled. A server
needs that loop to keep running while requests arrive and stream out, so `AsyncEngine` gives
the engine its own thread and talks to it through two one-way channels:

    HTTP handlers (asyncio)                     engine thread
    -----------------------                     -------------
    submit(...) --- inbox (thread-safe queue) ---> add_request / abort_request between steps
    async for event in stream  <--- per-request asyncio.Queue --- after each step: new text,
                                                                   then the finished output

Only the engine thread touches the engine (no locks around the scheduler or block manager: the
same single-owner design as vLLM's engine core). Handlers never block the event loop on a step.

Events a request's queue receives, in order:
    ("delta", text, num_output_tokens)   new text since the last event (may be "")
    ("finished", RequestOutput)          exactly once, last
    ("error", message)                   instead of "finished" when this request failed

Streaming text is detokenised incrementally: the whole output is decoded each step and only the
part past what was already sent goes out, holding back an incomplete UTF-8 character ("\ufffd")
and, with stop strings, the last len(longest stop) - 1 characters (they might be the start of a
stop string the engine will cut). The finished output's text is the engine's own, so the
concatenated deltas equal the non-streamed text exactly.
"""
from __future__ import annotations

import asyncio
import collections
import queue
import threading
import traceback
from dataclasses import dataclass
from typing import Optional

from ..sampling import SamplingParams


@dataclass
class RequestStream:
    """The engine thread's view of one request it streams to."""
    request_id: str
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    hold_back: int = 0             # characters kept back while stop strings may still match
    sent_text: str = ""
    sent_tokens: int = 0

    def put(self, event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class AsyncEngine:
    """Runs `engine.step()` in a background thread while requests come and go.

    max_waiting: bound on requests queued but not yet running (the engine's waiting queue plus
    submissions the thread has not picked up). `submit` refuses with `QueueFull` beyond it, so
    a burst becomes fast 429s instead of minutes of queueing nobody waits for.
    observer: optional object with `on_step(engine, stats)` and `on_finished(output)` (the
    Prometheus metrics), called from the engine thread.
    """

    def __init__(self, engine, max_waiting: int = 256, observer=None, idle_wait: float = 0.05):
        if int(max_waiting) != max_waiting or max_waiting < 1:
            raise ValueError(f"max_waiting must be a positive integer, got {max_waiting}")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_waiting = max_waiting
        self.observer = observer
        self.idle_wait = idle_wait
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict = {}                 # request_id -> RequestStream (engine thread only)
        self._pending_adds = 0                   # submitted, not yet added by the thread
        self._count_lock = threading.Lock()
        self.num_waiting = 0                     # snapshot after the last step
        self.num_running = 0
        self.num_steps = 0
        self.num_step_failures = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.recent: collections.OrderedDict = collections.OrderedDict()  # id -> RequestOutput
        self.max_recent = 1024                   # finished outputs kept for inspection

    # --- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="minillm-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever is still live, then stop the thread."""
        if self._thread is None:
            return
        self._inbox.put(("abort_all",))
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # --- called from the event loop ------------------------------------------------------------
    def queue_depth(self) -> int:
        return self.num_waiting + self._pending_adds

    def submit(self, request_id: str, prompt_token_ids: list, params: SamplingParams,
               arrival_time: float) -> asyncio.Queue:
        """Queue a request; returns the asyncio.Queue its events arrive on. Raises QueueFull
        when max_waiting requests are already waiting. Call from the event loop thread."""
        with self._count_lock:
            if self.num_waiting + self._pending_adds >= self.max_waiting:
                raise QueueFull(f"{self.max_waiting} requests are already waiting; retry later")
            self._pending_adds += 1
        events: asyncio.Queue = asyncio.Queue()
        hold = max((len(s) for s in params.stop), default=1) - 1
        stream = RequestStream(request_id, asyncio.get_running_loop(), events, hold)
        self._inbox.put(("add", stream, prompt_token_ids, params, arrival_time))
        self._wake.set()
        return events

    def abort(self, request_id: str) -> None:
        """Abort a request (client went away); its blocks are freed before the next step."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    # --- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while True:
            self._drain_inbox()
            if self._stop.is_set() and not eng.has_unfinished():
                break
            if not eng.has_unfinished():
                self._wake.wait(self.idle_wait)
                self._wake.clear()
                continue
            try:
                finished = eng.step()
            except Exception as e:               # a bug in a step: fail what ran, keep serving
                self._fail_live(e)
                continue
            self.num_steps += 1
            self._publish(finished)

    def _drain_inbox(self) -> None:
        eng = self.engine
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                break
            kind = msg[0]
            if kind == "add":
                _, stream, ids, params, arrival = msg
                try:
                    eng.add_request(stream.request_id, ids, params, arrival_time=arrival)
                except ValueError as e:
                    stream.put(("error", str(e)))
                else:
                    self._streams[stream.request_id] = stream
                with self._count_lock:
                    self._pending_adds -= 1
                    self.num_waiting += 1         # until the next snapshot
            elif kind == "abort":
                if eng.abort_request(msg[1]):
                    self._streams.pop(msg[1], None)
            elif kind == "abort_all":
                for rid in list(self._streams):
                    eng.abort_request(rid)
                    self._streams.pop(rid).put(("finished_abort",))

    def _publish(self, finished: list) -> None:
        eng = self.engine
        broken = []
        for rid, stream in self._streams.items():
            group = eng.groups.get(rid)
            if not group:
                continue
            ids = group[0].output_token_ids
            if len(ids) > stream.sent_tokens:
                try:
                    text = eng.decode(ids)
                except Exception as e:            # noqa: BLE001 - this request's error only
                    broken.append((rid, f"detokenisation failed: {type(e).__name__}: {e}"))
                    continue
                self._send_delta(stream, text, len(ids))
        for rid, msg in broken:                   # fail that stream, free its blocks
            eng.abort_request(rid)
            self._streams.pop(rid).put(("error", msg))
        for out in finished:
            self.recent[out.request_id] = out
            while len(self.recent) > self.max_recent:
                self.recent.popitem(last=False)
            stream = self._streams.pop(out.request_id, None)
            if self.observer is not None:
                self.observer.on_finished(out)
            if stream is None:
                continue
            if out.finish_reason == "error":    # the engine failed this request only
                stream.put(("error", out.error or "the engine failed this request"))
            else:
                stream.put(("finished", out))
        s = eng.scheduler
        with self._count_lock:
            self.num_waiting = len(s.waiting)
        self.num_running = len(s.running)
        if self.observer is not None:
            self.observer.on_step(eng, eng.step_stats[-1] if eng.step_stats else None)

    @staticmethod
    def _send_delta(stream: RequestStream, text: str, num_tokens: int) -> None:
        stream.sent_tokens = num_tokens
        if text.endswith("\ufffd"):              # half a UTF-8 character: wait for the rest
            return
        end = len(text) - stream.hold_back
        if end <= len(stream.sent_text) or not text.startswith(stream.sent_text):
            return
        delta = text[len(stream.sent_text):end]
        stream.sent_text += delta
        stream.put(("delta", delta, num_tokens))

    def _fail_live(self, exc: Exception) -> None:
        """step() raised: every request it may have touched is failed and its blocks freed;
        requests submitted later are served normally."""
        self.num_step_failures += 1
        msg = f"the engine failed while running this request: {type(exc).__name__}: {exc}"
        traceback.print_exc()
        for rid in list(self._streams):
            self.engine.abort_request(rid)
            self._streams.pop(rid).put(("error", msg))
        try:                                      # return the aborted outputs (frees nothing new)
            if self.engine.has_unfinished():
                self.engine.step()
        except Exception:
            traceback.print_exc()


class QueueFull(Exception):
    """The waiting queue is at its bound: answer 429 and let the client retry."""


__all__ = ["AsyncEngine", "QueueFull", "RequestStream"]
