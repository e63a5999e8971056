r"""Strings from users and files (run names, trace file names, job, event, device and host names, error messages)
as plain text inside markup: Streamlit's markdown and plotly's subset of HTML.

A run named ``beacon ![t](http://198.51.100.7/p.png)`` must show those characters, not fetch that image; one
named ``**x** [y](javascript:...)`` must show the asterisks, not bold text and a link. The dashboard passes every
such string through ``markdown_text`` (or ``markdown_code``) before it is part of a title, caption, message or
label, and dpprof.charts passes them through ``plotly_text`` before they are part of a figure.

Example:
    >>> markdown_text("a_b*c [y](z)")
    'a\\_b\\*c \\[y\\]\u2060\\(z\\)'
    >>> shown_text(markdown_text("**x** ![t](http://198.51.100.7/p.png)"))
    '**x** ![t](http://198.51.100.7/p.png)'
    >>> plotly_text("<a href='x'>y</a>")
    "&lt;a href='x'&gt;y&lt;/a&gt;"
"""
from __future__ import annotations

import re
import string
import unicodedata

__all__ = ["JOINER", "capitalized", "error_line", "markdown_code", "markdown_text", "markdown_words", "one_line", "plotly_text",
           "shown_text"]

# CommonMark lets a backslash escape every ASCII punctuation character, and an escaped one is always literal text:
# no emphasis, link, image, code, HTML, entity, heading or list marker. Escaping all of them (not only those
# CommonMark uses) also covers what Streamlit adds on top: ``$`` (LaTeX), ``:`` (``:red[...]`` colours,
# ``:material/...:`` icons, emoji short codes), ``~`` (strikethrough) and ``|`` (tables).
_ESCAPED = frozenset(string.punctuation)
# GitHub-flavoured markdown's bare links (``www.x.org``, ``http://...``, ``a@b.org``) are found in the text after its
# escapes are read (remark-gfm), and so are Streamlit's typographic symbols (``<=`` becomes ≤, ``--`` a dash): a
# WORD JOINER (invisible, zero width) after ``@``, between two punctuation characters and between ``www`` and its
# dot breaks each pattern without a visible change.
JOINER = "\u2060"
_WWW_DOT = re.compile(r"(?<=www)(?=\.)", re.IGNORECASE)
# Control characters (newlines included) would end a paragraph or start a block: each becomes one space.
_BLOCK_BREAKS = frozenset("\u2028\u2029\x85")


def _control(ch: str) -> bool:
    return ch in _BLOCK_BREAKS or unicodedata.category(ch) == "Cc"


def capitalized(text: str) -> str:
    """``text`` with its first letter upper case and the rest as it is ("FSDP's" stays; str.capitalize lowers it)."""
    return text[:1].upper() + text[1:]


def one_line(value: object) -> str:
    """``value`` as text on one line: each control character (newline, tab, CR, ...) a space, ends trimmed."""
    text = "" if value is None else str(value)
    return "".join(" " if _control(ch) else ch for ch in text).strip()


def markdown_text(value: object) -> str:
    """``value`` as Streamlit markdown that shows exactly its characters: every ASCII punctuation character
    backslash-escaped, on one line (``one_line``: leading spaces would start a code block, newlines a new block),
    bare links and typographic symbols broken by an invisible JOINER.

    Args:
        value: any object; None is the empty string.

    Returns:
        Markdown source whose rendering is the text itself, safe to interpolate into a markdown template.
    """
    return _escaped(one_line(value))


def _escaped(text: str) -> str:
    text = _WWW_DOT.sub(JOINER, text)
    out = []
    for ch, after in zip(text, text[1:] + " "):
        if ch in _ESCAPED:
            out.append("\\" + ch + (JOINER if ch == "@" or after in _ESCAPED else ""))
        else:
            out.append(ch)
    return "".join(out)


def markdown_code(value: object) -> str:
    """``value`` as an inline code span (monospace, shown literally): fenced by more backticks than any run of
    backticks in it, so that nothing in it can close the span."""
    text = one_line(value)
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    if not text:
        return "` `"
    pad = " " if text.startswith("`") or text.endswith("`") else ""  # CommonMark strips one space each side
    return f"{fence}{pad}{text}{pad}{fence}"


def markdown_words(value: object) -> str:
    """dpprof's own sentences, whose commands are in backticks ("`dpprof advise RUN --calibrate` measures..."),
    as markdown: each backticked part a code span (markdown_code), the rest plain text (markdown_text). Whatever
    names the sentence holds, nothing in it becomes markup: a stray backtick only moves where code starts."""
    parts = one_line(value).split("`")
    if len(parts) % 2 == 0:  # an odd number of backticks: no pairs to trust
        return markdown_text(value)
    return "".join(markdown_code(p) if i % 2 else _escaped(p) for i, p in enumerate(parts))


def shown_text(source: str) -> str:
    """The characters markdown_text's output shows (its backslashes and joiners gone): what a reader sees, for
    checks on the markdown source a page sends (Streamlit's AppTest)."""
    return re.sub(r"\\(.)", r"\1", source).replace(JOINER, "")


def plotly_text(value: object) -> str:
    """``value`` as text in a plotly figure (titles, legend entries, tick labels, hover text), where ``<b>``,
    ``<a href>`` and ``<br>`` are markup and entities are decoded: ``& < >`` as entities, on one line."""
    return one_line(value).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def error_line(err: BaseException) -> str:
    """An exception in one line: its type and message's first line, and its last where it has several (torch's
    "Caught X in replica i on device d." ends with the replica's own error)."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()] or [""]
    said = lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}"
    return f"{type(err).__name__}: {said}"
