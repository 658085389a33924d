"""Run learner code with a time limit, so a grader survives code that raises or never returns.

Isolation modes (argument `isolation`, or the environment variable MINILLM_GRADE_ISOLATION):

- "fork" (default on Linux): the work runs in a forked child process. The child inherits the
  learner's function as it is (nothing is pickled on the way in); what it reports comes back
  through a pipe. A child that overruns the limit is killed with SIGKILL, so `while True: pass`
  costs exactly the limit and leaves nothing behind. The child first sets torch to one thread:
  an OpenMP thread pool that the parent already started does not survive fork(), and a
  multi-threaded torch op in the child would hang forever. The child must not touch CUDA when
  the parent already did (CUDA cannot be re-initialised in a forked process); graders work on
  CPU tensors.
- "thread" (default elsewhere): the work runs in a daemon thread. A time-out is reported the
  same way, but the runaway thread cannot be killed and keeps a CPU core busy until the
  process ends.
- "none": run inline with no time limit (for debugging a grader with pdb).

Everything the work reports must be picklable (fork mode sends it through a pipe).
"""
from __future__ import annotations

import gc
import io
import os
import pickle
import queue
import select
import signal
import struct
import sys
import threading
import time
import traceback
import warnings
from typing import Any, Callable, Iterator, Optional

DEFAULT_TIME_LIMIT = 10.0          # seconds per check group; MINILLM_GRADE_TIME_LIMIT overrides
ISOLATION_MODES = ("fork", "thread", "none")
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # .../minillm


class TimeLimitExceeded(Exception):
    """The learner's code did not return within the time limit."""


class LearnerError(Exception):
    """The learner's code raised. `type_name`, `detail` and `where` describe the original error."""

    def __init__(self, type_name: str, detail: str, where: str = ""):
        self.type_name, self.detail, self.where = type_name, detail, where
        super().__init__(f"{type_name}: {detail}" + (f" ({where})" if where else ""))


def default_time_limit() -> float:
    value = os.environ.get("MINILLM_GRADE_TIME_LIMIT")
    if value is None:
        return DEFAULT_TIME_LIMIT
    try:
        limit = float(value)
    except ValueError:
        raise ValueError(f"MINILLM_GRADE_TIME_LIMIT must be a number of seconds, "
                         f"got {value!r}") from None
    if limit <= 0:
        raise ValueError(f"MINILLM_GRADE_TIME_LIMIT must be positive, got {value!r}")
    return limit


def default_isolation() -> str:
    mode = os.environ.get("MINILLM_GRADE_ISOLATION")
    if mode is None:
        return "fork" if sys.platform.startswith("linux") else "thread"
    if mode not in ISOLATION_MODES:
        raise ValueError(f"MINILLM_GRADE_ISOLATION must be one of {', '.join(ISOLATION_MODES)}, "
                         f"got {mode!r}")
    return mode


def describe_exception(exc: BaseException) -> tuple[str, str, str]:
    """(type name, message, where) of an exception; `where` names the deepest frame that is
    neither minillm's nor a library's, i.e. the learner's own line when there is one."""
    try:
        detail = str(exc)
    except Exception:                             # a learner's exception with a broken __str__
        detail = "<unprintable>"
    if len(detail) > 300:
        detail = detail[:300] + " ..."
    where = getattr(exc, "_minillm_where", None)  # an exception replayed from a transcript
    if isinstance(where, str):
        return type(exc).__name__, detail, where
    where = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        path = os.path.abspath(frame.filename)
        if path.startswith(_PACKAGE_DIR) or "site-packages" in path or "lib/python" in path:
            continue
        where = f"in {frame.name}, line {frame.lineno}"
    return type(exc).__name__, detail, where


def run_stream(job: Callable[[], Iterator[Any]], time_limit: Optional[float] = None,
               isolation: Optional[str] = None) -> tuple[list, Optional[str]]:
    """Run the generator function `job` isolated and collect what it yields.

    Returns (items, problem): `problem` is None when job finished, "timeout" when the time limit
    ran out first, or a sentence saying how the process died. Items yielded before a problem
    are kept, so a grader knows which checks finished.
    """
    limit = default_time_limit() if time_limit is None else float(time_limit)
    if limit <= 0:
        raise ValueError(f"time_limit must be a positive number of seconds, got {time_limit}")
    mode = isolation or default_isolation()
    if mode == "fork":
        return _run_forked(job, limit)
    if mode == "thread":
        return _run_threaded(job, limit)
    if mode == "none":
        return list(job()), None
    raise ValueError(f"isolation must be one of {', '.join(ISOLATION_MODES)}, got {mode!r}")


