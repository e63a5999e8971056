"""dpprof.trace.decode: events decoded a chunk at a time read exactly as json.load reads them, whatever the
layout, and where a guessed event boundary is wrong, msgspec refuses a value, an event spans chunks, or the
file is broken."""
from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import pytest

from dpprof.trace.decode import CHUNK_BYTES, Flow, OddEvent, TraceError, TraceFile

EVENTS = 30_000  # about 4 MB: several of the reader's 1 MiB chunks


def _event(i: int, **fields) -> dict:
    return {"ph": "X", "cat": "cpu_op", "name": f"aten::op{i}", "pid": 1, "tid": 2, "ts": 1000 + i, "dur": 1.5,
            "args": {"External id": i}, **fields}


CASES = {
    "plain": lambda: [_event(i) for i in range(EVENTS)],
    # "}, {" inside an event (objects in a list in args, args first): a boundary guessed there cannot decode
    "objects in lists in args": lambda: [{"args": {"a": {"b": 1}, "c": [{"x": 1}, {"y": 2}]}, **_event(i)}
                                         for i in range(EVENTS)],
    # and inside strings
    "braces in names": lambda: [_event(i, name=f'x}}, {{"ph": "Q"}} ]\u00e9 {i}') for i in range(EVENTS)],
    "non-ASCII names": lambda: [_event(i, name="ünïcødé ☃ " * 3) for i in range(EVENTS)],
    # what msgspec refuses and the stdlib reads: NaN, a lone surrogate
    "NaN": lambda: [_event(i, dur=float("nan") if i % 1000 == 0 else 1.5) for i in range(EVENTS)],
    "lone surrogate": lambda: [_event(i, name="\ud800" if i % 7000 == 0 else "n") for i in range(EVENTS)],
    # events longer than a chunk, first and last
    "events larger than a chunk": lambda: [_event(0, args={"big": "y" * (3 * CHUNK_BYTES)}),
                                           *(_event(i) for i in range(1, EVENTS)),
                                           _event(EVENTS, args={"big": list(range(400_000))})],
    # flows keep only their category; a phase the Trace Event Format does not have, or none, reads its chunk
    # without the dispatch on phases
    "flows and odd phases": lambda: [_event(i, ph={0: "s", 1: "f", 2: "X", 3: "i", 4: "M"}[i % 5]
                                            if i % 9000 else ("Z" if i % 2 else None)) for i in range(EVENTS)],
    "odd field types": lambda: [_event(i, ts="soon" if i % 5000 == 0 else i, name=i if i % 3000 == 0 else "n",
                                       args=["not", "a", "dict"] if i % 4000 == 0 else {"a": 1})
                                for i in range(EVENTS)],
}
LAYOUTS = {"compact": {"separators": (",", ":")}, "indented": {"indent": 2}, "spaced": {}}


def _write(path: Path, events: list, layout: str, ascii_only: bool) -> dict:
    doc = {"schemaVersion": 1, "traceEvents": events, "distributedInfo": {"rank": 0, "world_size": 2}}
    path.write_bytes(json.dumps(doc, ensure_ascii=ascii_only, **LAYOUTS[layout]).encode("utf-8", "surrogatepass"))
    return doc


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES)
def test_batches_and_events_read_as_json_load_does(case, layout, tmp_path):
    events = CASES[case]()
    path = tmp_path / "trace.json"
    doc = _write(path, events, layout, ascii_only=(layout == "compact" or case == "lone surrogate"))
    trace = TraceFile(path)
    got = [e for batch in trace.batches() for e in batch]
    assert len(got) == len(events) == trace.events_read
    odd = [e for e, want in zip(got, events) if want["ph"] not in ("X", "i", "M", "s", "f")]
    assert all(isinstance(e, OddEvent) for e in odd)  # and the other events of their chunks too
    assert sum(isinstance(e, OddEvent) for e in got) <= len(odd) * 2 * CHUNK_BYTES / (len(path.read_bytes()) / EVENTS)
    for e, want in zip(got, events):
        if isinstance(e, Flow):
            assert (e.ph, e.cat) == (want["ph"], want["cat"])
            continue
        assert (e.ph, e.cat, e.name, e.ts, e.pid, e.tid) == tuple(want[k] for k in ("ph", "cat", "name", "ts", "pid",
                                                                                      "tid"))
        if case not in ("NaN", "lone surrogate"):  # their args are what msgspec cannot decode, and not read
            assert e.dur == want["dur"] and msgspec.json.decode(e.args) == want["args"]
    assert trace.meta == {k: v for k, v in doc.items() if k != "traceEvents"}
    dicts = list(TraceFile(path).events())
    assert json.dumps(dicts) == json.dumps(events)


def test_an_entry_that_is_not_an_event_object_is_refused(tmp_path):
    path = tmp_path / "odd.json"
    _write(path, [_event(0), 5, _event(1)], "compact", True)
    with pytest.raises(TraceError, match="odd.json: traceEvents holds something other than event objects"):
        list(TraceFile(path).batches())


