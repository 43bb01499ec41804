"""The three memory ledgers in one report, and the ``report`` CLI command.

Note:
    Each metric sees one layer only, so the report keeps them apart:

    * references (``tracked``): what tpool objects hold: each cache's payload
      vs the storage bytes it keeps alive (and, backed by an ``Arena``, the
      arena's whole buffer), and whatever each pool's ``memory_bytes()``
      returns (a dict of byte counts, read duck-typed: a ``PagePool``, a
      ``PageTable``, an ``Arena``, a ``PagedKVCache``…). Each object is its own
      row set, never summed with another's: an ``Arena`` passed beside the
      ``OwnedCache`` it backs shows the same buffer twice;
    * caching allocator (``allocator``): ``torch.cuda.memory_stats``:
      allocated, reserved, their peaks, inactive split bytes, of THIS process
      only. Freed blocks stay reserved, so reserved >= allocated. With a
      pluggable allocator (RMM…) torch has no statistics: the ledger is None
      with the reason, and the driver ledger is still measured;
    * driver (``driver``): ``torch.cuda.mem_get_info``: total and free on the
      device. ``used = total - free`` is device-wide (other processes too);
      ``non_pytorch = used - reserved`` (reserved by THIS process): CUDA
      context, NCCL, other libraries, and other processes' memory, their
      PyTorch memory included. Run from the ``report`` CLI (a process of its
      own, which reserves nothing), it is everything on the device but the
      CLI's own context is in it too: call :func:`memory_report` inside the
      engine's process for the engine's split;
    * process: resident set size from ``/proc/self/statm`` (current) and
      ``resource`` (peak), on every device.

    A number that cannot be measured is ``None`` with a reason string; the
    report never invents one. On a CPU only the references and the process
    ledger exist. Reading CUDA numbers creates a CUDA context if there was none.
"""

from __future__ import annotations

import argparse
import json
import math
from numbers import Integral, Real
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch

from tpool import _checks
from tpool._prog import prog

__all__ = ["memory_report", "format_report", "main", "MemoryReport", "Tracked", "Allocator", "Driver", "Process"]

MIB = 1 << 20  # bytes in a MiB, for format_report
_SCALARS = (int, float, str, bool, type(None))  # what memory_bytes() values may be (JSON scalars)
_CUDA_STATS = {  # field -> torch.cuda.memory_stats key
    "allocated_bytes": "allocated_bytes.all.current",
    "reserved_bytes": "reserved_bytes.all.current",
    "peak_allocated_bytes": "allocated_bytes.all.peak",
    "peak_reserved_bytes": "reserved_bytes.all.peak",
    "inactive_split_bytes": "inactive_split_bytes.all.current",
}


@dataclass(frozen=True)
class Tracked:
    """References ledger: ``caches`` and ``pools`` map a name to the object's ``memory_bytes()``."""

    caches: dict[str, dict[str, Any]]
    pools: dict[str, dict[str, Any]]


@dataclass(frozen=True)
class Allocator:
    """Caching allocator ledger (bytes; None with ``unavailable`` when not measurable)."""

    allocated_bytes: int | None
    reserved_bytes: int | None
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    inactive_split_bytes: int | None
    unavailable: str | None = None


@dataclass(frozen=True)
class Driver:
    """Driver ledger (bytes; None with ``unavailable`` when not measurable)."""

    total_bytes: int | None
    free_bytes: int | None
    used_bytes: int | None  # total - free: device-wide, every process
    non_pytorch_bytes: int | None  # used - reserved by THIS process: context, other libraries, other processes
    unavailable: str | None = None


@dataclass(frozen=True)
class Process:
    """This process on the host (bytes; None with ``unavailable`` when not measurable)."""

    rss_bytes: int | None
    peak_rss_bytes: int | None
    unavailable: str | None = None


