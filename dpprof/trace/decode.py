"""A streaming reader of torch.profiler (Kineto) trace files: events a chunk at a time, in bounded memory.

``.json`` and ``.json.gz`` files are read in 1 MiB chunks (on a thread of their own, which reads and
gunzips while the caller decodes: zlib and file reads let go of the GIL) and walked at their top two
levels: the top-level object's fields, and inside ``traceEvents`` the events. Only a few chunks are in
memory, never the file, and fields such as ``distributedInfo`` are read wherever they are: before
``traceEvents`` or, in on-demand traces, after it.

The events of a chunk are decoded in one call: the chunk up to its last event boundary, as guessed from
the bytes (a ``}``, then ``,`` and the next ``{``), is decoded as one JSON array by msgspec into structs,
one class per phase (``ph``, a tagged union). ``Event`` keeps the seven fields dpprof reads and leaves
``args`` as raw bytes, decoded only for the few events that need them (``dpprof.trace.collect.args_of``);
``Flow`` (a third of a Kineto trace's events) keeps its category alone; a chunk holding an event of no
phase the Trace Event Format has reads as ``OddEvent``s, whose ``ph`` is a field.

A guess that is wrong (a ``},{`` inside a string, or between objects nested in an event) cannot decode as
an array of objects: the chunk is decoded again up to an earlier boundary, before the byte where msgspec
stopped. What msgspec refuses (``NaN``, a lone surrogate, an entry that is not an object) and the last
event of ``traceEvents`` are decoded one event at a time by the standard library's C scanner, which also
words the errors. Fields dpprof never reads are skipped, not checked. Bytes that are not UTF-8 and control
characters inside strings (torch writes a ``with_stack`` call stack's bytes as they are) are read, not refused: a
string dpprof reads holds U+FFFD for each byte that is not UTF-8.

Speed, in CPU time on the 2-core build machine: decoding every field of every event with the standard
library's decoder (as this reader did until 2026-11) ran at 34-45 MiB/s of JSON, ijson's yajl2_c at a third
of that; this reader decodes and collects (``dpprof.trace.collect``) about 280 MiB/s (bench/trace_import.py).
"""
from __future__ import annotations

import codecs
import gzip
import json
import os
import queue
import re
import sys
import threading
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
import types
from dataclasses import dataclass
from typing import Any, ClassVar, Union

import msgspec

from dpprof.trace.numbers import shown

__all__ = ["TraceError", "TraceFile", "Event", "Flow", "OddEvent", "TRACE_SUFFIXES", "trace_suffix", "is_trace_name", "is_gzip_name", "CHUNK_BYTES",
           "MAX_VALUE_BYTES", "PHASES", "Span", "split_points"]

TRACE_SUFFIXES = (".json", ".json.gz")
CHUNK_BYTES = 1 << 20  # 1 MiB per read: large enough that per-read and per-batch costs vanish, small next to the import
READ_AHEAD_CHUNKS = 4  # chunks the reading thread may hold ahead of the decoder (bounded memory)
MAX_VALUE_BYTES = 64 << 20  # one event (or top-level field) larger than this is not a trace event: a broken file
# Event categories only Kineto writes: a JSON trace without any of them (and without Kineto's
# schemaVersion) is a Chrome trace from some other tool.
KINETO_CATEGORIES = frozenset({
    "cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver", "kernel", "gpu_memcpy",
    "gpu_memset", "gpu_user_annotation", "ac2g", "Operator", "Runtime", "Kernel", "Memcpy", "Memset",
    "Trace", "fwdbwd", "cpu_instant_event",
})
_SPACE = re.compile(rb"[ \t\n\r]*")
_SEPARATORS = re.compile(rb"[ \t\n\r,]*")  # between events
_BOUNDARY = re.compile(rb"}[ \t\n\r]*(?:,[ \t\n\r]*{|])")  # an event's end, then the next one or the list's, guessed
_AT_BYTE = re.compile(r"\(byte (\d+)\)$")  # where msgspec says it stopped
GUESSES = 4  # event boundaries tried in a chunk before its events are read one by one
# the stdlib's C scanner: (value, end), or StopIteration / JSONDecodeError. strict=False: a control character inside a
# string (torch writes a with_stack "Call stack" string's bytes as they are) is read as itself, as Kineto wrote it
_scan = json.JSONDecoder(strict=False).scan_once


