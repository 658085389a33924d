"""One submission's supervisor: runs its notebook in a fresh kernel, leaves no process behind.

    python minillm/grading/supervisor.py CONFIG.json      (started by batch.py)

The process tree of one submission, and why it has these levels:

    batch (trusted: computes the grades; never a parent of learner code)
     └─ supervisor   its own session; a child subreaper, so every orphaned descendant is
        │            re-parented to it; kills them all when the run ends; reports to the batch
        └─ driver    executes the notebook with nbclient, cell by cell, each cell under a time
           │         limit (interrupted when it passes)
           └─ kernel the learner's code: os.kill(os.getppid(), ...) reaches the driver, never
                     the batch

Every process of the run carries MINILLM_GRADE_RUN=<token> in its environment. While the run
goes on, the batch also polls /proc and remembers every process of the supervisor's subtree and
session. At the end, whatever is still alive (processes re-parented away because the submission
killed the supervisor itself included) is killed by the supervisor, then again by the batch.

This file imports only the standard library at the top (nbclient inside the driver), so it
starts fast as a script and never imports minillm or torch.
"""
from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import sys
import time

MARKER_ENV = "MINILLM_GRADE_RUN"
PR_SET_CHILD_SUBREAPER = 36


# =========================================================================== processes

def become_subreaper() -> bool:
    """Orphaned descendants are re-parented to this process instead of init (Linux >= 3.4)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def process_table() -> dict:
    """{pid: (ppid, session id, state, start time)} of every process this user can see."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = data[data.rindex(")") + 2:].split()
        table[int(name)] = (int(fields[1]), int(fields[3]), fields[0], int(fields[19]))
    return table


