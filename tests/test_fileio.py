"""Atomic writes: all files or none, no temporaries left, failures named by the argument."""
import os

import pytest

from paraplan.errors import ConfigError
from paraplan.fileio import MAX_INPUT_BYTES, check_distinct_files, read_text, write_files_atomic


def test_several_files_are_written_all_or_none(tmp_path):
    (tmp_path / "b.txt").mkdir()  # the second target cannot become a file
    with pytest.raises(ConfigError, match=r"^--out: .*b.txt is a directory"):
        write_files_atomic([(tmp_path / "a.txt", "a", "--out"), (tmp_path / "b.txt", "b", "--out")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.txt"]  # no a.txt, no temporaries
    write_files_atomic([(tmp_path / "a.txt", "a", "--out"), (tmp_path / "c.bin", b"\x00", "--out")])
    assert (tmp_path / "a.txt").read_text() == "a" and (tmp_path / "c.bin").read_bytes() == b"\x00"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "c.bin"]


def test_a_late_failure_names_the_target_not_a_temporary(tmp_path, monkeypatch):
    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(ConfigError) as err:
        write_files_atomic([(tmp_path / "t.json", "{}", "--trace")])
    assert str(err.value) == f"--trace: cannot write {tmp_path / 't.json'}: No space left on device"
    assert list(tmp_path.iterdir()) == []


def test_same_file_under_two_names_is_refused(tmp_path):
    f = tmp_path / "f.yaml"
    f.write_text("x")
    (tmp_path / "alias.yaml").symlink_to(f)
    with pytest.raises(ConfigError, match=r"^--out: .*alias.yaml is the same file as config"):
        check_distinct_files({"config": f, "--out": tmp_path / "alias.yaml"})
    check_distinct_files({"config": f, "--out": tmp_path / "other.yaml", "--report": None})


def test_oversized_input_is_refused_before_reading(tmp_path):
    big = tmp_path / "big.yaml"
    with open(big, "wb") as fh:
        fh.truncate(MAX_INPUT_BYTES + 1)  # sparse: no disk used
    with pytest.raises(ConfigError, match=r"^scenario: .*big.yaml is 64 MiB; input files are at most 64 MiB"):
        read_text(big, "scenario")