class _Tagged(msgspec.Struct, gc=False, tag_field="ph"):
    """An event decoded by its phase (``ph``, msgspec's tagged union: one look at a field Kineto writes first)
    into a struct of the phase's class, which says its ``ph`` as a class attribute. ``gc=False``: millions are
    made and dropped, and none holds a cycle."""


class Event(_Tagged):
    """One trace event: the fields dpprof reads, any JSON type each (odd values are data, not errors); ``args``
    undecoded (``dpprof.trace.collect.args_of``). ``ph`` is its class's."""

    ph: ClassVar[str]
    cat: Any = None
    name: Any = None
    ts: Any = None
    dur: Any = None
    pid: Any = None
    tid: Any = None
    args: msgspec.Raw = msgspec.Raw()


class Flow(_Tagged):
    """A flow event (``s``, ``t``, ``f``: a third of a Kineto trace's events, the links from CPU ops to their
    kernels), of which dpprof reads nothing but the category (a Kineto one, for telling Kineto traces)."""

    ph: ClassVar[str]
    cat: Any = None


class OddEvent(msgspec.Struct, gc=False):
    """An event whose ``ph`` is missing or is none of the Trace Event Format's: the same fields, ``ph`` with them."""

    ph: Any = None
    cat: Any = None
    name: Any = None
    ts: Any = None
    dur: Any = None
    pid: Any = None
    tid: Any = None
    args: msgspec.Raw = msgspec.Raw()


# The Trace Event Format's phases: duration, complete, instant, counter, async, flow, sample, object, metadata,
# memory dump, mark, clock sync, context, linked id.
PHASES = ("B", "E", "X", "i", "I", "C", "b", "n", "e", "S", "T", "p", "F", "s", "t", "f", "P", "N", "O", "D", "M",
          "V", "v", "R", "c", "(", ")", "=")
FLOW_PHASES = frozenset({"s", "t", "f"})
_PHASE_CLASS: dict[str, type] = {
    ph: types.new_class(f"Event_{ord(ph)}", (Flow if ph in FLOW_PHASES else Event,), {"tag": ph},
                        lambda ns, ph=ph: ns.update({"ph": ph}))
    for ph in PHASES
}
_decode_events = msgspec.json.Decoder(list[Union[tuple(_PHASE_CLASS.values())]]).decode  # noqa: UP007
_decode_odd_events = msgspec.json.Decoder(list[OddEvent]).decode  # a chunk with an event of no known phase
_encode = msgspec.json.encode
_MSGSPEC_ERRORS = (msgspec.DecodeError, UnicodeDecodeError)  # ValidationError is a DecodeError


class TraceError(Exception):
    """A file that cannot be read as a torch.profiler trace; the message names the file and why."""


def trace_suffix(name: str) -> str | None:
    """The trace suffix ``name`` ends in, as written: .json or .json.gz in any case (trace.JSON too), else None."""
    for suffix in sorted(TRACE_SUFFIXES, key=len, reverse=True):
        if name.lower().endswith(suffix):
            return name[-len(suffix):]
    return None


def is_trace_name(name: str) -> bool:
    return trace_suffix(name) is not None


def is_gzip_name(name: str) -> bool:
    """A file dpprof reads or writes gzip'd: its name ends in .gz, in any case."""
    return name.lower().endswith(".gz")


class _Broken(Exception):
    def __init__(self, msg: str, at: int) -> None:
        super().__init__(msg)
        self.msg, self.at = msg, at


