"""Start the worker processes with torchrun and collect their measurements (no torch import here).

`launch(scenarios, nproc=...)` writes a job file, runs
`python -m torch.distributed.run --standalone --nproc-per-node N -m executor.worker JOB --out-dir DIR`
(or a multi-node rendezvous), streams the workers' progress lines, and returns one measurement per
scenario. A failed job raises `LaunchError` naming the rank that failed first and its error; the
full torchrun log stays in the run directory.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from executor.config import scenario_to_json
from paraplan.errors import ConfigError, ParaplanError
from paraplan.fileio import write_atomic
from paraplan.specs import Scenario

ROOT = Path(__file__).resolve().parents[1]


class LaunchError(ParaplanError):
    """The job started but a rank failed (or the job timed out); `rank` is None when no rank said."""

    def __init__(self, message: str, *, rank: int | None, log: Path | None):
        self.rank, self.log = rank, log
        super().__init__(message + (f" (log: {log})" if log else ""))


@dataclass(frozen=True, kw_only=True)
class Rendezvous:
    """Multi-node: every node runs the same launch with its node_rank; endpoint is host:port of node 0."""

    nnodes: int
    node_rank: int
    endpoint: str


def torchrun_command(nproc: int, rendezvous: Rendezvous | None, job_file, out_dir) -> list[str]:
    """The torchrun command line that starts this node's workers on `job_file` (one standalone node,
    or a c10d rendezvous at node 0's endpoint); the executor's root goes on PYTHONPATH."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--monitor-interval", "0.5"]
    if rendezvous is None or rendezvous.nnodes == 1:
        cmd += ["--standalone"]
    else:
        cmd += ["--nnodes", str(rendezvous.nnodes), "--node-rank", str(rendezvous.node_rank),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", rendezvous.endpoint, "--rdzv-id", "paraplan"]
    return cmd + ["-m", "executor.worker", str(job_file), "--out-dir", str(out_dir)]


RUN_DIR_FILES = {"job.json", "torchrun.log", "out"}
"""What a run leaves in its --run-dir: the job file, torchrun's log, the per-plan results."""


def check_run_dir(path: str | os.PathLike) -> None:
    """A --run-dir must be new, empty, or hold an earlier run and nothing else (its job.json one a
    launch wrote): a run replaces the earlier run's files, and would otherwise delete or overwrite
    files that are not its own."""
    path = Path(path)
    if not path.is_dir():
        return
    entries = {p.name for p in path.iterdir()}
    if not entries:
        return
    try:
        earlier = "runs" in json.loads((path / "job.json").read_text())
    except (OSError, ValueError, TypeError):
        earlier = False
    if not earlier or not entries <= RUN_DIR_FILES:
        others = sorted(entries - RUN_DIR_FILES) or sorted(entries)
        raise ConfigError("--run-dir", f"{path} holds {', '.join(others[:3])}{', ...' if len(others) > 3 else ''}, "
                                       "not an earlier run's files only; choose an empty or new folder")


def launch(scenarios: list[Scenario], *, nproc: int, backend: str, timeout_s: float,
           run_dir: str | os.PathLike | None = None, rendezvous: Rendezvous | None = None,
           env: dict | None = None, echo=print, job_timeout_s: float | None = None,
           cpu_bf16: bool = False) -> list[dict]:
    """Run every scenario's plan in one torchrun job; return their measurements (rank 0's node).

    run_dir keeps the job file, the log and the per-plan results; a temporary one is removed after
    a successful job and kept (and named in the error) after a failed one. `job_timeout_s` bounds
    the whole job from outside (start-up and every plan), on top of the process-group timeout.
    `cpu_bf16` runs bf16 plans in bf16 mixed precision on CPUs too (tests of the GPU code path).
    """
    own_dir = run_dir is None
    if not own_dir:
        check_run_dir(run_dir)
    # absolute: torchrun and its workers run from the package root, not from the caller's directory
    run_dir = Path(tempfile.mkdtemp(prefix="paraplan-launch-")) if own_dir else Path(run_dir).absolute()
    run_dir.mkdir(parents=True, exist_ok=True)
    out_dir = run_dir / "out"
    if out_dir.exists():  # an earlier run's (check_run_dir)
        shutil.rmtree(out_dir)
    out_dir.mkdir()
    job = {"backend": backend, "timeout_s": timeout_s, "cpu_bf16": cpu_bf16,
           "runs": [scenario_to_json(s) for s in scenarios]}
    write_atomic(run_dir / "job.json", json.dumps(job, indent=1), "--run-dir")
    cmd = torchrun_command(nproc, rendezvous, run_dir / "job.json", out_dir)
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full_env.get("PYTHONPATH")]))
    full_env.update(env or {})
    log_path = run_dir / "torchrun.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
                                cwd=ROOT, start_new_session=True)
        reader = threading.Thread(target=_copy_lines, args=(proc.stdout, log, echo), daemon=True)
        reader.start()
        try:
            proc.wait(timeout=job_timeout_s)
        except subprocess.TimeoutExpired:
            _terminate(proc)  # ours: the torchrun we started and its workers (their own session)
            raise LaunchError(f"the job did not finish within {job_timeout_s:g} s", rank=None, log=log_path) from None
        except BaseException:  # Ctrl-C or SIGTERM: the job runs in its own session, so stop it here
            _terminate(proc)
            if own_dir:  # nothing failed that its log would explain
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
        finally:
            reader.join(timeout=5)
    if proc.returncode != 0:
        raise _failure(out_dir, log_path, proc.returncode, max(s.plan.world_size for s in scenarios))
    results = []
    for i in range(len(scenarios)):
        path = out_dir / f"run{i}.json"
        if not path.exists():
            if rendezvous is not None and rendezvous.node_rank != 0:
                return []  # measurements are written on node 0
            raise LaunchError(f"the job ended without a measurement for plan {i}", rank=None, log=log_path)
        results.append(json.loads(path.read_text()))
    if own_dir:
        shutil.rmtree(run_dir, ignore_errors=True)
    return results