@pytest.mark.parametrize("cut, expected", [
    (0.5, r"truncated or corrupt JSON after [\d,]+ events \(byte [\d,]+: "),
    (-3, r"truncated or corrupt JSON after 30,000 events"),
    (100, r"not JSON \(byte 9\d: Unterminated string"),
])
def test_a_truncated_file_says_where(cut, expected, tmp_path):
    whole = tmp_path / "whole.json"
    _write(whole, CASES["plain"](), "indented", True)
    raw = whole.read_bytes()
    path = tmp_path / "cut.json"
    path.write_bytes(raw[:int(len(raw) * cut)] if isinstance(cut, float) else raw[:cut])
    with pytest.raises(TraceError, match=f"^cut.json: {expected}"):
        list(TraceFile(path).batches())


def test_bytes_that_are_not_utf8_and_control_characters_in_strings_are_read_and_binary_is_not_json(tmp_path):
    """torch writes a with_stack "Call stack" string's bytes as they are: one that is not UTF-8, or a control
    character, in a string (a name dpprof reads, or args it skips, or before a top-level field) is read, the bad byte as
    U+FFFD; the file was refused whole as "not UTF-8 text". A file of binary is still not JSON."""
    whole = tmp_path / "whole.json"
    events = CASES["plain"]()
    _write(whole, events, "compact", True)
    expected = [e["name"] for e in events]
    path = tmp_path / "binary.json"
    raw = whole.read_bytes().replace(b'"aten::op15000"', b'"aten::op\xff\xfe15000"')
    raw = raw.replace(b'"aten::op20000"', b'"aten::op\x16\x7f20000"')
    raw = raw.replace(b'"traceEvents"', b'"note": "\xa0~\xe5\xf2", "traceEvents"', 1)
    path.write_bytes(raw)
    trace = TraceFile(path)
    names = [e.name for batch in trace.batches() for e in batch]
    expected[15000], expected[20000] = "aten::op\ufffd\ufffd15000", "aten::op\x16\x7f20000"
    assert names == expected
    assert trace.meta["note"] == "\ufffd~\ufffd\ufffd"
    path.write_bytes(bytes(range(256)) * 10_000)
    with pytest.raises(TraceError, match=r"^binary.json: not JSON"):
        list(TraceFile(path).batches())


def test_a_reader_left_early_stops_its_reading_thread(tmp_path):
    import threading

    path = tmp_path / "trace.json"
    _write(path, [_event(i) for i in range(100_000)], "compact", True)  # more chunks than the thread reads ahead
    before = threading.active_count()
    batches = TraceFile(path).batches()
    next(batches)
    assert threading.active_count() == before + 1
    batches.close()
    assert threading.active_count() == before


def test_a_file_that_is_no_trace_says_what_it_is_and_a_byte_order_mark_is_read_past(tmp_path):
    import gzip

    whole = tmp_path / "whole.json"
    _write(whole, CASES["plain"](), "compact", True)
    text = whole.read_bytes()
    cases = {"scalar.json": (b"42", "a JSON number, not a torch.profiler trace"),
             "string.json": (b'"trace"', "a JSON string, not a torch.profiler trace"),
             "gzip.json": (gzip.compress(text), "gzip data in a file whose name does not end in .gz (name it .json.gz)"),
             "plain.json.gz": (text, "not gzip data, though its name ends in .gz (name it .json)"),
             "object.json": (b'{"traceEvents": {"0": {}}}', "traceEvents is a JSON object, not an array of events")}
    for name, (data, said) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(TraceError, match=f"^{re.escape(name)}: {re.escape(said)}"):
            list(TraceFile(tmp_path / name).batches())
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + text)  # written by an editor that marks UTF-8
    assert sum(len(b) for b in TraceFile(tmp_path / "bom.json").batches()) == \
        sum(len(b) for b in TraceFile(whole).batches())


def test_anything_after_the_trace_s_end_is_refused_as_json_load_does(tmp_path):
    """Two traces joined into one file (``cat a.json b.json``, or two gzip members) read as the first alone, its
    second trace's events silently lost; ``json.load`` refuses them. White space after the end is read past."""
    import gzip

    whole = tmp_path / "whole.json"
    _write(whole, CASES["plain"](), "indented", True)
    text = whole.read_bytes()
    cases = {"joined.json": text + text, "joined.json.gz": gzip.compress(text) + gzip.compress(text),
             "tail.json": text + b"\n}garbage"}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(json.JSONDecodeError, match="Extra data"):
            json.loads(gzip.decompress(data) if name.endswith(".gz") else data)
        at = len(text) + len(data[len(text):]) - len(data[len(text):].lstrip()) if name.endswith(".json") else len(text)
        said = f"more after the trace's end (byte {at:,}"  # the first byte that is not white space
        with pytest.raises(TraceError, match=f"^{re.escape(name)}: {re.escape(said)}"):
            list(TraceFile(tmp_path / name).batches())
    (tmp_path / "spaced.json").write_bytes(text + b" \n\t\r\n")
    assert sum(len(b) for b in TraceFile(tmp_path / "spaced.json").batches()) == \
        sum(len(b) for b in TraceFile(whole).batches())