@dataclass(frozen=True)
class MemoryReport:
    """The ledgers of one device, as :func:`memory_report` measured them."""

    device: str
    tracked: Tracked
    allocator: Allocator
    driver: Driver
    process: Process

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dicts (JSON-serialisable).

        Returns
        -------
        dict of str to Any
            ``device`` and the four ledgers, each a dict of its fields.
        """
        return asdict(self)


def _name(obj: Any, i: int, names: set[str] | dict) -> str:
    """``obj.name`` (or ``Type[i]``), with an index suffix, the next one that is free, if taken."""
    name = getattr(obj, "name", None)
    name = name if isinstance(name, str) and name else f"{type(obj).__name__}[{i}]"
    base, k = name, i
    while name in names:  # "kv", "kv[2]", "kv": the third is kv[3], not a second kv[2]
        name, k = f"{base}[{k}]", k + 1
    return name


def _tracked(objs: Any, kind: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    if callable(getattr(objs, "memory_bytes", None)):  # one object, not a list of them
        objs = [objs]
    elif isinstance(objs, (str, bytes, dict)) or not hasattr(objs, "__iter__"):
        raise TypeError(f"{kind}: expected a list of objects with memory_bytes() (or one), got {type(objs).__name__}")
    for i, obj in enumerate(objs):
        fn = getattr(obj, "memory_bytes", None)
        if not callable(fn):
            raise TypeError(f"{kind}[{i}]: expected an object with memory_bytes(), got {type(obj).__name__}")
        numbers = fn()
        scalars = {k: _scalar(v) for k, v in numbers.items()} if isinstance(numbers, dict) else None
        if scalars is None or not all(isinstance(k, str) and v is not _NOT_SCALAR for k, v in scalars.items()):
            raise TypeError(f"{kind}[{i}].memory_bytes(): expected a dict of str -> int (or another "
                            f"JSON scalar; not nan or inf, which JSON cannot hold), got {numbers!r}")
        out[_name(obj, i, out)] = scalars
    return out


_NOT_SCALAR = object()


def _scalar(v: Any) -> Any:
    """``v`` as a JSON scalar (a numpy integer or float read as int or float), or ``_NOT_SCALAR``."""
    if not isinstance(v, _SCALARS):
        if isinstance(v, Integral):  # numpy.int64 from a user's sum over an array
            v = int(v)
        elif isinstance(v, Real):
            v = float(v)
        else:
            return _NOT_SCALAR
    return _NOT_SCALAR if isinstance(v, float) and not math.isfinite(v) else v


_PEAK_SEEN = [0]  # the highest RSS a report of this process has read: a peak never goes down


def _rss() -> int:
    """The process's resident bytes now (``OSError``/``ValueError``/``IndexError`` where unreadable)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _process() -> Process:
    rss = peak = None
    reasons = []
    try:
        rss = _rss()
    except (OSError, ValueError, IndexError):
        reasons.append("rss: /proc/self/statm unreadable")
    try:
        import resource

        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB elsewhere
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
        peak = max(peak, rss or 0, _PEAK_SEEN[0])  # ru_maxrss can lag the current RSS, which an earlier report read
        _PEAK_SEEN[0] = peak
    except (ImportError, OSError):
        reasons.append("peak rss: module resource unavailable")
    return Process(rss, peak, "; ".join(reasons) or None)


def _allocator(device: torch.device) -> Allocator:
    try:
        stats = torch.cuda.memory_stats(device)
    except RuntimeError as e:  # a pluggable allocator (RMM...): "... does not yet support getDeviceStats"
        return Allocator(None, None, None, None, None, f"torch.cuda.memory_stats failed: {e}")
    if not stats:  # {}: the caching allocator has not been initialised on this device yet, so it holds nothing
        return Allocator(**{name: 0 for name in _CUDA_STATS})
    # A key missing from non-empty stats (a torch that renamed it) is that field None with the key
    # named, not 0: the other fields are still right, and 0 would be a number the report invented.
    missing = [key for key in _CUDA_STATS.values() if key not in stats]
    return Allocator(**{name: int(stats[key]) if key in stats else None for name, key in _CUDA_STATS.items()},
                     unavailable=f"torch.cuda.memory_stats has no {', '.join(missing)}" if missing else None)


