"""The process torchrun starts on every rank: `python -m executor.worker JOB.json --out-dir DIR`.

JOB.json (written by executor.launch) lists one or more plans; running several in one job
amortises torchrun's start-up (the tests run a dozen plans per launch). The process group is
created once, with the job's timeout, so a dead or hung rank ends the job within that time; each
plan then builds its own DeviceMesh and groups.

Outputs in DIR: `run{i}.json`, the measurement of plan i (written atomically by rank 0), and on a
failure `failure-rank{r}.json` with the rank, the step's error type and message, so the launcher
can name the rank.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="executor.worker")
    parser.add_argument("job")
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args(argv)
    out_dir = Path(args.out_dir)
    rank = int(os.environ.get("RANK", "0"))
    try:
        return _run(json.loads(Path(args.job).read_text()), out_dir)
    except BaseException as exc:  # report which rank died and why, then die
        if isinstance(exc, SystemExit) and not exc.code:
            raise
        _write_failure(out_dir, rank, exc)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # do not wait in process-group teardown for peers that may be gone


# FSDP2 (and replicate, built on it) warns whenever a wrapped pipeline stage returns a view: an
# in-place op on that view would drop its pre-backward hook. A stage's output here only feeds the
# loss or PipelineStage's send and backward, never an in-place op, and the CPU tests check every
# composition's losses against a single-process reference; the warning, four times a run, is noise.
STAGE_VIEW_WARNING = r"FSDP2-wrapped module \(\w+\) returned a view tensor"


def _run(job: dict, out_dir: Path) -> int:
    import warnings

    import torch
    import torch.distributed as dist

    from executor.config import scenario_from_json
    from executor.trainer import summary, train
    from paraplan.fileio import write_atomic

    warnings.filterwarnings("ignore", message=STAGE_VIEW_WARNING, category=UserWarning)
    backend = job["backend"]
    timeout = datetime.timedelta(seconds=job["timeout_s"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
        device_name = torch.cuda.get_device_name(device)
        device_memory = int(torch.cuda.get_device_properties(device).total_memory)
    else:
        device = torch.device("cpu")  # threads: torchrun sets OMP_NUM_THREADS=1 per process when nproc > 1
        dist.init_process_group("gloo", timeout=timeout)
        device_name, device_memory = "cpu", 0
    rank = dist.get_rank()
    fault = os.environ.get("PARAPLAN_EXECUTOR_FAULT")
    for i, raw in enumerate(job["runs"]):
        sc = scenario_from_json(raw)
        t0 = time.perf_counter()
        record = train(sc, device=device, fault=fault, cpu_bf16=job.get("cpu_bf16", False))
        records = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(record, records, dst=0)
        if rank == 0:
            result = summary(sc, records, backend=backend, device_name=device_name, device_memory=device_memory,
                             on_gpu=device.type == "cuda")
            result["wall_s"] = time.perf_counter() - t0
            write_atomic(out_dir / f"run{i}.json", json.dumps(result, indent=1))
            if job.get("progress", True):
                losses = " ".join(f"{s['loss']:.4f}" for s in result["steps"])
                print(f"[paraplan] run {i + 1}/{len(job['runs'])} {sc.name}: step {result['step_time_s'] * 1e3:.1f} ms, "
                      f"loss {losses}", flush=True)
        del record
        gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _write_failure(out_dir: Path, rank: int, exc: BaseException) -> None:
    from paraplan.errors import ParaplanError
    from paraplan.fileio import write_atomic

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
        # gloo prefixes its messages with the C++ source location: drop it
        msg = re.sub(r"^\[[^\]]*\]\s*", "", lines[0]) if lines else ""
        msg = msg if len(msg) <= 200 else msg[:197] + "..."
        text = json.dumps({"rank": rank, "error": type(exc).__name__, "message": msg, "time": time.time()})
        write_atomic(out_dir / f"failure-rank{rank}.json", text)
    except (OSError, ParaplanError):
        pass


if __name__ == "__main__":
    sys.exit(main())
