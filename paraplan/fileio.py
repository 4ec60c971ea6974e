"""File access for the CLI: atomic writes (a reader never sees a half-written file, an interrupted
write leaves none), output paths checked before any work, and text reads whose failures are one
line naming the argument."""
from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import yaml

from paraplan.errors import ConfigError


# Scenarios, profiles, configs and record files are kilobytes to a few megabytes; the cap keeps a
# device such as /dev/zero, or a wrong multi-gigabyte file, from being read into memory.
MAX_INPUT_BYTES = 64 * 2**20


def write_atomic(path: str | os.PathLike, data: str | bytes, what: str | None = None) -> None:
    """Write one file atomically (write_files_atomic); `what` is the argument that named it."""
    write_files_atomic([(path, data, what)])


def write_files_atomic(files: list[tuple[str | os.PathLike, str | bytes, str | None]]) -> None:
    """Write every (path, data, argument) file, each atomically: each goes to a temporary file
    beside its target first, and only when all are written are they renamed into place, so a
    failure while writing (a full disk, a bad folder) leaves every target as it was. The renames
    themselves run one by one: one failing after another succeeded (rare: a target replaced by a
    folder meanwhile) leaves the files before it new and the rest old, each whole. A symlink is
    written through (its target is replaced), a device or FIFO is refused. A failure names the
    target and the argument that chose it, never a temporary name, and leaves no temporary behind."""
    targets = [(Path(os.path.realpath(p)), data, what) for p, data, what in files]
    for target, _, what in targets:
        _check_target(target, what)
    temps: list[tuple[str, Path]] = []
    target, what = Path("."), None
    try:
        for target, data, what in targets:
            target.parent.mkdir(parents=True, exist_ok=True)
            temps.append((_write_temp(target, data), target))
        for (tmp, target), (_, _, what) in zip(temps, targets):
            os.replace(tmp, target)
    except OSError as exc:
        _remove_temps(temps)
        raise ConfigError(what or "", f"cannot write {target}: {exc.strerror or exc}") from None
    except BaseException:
        _remove_temps(temps)
        raise


def _write_temp(target: Path, data: str | bytes) -> str:
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # what open() would have given, not mkstemp's 0600
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _remove_temps([(tmp, target)])
        raise
    return tmp


def _remove_temps(temps) -> None:
    for tmp, _ in temps:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _check_target(target: Path, what: str | None) -> None:
    if target.is_dir():
        raise ConfigError(what or "", f"{target} is a directory, expected a file name")
    if target.exists() and not target.is_file():
        raise ConfigError(what or "", f"{target} is not a regular file (a device, FIFO or socket); "
                                      f"give a file name")