def _said(err: Exception) -> str:
    """What the stdlib's decoder says is wrong, to follow the byte it happened at: its message ends in " at" where
    it names a place ("Unterminated string starting at"), which is that byte here."""
    msg = getattr(err, "msg", "expecting a value")
    return f"{msg[:-3]} there" if msg.endswith(" at") else msg


@dataclass(frozen=True)
class Span:
    """A part of a plain JSON trace's events, read on its own (``TraceFile(path, span=...)``): bytes ``start`` to
    ``stop`` of the file, cut at event boundaries (``split_points``). The first part holds the top-level fields
    before ``traceEvents`` and the events up to ``stop``; a later one begins at an event, and the last reads the
    fields after ``traceEvents`` too."""

    start: int
    stop: int | None  # None: to the end of the file
    index: int  # the part's place among the file's parts: 0 is the first

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.stop is None


class _Chunks:
    """The file's bytes in chunks, read (and decompressed) by a thread ahead of the caller: zlib and file
    reads let go of the GIL, so on two cores decompression costs the decoder little. Errors are raised
    in the caller, at the chunk where they happened. With a ``span``, only its bytes."""

    def __init__(self, path: Path, progress: Callable[[int], None] | None, span: Span | None = None) -> None:
        self.progress = progress
        self._queue: queue.Queue = queue.Queue(maxsize=READ_AHEAD_CHUNKS)
        self._stop = threading.Event()
        raw = open(path, "rb")  # an OSError here is the caller's (cannot read)
        stream = gzip.GzipFile(fileobj=raw, mode="rb") if is_gzip_name(path.name) else raw
        self._left: int | None = None
        if span is not None:
            raw.seek(span.start)
            self._left = None if span.stop is None else span.stop - span.start
        self._thread = threading.Thread(target=self._read, args=(raw, stream), name=f"dpprof-read-{path.name}",
                                        daemon=True)
        self._thread.start()

    def _put(self, item: tuple[Any, int]) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _read(self, raw: Any, stream: Any) -> None:
        before = raw.tell()  # a span's start: its bytes alone are told
        try:
            with raw, stream:
                while True:
                    left = self._left
                    chunk = stream.read(CHUNK_BYTES if left is None else min(CHUNK_BYTES, left))
                    if left is not None:
                        self._left = left - len(chunk)
                    position = raw.tell()
                    if not self._put((chunk, position - before)) or not chunk:
                        return
                    before = position
        except BaseException as err:  # handed to the caller, raised there
            self._put((err, 0))

    def next(self) -> bytes:
        """The next chunk; b"" at the end of the file."""
        item, read = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        if self.progress is not None and read:
            self.progress(read)
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _json_kind(head: bytes) -> str | None:
    """What a JSON value beginning with the bytes ``head`` is ("a JSON number"), None where they begin none."""
    for literal in (b"true", b"false", b"null"):
        if head.startswith(literal):
            return f"a JSON {literal.decode()}"
    kinds = {b'"': "a JSON string", b"{": "a JSON object", b"[": "a JSON array"}
    first = head[:1]
    return kinds.get(first) or ("a JSON number" if first and first in b"-0123456789" else None)


def _not_an_object(head: bytes, gunzipped: bool = False) -> str:
    """Why a file beginning with the bytes ``head`` (once gunzipped, for a file named .gz) is no torch.profiler trace
    (a JSON object)."""
    if head[:1] == b"\x1f":
        if gunzipped:  # gzip's magic again inside the gzip data
            return "gzip data again inside its gzip data (compressed twice: gunzip it once)"
        return "gzip data in a file whose name does not end in .gz (name it .json.gz)"
    what = _json_kind(head)
    return f"{what}, not a torch.profiler trace (a JSON object)" if what else "not JSON (a torch.profiler trace is " \
        "a JSON object)"


