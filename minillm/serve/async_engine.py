"""One engine thread behind many concurrent HTTP requests (chapter 08).

`LLMEngine` is synchronous: `step_outputs()` runs one forward pass over everything scheduled. A
server needs that loop to keep running while requests arrive and stream out, so `AsyncEngine`
gives the engine its own thread and talks to it through two one-way channels:

    HTTP handlers (asyncio)                     engine thread
    -----------------------                     -------------
    submit(...) --- inbox (thread-safe queue) ---> add_request / abort_request between steps
    async for event in stream  <--- per-request asyncio.Queue --- after each step: the step's
                                                                   TokenDeltas as text, then
                                                                   the finished outputs

Only the engine thread touches the engine (no locks around it: the same single-owner design as
vLLM's engine core), and it uses only the engine's public surface: `add_request`,
`abort_request`, `has_unfinished`, `step_outputs`, `decode` and `logprob_dict` (only for a
request that asked for logprobs). Everything it publishes (text,
finished outputs, the metrics' gauges) comes from what `step_outputs()` returned: the
`TokenDelta`s, the finished `RequestOutput`s and the `StepStats` snapshot. Handlers never block
the event loop on a step.

Events a request's queue receives (small frozen dataclasses; consumers match on their type):

    event                               when                               how many
    ----------------------------------  ---------------------------------  ----------------
    TextDelta(text, num_output_tokens)  a step gave it tokens whose text   0 or more, first
                                        is now safe to send
    Finished(output)                    it finished (stop / length / abort  exactly one of
                                        by the engine): the RequestOutput  these four, last
    Failed(message)                     the engine failed this request
                                        (its step raised, detokenising
                                        failed, add_request refused it)
    Aborted()                           the server stopped before it
                                        finished (shutdown)

With n > 1 every sample streams (TextDelta.index says which). With logprobs, each TextDelta
carries the {id: Logprob} of the tokens it covers.

Streaming text is detokenised incrementally: each step the request's whole output so far is
decoded and only the part past what was already sent goes out, holding back an incomplete UTF-8
character ("\\ufffd") and, with stop strings, the last len(longest stop) - 1 characters (they
might be the start of a stop string the engine will cut). The finished output's text is the
engine's own, so the concatenated deltas plus the rest of the Finished text equal the
non-streamed text exactly.
"""
from __future__ import annotations

import asyncio
import collections
import queue
import threading
import traceback
from dataclasses import dataclass, field
from typing import Optional, Union

from ..engine.outputs import RequestOutput, StepOutput, TokenDelta
from ..sampling import SamplingParams


# --- what a request's stream receives ------------------------------------------------------------
@dataclass(frozen=True)
class TextDelta:
    """New text of sample `index` since its previous event (never empty); `num_output_tokens`
    it covers so far; `logprobs`: {id: Logprob} of each token since the previous event, when
    the request asked for logprobs."""
    text: str
    num_output_tokens: int
    index: int = 0
    logprobs: tuple = ()


@dataclass(frozen=True)
class Finished:
    """The request finished; `output` is the engine's RequestOutput (its text is authoritative)."""
    output: RequestOutput


@dataclass(frozen=True)
class Failed:
    """The engine failed this request (the others carry on); `message` says why."""
    message: str


@dataclass(frozen=True)
class Aborted:
    """The server shut down before this request finished."""


StreamEvent = Union[TextDelta, Finished, Failed, Aborted]


@dataclass
class SampleStream:
    """One sample's streaming state (n > 1 gives a request several)."""
    token_ids: list = field(default_factory=list)   # output tokens so far (from the deltas)
    sent_text: str = ""
    pending_logprobs: list = field(default_factory=list)   # not yet sent with any text


@dataclass
class RequestStream:
    """The engine thread's view of one request it streams to."""
    request_id: str
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue           # of StreamEvent, read by the HTTP handler
    hold_back: int = 0              # characters kept back while stop strings may still match
    samples: dict = field(default_factory=dict)    # sample index -> SampleStream

    def put(self, event: StreamEvent) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def sample(self, index: int) -> SampleStream:
        return self.samples.setdefault(index, SampleStream())

    def text_delta(self, text: str, index: int = 0) -> Optional[TextDelta]:
        """The part of `text` (sample `index`'s whole output decoded) that is safe to send now,
        or None."""
        s = self.sample(index)
        if text.endswith("\ufffd"):              # half a UTF-8 character: wait for the rest
            return None
        end = len(text) - self.hold_back
        if end <= len(s.sent_text) or not text.startswith(s.sent_text):
            return None
        delta = text[len(s.sent_text):end]
        s.sent_text += delta
        lps, s.pending_logprobs = tuple(s.pending_logprobs), []
        return TextDelta(delta, len(s.token_ids), index, lps)


class QueueFull(Exception):
    """The waiting queue is at its bound: answer 429 and let the client retry."""


