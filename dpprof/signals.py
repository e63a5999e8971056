"""SIGTERM and SIGHUP while recording: the run is flushed and marked interrupted, then the signal does
what it would have done without dpprof. While the run closes, those and Ctrl-C wait for the close to finish.

A job scheduler (and ``kill``) ends a job with SIGTERM, a closed terminal with SIGHUP. Without a
handler of the program's own, either ends the process at once and the run would read as
incomplete; with dpprof recording, the signal becomes :class:`Interrupted`, which unwinds the
training loop like Ctrl-C does; ``dpprof.record`` closes the run and then raises the same signal
again with its default action, so the process still ends by that signal (exit status 128+N
in a shell, what a scheduler expects). A handler the program installed is called after the run
is flushed, and decides what happens next; a signal the program ignores stays ignored.
"""
from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any, Callable

__all__ = ["Interrupted", "SignalGuard", "HANDLED_SIGNALS", "signal_name"]

HANDLED_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Interrupted(BaseException):
    """A SIGTERM or SIGHUP that would have ended the process, raised in the main thread while recording.

    A BaseException, like KeyboardInterrupt, so that ``except Exception`` in a training loop lets it by.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal_name(signum))
        self.signum = signum


class SignalGuard:
    """Handlers for HANDLED_SIGNALS over one recording; installed only from the main thread (the only
    one Python runs signal handlers in), a no-op elsewhere.

    Installed and held (``install().hold()``) before the run's file is made, and released once the run is whole
    (``release``), so that a signal in between waits for the run to start and then closes it, rather than ending the
    process with a run file left 'running'.

    Args:
        on_chain: called with the signal number before a handler the program installed is called
            (the run flushes and marks itself interrupted there, in case that handler ends the process); None: set
            ``on_chain`` once the run exists, before ``release``.
    """

    def __init__(self, on_chain: Callable[[int], None] | None = None) -> None:
        self.on_chain = on_chain
        self._previous: dict[int, Any] = {}
        self.received: int | None = None  # the first handled signal that arrived
        self.closing = False  # the run is closing: a signal now waits for the close to finish
        self.pending: int | None = None
        self._interrupt: Any = None  # SIGINT's handler while the close holds it (hold), else None
        self.held_interrupt = False  # a Ctrl-C came while the run closed

    def install(self) -> SignalGuard:
        if threading.current_thread() is not threading.main_thread():
            return self
        for signum in HANDLED_SIGNALS:
            previous = signal.getsignal(signum)
            if previous is None:  # installed outside Python: leave it alone
                continue
            self._previous[signum] = previous
            signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous.get(signum, signal.SIG_DFL)
        if previous == signal.SIG_IGN:
            return
        if self.received is None:
            self.received = signum
        if self.closing:
            self.pending = signum
            return
        if callable(previous):
            if self.on_chain is not None:
                self.on_chain(signum)
            previous(signum, frame)
            return
        raise Interrupted(signum)

    def hold(self) -> None:
        """The run closes: a handled signal, and Ctrl-C (SIGINT), now waits for the close to finish (restore, then
        deliver or deliver_interrupt), so that storing the last steps and a capture is never cut short."""
        self.closing = True
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGINT)
        if callable(previous):  # Python's KeyboardInterrupt or the program's own; an ignored one stays ignored
            self._interrupt = previous
            signal.signal(signal.SIGINT, self._hold_interrupt)

    def _hold_interrupt(self, signum: int, frame: FrameType | None) -> None:
        self.held_interrupt = True

    def release(self) -> None:
        """The run has started (after ``install().hold()``): signals act again, and one that came while it started
        acts now, where the run can be closed: Interrupted, the program's handler (after on_chain), or Ctrl-C's
        KeyboardInterrupt."""
        self.closing = False
        interrupt, self._interrupt = self._interrupt, None
        if interrupt is not None and signal.getsignal(signal.SIGINT) == self._hold_interrupt:
            signal.signal(signal.SIGINT, interrupt)
        pending, self.pending = self.pending, None
        if pending is not None:
            self._handle(pending, None)
        if self.held_interrupt and interrupt is not None:
            self.held_interrupt = False
            interrupt(signal.SIGINT, None)

    def restore(self) -> None:
        """Put back the handlers that were there before (unless the program has replaced ours since)."""
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, previous)
        if self._interrupt is not None and signal.getsignal(signal.SIGINT) == self._hold_interrupt:
            signal.signal(signal.SIGINT, self._interrupt)

    def deliver_interrupt(self) -> None:
        """After restore(): a Ctrl-C held while the run closed does now what it would have done (KeyboardInterrupt,
        or the program's handler)."""
        if self.held_interrupt and self._interrupt is not None:
            self.held_interrupt = False
            self._interrupt(signal.SIGINT, None)

    def deliver(self, signum: int, only_default: bool = False) -> None:
        """After restore(): what the signal would have done without dpprof (end the process by it, or
        call the program's handler, unless ``only_default``). Returns if the process survives it."""
        previous = self._previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            if not only_default:
                previous(signum, None)
        elif previous != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
