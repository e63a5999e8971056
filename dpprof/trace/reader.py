"""A streaming reader of torch.profiler (Kineto) trace files: events one at a time, in bounded memory.

``.json`` and ``.json.gz`` files are parsed incrementally with ijson, so a file of several GB is never
held in memory: only the event being read and the file's small top-level fields (``distributedInfo``,
``deviceProperties``, ``baseTimeNanoseconds``, ...), which Kineto writes before ``traceEvents`` or,
for on-demand traces, after it. Both places are read in the same single pass: the fields before the
events by a second parser that stops at the first event, the fields after them from the file's tail.
"""
from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ijson

__all__ = ["TraceError", "TraceFile", "TRACE_SUFFIXES", "is_trace_name", "CHUNK_BYTES"]

TRACE_SUFFIXES = (".json", ".json.gz")
CHUNK_BYTES = 1 << 20  # 1 MiB per read: large enough that the parser's per-call cost vanishes
TAIL_MAX_BYTES = 16 << 20  # the bytes after the last event kept to read trailing fields (Kineto's are < 1 MB)
# Event categories only Kineto writes: a JSON trace without any of them (and without Kineto's
# schemaVersion) is a Chrome trace from some other tool.
KINETO_CATEGORIES = frozenset({
    "cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver", "kernel", "gpu_memcpy",
    "gpu_memset", "gpu_user_annotation", "ac2g", "Operator", "Runtime", "Kernel", "Memcpy", "Memset",
    "Trace", "fwdbwd", "cpu_instant_event",
})


class TraceError(Exception):
    """A file that cannot be read as a torch.profiler trace; the message names the file and why."""


def is_trace_name(name: str) -> bool:
    return name.endswith(TRACE_SUFFIXES)


def _open_bytes(path: Path) -> tuple[Any, Any]:
    """(stream of the JSON bytes, the raw file whose position is the bytes read from disk)."""
    raw = open(path, "rb")
    if path.name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb"), raw
    return raw, raw


class TraceFile:
    """One trace file, read once: iterate ``events()``, then ``meta`` holds its top-level fields.

    Args:
        path: a ``.json`` or ``.json.gz`` Kineto trace.
        progress: called with the number of bytes read from disk since the last call (a progress bar).

    Example:
        >>> trace = TraceFile("rank0.pt.trace.json.gz")
        >>> kernels = sum(1 for e in trace.events() if e.get("cat") == "kernel")
        >>> trace.meta.get("distributedInfo")
    """

    def __init__(self, path: str | os.PathLike[str], progress: Callable[[int], None] | None = None) -> None:
        self.path = Path(path)
        self.name = self.path.name
        self.size_bytes = self.path.stat().st_size
        self.progress = progress
        self.meta: dict[str, Any] = {}
        self.events_read = 0
        self.kineto_events = 0

    def _error(self, what: str) -> TraceError:
        return TraceError(f"{self.name}: {what}")

    def events(self) -> Iterator[dict[str, Any]]:
        """Every entry of ``traceEvents`` as a dict, in file order; fills ``meta`` as it goes."""
        try:
            stream, raw = _open_bytes(self.path)
        except OSError as err:
            raise self._error(f"cannot read: {err.strerror or err}") from None
        events = ijson.sendable_list()
        head = ijson.sendable_list()
        parser = ijson.items_coro(events, "traceEvents.item", use_float=True)
        head_parser = ijson.kvitems_coro(head, "", use_float=True)  # top-level fields before the events
        tail: list[bytes] = []
        tail_bytes = 0
        read_before = 0
        first = True
        try:
            with stream:
                while True:
                    chunk = stream.read(CHUNK_BYTES)
                    if first:
                        first = False
                        if not chunk:
                            raise self._error("empty file")
                        if chunk.lstrip()[:1] == b"[":
                            raise self._error("a JSON array of events (a Chrome trace from another tool), "
                                              "not a torch.profiler trace")
                        if chunk.lstrip()[:1] != b"{":
                            raise self._error("not JSON (a torch.profiler trace is a JSON object)")
                    if self.progress is not None:
                        position = raw.tell()
                        self.progress(position - read_before)
                        read_before = position
                    if not chunk:
                        break
                    if head_parser is not None:
                        head_parser.send(chunk)
                    parser.send(chunk)
                    if events:
                        if head_parser is not None:  # the events began: what came before them is known
                            self._take_head(head)
                            head_parser = None
                        tail, tail_bytes = [chunk], len(chunk)
                        yield from self._count(events)
                        del events[:]
                    else:
                        tail.append(chunk)
                        tail_bytes += len(chunk)
                        while tail_bytes > TAIL_MAX_BYTES and len(tail) > 1:
                            tail_bytes -= len(tail.pop(0))
                parser.close()
                yield from self._count(events)
        except (EOFError, zlib.error, gzip.BadGzipFile) as err:
            raise self._error(f"truncated or corrupt gzip ({err})") from None
        except ijson.IncompleteJSONError as err:
            if self.events_read:
                raise self._error(f"truncated: the JSON ends after {self.events_read:,} events ({err})") from None
            raise self._error(f"not JSON ({err})") from None
        except ijson.JSONError as err:
            raise self._error(f"not valid JSON ({err})") from None
        if head_parser is not None:  # no events at all: the whole file was the head
            try:
                head_parser.close()
            except ijson.JSONError:
                pass
            self._take_head(head)
        else:
            trailing = _trailing_fields(b"".join(tail))
            self.meta.update((k, v) for k, v in trailing.items() if k != "traceEvents" and k not in self.meta)
        if not self.events_read:
            raise self._error("no events (traceEvents is empty or missing)")
        if not self.kineto_events and "schemaVersion" not in self.meta:
            raise self._error("a Chrome trace from another tool, not a torch.profiler trace (no Kineto "
                              "event categories, no schemaVersion)")

    def _take_head(self, head: list[tuple[str, Any]]) -> None:
        self.meta.update((k, v) for k, v in head if k != "traceEvents")
        del head[:]

    def _count(self, events: list[Any]) -> Iterator[dict[str, Any]]:
        for event in events:
            if not isinstance(event, dict):
                raise self._error("traceEvents holds something other than event objects")
            self.events_read += 1
            if event.get("cat") in KINETO_CATEGORIES:
                self.kineto_events += 1
            yield event


def _trailing_fields(tail: bytes) -> dict[str, Any]:
    """The top-level fields after ``traceEvents`` ends, from the file's last bytes.

    ``tail`` starts inside the last event (or, for a file of one chunk, at its start). A ``]`` inside
    an event leaves more closers than openers, so it never parses; the first ``]`` whose remainder
    parses as the rest of one object ends traceEvents, or, in a one-chunk file, a list before it,
    which gives a suffix of the same top-level fields.
    """
    decoder = json.JSONDecoder()
    start = 0
    while True:
        at = tail.find(b"]", start)
        if at < 0:
            return {}
        rest = tail[at + 1:].lstrip()
        if rest[:1] == b",":
            rest = rest[1:]
        try:
            text = "{" + rest.decode("utf-8")
            value, end = decoder.raw_decode(text)
            if isinstance(value, dict) and not text[end:].strip():
                return value
        except (ValueError, UnicodeDecodeError):
            pass
        start = at + 1
