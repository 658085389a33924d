"""Record a learner's function as plain data in one process; replay it in another.

The instructor's batch grader (batch.py) never runs learner code in the process that computes a
verdict. In the submission's kernel, each check talks to the learner's function through a
`LearnerObject` stand-in whose channel records every interaction as a JSON line:

    the check asks       call(args) / getattr(name) / repr / str, on learner object number N
    the learner answers  a plain value (numbers, strings, lists, tuples, dicts, sets, tensors
                         through torch.save / torch.load(weights_only=True)), an exception
                         (type, message, the learner's line), or a new learner object (an
                         instance, a bound method: later uses are recorded the same way),
                         plus the new contents of every argument the call changed in place

The trusted process then runs the same check code with a replaying channel (regrade.py): every
request must equal the recorded one (compared by a digest of its arguments) and gets the
recorded answer. Checks are deterministic, so given the same answers they make the same
requests; a request the transcript does not hold means the learner's call never returned (time
limit, crash) or the notebook tampered with the grader, and the check fails. Nothing from the
submission is unpickled, imported or executed: a forged transcript can only claim answers, which
is no more than a learner function could return anyway.

Both sides hand the check identical values (the recording side decodes what it encodes), so the
verdict computed in the kernel and the one computed from the transcript agree.

This module is the record's format and its two channels; it imports nothing of minillm.grading
but timelimit.describe_exception (a leaf), so core can use it and regrade can use both.
"""
from __future__ import annotations

import base64
import builtins
import collections
import dataclasses
import hashlib
import inspect
import io
import json
import os
import stat
import sys
import uuid
from typing import Any, Callable, Optional

from .timelimit import describe_exception

RECORD_ENV = "MINILLM_GRADE_RECORD"      # path of the JSON-lines file a kernel records into
MAX_RECORD_BYTES = 64 << 20              # the trusted side reads at most this much per submission
_MAX_TEXT = 2000                         # characters kept of a message or repr