class _Buffer:
    """The unread part of the file's bytes, with a cursor."""

    def __init__(self, chunks: _Chunks) -> None:
        self.chunks = chunks
        self.buf = b""
        self.pos = 0
        self.eof = False
        self.consumed = 0  # bytes dropped before buf (for error positions)

    def more(self, at_least: int = 1) -> bool:
        """Append at least ``at_least`` bytes more (dropping what was read); False at the end of the file."""
        if self.eof:
            return False
        parts = [self.buf[self.pos:]]
        got = 0
        while got < at_least:
            chunk = self.chunks.next()
            if not chunk:
                self.eof = True
                break
            parts.append(chunk)
            got += len(chunk)
        self.consumed += self.pos
        self.buf = b"".join(parts)
        self.pos = 0
        return True

    def peek(self) -> bytes:
        """The next byte that is not white space (b"" at the end of the file)."""
        while True:
            self.pos = _SPACE.match(self.buf, self.pos).end()
            if self.pos < len(self.buf) or not self.more():
                return self.buf[self.pos:self.pos + 1]

    def value(self) -> Any:
        """Decode the JSON value at the cursor with the stdlib's scanner, reading on until it is whole."""
        self.peek()
        while True:
            text, _ = codecs.utf_8_decode(self.buf[self.pos:], _BAD_BYTES, False)  # a character cut at the end waits
            try:
                value, end = _scan(text, 0)
            except (json.JSONDecodeError, StopIteration) as err:
                if self.eof or len(self.buf) - self.pos > MAX_VALUE_BYTES:
                    at = err.pos if isinstance(err, json.JSONDecodeError) else 0
                    raise _Broken(_said(err), self.consumed + self.pos + _nbytes(text[:at])) from None
                self.more(len(self.buf) - self.pos)  # twice as much each time: a large value is decoded a few times
                continue
            if text.isascii():
                self.pos += end
                return value
            self.pos += _nbytes(text[:end])
            return _valid(value)


# Bytes that are not UTF-8 (torch has written one inside a with_stack "Call stack" string) are read as lone surrogates,
# one per byte, and counted back as that byte: a field dpprof reads is seldom the one that holds them, and the others
# are skipped. A string holding one reads with it (sqlite3 stores it as written; dpprof.store)
_BAD_BYTES = "surrogateescape"


def _nbytes(text: str) -> int:
    """How many bytes of the file ``text`` was decoded from (a byte that is not UTF-8 counted as one)."""
    return len(text.encode("utf-8", _BAD_BYTES))