def _copy_lines(stream, log, echo) -> None:
    for line in stream:
        log.write(line)
        log.flush()
        if line.startswith("[paraplan]") and echo is not None:
            echo(line.rstrip("\n"))


def _terminate(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop the torchrun we started and its workers: SIGTERM to its process group (torchrun passes it
    on to the workers), and whatever still runs after `grace_s` is killed. torchrun starts its
    workers in sessions of their own (torch.distributed.elastic's subprocess_handler,
    start_new_session=True), out of reach of a signal to its group: a worker that outlives it is
    killed by its pid."""
    import signal

    workers = _descendants(proc.pid)
    deadline = time.monotonic() + grace_s
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    for pid in workers:
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _running(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _stat(pid: int | str) -> list[str] | None:
    """The fields of Linux's /proc/PID/stat after the command name (state, parent pid, ...); None
    where the process is gone or there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (not gone, not a zombie waiting to be reaped)."""
    fields = _stat(pid)
    return bool(fields) and fields[0] != "Z"


def _descendants(pid: int) -> list[int]:
    """The processes under `pid`, read from Linux's /proc (none where there is no /proc)."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for entry in entries:
        fields = _stat(entry)
        if fields and len(fields) > 1:  # else gone meanwhile
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _failure(out_dir: Path, log_path: Path, code: int, world: int) -> LaunchError:
    """Name the rank that caused the failure.

    A rank that died without writing a report (killed, os._exit, a crash in C++) is the cause, and
    torchrun's summary gives its exit code; otherwise the earliest report. Ranks that reported
    nothing while others timed out waiting for them are named as probably hung.
    """
    reports = {}
    for path in out_dir.glob("failure-rank*.json"):
        try:
            r = json.loads(path.read_text())
            reports[r["rank"]] = r
        except (OSError, json.JSONDecodeError, KeyError):
            continue
    text = log_path.read_text(errors="replace")
    # torchrun's summary: "rank       : 1 (local_rank: 1)" then "exitcode   : -9 (pid: ...)"
    exits = {int(m.group(1)): int(m.group(2))
             for m in re.finditer(r"rank\s*:\s*(\d+)\s*\(local_rank[^\n]*\n\s*exitcode\s*:\s*(-?\d+)", text)}
    silent = sorted(r for r, c in exits.items() if r not in reports and c != -15)  # -15: stopped by torchrun
    after = ""
    if reports:
        first = min(reports.values(), key=lambda r: r["time"])
        after = f"{first['error']}: {first['message']}"
    if silent:
        rank, exitcode = silent[0], exits[silent[0]]
        how = f"was killed by signal {-exitcode}" if exitcode < 0 else f"exited with code {exitcode}"
        also = f"; then rank {first['rank']} failed: {after}" if reports else ""
        return LaunchError(f"rank {rank} {how} without reporting an error{also}", rank=rank, log=log_path)
    if reports:
        others = sorted(r for r in reports if r != first["rank"])
        msg = f"rank {first['rank']} failed: {after}"
        if others:
            msg += f"; {'ranks' if len(others) > 1 else 'rank'} {', '.join(map(str, others))} failed after it"
        quiet = [r for r in range(world) if r not in reports]
        if quiet and "imed out" in after:
            msg += f"; no error from rank {', '.join(map(str, quiet))} (hung?)"
        return LaunchError(msg, rank=first["rank"], log=log_path)
    return LaunchError(f"torchrun exited with code {code}", rank=None, log=log_path)
