"""The default search storage: an Optuna journal file with an flock lock.

Optuna's JournalFileBackend locks with a symlink (or an O_EXCL file) that a killed process leaves
behind: the next writer then waits out a 30 s grace period. `flock` locks die with their process,
so a search killed with kill -9 can be resumed at once. The file format is Optuna's own journal
(one JSON operation a line), so Optuna tools read it as usual.

`durable=False` skips the fsync after each append: a write() has reached the kernel when it
returns, so killing the process loses nothing, and only an OS crash or power cut could lose the
last trials written before it. It is the default for the planner's own journal because the fsync
costs about as much as a small simulation (16 appends a trial); pass durable=True for a journal
on storage you do not trust to survive a crash.
"""
from __future__ import annotations

import fcntl
import json
import os

from optuna.storages.journal import JournalFileBackend


class FlockLock:
    """An exclusive flock(2) on `<journal>.flock`, released by the kernel if the process dies."""

    def __init__(self, journal_path: str):
        self._path = journal_path + ".flock"
        self._fd: int | None = None

    def acquire(self) -> bool:
        if self._fd is None:
            self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return True

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def __getstate__(self):
        return {"_path": self._path, "_fd": None}


class JournalFile(JournalFileBackend):
    """Optuna's journal file backend with an flock lock and an optional fsync. Reading is
    Optuna's own; only append_logs is replaced (it uses the `_file_path` the base class sets)."""

    def __init__(self, path: str, *, durable: bool = False):
        super().__init__(path, lock_obj=FlockLock(path))
        self._durable = durable

    def append_logs(self, logs: list[dict]) -> None:
        """Append the operations, one JSON line each. A last line without its newline is a write
        that never finished (a full disk, a killed process): Optuna's reader skips it, and it is
        cut off before appending, since the next line would otherwise be glued onto it and turn
        it into a corrupt line mid-file. A failed write names the journal."""
        text = "".join(json.dumps(log, separators=(",", ":")) + "\n" for log in logs)
        self._lock.acquire()
        try:
            with open(self._file_path, "a+b") as f:  # appends wherever it seeks; read for the last line
                _drop_unfinished_line(f)
                f.write(text.encode("utf-8"))
                f.flush()
                if self._durable:
                    os.fsync(f.fileno())
        except OSError as e:
            raise OSError(e.errno, f"cannot write the study journal: {e.strerror or e}", self._file_path) from e
        finally:
            self._lock.release()


def _drop_unfinished_line(f, block: int = 1 << 16) -> None:
    """Truncate a file open for reading and appending after its last newline (to empty if it has
    none)."""
    end = f.seek(0, os.SEEK_END)
    if end == 0:
        return
    f.seek(end - 1)
    if f.read(1) == b"\n":
        return
    while end > 0:  # look back for the last complete line's newline
        start = max(0, end - block)
        f.seek(start)
        cut = f.read(end - start).rfind(b"\n")
        if cut >= 0:
            f.truncate(start + cut + 1)
            return
        end = start
    f.truncate(0)