class ReplayEnd(BaseException):
    """The transcript has no answer for this request (a BaseException: checks that catch the
    learner's Exceptions must not swallow it)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason                 # "exhausted", "mismatch" or "invalid"


# =========================================================================== fingerprints

def _torch():
    return sys.modules.get("torch")          # no tensor can exist before torch is imported


def _tensor_bytes(t) -> bytes:
    torch = _torch()
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _fp(value, channel, depth=0):
    """A canonical JSON-able description of an argument, compared between the two sides."""
    if depth > 50:
        return ["deep"]
    torch = _torch()
    if value is None or isinstance(value, bool):
        return ["c", repr(value)]
    if isinstance(value, int):
        return ["i", str(int(value))]
    if isinstance(value, float):
        return ["f", repr(float(value))]
    if isinstance(value, str):
        return ["s", str(value)]
    if isinstance(value, (bytes, bytearray)):
        return ["b", hashlib.sha256(bytes(value)).hexdigest()]
    if torch is not None and isinstance(value, torch.Tensor):
        return ["t", str(value.dtype), list(value.shape),
                hashlib.sha256(_tensor_bytes(value)).hexdigest()]
    if isinstance(value, LearnerObject):
        return ["o", value._oid if value._channel is channel else -1]
    if isinstance(value, (list, tuple, collections.deque)):
        return [type(value).__name__[:1], [_fp(v, channel, depth + 1) for v in value]]
    if isinstance(value, dict):
        return ["d", [[_fp(k, channel, depth + 1), _fp(v, channel, depth + 1)]
                      for k, v in value.items()]]
    if isinstance(value, (set, frozenset)):
        return ["S", sorted(json.dumps(_fp(v, channel, depth + 1)) for v in value)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return ["D", type(value).__qualname__,
                [[f.name, _fp(getattr(value, f.name), channel, depth + 1)]
                 for f in dataclasses.fields(value)]]
    if hasattr(value, "item") and type(value).__module__ == "numpy":
        if getattr(value, "shape", ()) == ():                     # a numpy scalar
            return _fp(value.item(), channel, depth + 1)
        import torch                                               # an array: as a tensor
        return _fp(torch.as_tensor(value), channel, depth + 1)
    state = getattr(value, "__dict__", None)
    return ["x", type(value).__qualname__,
            _fp(state, channel, depth + 1) if isinstance(state, dict) else None]


def _digest(parts) -> str:
    text = json.dumps(parts, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def request_digest(channel, oid: int, op: str, name: Optional[str], args, kwargs) -> str:
    return _digest([oid, op, name, [_fp(a, channel) for a in args],
                    sorted([k, _fp(v, channel)] for k, v in kwargs.items())])


def _describe(op: str, name, args) -> str:
    if op == "getattr":
        return f".{name}"
    if op == "measure":
        return f"measure {name}"
    if op == "call":
        return f"call with {len(args)} argument(s)"
    return op


# =========================================================================== plain data

class _Unencodable(Exception):
    pass


def encode(value, register: Callable[[Any], int], depth: int = 0, path=()):
    """Plain JSON for `value`; objects that are not plain data become {"__object__": id} through
    `register` (the recording side keeps them and records their uses)."""
    torch = _torch()
    if value is None:
        return None
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if depth > 40 or id(value) in path:
        return _object(value, register)
    path = path + (id(value),)
    try:
        if isinstance(value, bytes):
            return {"__bytes__": base64.b64encode(value).decode()}
        if torch is not None and isinstance(value, torch.Tensor):
            buf = io.BytesIO()
            torch.save(value.detach().cpu().clone(), buf)
            return {"__tensor__": base64.b64encode(buf.getvalue()).decode()}
        if isinstance(value, tuple):
            return {"__tuple__": [encode(v, register, depth + 1, path) for v in value]}
        if isinstance(value, list):
            return [encode(v, register, depth + 1, path) for v in value]
        if isinstance(value, collections.deque):
            return {"__deque__": [encode(v, register, depth + 1, path) for v in value]}
        if isinstance(value, dict):
            return {"__dict__": [[encode(k, register, depth + 1, path),
                                  encode(v, register, depth + 1, path)]
                                 for k, v in list(value.items())]}
        if isinstance(value, (set, frozenset)):
            return {"__set__": [encode(v, register, depth + 1, path) for v in value],
                    "frozen": isinstance(value, frozenset)}
        if type(value).__module__ == "numpy" and hasattr(value, "item") and \
                getattr(value, "shape", None) == ():
            return encode(value.item(), register, depth, path)
    except _Unencodable:
        raise
    except Exception:                         # a tensor that cannot be saved, a broken dict ...
        pass
    return _object(value, register)


def _object(value, register):
    return {"__object__": register(value), "type": type(value).__name__[:100]}


class BadRecord(ReplayEnd):
    """The transcript holds something that is not valid plain data (ends the check, like
    ReplayEnd, so that no check's `except Exception` can take it for the learner's error)."""

    def __init__(self, detail: str):
        ReplayEnd.__init__(self, "invalid")
        self.detail = detail

    def __str__(self):
        return self.detail


def decode(data, channel):
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [decode(v, channel) for v in data]
    if not isinstance(data, dict) or len(data) > 2:
        raise BadRecord(f"unexpected {type(data).__name__}")
    if "__tuple__" in data:
        return tuple(decode(v, channel) for v in _list(data["__tuple__"]))
    if "__deque__" in data:
        return collections.deque(decode(v, channel) for v in _list(data["__deque__"]))
    if "__dict__" in data:
        out = {}
        for pair in _list(data["__dict__"]):
            if not isinstance(pair, list) or len(pair) != 2:
                raise BadRecord("a dict entry is not a pair")
            key = decode(pair[0], channel)
            try:
                out[key] = decode(pair[1], channel)
            except TypeError:                     # an unhashable key
                raise BadRecord("unhashable dict key") from None
        return out
    if "__set__" in data:
        try:
            items = [decode(v, channel) for v in _list(data["__set__"])]
            return frozenset(items) if data.get("frozen") else set(items)
        except TypeError:
            raise BadRecord("unhashable set member") from None
    if "__bytes__" in data:
        return base64.b64decode(_str(data["__bytes__"]))
    if "__tensor__" in data:
        import torch
        try:
            value = torch.load(io.BytesIO(base64.b64decode(_str(data["__tensor__"]))),
                               weights_only=True)
        except Exception as exc:
            raise BadRecord(f"a tensor could not be loaded: {type(exc).__name__}") from None
        if not isinstance(value, torch.Tensor):
            raise BadRecord("a tensor record holds something else")
        return value
    if "__object__" in data:
        oid = data["__object__"]
        if not isinstance(oid, int) or isinstance(oid, bool):
            raise BadRecord("bad object id")
        return channel.proxy(oid, _str(data.get("type", "object"))[:100])
    raise BadRecord(f"unknown record keys {sorted(data)[:3]}")


def _list(x) -> list:
    if not isinstance(x, list):
        raise BadRecord("expected a list")
    return x


def _str(x) -> str:
    if not isinstance(x, str):
        raise BadRecord("expected a string")
    return x


# =========================================================================== exceptions

def _builtin_base(cls) -> str:
    for c in cls.__mro__:
        if isinstance(c, type) and issubclass(c, BaseException) and \
                getattr(builtins, c.__name__, None) is c:
            return c.__name__
    return "Exception"


def encode_exception(exc: BaseException, depth: int = 0) -> dict:
    try:
        name, detail, where = describe_exception(exc)
    except Exception:
        name, detail, where = type(exc).__name__, "<unprintable>", ""
    cause = exc.__cause__
    return {"type": str(name)[:100], "base": _builtin_base(type(exc)),
            "message": str(detail)[:_MAX_TEXT], "where": str(where)[:300],
            "cause": encode_exception(cause, depth + 1) if cause is not None and depth < 3
            else None}


_EXC_CLASSES: dict = {}


def decode_exception(data, depth: int = 0) -> BaseException:
    """An exception that behaves like the learner's for the checks: same type name, message and
    line, and an instance of the same built-in exception class (ValueError, ...)."""
    if not isinstance(data, dict) or depth > 3:
        raise BadRecord("bad exception record")
    name, base_name = _str(data.get("type", "Exception")), _str(data.get("base", "Exception"))
    message = _str(data.get("message", ""))
    base = getattr(builtins, base_name, None)
    if not (isinstance(base, type) and issubclass(base, BaseException)) or \
            issubclass(base, ReplayEnd):
        base = Exception
    key = (name, base)
    if key not in _EXC_CLASSES:
        try:
            _EXC_CLASSES[key] = type(name, (base,), {"__str__": lambda self: self._message,
                                                     "__module__": "learner"})
        except TypeError:                     # a base that cannot be subclassed
            _EXC_CLASSES[key] = type(name, (Exception,), {"__str__": lambda self: self._message,
                                                          "__module__": "learner"})
    try:
        exc = _EXC_CLASSES[key](message)
    except Exception:                         # a base whose constructor wants other arguments
        fallback = (name, Exception)
        if fallback not in _EXC_CLASSES:
            _EXC_CLASSES[fallback] = type(name, (Exception,), {
                "__str__": lambda self: self._message, "__module__": "learner"})
        exc = _EXC_CLASSES[fallback](message)
    exc._message = message
    exc._minillm_where = _str(data.get("where", ""))
    if data.get("cause") is not None:
        exc.__cause__ = decode_exception(data["cause"], depth + 1)
    return exc


# =========================================================================== stand-ins

_PROXY_CLASSES: dict = {}


class LearnerObject:
    """Stands for an object of the learner's code (the submitted function or class, an instance,
    a method): calls, attribute reads, repr(), str(), len(), truth, `in`, indexing and iteration
    (answered as one list) go through the channel; anything else (==, hash) behaves like a plain
    object, identically on both sides."""
    __slots__ = ("_channel", "_oid")

    def __init__(self, channel, oid: int):
        object.__setattr__(self, "_channel", channel)
        object.__setattr__(self, "_oid", oid)

    def __call__(self, *args, **kwargs):
        return self._channel.interact(self._oid, "call", None, args, kwargs)

    def __getattr__(self, name):
        if name.startswith("__") and name not in ("__name__", "__qualname__"):
            raise AttributeError(name)
        return self._channel.interact(self._oid, "getattr", name, (), {})

    def __setattr__(self, name, value):
        raise AttributeError(f"the grader does not set attributes on your objects ({name})")

    def __repr__(self):
        return _text(self._channel.interact(self._oid, "repr", None, (), {}), "__repr__")

    def __len__(self):
        return self._channel.interact(self._oid, "len", None, (), {})

    def __bool__(self):
        return bool(self._channel.interact(self._oid, "bool", None, (), {}))

    def __contains__(self, item):
        return bool(self._channel.interact(self._oid, "contains", None, (item,), {}))

    def __getitem__(self, key):
        return self._channel.interact(self._oid, "getitem", None, (key,), {})

    def __iter__(self):                  # the whole iteration is one answer: a list
        return iter(self._channel.interact(self._oid, "iter", None, (), {}))

    def __str__(self):
        return _text(self._channel.interact(self._oid, "str", None, (), {}), "__str__")


def _text(value, what):
    if not isinstance(value, str):
        raise TypeError(f"{what} returned non-string (type {type(value).__name__})")
    return value


def _proxy_class(type_name: str):
    if type_name not in _PROXY_CLASSES:
        _PROXY_CLASSES[type_name] = type(type_name, (LearnerObject,), {"__slots__": ()})
    return _PROXY_CLASSES[type_name]


def _is_mutable(value) -> bool:
    torch = _torch()
    return isinstance(value, (list, dict, set, bytearray, collections.deque)) or (
        torch is not None and isinstance(value, torch.Tensor))


def _apply_mutation(target, new) -> None:
    """Give `target` the contents `new` (decoded), in place; the same on both sides."""
    torch = _torch()
    try:
        if torch is not None and isinstance(target, torch.Tensor):
            if isinstance(new, torch.Tensor):
                with torch.no_grad():
                    if new.shape == target.shape and new.dtype == target.dtype:
                        target.copy_(new)
                    else:
                        target.set_(new.clone())
        elif isinstance(target, (list, bytearray)):
            target[:] = new
        elif isinstance(target, dict):
            target.clear()
            target.update(new)
        elif isinstance(target, (set, collections.deque)):
            target.clear()
            (target.update if isinstance(target, set) else target.extend)(new)
    except Exception:
        pass


class _Channel:
    """What both sides share: turning a response into what the check sees."""

    def __init__(self):
        self.seq = 0

    def proxy(self, oid: int, type_name: str) -> LearnerObject:
        return _proxy_class(type_name)(self, oid)

    def respond(self, response, args, kwargs):
        if not isinstance(response, dict):
            raise BadRecord("bad response")
        mutations = response.get("mutated") or {}
        if not isinstance(mutations, dict):
            raise BadRecord("bad mutations")
        for key, value in mutations.items():
            target = (args[int(key)] if key.isdigit() and int(key) < len(args)
                      else kwargs.get(key[1:]) if key.startswith("=") else None)
            if target is not None and _is_mutable(target):
                _apply_mutation(target, decode(value, self))
        if "raise" in response:
            raise decode_exception(response["raise"])
        if "value" not in response:
            raise BadRecord("a response without a value")
        return decode(response["value"], self)


class RecordingChannel(_Channel):
    """The kernel's side: performs each request on the learner's real objects and records it."""

    def __init__(self, learner, write: Callable[[dict], None]):
        super().__init__()
        self.objects = {0: learner}
        self.write = write

    def register(self, obj) -> int:
        oid = len(self.objects)
        self.objects[oid] = obj
        return oid

    def _real(self, value):
        if isinstance(value, LearnerObject) and value._channel is self:
            return self.objects[value._oid]
        return value

    def interact(self, oid, op, name, args, kwargs, helper=None):
        digest = request_digest(self, oid, op, name, args, kwargs)
        real = self.objects[oid]
        real_args = [self._real(a) for a in args]
        real_kwargs = {k: self._real(v) for k, v in kwargs.items()}
        watched = {str(i): a for i, a in enumerate(args) if _is_mutable(a)}
        watched.update({"=" + k: v for k, v in kwargs.items() if _is_mutable(v)})
        before = {k: _digest(_fp(v, self)) for k, v in watched.items()}
        response: dict = {}
        try:
            if op == "call":
                value = real(*real_args, **real_kwargs)
            elif op == "measure":                    # the check's helper, beside the learner
                value = helper(real, *real_args, **real_kwargs)
            elif op == "getattr":
                value = getattr(real, name)
            elif op == "repr":
                value = repr(real)
            elif op == "len":
                value = len(real)
            elif op == "bool":
                value = bool(real)
            elif op == "contains":
                value = real_args[0] in real
            elif op == "getitem":
                value = real[real_args[0]]
            elif op == "iter":
                value = list(real)
            else:
                value = str(real)
            response["value"] = encode(value, self.register)
        except ReplayEnd:
            raise
        except BaseException as exc:          # the learner's error, SystemExit included
            response = {"raise": encode_exception(exc)}
        changed = {k: encode(v, self.register) for k, v in watched.items()
                   if _digest(_fp(v, self)) != before[k]}
        if changed:
            response["mutated"] = changed
        self.write({"seq": self.seq, "digest": digest, "what": _describe(op, name, args),
                    "response": response})
        self.seq += 1
        return self.respond(response, args, kwargs)


class ReplayChannel(_Channel):
    """The trusted side: answers each request with the recorded answer, or ends the check."""

    def __init__(self, interactions: list):
        super().__init__()
        self.interactions = interactions

    def interact(self, oid, op, name, args, kwargs, helper=None):
        if self.seq >= len(self.interactions):
            raise ReplayEnd("exhausted")
        record = self.interactions[self.seq]
        if record.get("digest") != request_digest(self, oid, op, name, args, kwargs):
            raise ReplayEnd("mismatch")
        self.seq += 1
        return self.respond(record.get("response"), args, kwargs)


def measure(helper: Callable, learner, *args, **kwargs):
    """helper(learner, *args, **kwargs), run beside the learner's code: for what only makes sense
    where that code runs, such as timing it. In the instructor's batch grader the helper runs in
    the learner's kernel, on the real object, and only its plain-data result is recorded (and
    replayed to the trusted side), so it measures the learner's code, not the replay. The result
    is as trustworthy as the learner's kernel: a hostile notebook can fake it."""
    if isinstance(learner, LearnerObject):
        name = f"{getattr(helper, '__module__', '')}.{getattr(helper, '__qualname__', helper)}"
        return learner._channel.interact(learner._oid, "measure", name, args, kwargs, helper)
    return helper(learner, *args, **kwargs)