def read_text(path: str | os.PathLike, what: str) -> str:
    """The file's UTF-8 text; a file that cannot be read is a ConfigError naming `what` (the
    argument or key that gave the path) and why."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(what, f"{path} is a directory, expected a file")
    if not path.exists():
        raise ConfigError(what, f"file not found: {path}")
    if not path.is_file():
        raise ConfigError(what, f"{path} is not a regular file (a device, FIFO or socket)")
    size = path.stat().st_size
    if size > MAX_INPUT_BYTES:
        raise ConfigError(what, f"{path} is {size / 2**20:.0f} MiB; input files are at most "
                                f"{MAX_INPUT_BYTES // 2**20} MiB")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(what, f"{path} is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(what, f"cannot read {path}: {exc.strerror}") from None


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A PyYAML error as one line, the same for every file paraplan reads (scenario, profile,
    published runs, --set values): 'line 3, column 5: mapping values are not allowed here'."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    return " ".join(f"{where}{problem}".split())


def check_output_file(path: str | os.PathLike | None, what: str) -> None:
    """Fail before any work if `path` cannot be written as a file: it is empty, a directory or a
    device, or its folder cannot take a new file. Leaves nothing behind."""
    if path is None:
        return
    if str(path) == "":
        raise ConfigError(what, "empty; expected a file name")
    if str(path) == "-":  # the Unix spelling of standard output, which carries the report
        raise ConfigError(what, "'-' (standard output) is not supported; give a file name, e.g. ./-")
    if str(path).endswith(os.sep) and not os.path.exists(path):  # a folder's spelling, though none is there yet
        raise ConfigError(what, f"{path} names a folder; expected a file name")
    target = Path(os.path.realpath(path))
    _check_target(target, what)
    _check_parent(target.parent, what)


def check_distinct_files(named: dict[str, str | os.PathLike | None]) -> None:
    """Inputs and outputs of one command (argument -> path) must be different files: a trace
    written over its own scenario, or a plot over the trace, would silently lose one of them."""
    seen: dict[str, str] = {}
    for what, path in named.items():
        if path is None or str(path) == "":
            continue
        real = os.path.realpath(path)
        if real in seen:
            raise ConfigError(what, f"{path} is the same file as {seen[real]}; give a different file name")
        seen[real] = what


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
    """Fail before any work if `path` cannot be used as an output directory (it is empty, a file,
    or lies under a file or a folder that cannot take new files). Leaves nothing behind."""
    if path is None:
        return
    if str(path) == "":
        raise ConfigError(what, "empty; expected a folder name")
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(what, f"{path} exists and is not a directory")
    _check_parent(path if path.exists() else path.parent, what)


def _check_parent(parent: Path, what: str) -> None:
    """The nearest existing ancestor of `parent` must be a directory that takes a new file: tried
    by creating (and removing) an empty one, since permission bits do not tell a read-only file
    system, or /proc, from a writable folder."""
    probe = parent if str(parent) else Path(".")
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(what, f"{probe} is a file, so nothing can be written under it")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".paraplan-probe.", dir=probe)
    except OSError as exc:
        raise ConfigError(what, f"cannot write under {probe}: {exc.strerror or exc}") from None
    os.close(fd)
    os.unlink(tmp)


# ----------------------------------------------------------------------------------------------
# Parsing YAML.


class _StrictSafeLoader(yaml.SafeLoader):
    """yaml.SafeLoader (plain data only, no object construction) that also rejects a key given
    twice in one mapping: plain safe_load keeps the last one silently, so `tp: 8 ... tp: 4` would
    quietly mean tp=4."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = self.construct_object(key_node)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r}", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        """An integer, but not one with a leading zero, which YAML 1.1 reads as octal (040 is 32)
        and YAML 1.2 as decimal: refused rather than read either way silently."""
        digits = str(self.construct_scalar(node)).replace("_", "").lstrip("+-")
        if len(digits) > 1 and digits[0] == "0" and digits[1].isdigit():
            raise yaml.constructor.ConstructorError(
                None, None, f"{node.value!r} has a leading zero, which YAML 1.1 reads as octal: write it without",
                node.start_mark)
        return super().construct_yaml_int(node)


_StrictSafeLoader.add_constructor("tag:yaml.org,2002:int", _StrictSafeLoader.construct_yaml_int)


# YAML 1.2's floats without a dot (1e-5, 3E8), which PyYAML's YAML 1.1 rules read as strings
_StrictSafeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"), list("-+0123456789"))


def parse_yaml(text: str) -> Any:
    """Plain data from YAML text, strictly: a key given twice is an error, YAML 1.2 floats
    without a dot (1e-5) are numbers, and a self-referencing or too deeply nested document is a
    yaml.YAMLError, not a RecursionError."""
    try:
        value = yaml.load(text, Loader=_StrictSafeLoader)  # noqa: S506  a SafeLoader subclass
        _check_acyclic(value)
        return value
    except RecursionError:
        raise yaml.YAMLError("nested too deeply (or an alias refers to itself)") from None


def _check_acyclic(value: Any, open_: set[int] | None = None, done: set[int] | None = None) -> None:
    """Raise RecursionError for a self-referencing value (an anchor used inside itself, `&a [*a]`),
    which PyYAML builds as a cyclic list or dict, and for nesting deeper than the recursion limit.
    Each node is visited once, however often aliases share it (a "billion laughs" document costs
    its distinct nodes)."""
    if not isinstance(value, (list, dict)):
        return
    open_ = set() if open_ is None else open_
    done = set() if done is None else done
    key = id(value)
    if key in done:
        return
    if key in open_:
        raise RecursionError
    open_.add(key)
    for item in (value.values() if isinstance(value, dict) else value):
        _check_acyclic(item, open_, done)
    open_.discard(key)
    done.add(key)