def _valid(value: Any) -> Any:
    """``value`` (decoded from text that may hold bytes that are not UTF-8) with each such byte in its strings as
    U+FFFD, the replacement character, as a UTF-8 decoder that replaces writes it: nothing downstream (SQLite, the
    terminal) takes a lone surrogate."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
            return value
        except UnicodeEncodeError:
            return value.encode("utf-8", _BAD_BYTES).decode("utf-8", "replace")
    if isinstance(value, list):
        return [_valid(v) for v in value]
    if isinstance(value, dict):
        return {_valid(k): _valid(v) for k, v in value.items()}
    return value


class TraceFile:
    """One trace file, read once: iterate ``events()`` (dicts) or ``batches()`` (lists of ``Event``), then
    ``meta`` holds its top-level fields.

    Args:
        path: a ``.json`` or ``.json.gz`` Kineto trace.
        progress: called with the number of bytes read from disk since the last call (a progress bar).

    Example:
        >>> trace = TraceFile("rank0.pt.trace.json.gz")
        >>> kernels = sum(1 for batch in trace.batches() for e in batch if e.cat == "kernel")
        >>> trace.meta.get("distributedInfo")
    """

    def __init__(self, path: str | os.PathLike[str], progress: Callable[[int], None] | None = None,
                 span: Span | None = None) -> None:
        self.path = Path(path)
        self.name = self.path.name
        self.size_bytes = self.path.stat().st_size
        self.progress = progress
        self.span = span  # a part of the file's events only (dpprof.trace.jobs reads a large file in parts)
        self.meta: dict[str, Any] = {}
        self.events_read = 0
        self.kineto_events = 0  # counted until the first is seen: all that is asked of it is whether there is one

    def _error(self, what: str) -> TraceError:
        return TraceError(f"{self.name}: {what}")

    def batches(self) -> Iterator[list[Event | Flow | OddEvent]]:
        """The entries of ``traceEvents`` as structs (``Event``, ``Flow``, ``OddEvent``: ``ph`` says which),
        in file order, a chunk's worth at a time; fills ``meta`` as it goes."""
        return self._read(_decode_structs, _event_of)

    def events(self) -> Iterator[dict[str, Any]]:
        """Every entry of ``traceEvents`` as a dict with all its fields, in file order; fills ``meta``."""
        for batch in self._read(_decode_dicts, lambda d: d):
            yield from batch

    def _read(self, decode: Callable[[bytes], list], from_dict: Callable[[dict], Any]) -> Iterator[list]:
        try:
            chunks = _Chunks(self.path, self.progress, self.span)
        except OSError as err:
            raise self._error(f"cannot read: {err.strerror or err}") from None
        try:
            yield from self._walk(_Buffer(chunks), decode, from_dict)
        except gzip.BadGzipFile as err:  # an OSError: before that branch
            if str(err).startswith("Not a gzipped file"):
                raise self._error("not gzip data, though its name ends in .gz (name it .json)") from None
            raise self._error(f"truncated or corrupt gzip ({err})") from None
        except OSError as err:
            raise self._error(f"cannot read: {err.strerror or err}") from None
        except (EOFError, zlib.error) as err:
            raise self._error(f"truncated or corrupt gzip ({err})") from None
        except UnicodeDecodeError:
            raise self._error("not JSON (not UTF-8 text)") from None
        except RecursionError:  # msgspec's and the stdlib's decoders stop at about 1,000 levels of arrays/objects
            after = f" after {self.events_read:,} events" if self.events_read else ""
            raise self._error(f"JSON nested deeper than {sys.getrecursionlimit():,} levels{after}: no trace "
                              "nests so deep") from None
        except _Broken as err:
            if self.events_read:
                raise self._error(f"truncated or corrupt JSON after {self.events_read:,} events (byte {err.at:,}: "
                                  f"{err.msg})") from None
            raise self._error(f"not JSON (byte {err.at:,}: {err.msg})") from None
        finally:
            chunks.close()
        if not self.events_read:
            if "traceEvents" not in self.meta and isinstance(self.meta.get("nodes"), list) and "schema" in self.meta:
                raise self._error(f"an execution trace (torch.profiler.ExecutionTraceObserver's nodes, schema "
                                  f"{shown(self.meta['schema'])}), not a torch.profiler trace: import the file the "
                                  "profiler wrote (tensorboard_trace_handler's or export_chrome_trace's)")
            raise self._error("no events (traceEvents is empty or missing)")
        if self.span is not None and not self.span.first:
            return  # what the file is, is the first part's to say: its header holds schemaVersion
        if not self.kineto_events and "schemaVersion" not in self.meta:
            raise self._error("a Chrome trace from another tool, not a torch.profiler trace (no Kineto "
                              "event categories, no schemaVersion)")

    def _walk(self, text: _Buffer, decode: Callable[[bytes], list], from_dict: Callable[[dict], Any]) -> Iterator[list]:
        if self.span is not None and not self.span.first:  # a later part begins inside traceEvents, at an event
            yield from self._events(text, decode, from_dict)
            if not self.span.last:
                return
            yield from self._fields(text, decode, from_dict)
            self._end(text)
            return
        first = text.peek()
        if first == b"\xef" and text.buf[text.pos:text.pos + 3] == b"\xef\xbb\xbf":  # a UTF-8 byte order mark
            text.pos += 3
            first = text.peek()
        if first == b"[":
            raise self._error("a JSON array of events (a Chrome trace from another tool), not a torch.profiler trace")
        if first != b"{":
            raise self._error("empty file" if first == b"" else _not_an_object(text.buf[text.pos:text.pos + 8],
                                                                                 is_gzip_name(self.name)))
        text.pos += 1
        yield from self._fields(text, decode, from_dict)
        if self.span is None or self.span.last:  # else the part ended inside traceEvents
            self._end(text)

    def _end(self, text: _Buffer) -> None:
        """After the top-level object's closing brace only white space may follow, as ``json.load`` requires (two
        traces joined into one file would read as the first alone)."""
        text.pos += 1
        if text.peek():
            raise self._error(f"more after the trace's end (byte {text.consumed + text.pos:,}): not one JSON "
                              "document (two traces joined into one file?)")

    def _fields(self, text: _Buffer, decode: Callable[[bytes], list],
                from_dict: Callable[[dict], Any]) -> Iterator[list]:
        """The top-level object's fields from the cursor to its closing brace; ``traceEvents``' events in batches."""
        while True:
            c = text.peek()
            if c == b"}":
                return
            if c == b",":
                text.pos += 1
                continue
            key = text.value()
            if not isinstance(key, str) or text.peek() != b":":
                raise _Broken("expecting a field name and ':'", text.consumed + text.pos)
            text.pos += 1
            if key == "traceEvents" and text.peek() == b"[":
                text.pos += 1
                yield from self._events(text, decode, from_dict)
                if self.span is not None and not self.span.last:  # the part ends inside traceEvents
                    return
            elif key == "traceEvents" and text.peek() not in (b"n", b""):  # an object, a number: not the events' array
                raise self._error(f"traceEvents is {_json_kind(text.buf[text.pos:text.pos + 8]) or 'not JSON'}, not an "
                                  "array of events")
            else:
                self.meta[key] = text.value()

    def _counted(self, batch: list, cat: Callable[[Any], Any]) -> list:
        self.events_read += len(batch)
        if not self.kineto_events:
            kineto = KINETO_CATEGORIES
            self.kineto_events = sum(1 for e in batch if cat(e) in kineto)
        return batch

    def _events(self, text: _Buffer, decode: Callable[[bytes], list], from_dict: Callable[[dict], Any]) -> Iterator[list]:
        """The events of traceEvents: a chunk's worth per msgspec call, one by one where that cannot be."""
        skip = _SEPARATORS.match
        cat = _cat_of
        while True:
            buf = text.buf
            pos = text.pos = skip(buf, text.pos).end()
            if pos >= len(buf):
                if not text.more():
                    if self.span is not None and not self.span.last:  # the part's end: an event boundary
                        return
                    raise _Broken("the file ends inside traceEvents", text.consumed + pos)
                continue
            if buf[pos] == 0x5D:  # "]"
                if self.span is not None and not self.span.last:  # cut inside traceEvents, so it cannot end here
                    raise _Broken("traceEvents ends inside a part of the file", text.consumed + pos)
                text.pos = pos + 1
                return
            cut = _last_boundary(buf, pos, len(buf))
            if cut is None and text.eof and self.span is not None and not self.span.last:
                # a part's bytes end with its last event's closing brace (split_points): decoded as the others are
                end = len(buf.rstrip())
                cut = end if end > pos and buf[end - 1] == 0x7D else None
            if cut is None and not text.eof:  # the buffer ends inside its first event: read on
                text.more(len(buf) - pos)
                continue
            batch, end = _in_one_call(buf, pos, cut, decode)
            if batch is not None:
                text.pos = end
                yield self._counted(batch, cat)
            else:
                yield self._counted(self._one_by_one(text, end, from_dict), cat)

    def _one_by_one(self, text: _Buffer, until: int | None, from_dict: Callable[[dict], Any]) -> list:
        """The events from the cursor up to byte ``until`` (None: one event), by the stdlib's C scanner, which
        reads what msgspec refuses (NaN, lone surrogates) and says what is wrong where neither can read."""
        window = max(1 << 16, 0 if until is None else until - text.pos)
        while True:
            buf, pos = text.buf, text.pos
            stop = pos + 1 if until is None else until
            end_window = min(len(buf), pos + window)
            whole = end_window == len(buf)
            chunk, _ = codecs.utf_8_decode(buf[pos:end_window], _BAD_BYTES, False)  # a character cut at the end waits
            ascii_only = chunk.isascii()
            out: list = []
            at = done_chars = done = 0  # characters scanned; of them, those whose bytes are counted in done
            while True:
                at = _SEPARATORS_STR.match(chunk, at).end()
                if out and (pos + done >= stop or at >= len(chunk) or chunk[at] == "]"):
                    text.pos = pos + done
                    return out
                try:
                    event, end = _scan(chunk, at)
                except (json.JSONDecodeError, StopIteration) as err:
                    if out:  # what was read is handed on; the rest is tried again from there
                        text.pos = pos + done
                        return out
                    if not whole:  # perhaps only the window's end: a wider one
                        window *= 2
                        break
                    if text.eof or len(buf) - pos > MAX_VALUE_BYTES:
                        at_char = err.pos if isinstance(err, json.JSONDecodeError) else at
                        raise _Broken(_said(err), text.consumed + pos + _nbytes(chunk[:at_char])) from None
                    text.more(len(buf) - pos)  # the event runs past the buffer: read on and decode it again
                    window = max(window, len(text.buf) - text.pos)
                    break
                if not isinstance(event, dict):
                    raise self._error("traceEvents holds something other than event objects")
                out.append(from_dict(event if ascii_only else _valid(event)))
                done += _nbytes(chunk[done_chars:end])
                at = done_chars = end