# =========================================================================== the kernel's side

def origin(learner) -> dict:
    """Where the submitted object comes from (for the course policy on minillm's own code)."""
    try:
        info = {"module": str(getattr(learner, "__module__", "") or "")[:200],
                "qualname": str(getattr(learner, "__qualname__", "") or "")[:200]}
    except Exception:
        return {}
    try:
        info["file"] = str(inspect.getsourcefile(learner) or "")[:300]
    except Exception:
        info["file"] = ""
    return info


class Recorder:
    """Records one run of an exercise's checks into the file named by $MINILLM_GRADE_RECORD."""

    def __init__(self, path: str, exercise_id: str, num_checks: int, learner):
        self.path, self.exercise = path, exercise_id
        self.run = uuid.uuid4().hex[:16]
        self.learner = learner
        self._line({"t": "run", "exercise": exercise_id, "checks": num_checks,
                    "origin": origin(learner)})

    def _line(self, record: dict) -> None:
        record = {"run": self.run, **record}
        data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)

    def stand_in(self, index: int) -> LearnerObject:
        """The learner's function as check `index` must see it (a recording stand-in)."""
        self._line({"t": "check", "check": index})
        channel = RecordingChannel(self.learner,
                                   lambda rec: self._line({"t": "io", "check": index, **rec}))
        return channel.proxy(0, type(self.learner).__name__[:100])

    def done(self, index: int) -> None:
        self._line({"t": "done", "check": index})

    def stopped(self, index: int, why: str) -> None:
        self._line({"t": "stopped", "check": index, "why": str(why)[:300]})


