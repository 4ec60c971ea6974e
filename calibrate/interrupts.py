"""Ctrl-C during a calibration, raised again at the next benchmark if Python dropped it.

Python raises KeyboardInterrupt wherever the main thread is when SIGINT lands. If that is inside a
finalizer (a __del__ or a weakref callback, which the garbage collector runs at arbitrary points,
torch's included), the exception is printed as "Exception ignored in ..." and dropped, and the
run would go on for minutes. While `kept()` is active the signal is also recorded, and `check()`,
which the progress display calls before every benchmark, raises it again.
"""
from __future__ import annotations

import contextlib
import signal
import threading

_pending: list[int] = []


def _record_and_raise(signum, frame):
    _pending.append(signum)
    signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt


@contextlib.contextmanager
def kept():
    """Record SIGINT while inside, where Python's own handler is installed (the main thread of a
    process that did not change it)."""
    installed = (threading.current_thread() is threading.main_thread()
                 and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    if installed:
        signal.signal(signal.SIGINT, _record_and_raise)
    _pending.clear()
    try:
        yield
    finally:
        _pending.clear()
        if installed:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def check() -> None:
    """Raise the KeyboardInterrupt of a SIGINT received inside kept(), if any."""
    if _pending:
        raise KeyboardInterrupt
