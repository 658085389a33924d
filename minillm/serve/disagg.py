"""Disaggregated prefill and decode (chapter 11): two engine processes, the KV moved between them.

In one engine a long prefill and the running decodes share every step, so a prompt's arrival
stretches every stream's inter-token gap (chapter 05 bounds it with chunking). DistServe and
Splitwise put prefill and decode on different machines instead, each tuned for its phase, and
move each request's KV cache from one to the other once its prompt is done:

    driver            prefill worker (rank 0)              decode worker (rank 1)
    submit(ids) ----> engine with max_tokens=1:
                      prefill, sample the first token
    <-- "first" ----- KVSender.request_finished: K/V of
                      the prompt's tokens, every layer
                      "kv" message (ids, first token) ---> queue
                      dist.isend(K), dist.isend(V) ======> dist.recv into the same shapes
                                                           add_request(ids + [first]):
                                                           KVReceiver.lookup hands the K/V to
                                                           the scheduler as blocks found
                                                           outside the pool; only the first
                                                           token is computed, then decoding
    <-- "tokens" ---------------------------------------- every step's new tokens
    <-- "done" ------------------------------------------ finish_reason

The two workers form a torch.distributed process group (gloo on CPU; NCCL would carry the
tensors GPU to GPU); requests and tokens travel on multiprocessing queues. The transfer is
exactly the prompt's KV: 2 x layers x kv_heads x head_dim x dtype bytes per prompt token
(chapter 01's kv_bytes_per_token), which the workers count (`stats()`).

Greedy outputs equal the colocated engine's token for token (the decode worker sees the same
prompt K/V and the same first token). Each worker runs `threads` torch threads: one core each
here, against two cores shared by one colocated engine.

Faults: a worker that dies makes the driver raise a RuntimeError naming it within `timeout`
seconds; `close()` (also on `with` exit and at interpreter exit) stops both workers, killing
them after a grace period, so no process is left behind.
"""
from __future__ import annotations

import atexit
import dataclasses
import queue
import socket
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..configs import ModelConfig
from ..sampling import SamplingParams


# --- the two connectors (the scheduler's KV seam, cache/blocks.py NoKVConnector) --------------
class KVSender:
    """In the prefill engine: when a hand-off request finishes (its first token sampled), keep
    the K/V of its prompt tokens ([layers, prompt_len, kv_heads, head_dim] each) for sending."""

    def __init__(self):
        self.cache = None           # the engine's PagedKVCache, set once the engine exists
        self.outbox: dict = {}      # request_id -> (k, v)

    def lookup(self, req, token_ids, num_hit_blocks: int) -> tuple:
        return 0, []

    def request_finished(self, req) -> None:
        if req.finish_reason != "length" or req.kv is None:
            return                   # ended at its first token (EOS, stop) or failed: no decode
        n = req.num_prompt_tokens
        k, v = self.cache.swap_out(req.kv.block_ids)          # [L, blocks, bs, KVH, D]
        L, _, _, kvh, d = k.shape
        self.outbox[req.request_id] = (k.reshape(L, -1, kvh, d)[:, :n].contiguous(),
                                       v.reshape(L, -1, kvh, d)[:, :n].contiguous())

    def clear(self) -> int:
        return 0