def run_with_time_limit(fn: Callable, *args, time_limit: Optional[float] = None,
                        isolation: Optional[str] = None, **kwargs):
    """fn(*args, **kwargs) with a time limit: returns its result (which must be picklable),
    raises TimeLimitExceeded when it does not return in time and LearnerError when it raises."""
    def job():
        try:
            yield ("ok", fn(*args, **kwargs))
        except Exception as exc:                               # the learner's error, reported
            yield ("error", describe_exception(exc))

    limit = default_time_limit() if time_limit is None else time_limit
    items, problem = run_stream(job, limit, isolation)
    if problem == "timeout":
        raise TimeLimitExceeded(f"{getattr(fn, '__name__', 'the function')} did not return "
                                f"within {limit:g} s")
    if problem is not None or not items:
        raise LearnerError("ProcessDied", problem or "no result came back")
    kind, payload = items[0]
    if kind == "error":
        raise LearnerError(*payload)
    return payload


# --------------------------------------------------------------------------- fork

def _child_setup() -> None:
    gc.disable()                                  # short-lived; never finalise the parent's objects
    sys.stdout = io.StringIO()                    # the learner's prints go nowhere, and never
    sys.stderr = io.StringIO()                    # into a Jupyter kernel's output machinery
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)  # the parent's OpenMP pool is gone after fork()


_FINISHED = ("minillm-grading", "job finished")     # last item of a job that ran to its end


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _run_forked(job, limit: float) -> tuple[list, Optional[str]]:
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    with warnings.catch_warnings():              # Python 3.12+ warns about fork with threads
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:                                 # ---- child: never returns
        code = 0
        try:
            os.close(read_fd)
            _child_setup()
            for item in job():
                data = pickle.dumps(item)
                _write_all(write_fd, struct.pack("<Q", len(data)) + data)
            data = pickle.dumps(_FINISHED)           # the job ran to its end
            _write_all(write_fd, struct.pack("<Q", len(data)) + data)
        except BaseException:
            code = 70
        finally:
            os._exit(code)
    # ---- parent
    os.close(write_fd)
    items, buf, problem, eof = [], b"", None, False
    deadline = time.monotonic() + limit
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read_fd], [], [], left)[0]:
                problem = "timeout"
                break
            chunk = os.read(read_fd, 1 << 16)
            if not chunk:
                eof = True
                break
            buf += chunk
            while len(buf) >= 8:
                size = struct.unpack("<Q", buf[:8])[0]
                if len(buf) < 8 + size:
                    break
                items.append(pickle.loads(buf[8:8 + size]))
                buf = buf[8 + size:]
    finally:
        os.close(read_fd)
        if not eof:                              # time-out, or the parent was interrupted
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _, status = os.waitpid(pid, 0)
    finished = bool(items) and items[-1] == _FINISHED
    if finished:
        items.pop()
    if problem is None:
        if os.WIFSIGNALED(status):
            problem = f"the process running it was killed by signal {os.WTERMSIG(status)}"
        elif os.WEXITSTATUS(status) == 70:
            problem = "the grading process failed to send its result back (is it picklable?)"
        elif os.WEXITSTATUS(status) != 0:
            problem = f"the process running it exited with status {os.WEXITSTATUS(status)}"
        elif not finished:                       # os._exit(0) in the learner's code
            problem = "the process running it exited with status 0 before it had finished"
    return items, problem


# --------------------------------------------------------------------------- thread

_DONE = object()


def _run_threaded(job, limit: float) -> tuple[list, Optional[str]]:
    out: queue.Queue = queue.Queue()

    def work():
        try:
            for item in job():
                out.put(item)
        except BaseException as exc:             # job itself broke: report like a dead process
            out.put((_DONE, f"the grading thread failed: {type(exc).__name__}: {exc}"))
            return
        out.put((_DONE, None))

    threading.Thread(target=work, daemon=True, name="minillm-grading").start()
    items, deadline = [], time.monotonic() + limit
    while True:
        left = deadline - time.monotonic()
        try:
            item = out.get(timeout=max(left, 0.0)) if left > 0 else out.get_nowait()
        except queue.Empty:
            return items, "timeout"
        if isinstance(item, tuple) and len(item) == 2 and item[0] is _DONE:
            return items, item[1]
        items.append(item)