class AsyncEngine:
    """Runs `engine.step_outputs()` in a background thread while requests come and go.

    max_waiting: bound on requests queued but not yet running (the engine's waiting queue at the
    last step plus submissions since). `submit` refuses with `QueueFull` beyond it, so a burst
    becomes fast 429s instead of minutes of queueing nobody waits for.
    observer: optional object with `on_step(stats)` (a StepStats) and `on_finished(output)` (the
    Prometheus metrics), called from the engine thread.
    """

    def __init__(self, engine, max_waiting: int = 256, observer=None, idle_wait: float = 0.05):
        if int(max_waiting) != max_waiting or max_waiting < 1:
            raise ValueError(f"max_waiting must be a positive integer, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.observer = observer
        self.idle_wait = idle_wait
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict = {}                 # request_id -> RequestStream (engine thread only)
        self._count_lock = threading.Lock()
        self._pending_adds = 0                   # submitted, not yet added by the thread
        self.num_waiting = 0                     # the engine's waiting queue (last step + adds)
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
        """Abort whatever is still live (its streams get Aborted), then stop the thread."""
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
    def submit(self, request_id: str, prompt_token_ids: list, params: SamplingParams,
               arrival_time: float) -> asyncio.Queue:
        """Queue a request; returns the asyncio.Queue its StreamEvents arrive on. Raises
        QueueFull when max_waiting requests are already waiting. Call from the event loop."""
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
                out = eng.step_outputs()
            except Exception as e:               # a bug in a step: fail what ran, keep serving
                self._fail_live(e)
                continue
            self._publish(out)

    def _drain_inbox(self) -> None:
        """Apply what the handlers sent since the last step (between steps, never during)."""
        eng = self.engine
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                break
            kind = msg[0]
            if kind == "add":
                self._add(*msg[1:])
            elif kind == "abort":
                if eng.abort_request(msg[1]):
                    self._streams.pop(msg[1], None)
            elif kind == "abort_all":
                for rid in list(self._streams):
                    eng.abort_request(rid)
                    self._streams.pop(rid).put(Aborted())

    def _add(self, stream: RequestStream, ids: list, params: SamplingParams,
             arrival_time: float) -> None:
        try:
            self.engine.add_request(stream.request_id, ids, params, arrival_time=arrival_time)
        except ValueError as e:                  # the handler's checks missed something
            stream.put(Failed(str(e)))
        else:
            self._streams[stream.request_id] = stream
        with self._count_lock:
            self._pending_adds -= 1
            self.num_waiting += stream.request_id in self._streams   # until the next snapshot

    def _publish(self, out: StepOutput) -> None:
        """Send one step's results: text of the deltas, then the finished outputs, then the
        stats snapshot (admission's waiting count and the observer's gauges)."""
        for delta in out.deltas:
            self._on_delta(delta)
        for output in out.finished:
            self._on_finished(output)
        with self._count_lock:
            self.num_waiting = out.stats.num_waiting
        if self.observer is not None:
            self.observer.on_step(out.stats)

    def _on_delta(self, delta: TokenDelta) -> None:
        stream = self._streams.get(delta.request_id)
        if stream is None or delta.finished or not delta.token_ids:
            return      # aborted; or finishing: Finished has the text
        sample = stream.sample(delta.index)
        sample.token_ids.extend(delta.token_ids)
        try:
            sample.pending_logprobs.extend(self.engine.logprob_dict(d) for d in delta.logprobs)
            text = self.engine.decode(sample.token_ids)
        except Exception as e:                    # noqa: BLE001 - this request's error only
            self.engine.abort_request(delta.request_id)     # fail that stream, free its blocks
            self._streams.pop(delta.request_id)
            stream.put(Failed(f"detokenisation failed: {type(e).__name__}: {e}"))
            return
        event = stream.text_delta(text, delta.index)
        if event is not None:
            stream.put(event)

    def _on_finished(self, output: RequestOutput) -> None:
        self.recent[output.request_id] = output
        while len(self.recent) > self.max_recent:
            self.recent.popitem(last=False)
        if self.observer is not None:
            self.observer.on_finished(output)
        stream = self._streams.pop(output.request_id, None)
        if stream is None:
            return
        if output.finish_reason == "error":      # the engine failed this request only
            stream.put(Failed(output.error or "the engine failed this request"))
        else:
            stream.put(Finished(output))

    def _fail_live(self, exc: Exception) -> None:
        """step_outputs() raised: every request it may have touched is failed and its blocks
        freed (the next step returns their aborted outputs); requests submitted later are
        served normally."""
        msg = f"the engine failed while running this request: {type(exc).__name__}: {exc}"
        traceback.print_exc()
        for rid in list(self._streams):
            self.engine.abort_request(rid)
            self._streams.pop(rid).put(Failed(msg))


__all__ = ["AsyncEngine", "QueueFull", "RequestStream", "SampleStream", "StreamEvent",
           "TextDelta", "Finished", "Failed", "Aborted"]