_SEPARATORS_STR = re.compile(r"[ \t\n\r,]*")


# Where a plain JSON trace may be cut into parts read on their own: an event's closing brace, a comma and a new line
# before the next event's opening brace. A JSON string holds no raw new line, so no such place is inside one.
_PART_BOUNDARY = re.compile(rb"}[ \t\r]*,[ \t\r]*\n[ \t\r\n]*{")
_PART_WINDOW = 1 << 20  # bytes looked at around each cut for a boundary
_decode_any = msgspec.json.Decoder().decode


def split_points(path: str | os.PathLike[str], parts: int) -> list[Span]:
    """Cut a plain JSON trace into ``parts`` spans of about equal size at event boundaries inside ``traceEvents``,
    each checked by decoding the events after it (an array of objects that each have a ``ph``); fewer where no
    checked boundary is found near a cut (a gzipped file, or a small one, is one span: the whole file)."""
    path = Path(path)
    size = path.stat().st_size
    if parts < 2 or is_gzip_name(path.name):
        return [Span(0, None, 0)]
    cuts: list[int] = []
    with open(path, "rb") as f:
        for k in range(1, parts):
            at = size * k // parts
            if cuts and at <= cuts[-1]:
                continue
            f.seek(at)
            window = f.read(_PART_WINDOW)
            cut = _checked_boundary(window)
            if cut is not None and (not cuts or at + cut > cuts[-1]):
                cuts.append(at + cut)
    bounds = [0, *cuts]
    return [Span(lo, hi, i) for i, (lo, hi) in enumerate(zip(bounds, [*cuts, None]))]


