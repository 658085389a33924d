"""Overlap scheduling in miniature (chapter 12): prepare step N+1 while step N computes.

An engine step is host work (schedule, build the step's tensors) followed by device work (the
forward). Run one after the other, the device idles during the host work. vLLM's async
scheduling and SGLang's overlap scheduler run the host work of the NEXT step while the device
runs this one. On a CPU the "device" is torch's C++ kernels, which release Python's GIL, so a
second Python thread can do the host work meanwhile.

    serial_s, overlapped_s, same = compare(prepare, forward, steps)

`prepare(i)` builds step i's inputs (pure Python), `forward(inputs)` runs it (torch ops).
Both runs must produce the same outputs (up to float rounding); only the schedule of the work
differs.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch


def run_serial(prepare, forward, steps: int) -> tuple:
    outs, t0 = [], time.perf_counter()
    for i in range(steps):
        outs.append(forward(prepare(i)))
    return time.perf_counter() - t0, outs


def run_overlapped(prepare, forward, steps: int) -> tuple:
    """prepare(i + 1) runs in a helper thread while forward(inputs of i) runs here."""
    outs, t0 = [], time.perf_counter()
    with ThreadPoolExecutor(max_workers=1) as pool:
        nxt = pool.submit(prepare, 0)
        for i in range(steps):
            inputs = nxt.result()
            if i + 1 < steps:
                nxt = pool.submit(prepare, i + 1)
            outs.append(forward(inputs))
    return time.perf_counter() - t0, outs


def compare(prepare, forward, steps: int, rounds: int = 3) -> tuple:
    """Best of `rounds` interleaved runs each: (serial s, overlapped s, same outputs)."""
    serial, overlapped, same = [], [], True
    for _ in range(rounds):
        s, a = run_serial(prepare, forward, steps)
        o, b = run_overlapped(prepare, forward, steps)
        serial.append(s)
        overlapped.append(o)
        # equal up to float rounding: a BLAS may round differently for buffers at other
        # addresses, which the two schedules allocate in a different order
        same = same and len(a) == len(b) and all(
            torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b))
    return min(serial), min(overlapped), same
