"""Reading a number with a unit out of a free-text answer, and comparing it with the right value.

Every numeric answer is stored in a base unit of its dimension (bytes, seconds, tokens/s, ...).
A learner may answer in any unit of that dimension: "327680", "320 KiB", "0.328 MB", "3.2768e5 B"
all name the same size. A bare number is read in the unit the question asks for.

Decimal and binary prefixes are different units here, as on a datasheet: KB = 1000 B,
KiB = 1024 B. Confusing them is a 2.4 % (K), 4.9 % (M) or 7.4 % (G) error, and the grader says so.

Bits and bytes differ by case, as on a datasheet: B is a byte, b a bit ("8 Gb" = 1 GB,
"400 Gb/s" = "400 Gbps" = 50 GB/s); "bit"/"bits" spelled out are bits too. The prefix's case does
not matter (kB = KB).

Reading rules for the number:
  - a comma groups thousands only as 1-3 digits then groups of exactly three ("327,680",
    "1,048,576.5"); any other comma ("0,3125", "1,5", "0,312") is a decimal comma and is refused
    with the fix ("write 0.3125"), never silently read as 3125;
  - "~", "≈", "~=", "about", "approx", "approx.", "approximately", "around", "roughly", "circa",
    "ca." may come before the number (an estimate is graded like any answer).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

# unit (lower case, as typed) -> (dimension, factor to the base unit)
_UNITS: dict[str, tuple[str, float]] = {}


def _add(dimension: str, factor: float, *names: str) -> None:
    for name in names:
        _UNITS[name.lower()] = (dimension, factor)


_add("bytes", 1, "b", "byte", "bytes")
for _p, _dec, _bin in (("k", 1e3, 2**10), ("m", 1e6, 2**20), ("g", 1e9, 2**30), ("t", 1e12, 2**40)):
    _add("bytes", _dec, f"{_p}b", f"{_p}byte", f"{_p}bytes")
    _add("bytes", _bin, f"{_p}ib")
_add("seconds", 1, "s", "sec", "secs", "second", "seconds")
_add("seconds", 1e-3, "ms", "msec", "millisecond", "milliseconds")
_add("seconds", 1e-6, "us", "µs", "μs", "usec", "microsecond", "microseconds")
_add("seconds", 1e-9, "ns", "nanosecond", "nanoseconds")
_add("seconds", 60, "min", "minute", "minutes")
_add("tokens_per_s", 1, "tok/s", "tokens/s", "token/s", "tps", "tokens/sec", "tok/sec")
_add("bytes_per_s", 1, "b/s")
for _p, _dec in (("k", 1e3), ("m", 1e6), ("g", 1e9), ("t", 1e12)):
    _add("bytes_per_s", _dec, f"{_p}b/s")
_add("flop_per_byte", 1, "flop/b", "flop/byte", "flops/byte", "flop/bytes", "flops/b")
_add("ratio", 1, "x", "×", "times")
_add("fraction", 0.01, "%", "percent")
_add("dollars", 1, "$", "usd", "dollars")
# counts carry their noun, which says nothing about scale
_add("count", 1, "tokens", "token", "blocks", "block", "requests", "request", "seqs", "sequences",
     "sequence", "slots", "slot", "users", "steps", "step")

DIMENSION_WORDS = {
    "bytes": "a size, e.g. '327680', '320 KiB' or '0.33 MB'",
    "seconds": "a time, e.g. '20.6 ms', '20600 us' or '0.0206 s'",
    "tokens_per_s": "a rate, e.g. '48.6 tok/s'",
    "bytes_per_s": "a bandwidth, e.g. '3.35 TB/s' or '3350 GB/s'",
    "flop_per_byte": "an arithmetic intensity, e.g. '295 FLOP/byte' or just '295'",
    "ratio": "a ratio, e.g. '1.61x' or '1.61'",
    "fraction": "a fraction, e.g. '0.78' or '78%'",
    "count": "a whole number, e.g. '23'",
    "dollars": "an amount in dollars, e.g. '$0.42' or '0.42'",
}

# the unit a bare number is read in, per dimension, unless the question names another
BASE_UNIT = {"bytes": "B", "seconds": "s", "tokens_per_s": "tok/s", "bytes_per_s": "B/s",
             "flop_per_byte": "FLOP/byte", "ratio": "x", "fraction": "", "count": "",
             "dollars": "$"}

_APPROX = r"(?:~=?|≈|about|approx(?:\.|imately)?|around|roughly|circa|ca\.)"
_NUMBER = re.compile(r"^\s*(?:" + _APPROX + r"\s*)?(?P<dollar>\$)?\s*(?:" + _APPROX + r"\s*)?"
                     r"(?P<num>[-+]?(?:\d[\d,_]*)?\.?\d+(?:[eE][-+]?\d+)?)\s*(?P<unit>.*?)\s*\.?\s*$",
                     re.IGNORECASE)
_THOUSANDS = re.compile(r"^[-+]?[1-9]\d{0,2}(?:,\d{3})+(?:\.\d*)?(?:[eE][-+]?\d+)?$")
# a bit unit: an optional prefix, then a lower-case b or "bit(s)", optionally per second
_BITS = re.compile(r"^(?P<prefix>[kKmMgGtT]i?)?(?:b|bits?)(?P<rate>/s|ps)?$")


class UnitError(ValueError):
    """The answer could not be read as a number of the expected kind; the message says why."""


@dataclass(frozen=True)
class Quantity:
    value: float              # in the base unit of its dimension
    dimension: str
    unit: str                 # as the learner typed it ("" for a bare number)


def unit_factor(unit: str, dimension: str) -> float:
    """Factor from `unit` to the base unit of `dimension` ("MiB" -> 1048576 for bytes)."""
    if unit in ("", None):
        return 1.0
    key = unit.strip().lower()
    if key not in _UNITS or _UNITS[key][0] != dimension:
        raise ValueError(f"{unit!r} is not a unit of {dimension}")
    return _UNITS[key][1]


def parse_quantity(text: str, dimension: str, default_unit: str = "") -> Quantity:
    """Read `text` as a quantity of `dimension`; a bare number is in `default_unit`.

    Raises UnitError with a message that names the expected format."""
    expected = DIMENSION_WORDS.get(dimension, "a number")
    if text is None or not str(text).strip():
        raise UnitError(f"no answer given; expected {expected}")
    m = _NUMBER.match(str(text))
    if not m:
        raise UnitError(f"could not read a number in {str(text)!r}; expected {expected}")
    number = _read_number(m.group("num"))
    unit = m.group("unit").split("(")[0].strip()   # "327,680 B (320 KiB)": the first unit counts
    if m.group("dollar") and not unit:
        unit = "$"
    if not unit:
        return Quantity(number * unit_factor(default_unit, dimension), dimension, "")
    key, per_bit = _unit_key(unit)
    if key not in _UNITS:
        raise UnitError(f"unknown unit {unit!r}; expected {expected}")
    dim, factor = _UNITS[key]
    factor *= per_bit
    if dim == "count" and dimension != "count":      # "23 tokens" for a size: a unit slip
        raise UnitError(f"{unit!r} counts things; expected {expected}")
    if dim != dimension and not (dim == "ratio" and dimension == "fraction"):
        raise UnitError(f"{unit!r} is a unit of {dim.replace('_', ' ')}; expected {expected}")
    if dim == "ratio" and dimension == "fraction":
        factor = 1.0
    return Quantity(number * factor, dimension, unit)


def _read_number(num: str) -> float:
    """The number as typed; a comma must group thousands (see the module docstring)."""
    if "," in num and not _THOUSANDS.match(num.replace("_", "")):
        fixed = num.replace(",", ".", 1) if num.count(",") == 1 else num.replace(",", "")
        raise UnitError(f"{num!r} has a decimal comma (or commas that do not group thousands); "
                        f"write a decimal point, e.g. {fixed}")
    return float(num.replace(",", "").replace("_", ""))


def _unit_key(unit: str) -> tuple[str, float]:
    """The _UNITS key of a typed unit and the factor for bits: ("gb", 1/8) for "Gb"."""
    m = _BITS.match(unit)
    if m:
        prefix = (m.group("prefix") or "").lower()
        return f"{prefix}b" + ("/s" if m.group("rate") else ""), 1 / 8
    if unit.lower().endswith("bps"):                 # "GBps": bytes per second
        return unit.lower()[:-3] + "b/s", 1.0
    return unit.lower(), 1.0


def fmt_bytes(n: float) -> str:
    """A byte count in bytes and in the nearest binary and decimal units:
    '327,680 B (320 KiB, 0.33 MB)'."""
    n = float(n)
    if abs(n) < 1024:
        return f"{n:,.0f} B"
    for unit, p in (("TiB", 4), ("GiB", 3), ("MiB", 2), ("KiB", 1)):
        if abs(n) >= 1024**p:
            binary = f"{n / 1024**p:,.3g} {unit}"
            break
    for unit, p in (("TB", 4), ("GB", 3), ("MB", 2), ("KB", 1)):
        if abs(n) >= 1000**p:
            decimal = f"{n / 1000**p:,.3g} {unit}"
            break
    return f"{n:,.0f} B ({binary}, {decimal})"


def fmt_seconds(s: float) -> str:
    s = float(s)
    if abs(s) >= 1:
        return f"{s:,.3g} s"
    if abs(s) >= 1e-3:
        return f"{s * 1e3:,.3g} ms"
    if abs(s) >= 1e-6:
        return f"{s * 1e6:,.3g} us"
    return f"{s * 1e9:,.3g} ns"


def fmt_value(value: float, dimension: str) -> str:
    """How the grader prints the right answer."""
    if dimension == "bytes":
        return fmt_bytes(value)
    if dimension == "seconds":
        return fmt_seconds(value)
    if dimension == "tokens_per_s":
        return f"{value:,.4g} tok/s"
    if dimension == "bytes_per_s":
        return f"{value / 1e9:,.4g} GB/s"
    if dimension == "flop_per_byte":
        return f"{value:,.4g} FLOP/byte"
    if dimension == "ratio":
        return f"{value:,.3f}x"
    if dimension == "fraction":
        return f"{value:.4g} ({value * 100:.3g}%)"
    if dimension == "dollars":
        return f"${value:,.4g}"
    if dimension == "count":
        return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.4g}"
    return f"{value:,.4g}"


_SLIPS = (
    (1.024, "decimal and binary units mixed (KB vs KiB, 1000 vs 1024)"),
    (1.024**2, "decimal and binary units mixed (MB vs MiB: 1e6 vs 1048576)"),
    (1.024**3, "decimal and binary units mixed (GB vs GiB: 1e9 vs 1073741824)"),
    (1.024**4, "decimal and binary units mixed (TB vs TiB)"),
    (8.0, "bits and bytes mixed (b is a bit, B a byte: 8 Gb = 1 GB)"),
    (2.0, "a factor of 2 (K and V both cached? 2 bytes per bf16 value? a sum counted twice?)"),
    (1000.0, "a factor of 1000: check the unit prefix (ms vs us, KB vs MB)"),
)


def compare(expected: float, got: float, rel_tol: float, abs_tol: float = 0.0) -> tuple[bool, str]:
    """Is `got` within tolerance of `expected`? If not, name a known slip that explains the gap."""
    if math.isclose(got, expected, rel_tol=rel_tol, abs_tol=abs_tol):
        return True, ""
    if got == 0 or expected == 0:
        return False, ""
    ratio = got / expected
    for factor, why in _SLIPS:
        for r in (factor, 1 / factor):
            if math.isclose(ratio, r, rel_tol=min(rel_tol, 0.005)):
                return False, f"off by {ratio:.4g}x: looks like {why}"
    return False, f"off by {ratio:.3g}x"
