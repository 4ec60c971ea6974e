"""File access for the CLI: atomic writes (a reader never sees a half-written file, an interrupted
write leaves none), output paths checked before any work, and text reads whose failures are one
line naming the argument."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from paraplan.errors import ConfigError


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = "wb" if isinstance(data, bytes) else "w"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # what open() would have given, not mkstemp's 0600
        with os.fdopen(fd, mode) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_text(path: str | os.PathLike, what: str) -> str:
    """The file's UTF-8 text; a file that cannot be read is a ConfigError naming `what` (the
    argument or key that gave the path) and why."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(what, f"{path} is a directory, expected a file")
    if not path.exists():
        raise ConfigError(what, f"file not found: {path}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(what, f"{path} is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(what, f"cannot read {path}: {exc.strerror}") from None


def check_output_file(path: str | os.PathLike | None, what: str) -> None:
    """Fail before any work if `path` cannot be written as a file: it is a directory, or its
    parent is a file or an unwritable directory. Creates nothing."""
    if path is None:
        return
    path = Path(path)
    if str(path) == "" or path.is_dir():
        raise ConfigError(what, f"{str(path) or '(empty)'} is a directory or empty, expected a file name")
    _check_parent(path.parent, what)


def check_profile_suffix(path: str | os.PathLike, what: str) -> None:
    """A hardware profile's file name must end in .yaml or .yml: a scenario's `cluster.gpu` tells a
    profile file from a bundled profile name by it."""
    if Path(path).suffix not in (".yaml", ".yml"):
        raise ConfigError(what, f"{path}: a profile file must end in .yaml or .yml (scenarios find it by that)")


def check_profile_output(path: str | os.PathLike, what: str) -> None:
    """check_output_file for a hardware profile about to be written."""
    check_profile_suffix(path, what)
    check_output_file(path, what)


def check_output_dir(path: str | os.PathLike | None, what: str) -> None:
    """Fail before any work if `path` cannot be used as an output directory (it is a file, or
    lies under a file or an unwritable directory). Creates nothing."""
    if path is None:
        return
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(what, f"{path} exists and is not a directory")
    _check_parent(path if path.exists() else path.parent, what)


def _check_parent(parent: Path, what: str) -> None:
    """The nearest existing ancestor of `parent` must be a writable directory."""
    probe = parent if str(parent) else Path(".")
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(what, f"{probe} is a file, so nothing can be written under it")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(what, f"cannot write under {probe}: permission denied")