class KVReceiver:
    """In the decode engine: the K/V received for a request are found 'outside the pool' at its
    admission (and again if it is preempted and recomputed); dropped when it finishes."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.inbox: dict = {}       # request_id -> (k, v) [L, prompt_len, KVH, D]

    def lookup(self, req, token_ids, num_hit_blocks: int) -> tuple:
        if req.request_id not in self.inbox:
            return 0, []
        k, v = self.inbox[req.request_id]
        bs, n = self.block_size, k.shape[1]
        nb = -(-n // bs)
        if num_hit_blocks >= nb:
            return 0, []
        pad = nb * bs - n                                      # the last block's empty slots
        k = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad))   # [L, nb * bs, KVH, D]
        v = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad))
        loads = [(k[:, i * bs:(i + 1) * bs], v[:, i * bs:(i + 1) * bs])
                 for i in range(num_hit_blocks, nb)]
        return n - num_hit_blocks * bs, loads

    def request_finished(self, req) -> None:
        self.inbox.pop(req.request_id, None)

    def clear(self) -> int:
        return 0


# --- the workers ---------------------------------------------------------------------------------
@dataclass
class WorkerSpec:
    """What each worker process builds: the model (a name for load_model, or a ModelConfig with
    random weights from `seed`), the engine's arguments, its torch threads."""
    model: object = "smollm2-135m"
    weights: str = "pretrained"
    seed: int = 0
    engine_kwargs: dict = field(default_factory=dict)
    threads: int = 1

    def build(self, connector):
        from ..engine import LLMEngine
        from ..loader import load_model, random_model
        torch.set_num_threads(self.threads)
        if isinstance(self.model, ModelConfig):
            model, tok = random_model(self.model, "cpu", torch.float32, seed=self.seed), None
        else:
            model, tok = load_model(self.model, weights=self.weights, device="cpu",
                                    seed=self.seed)
        return LLMEngine(model, tok, kv_transfer_config=connector, **self.engine_kwargs)


def _init_group(rank: int, port: int) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)


def _take(q, block: bool):
    try:
        return q.get(timeout=0.05) if block else q.get_nowait()
    except queue.Empty:
        return None


def prefill_worker(spec: WorkerSpec, port: int, inbox, to_decode, outbox) -> None:
    """Rank 0: prefill each request and sample its first token, then send its KV to rank 1."""
    import torch.distributed as dist
    _init_group(0, port)
    sender = KVSender()
    engine = spec.build(sender)
    sender.cache = engine.runner.cache
    outbox.put(("ready", "prefill"))
    sends, params = [], {}
    while True:
        msg = _take(inbox, block=not engine.has_unfinished())
        if msg is not None and msg[0] == "stop":
            break
        if msg is not None:                                    # ("req", rid, ids, params)
            _, rid, ids, p = msg
            params[rid] = p
            first = dataclasses.replace(p, max_tokens=1, n=1)
            engine.add_request(rid, ids, first)
        if engine.has_unfinished():
            for out in engine.step_outputs().finished:
                _hand_off(out, params.pop(out.request_id), sender, to_decode, outbox, sends)
        sends = [s for s in sends if not s[0].is_completed()]
    for work, _ in sends:
        work.wait()
    dist.destroy_process_group()


def _hand_off(out, p: SamplingParams, sender, to_decode, outbox, sends) -> None:
    import torch.distributed as dist
    rid, now = out.request_id, time.perf_counter()
    if out.finish_reason == "error":
        sender.outbox.pop(rid, None)
        outbox.put(("done", rid, "error", out.error, now))
        return
    outbox.put(("tokens", rid, list(out.token_ids), now))
    kv = sender.outbox.pop(rid, None)
    if kv is None or p.max_tokens == 1:                        # finished at its first token
        outbox.put(("done", rid, out.finish_reason, None, now))
        return
    k, v = kv
    to_decode.put(("kv", rid, list(out.prompt_token_ids), out.token_ids[0], p, tuple(k.shape),
                   str(k.dtype)))
    sends.append((dist.isend(k, dst=1), (k, v)))
    sends.append((dist.isend(v, dst=1), (k, v)))
    outbox.put(("sent", rid, k.numel() * k.element_size() * 2, now))


def decode_worker(spec: WorkerSpec, port: int, from_prefill, outbox) -> None:
    """Rank 1: receive each request's KV and first token, decode the rest."""
    import torch.distributed as dist
    _init_group(1, port)
    receiver = KVReceiver(spec.engine_kwargs.get("block_size", 16))
    engine = spec.build(receiver)
    outbox.put(("ready", "decode"))
    while True:
        msg = _take(from_prefill, block=not engine.has_unfinished())
        if msg is not None and msg[0] == "stop":
            break
        if msg is not None:                     # ("kv", rid, ids, first, params, shape, dtype)
            _, rid, ids, first, p, shape, dtype = msg
            k = torch.empty(shape, dtype=getattr(torch, dtype.split(".")[-1]))
            v = torch.empty_like(k)
            t = time.perf_counter()
            dist.recv(k, src=0)
            dist.recv(v, src=0)
            outbox.put(("received", rid, time.perf_counter() - t, time.perf_counter()))
            receiver.inbox[rid] = (k, v)
            engine.add_request(rid, ids + [first],
                               dataclasses.replace(p, max_tokens=p.max_tokens - 1, n=1))
        if engine.has_unfinished():
            _step_and_report(engine, outbox)
    dist.destroy_process_group()


