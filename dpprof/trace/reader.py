"""A streaming reader of torch.profiler (Kineto) trace files: events one at a time, in bounded memory.

``.json`` and ``.json.gz`` files are read in 1 MiB chunks and walked at their top two levels: the
top-level object's fields, and inside ``traceEvents`` one event at a time, each decoded by the
standard library's C decoder (``json.JSONDecoder.raw_decode``). Only the chunk being read and the
event being decoded are in memory, never the file, and fields such as ``distributedInfo`` are read
wherever they are: before ``traceEvents`` or, in on-demand traces, after it.

Why not ijson: on this project's machine its fastest back-end (yajl2_c) decoded a trace's events at
about a third of the speed of the C decoder used here (ijson items: 3.5 s, raw_decode: 1.3 s, for the
same 162,000 events), and the speed of a large import is the decoding.
"""
from __future__ import annotations

import codecs
import gzip
import json
import os
import re
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["TraceError", "TraceFile", "TRACE_SUFFIXES", "is_trace_name", "CHUNK_BYTES", "MAX_VALUE_CHARS"]

TRACE_SUFFIXES = (".json", ".json.gz")
CHUNK_BYTES = 1 << 20  # 1 MiB per read: large enough that per-read costs vanish, small next to the import's memory
MAX_VALUE_CHARS = 64 << 20  # one event (or top-level field) larger than this is not a trace event: a broken file
# Event categories only Kineto writes: a JSON trace without any of them (and without Kineto's
# schemaVersion) is a Chrome trace from some other tool.
KINETO_CATEGORIES = frozenset({
    "cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver", "kernel", "gpu_memcpy",
    "gpu_memset", "gpu_user_annotation", "ac2g", "Operator", "Runtime", "Kernel", "Memcpy", "Memset",
    "Trace", "fwdbwd", "cpu_instant_event",
})
_SPACE = re.compile(r"\s*")
_SEPARATORS = re.compile(r"[\s,]*")  # between events
_decode = json.JSONDecoder().raw_decode
_scan = json.JSONDecoder().scan_once  # the C scanner raw_decode wraps: (value, end), or StopIteration


class TraceError(Exception):
    """A file that cannot be read as a torch.profiler trace; the message names the file and why."""


def is_trace_name(name: str) -> bool:
    return name.endswith(TRACE_SUFFIXES)


class _Text:
    """The file's text, decoded chunk by chunk, with a cursor; only the unread part is kept."""

    def __init__(self, stream: Any, raw: Any, progress: Callable[[int], None] | None) -> None:
        self.stream, self.raw, self.progress = stream, raw, progress
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.buf = ""
        self.pos = 0
        self.eof = False
        self.consumed = 0  # characters dropped before buf (for error positions)
        self._read_before = 0

    def more(self) -> bool:
        """Append the next chunk (dropping what was read); False at the end of the file."""
        if self.eof:
            return False
        chunk = self.stream.read(CHUNK_BYTES)
        if self.progress is not None:
            position = self.raw.tell()
            self.progress(position - self._read_before)
            self._read_before = position
        self.consumed += self.pos
        self.buf = self.buf[self.pos:] + self.decoder.decode(chunk, final=not chunk)
        self.pos = 0
        if not chunk:
            self.eof = True
        return True

    def peek(self) -> str:
        """The next character that is not white space ('' at the end of the file)."""
        while True:
            self.pos = _SPACE.match(self.buf, self.pos).end()
            if self.pos < len(self.buf) or not self.more():
                return self.buf[self.pos:self.pos + 1]

    def value(self) -> Any:
        """Decode the JSON value at the cursor, reading more of the file until it is whole."""
        self.peek()  # raw_decode takes no white space before the value
        while True:
            try:
                value, self.pos = _decode(self.buf, self.pos)
                return value
            except json.JSONDecodeError as err:
                if self.eof or len(self.buf) - self.pos > MAX_VALUE_CHARS:
                    raise _Broken(err.msg, self.consumed + err.pos) from None
                self.more()


class _Broken(Exception):
    def __init__(self, msg: str, at: int) -> None:
        super().__init__(msg)
        self.msg, self.at = msg, at


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
        try:
            with raw, stream:
                yield from self._walk(_Text(stream, raw, self.progress))
        except (EOFError, zlib.error, gzip.BadGzipFile) as err:
            raise self._error(f"truncated or corrupt gzip ({err})") from None
        except UnicodeDecodeError:
            raise self._error("not JSON (not UTF-8 text)") from None
        except _Broken as err:
            if self.events_read:
                raise self._error(f"truncated or corrupt JSON after {self.events_read:,} events ({err.msg} at "
                                  f"character {err.at:,})") from None
            raise self._error(f"not JSON ({err.msg} at character {err.at:,})") from None
        if not self.events_read:
            raise self._error("no events (traceEvents is empty or missing)")
        if not self.kineto_events and "schemaVersion" not in self.meta:
            raise self._error("a Chrome trace from another tool, not a torch.profiler trace (no Kineto "
                              "event categories, no schemaVersion)")

    def _walk(self, text: _Text) -> Iterator[dict[str, Any]]:
        first = text.peek()
        if first == "[":
            raise self._error("a JSON array of events (a Chrome trace from another tool), not a torch.profiler trace")
        if first != "{":
            raise self._error("empty file" if first == "" else "not JSON (a torch.profiler trace is a JSON object)")
        text.pos += 1
        while True:
            c = text.peek()
            if c == "}":
                return
            if c == ",":
                text.pos += 1
                continue
            key = text.value()
            if not isinstance(key, str) or text.peek() != ":":
                raise _Broken("expecting a field name and ':'", text.consumed + text.pos)
            text.pos += 1
            if key == "traceEvents" and text.peek() == "[":
                text.pos += 1
                yield from self._events(text)
            else:
                self.meta[key] = text.value()

    def _events(self, text: _Text) -> Iterator[dict[str, Any]]:
        """The events of traceEvents, decoded one by one straight from the buffer (the hot loop)."""
        kineto = KINETO_CATEGORIES
        skip = _SEPARATORS.match
        scan = _scan
        buf, pos = text.buf, text.pos
        while True:
            pos = skip(buf, pos).end()
            if pos >= len(buf):
                text.pos = pos
                if not text.more():
                    raise _Broken("the file ends inside traceEvents", text.consumed + pos)
                buf, pos = text.buf, text.pos
                continue
            if buf[pos] == "]":
                text.pos = pos + 1
                return
            try:
                event, pos = scan(buf, pos)
            except (json.JSONDecodeError, StopIteration) as err:
                text.pos = pos
                if text.eof or len(buf) - pos > MAX_VALUE_CHARS:
                    at = err.pos if isinstance(err, json.JSONDecodeError) else pos
                    raise _Broken(getattr(err, "msg", "expecting a value"), text.consumed + at) from None
                text.more()  # the event runs past the buffer: read on and decode it again
                buf, pos = text.buf, text.pos
                continue
            if not isinstance(event, dict):
                raise self._error("traceEvents holds something other than event objects")
            self.events_read += 1
            if event.get("cat") in kineto:
                self.kineto_events += 1
            yield event