def memory_report(device: torch.device | str | int | None = None, *, pools=(), caches=()) -> MemoryReport:
    """Measure the ledgers of ``device`` (default: the current CUDA device, else the CPU).

    Parameters
    ----------
    device : torch.device, str or int, optional
        ``"cuda:0"``, ``0`` (an int is a CUDA index), ``"cpu"``… Default the
        current CUDA device, else the CPU.
    pools, caches : iterables, or one object
        Objects with ``memory_bytes() -> dict[str, int]`` (``OwnedCache``,
        ``PagePool``, ``PageTable``, ``Arena``, ``PagedKVCache``, or your own;
        other JSON scalars are accepted as values; either argument takes any
        of them: the two only label the rows), reported by their ``name``
        attribute or ``Type[i]`` (``i`` its position); a name already taken
        gets the suffix ``[i]``, or the next index that makes it unique, so
        no object is dropped.

    Returns
    -------
    MemoryReport
        The references ledger, and for a CUDA device the caching allocator
        and driver ledgers (on any other device those are None with the
        reason in ``unavailable``); the process ledger on every device.

    Raises
    ------
    ValueError
        ``device`` is not a cpu or cuda device (a string torch does not parse
        included), a CUDA device without CUDA, or a CUDA index out of range.
    TypeError
        An object without a callable ``memory_bytes``, or one whose
        ``memory_bytes()`` is not a dict of str to JSON scalars.
    """
    device = _checks.resolve_device(device)
    tracked = Tracked(caches=_tracked(caches, "caches"), pools=_tracked(pools, "pools"))
    if device.type != "cuda":
        why = f"no caching-allocator statistics for device type {device.type!r}"
        allocator = Allocator(None, None, None, None, None, why)
        driver = Driver(None, None, None, None, f"no driver memory query for device type {device.type!r}")
        return MemoryReport(str(device), tracked, allocator, driver, _process())
    allocator = _allocator(device)
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    driver = Driver(total, free, used, None if allocator.reserved_bytes is None else used - allocator.reserved_bytes,
                    None if allocator.reserved_bytes is not None
                    else "non_pytorch_bytes needs the allocator's reserved_bytes (unavailable)")
    return MemoryReport(str(device), tracked, allocator, driver, _process())


def _rows(report: MemoryReport) -> list[tuple[str, str, Any, str]]:
    rows = []
    for kind, objs in (("cache", report.tracked.caches), ("pool", report.tracked.pools)):
        for name, numbers in objs.items():
            rows += [("references", f"{kind} {name}: {k}", v, "") for k, v in numbers.items()] or \
                [("references", f"{kind} {name}", None, "its memory_bytes() gave no numbers")]
    if not rows:
        rows.append(("references", "(no caches or pools passed)", None,
                     "memory_report(pools=..., caches=...) in your process counts them"))
    for ledger, obj in (("allocator", report.allocator), ("driver", report.driver), ("process", report.process)):
        numbers = {k: v for k, v in asdict(obj).items() if k != "unavailable"}
        if all(v is None for v in numbers.values()):
            rows.append((ledger, "(unavailable)", None, obj.unavailable or ""))
        else:
            rows += [(ledger, k, v, (obj.unavailable or "") if v is None else "") for k, v in numbers.items()]
    return rows


CLI_NOTE = ("the allocator ledger and non_pytorch_bytes (used - reserved) are of this process, the CLI, which "
            "holds no tensors: non_pytorch_bytes is then every process's memory on the device (PyTorch's and "
            "the CLI's own CUDA context included); call memory_report() in the engine's process for its split")
CLI_NOTE_CPU = ("on a CPU only the process ledger is measured, and it is this CLI's own; call memory_report() in "
                "the engine's process for what its pools and caches hold")