def _step_and_report(engine, outbox) -> None:
    """One engine step; its new tokens and finished requests go to the driver."""
    step = engine.step_outputs()
    now = time.perf_counter()
    for d in step.deltas:
        outbox.put(("tokens", d.request_id, list(d.token_ids), now))
    for out in step.finished:
        outbox.put(("done", out.request_id, out.finish_reason, out.error, now,
                    out.num_cached_tokens, out.metrics.num_preemptions))


def colocated_worker(spec: WorkerSpec, inbox, outbox) -> None:
    """The baseline: one engine does both phases (chapters 04-05), on `spec.threads` threads."""
    engine = spec.build(None)
    outbox.put(("ready", "colocated"))
    while True:
        msg = _take(inbox, block=not engine.has_unfinished())
        if msg is not None and msg[0] == "stop":
            break
        if msg is not None:                                    # ("req", rid, ids, params)
            engine.add_request(msg[1], msg[2], msg[3])
        if engine.has_unfinished():
            _step_and_report(engine, outbox)


# --- the driver ----------------------------------------------------------------------------------
@dataclass
class DisaggOutput:
    request_id: str
    token_ids: list = field(default_factory=list)
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    arrival: float = 0.0
    token_times: list = field(default_factory=list)   # perf_counter when each token arrived
    kv_bytes: int = 0                                 # K/V sent prefill -> decode
    recv_seconds: float = 0.0                         # the decode worker's recv of them
    decode_cached_tokens: int = 0     # prompt tokens the decode engine did not compute
    decode_preemptions: int = 0

    @property
    def ttft(self) -> Optional[float]:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def itl(self) -> list:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Driver:
    """Worker processes fed by queues; outputs collected here with arrival-side timestamps."""

    def _start(self, procs: dict, timeout: float) -> None:
        self.timeout, self.procs = timeout, procs
        self.outputs: dict = {}
        self._closed = False
        for p in self.procs.values():
            p.start()
        atexit.register(self.close)
        ready = set()
        while len(ready) < len(procs):
            msg = self._next(time.monotonic() + timeout)
            if msg[0] == "ready":
                ready.add(msg[1])

    def _check_workers(self) -> None:
        for name, p in self.procs.items():
            if not p.is_alive():
                code = p.exitcode
                self.close()
                raise RuntimeError(f"the {name} worker (pid {p.pid}) died with exit code {code}; "
                                   "its requests are lost: create a new DisaggregatedLLM")

    def _next(self, deadline: float):
        while True:
            try:
                return self.results.get(timeout=0.1)
            except queue.Empty:
                self._check_workers()
                if time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"no answer from the workers in {self.timeout} s; "
                                       "both were stopped") from None

    def submit(self, request_id: str, prompt_ids: list, params: SamplingParams) -> None:
        if self._closed:
            raise ValueError(f"this {type(self).__name__} is closed; create a new one")
        params.validate()
        if params.n != 1:
            raise ValueError("the disaggregated demo serves n=1 only")
        self.outputs[request_id] = DisaggOutput(request_id, arrival=time.perf_counter())
        self.inbox.put(("req", request_id, list(prompt_ids), params))

    def _apply(self, msg) -> Optional[str]:
        kind, rid = msg[0], msg[1]
        out = self.outputs[rid]
        if kind == "tokens":                # the worker's clock: perf_counter is
            out.token_ids += msg[2]             # CLOCK_MONOTONIC, one clock for all processes
            out.token_times += [msg[3]] * len(msg[2])
        elif kind == "sent":
            out.kv_bytes = msg[2]
        elif kind == "received":
            out.recv_seconds = msg[2]
        elif kind == "done":
            out.finish_reason, out.error = msg[2], msg[3]
            if len(msg) > 5:                                   # from the decode worker
                out.decode_cached_tokens, out.decode_preemptions = msg[5], msg[6]
            return rid
        return None

    def wait(self, request_ids) -> list:
        """Block until these requests are done; their outputs, in order."""
        left = {r for r in request_ids if self.outputs[r].finish_reason is None}
        deadline = time.monotonic() + self.timeout
        while left:
            left.discard(self._apply(self._next(deadline)))
        return [self.outputs[r] for r in request_ids]

    def run_trace(self, trace) -> list:
        """trace: [(arrival seconds from now, prompt ids, SamplingParams)], submitted open-loop
        at those times while results are collected. Outputs in trace order."""
        base, t0 = len(self.outputs), time.perf_counter()
        ids = [f"t{base + i}" for i in range(len(trace))]
        order = sorted(range(len(trace)), key=lambda i: trace[i][0])
        deadline = time.monotonic() + self.timeout + max((a for a, _, _ in trace), default=0)
        left, nxt = set(ids), 0
        while left:
            while nxt < len(order) and time.perf_counter() - t0 >= trace[order[nxt]][0]:
                i = order[nxt]
                self.submit(ids[i], trace[i][1], trace[i][2])
                self.outputs[ids[i]].arrival = t0 + trace[i][0]
                nxt += 1
            try:
                left.discard(self._apply(self.results.get(timeout=0.005)))
            except queue.Empty:
                self._check_workers()
                if time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"the trace did not finish in {self.timeout} s after its "
                                       "last arrival; the workers were stopped") from None
            left.difference_update(r for r in list(left) if r in self.outputs
                                   and self.outputs[r].finish_reason is not None)
        return [self.outputs[r] for r in ids]

    def generate(self, prompts: list, params: SamplingParams) -> list:
        base = len(self.outputs)
        ids = [f"d{base + i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts):
            self.submit(rid, p, params)
        return self.wait(ids)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for q in self.stop_queues:
            try:
                q.put(("stop",))
            except (ValueError, OSError):
                pass
        for p in self.procs.values():
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        for q in self.stop_queues + [self.results]:
            q.cancel_join_thread()
            q.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class DisaggregatedLLM(_Driver):
    """A prefill worker and a decode worker (processes) behind one driver.

        with DisaggregatedLLM(WorkerSpec("smollm2-135m"), WorkerSpec("smollm2-135m")) as d:
            outs = d.generate([ids_a, ids_b], SamplingParams(max_tokens=32))
    """

    def __init__(self, prefill: WorkerSpec, decode: WorkerSpec, timeout: float = 120.0):
        import torch.multiprocessing as mp
        ctx = mp.get_context("spawn")
        self.inbox, self.to_decode, self.results = ctx.Queue(), ctx.Queue(), ctx.Queue()
        self.stop_queues = [self.inbox, self.to_decode]
        port = _free_port()
        self._start({
            "prefill": ctx.Process(target=prefill_worker, name="minillm-prefill", daemon=True,
                                   args=(prefill, port, self.inbox, self.to_decode,
                                         self.results)),
            "decode": ctx.Process(target=decode_worker, name="minillm-decode", daemon=True,
                                  args=(decode, port, self.to_decode, self.results))}, timeout)


class ColocatedLLM(_Driver):
    """The same driver over ONE engine process doing prefill and decode: the baseline."""

    def __init__(self, spec: WorkerSpec, timeout: float = 120.0):
        import torch.multiprocessing as mp
        ctx = mp.get_context("spawn")
        self.inbox, self.results = ctx.Queue(), ctx.Queue()
        self.stop_queues = [self.inbox]
        self._start({"colocated": ctx.Process(target=colocated_worker, name="minillm-colocated",
                                              daemon=True,
                                              args=(spec, self.inbox, self.results))}, timeout)


__all__ = ["KVSender", "KVReceiver", "WorkerSpec", "DisaggregatedLLM", "ColocatedLLM",
           "DisaggOutput"]