def _checked_boundary(window: bytes) -> int | None:
    """The offset in ``window`` just past the first event boundary whose following events decode as event objects
    (up to the window's last boundary), None where there is none."""
    found = _PART_BOUNDARY.search(window)
    while found is not None:
        cut = found.start() + 1  # just past the closing brace: the part before ends with an event
        begin = found.end() - 1  # the next event's opening brace
        last = _last_boundary(window, begin, len(window))
        if last is not None and last > begin:
            try:
                events = _decode_any(b"".join((b"[", window[begin:last], b"]")))
            except (msgspec.DecodeError, RecursionError):
                events = None
            if events and all(type(e) is dict and "ph" in e for e in events):
                return cut
        found = _PART_BOUNDARY.search(window, found.end())
    return None


def _in_one_call(buf: bytes, pos: int, cut: int | None, decode: Callable[[bytes], list]) -> tuple[list | None, int | None]:
    """(the events of buf[pos:cut], cut), decoded in one msgspec call; where that fails, from an earlier boundary:
    before the byte where msgspec stopped, or where it does not say (a string cut open, a lone surrogate) the
    boundary before, ``GUESSES`` tries in all. Else (None, how far to read one by one; None: one event)."""
    until = cut
    for _ in range(GUESSES):
        if cut is None:
            break
        try:
            return decode(b"".join((b"[", memoryview(buf)[pos:cut], b"]"))), cut  # one copy of the chunk
        except _MSGSPEC_ERRORS as err:
            at = _error_byte(err)
            if at is not None:
                at += pos - 1  # in buf: the decoded bytes begin with the "[" put before buf[pos]
            until = cut if at is None else at + 1
            cut = _last_boundary(buf, pos, cut - 1 if at is None else at)
    return None, until