def descendants(root: int, table: dict) -> set:
    children: dict = {}
    for pid, (ppid, *_) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def carries_marker(pid: int, marker: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{MARKER_ENV}={marker}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def track(tracked: dict, root=None, session=None, marker=None) -> dict:
    """Add to `tracked` ({pid: start time}) every process that belongs to a run: descendants of
    `root` or of a process already tracked, processes of `session`, carriers of `marker`.
    Polled while a run goes on, this remembers processes that a killed supervisor orphaned."""
    table = process_table()
    found = set(descendants(root, table)) if root is not None else set()
    for pid, (_, sid, _, start) in table.items():
        if tracked.get(pid) == start or (session is not None and sid == session) or \
                (marker is not None and carries_marker(pid, marker)):
            found.add(pid)
    for pid in list(found):
        found |= descendants(pid, table)
    found.discard(os.getpid())
    for pid in found:
        tracked[pid] = table[pid][3]
    return tracked


def kill_processes(root=None, session=None, marker=None, tracked=None, rounds: int = 200) -> int:
    """SIGKILL every descendant of `root`, every process of `session`, every process whose
    environment carries `marker`, and every process of `tracked` ({pid: start time}, the same
    start time: not a new process that reuses the pid) with its descendants, until none is left
    (new ones forked meanwhile included). Reaps the zombies that are this process's own
    children. Returns how many were killed."""
    me = os.getpid()
    killed = set()
    for _ in range(rounds):
        table = process_table()
        victims = set()
        if root is not None:
            victims |= descendants(root, table)
        for pid, (_, sid, _, start) in table.items():
            if (session is not None and sid == session) or \
                    (marker is not None and carries_marker(pid, marker)) or \
                    (tracked is not None and tracked.get(pid) == start):
                victims.add(pid)
        for pid in list(victims):
            victims |= descendants(pid, table)
        victims.discard(me)
        alive = {p for p in victims if table.get(p, (0, 0, "Z", 0))[2] not in ("Z", "X")}
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except (ProcessLookupError, PermissionError):
                pass
        while True:                                  # reap our own dead children
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        if not alive:
            break
        time.sleep(0.02)
    return len(killed)


# =========================================================================== the driver

def _drive(cfg: dict, send) -> str:
    """Execute the notebook; send({"cell": i}) before each cell; returns the status sentence."""
    import asyncio

    import nbformat

    nb = nbformat.read(cfg["notebook"], as_version=4)
    # the kernel's connection file goes to the submission's own runtime folder too
    runtime = (cfg.get("kernel_env") or {}).get("JUPYTER_RUNTIME_DIR")
    if runtime:
        os.environ["JUPYTER_RUNTIME_DIR"] = runtime
    try:
        status = asyncio.run(_execute(nb, cfg, send))
    finally:
        if cfg.get("executed"):
            try:
                nbformat.write(nb, cfg["executed"])
            except Exception:
                pass
    return status


def kernel_environment(cfg: dict) -> dict:
    """The kernel's environment: this process's, with the submission's own HOME, IPYTHONDIR,
    Jupyter and matplotlib folders (cfg["kernel_env"], made by the batch; None removes a
    variable). The driver itself keeps the instructor's, to find the kernel spec."""
    env = dict(os.environ)
    for name, value in (cfg.get("kernel_env") or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = str(value)
    return env


async def _execute(nb, cfg: dict, send) -> str:
    import subprocess

    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    timeout, cell_timeout = float(cfg["timeout"]), float(cfg["cell_timeout"])
    client = NotebookClient(nb, timeout=max(1, int(cell_timeout)), kernel_name=cfg["kernel"],
                            allow_errors=True, record_timing=False, shutdown_kernel="immediate",
                            interrupt_on_timeout=True, startup_timeout=int(cfg["startup_timeout"]),
                            resources={"metadata": {"path": cfg["cwd"]}})
    client.reset_execution_trackers()
    failed, slow = [], []
    status = "ok"
    try:
        # the kernel's own stderr (start-up warnings, C-level noise) would clutter the log
        async with client.async_setup_kernel(env=kernel_environment(cfg),
                                             stderr=subprocess.DEVNULL):
            # Importing minillm (torch) takes seconds; it happens here, before the clock starts,
            # so that the per-cell limit measures the learner's cells, not the import.
            client.timeout = int(cfg["startup_timeout"])
            client.interrupt_on_timeout = False
            # nbclient stores an executed cell at its index: the warm-up goes at the end, and
            # out again, or it would replace the notebook's first cell (which then never ran)
            nb.cells.append(nbformat.v4.new_code_cell(cfg.get("warm_up",
                                                              "import minillm.grading")))
            try:
                await client.async_execute_cell(nb.cells[-1], len(nb.cells) - 1)
            except CellTimeoutError:
                return (f"stopped: the kernel did not import minillm within "
                        f"{cfg['startup_timeout']:g} s")
            finally:
                nb.cells.pop()
            deadline = time.monotonic() + timeout           # kernel start-up does not count
            for index, cell in enumerate(nb.cells):
                if cell.cell_type != "code":
                    continue
                left = deadline - time.monotonic()
                if left < 1:
                    status = f"stopped: time limit of {timeout:g} s reached before cell {index}"
                    break
                per_cell = min(cell_timeout, left)
                client.timeout = max(1, int(per_cell))
                # a cell that passes its own limit is interrupted and the notebook goes on; one
                # that reaches the notebook's limit ends the run
                client.interrupt_on_timeout = per_cell < left
                client.error_on_timeout = {
                    "ename": "CellTimeLimit",
                    "evalue": f"cell {index} ran past its time limit of {per_cell:g} s and was "
                              "interrupted",
                    "traceback": []} if client.interrupt_on_timeout else None
                send({"cell": index})
                start = time.monotonic()
                try:
                    await client.async_execute_cell(cell, index)
                except CellTimeoutError:
                    status = f"stopped: time limit of {timeout:g} s reached in cell {index}"
                    break
                except DeadKernelError:
                    status = f"stopped: the kernel died in cell {index}"
                    break
                if client.interrupt_on_timeout and time.monotonic() - start >= per_cell:
                    slow.append(str(index))
                errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
                if errors and str(index) not in slow:
                    failed.append(f"{index} ({errors[0].get('ename', 'error')})")
    except Exception as exc:                     # kernel did not start, client failure, ...
        status = f"stopped: {type(exc).__name__}: {str(exc)[:200]}"
    parts = [] if status == "ok" else [status]
    if slow:
        parts.append(f"cells {', '.join(slow)} ran past the cell time limit of "
                     f"{cell_timeout:g} s (interrupted)")
    if failed:
        parts.append("errors in cells " + ", ".join(failed))
    return "; ".join(parts) or "ok"


# =========================================================================== the supervisor

def supervise(cfg: dict, report) -> dict:
    subreaper = become_subreaper()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:                                          # ---- the driver
        os.close(read_fd)
        report.close()
        code = 0
        try:
            def send(obj):
                data = (json.dumps(obj) + "\n").encode()
                while data:
                    data = data[os.write(write_fd, data):]
            send({"status": _drive(cfg, send)})
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write_fd)
    deadline = time.monotonic() + float(cfg["timeout"]) + float(cfg["startup_timeout"]) + 30
    buf, last_cell, status, overran = b"", None, None, False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            overran = True
            break
        if not select.select([read_fd], [], [], min(left, 1.0))[0]:
            continue
        chunk = os.read(read_fd, 1 << 16)
        if not chunk:
            break
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict) and isinstance(msg.get("cell"), int):
                last_cell = msg["cell"]
            elif isinstance(msg, dict) and isinstance(msg.get("status"), str):
                status = msg["status"]
    os.close(read_fd)
    if overran:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _, wait_status = os.waitpid(pid, 0)
    where = f" in cell {last_cell}" if last_cell is not None else ""
    if overran:
        status = f"stopped: the notebook runner did not finish in time{where}"
    elif status is None:
        how = (f"killed by signal {os.WTERMSIG(wait_status)}" if os.WIFSIGNALED(wait_status)
               else f"ended with status {os.WEXITSTATUS(wait_status)}")
        status = (f"stopped: the notebook runner was {how}{where} (did the submission kill its "
                  "parent process?)")
    killed = kill_processes(root=os.getpid(), marker=cfg.get("marker"))
    return {"status": status, "left_behind": killed, "subreaper": subreaper}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # A cell past its time limit is interrupted with SIGINT. A batch started in the background
    # of a non-interactive shell (or under nohup) inherits SIGINT as ignored, and so would every
    # kernel, which would then never stop: catching it here lets the processes below start with
    # the default disposition again (a caught signal is reset to the default across exec).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # Run as a script, this file's folder comes first on sys.path; its modules (core.py,
    # testing.py, ...) must not shadow those nbclient and its dependencies import.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    with open(argv[0]) as f:
        cfg = json.load(f)
    report = os.fdopen(os.dup(1), "w")          # to the batch; nobody below inherits it
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    result = supervise(cfg, report)
    try:
        report.write(json.dumps(result) + "\n")
        report.flush()
    except OSError:                               # the batch is gone
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