def recorder_from_env(exercise_id: str, num_checks: int, learner) -> Optional[Recorder]:
    path = os.environ.get(RECORD_ENV)
    return Recorder(path, exercise_id, num_checks, learner) if path else None


# =========================================================================== the trusted side

def read_regular_file(path, limit: int, what: str) -> bytes:
    """The bytes of `path`, which the submission could have replaced: never follows a symlink,
    never blocks on a FIFO or device, never reads more than `limit` bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise BadRecord(f"{what} are not in a regular file")
        if info.st_size > limit:
            raise BadRecord(f"{what} take {info.st_size:,} bytes, more than the {limit:,} "
                            "allowed")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise BadRecord(f"{what} take more than the {limit:,} bytes allowed")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_records(path, limit: int = MAX_RECORD_BYTES) -> dict:
    """{exercise id: its last run} from a transcript file; a run is {"origin": {...}, "checks":
    {index: {"io": [records in order], "stopped": why or None}}}. Raises BadRecord when the file
    is larger than `limit`; lines that are not valid JSON objects are skipped."""
    data = read_regular_file(path, limit, "the recorded answers")
    runs: dict = {}
    last_run_of: dict = {}
    for raw in data.splitlines():
        try:
            rec = json.loads(raw)
        except (ValueError, RecursionError):
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("run"), str):
            continue
        kind = rec.get("t")
        if kind == "run" and isinstance(rec.get("exercise"), str):
            origin_info = rec.get("origin") if isinstance(rec.get("origin"), dict) else {}
            runs[rec["run"]] = {"exercise": rec["exercise"], "origin": origin_info,
                                "checks": {}}
            last_run_of[rec["exercise"]] = rec["run"]
            continue
        run = runs.get(rec["run"])
        index = rec.get("check")
        if run is None or not isinstance(index, int) or isinstance(index, bool):
            continue
        check = run["checks"].setdefault(index, {"io": [], "stopped": None, "done": False})
        if kind == "io":
            check["io"].append(rec)
        elif kind == "stopped" and isinstance(rec.get("why"), str):
            check["stopped"] = rec["why"]
        elif kind == "done":
            check["done"] = True
    return {ex: runs[run] for ex, run in last_run_of.items()}