def _last_boundary(buf: bytes, pos: int, end: int) -> int | None:
    """The end of the last whole event in buf[pos:end], as guessed from the bytes (a ``}``, then ``,`` and ``{``
    or the ``]`` that ends traceEvents; decoding checks the guess); None if there is none."""
    k = end
    while (k := buf.rfind(b"}", pos, k)) >= 0:
        if _BOUNDARY.match(buf, k):
            return k + 1
    return None


def _error_byte(err: Exception) -> int | None:
    """The byte of msgspec's input where it found the JSON malformed, if it says."""
    m = _AT_BYTE.search(str(err)) if type(err) is msgspec.DecodeError else None
    return int(m.group(1)) if m else None


def _cat_of(e: Any) -> str | None:
    """An event's category where it is a string (a list or an object there is no category: and no set holds it)."""
    cat = e.get("cat") if type(e) is dict else e.cat
    return cat if type(cat) is str else None


def _decode_structs(data: bytes) -> list[Event | Flow | OddEvent]:
    """A chunk's events by their phase; with an event of no known phase among them, all as ``OddEvent``."""
    try:
        return _decode_events(data)
    except msgspec.ValidationError:
        return _decode_odd_events(data)


def _event_of(d: dict[str, Any]) -> Event | Flow | OddEvent:
    """An event the stdlib decoded, as the struct msgspec would have made."""
    ph = d.get("ph")
    cls = _PHASE_CLASS.get(ph) if isinstance(ph, str) else None
    if cls is not None and issubclass(cls, Flow):
        return cls(cat=d.get("cat"))
    fields = {"cat": d.get("cat"), "name": d.get("name"), "ts": d.get("ts"), "dur": d.get("dur"), "pid": d.get("pid"),
              "tid": d.get("tid"), "args": msgspec.Raw(_encode_lenient(d["args"])) if "args" in d else msgspec.Raw()}
    return cls(**fields) if cls is not None else OddEvent(ph=ph, **fields)


def _encode_lenient(value: Any) -> bytes:
    try:
        return _encode(value)
    except Exception:  # a lone surrogate, say: what msgspec could not decode, it cannot encode; args unread
        return b""


def _decode_dicts(data: bytes) -> list[dict[str, Any]]:
    """A batch as dicts (``TraceFile.events``); an entry that is not an object sends it to the stdlib path."""
    batch = msgspec.json.decode(data)
    if not all(type(e) is dict for e in batch):
        raise msgspec.DecodeError("an entry that is not an object")
    return batch