def format_report(report: MemoryReport, note: str | None = None) -> str:
    """A readable table: ledger, quantity, bytes, MiB (``n/a`` and the reason when unmeasured).

    Parameters
    ----------
    report : MemoryReport
        As :func:`memory_report` returns it.
    note : str, optional
        A last line, ``note: ...`` (the CLI passes :data:`CLI_NOTE`).

    Returns
    -------
    str
        A title line naming the device, a header, then one line per number:
        integers with thousands separators, and MiB for quantities whose name
        ends in ``bytes``; a text value (a name, a backend) in the note column;
        a ledger with nothing measured is one ``n/a`` line; then ``note`` if given.

    Raises
    ------
    ValueError
        ``report`` is not a :class:`MemoryReport` (its ``to_dict()`` or JSON, say), or ``note`` is neither
        None nor a ``str``.
    """
    if not isinstance(report, MemoryReport):
        raise ValueError(f"report: expected a MemoryReport (what memory_report() returns), got a "
                         f"{type(report).__name__}")
    if note is not None and not isinstance(note, str):
        raise ValueError(f"note: expected a str or None, got a {type(note).__name__}")
    lines = [f"tpool memory report: {report.device}",
             f"{'ledger':<11} {'quantity':<40} {'bytes':>16} {'MiB':>11}  note"]
    for ledger, what, value, why in _rows(report):
        if value is None:
            lines.append(f"{ledger:<11} {what:<40} {'n/a':>16} {'':>11}  {why}".rstrip())
        elif isinstance(value, int) and not isinstance(value, bool):
            shown = f"{value / MIB:11.2f}" if what.endswith("bytes") else f"{'':>11}"
            lines.append(f"{ledger:<11} {what:<40} {value:>16,} {shown}")
        else:  # text (a name, a backend): in the note column, so the number columns stay aligned
            lines.append(f"{ledger:<11} {what:<40} {'':>16} {'':>11}  {value}")
    if note:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``tpool report [--json] [--device DEV]``; returns the exit status.

    Also reached as ``python -m tpool report``. Prints :func:`format_report`
    (or the JSON of :meth:`MemoryReport.to_dict` with ``--json``) of
    :func:`memory_report` on the device, with no caches or pools, and
    :data:`CLI_NOTE` (the table's last line; the JSON's ``"note"``; :data:`CLI_NOTE_CPU` on a CPU): the
    allocator and process numbers are this CLI process's.

    Parameters
    ----------
    argv : list of str, optional
        The arguments; default ``sys.argv[1:]``. A leading ``"report"`` is
        dropped.

    Returns
    -------
    int
        0 when the report was printed; 2 when the device could not be
        measured (the reason goes to stderr).

    Raises
    ------
    SystemExit
        From argparse, for ``--help`` or an unknown option.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["report"]:
        argv = argv[1:]
    parser = argparse.ArgumentParser(
        prog=prog("report"), allow_abbrev=False,  # as the demos': an abbreviation is a usage error
        description="Print the memory ledgers of a device as this process sees them: the caching allocator, the "
                    "driver and the process. It holds no pools or caches; call memory_report(pools=..., "
                    "caches=...) in the engine's process for what they hold.")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--device", default=None, help="cuda:N or cpu (default: current CUDA device, else cpu)")
    args = parser.parse_args(argv)
    try:  # (the device as the option that named it, as the demo words it: "--device: expected ...")
        report = memory_report(_checks.resolve_device(args.device, "--device"))
    except (ValueError, RuntimeError) as exc:  # (as argparse reports a usage error, and as the demo does)
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    note = CLI_NOTE_CPU if str(report.device) == "cpu" else CLI_NOTE
    text = json.dumps({**report.to_dict(), "note": note}, indent=2) if args.json else format_report(report, note)
    # One write, the newline included: print() writes the newline apart, which an unbuffered stdout
    # (PYTHONUNBUFFERED=1, common in containers) sends as a second write after `head -3` may have gone.
    sys.stdout.write(text + "\n")
    return 0
