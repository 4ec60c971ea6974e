"""Chrome / Perfetto trace of a simulated iteration: one process per simulated rank (pipeline
stage), one thread per stream (Trace Event Format, "X" complete events, microsecond times)."""
from __future__ import annotations

import json

STREAM_TID = {"compute": 0, "pp-comm": 1, "dp-comm": 2}


def chrome_trace(result) -> dict:
    events = []
    for s in result.stages:
        events.append({"ph": "M", "name": "process_name", "pid": s.stage,
                       "args": {"name": f"stage {s.stage} (layers {'+'.join(map(str, s.layers))})"}})
        for stream, tid in STREAM_TID.items():
            events.append({"ph": "M", "name": "thread_name", "pid": s.stage, "tid": tid, "args": {"name": stream}})
    for sp in result.spans:
        events.append({
            "ph": "X", "name": sp.name, "cat": sp.category, "pid": sp.stage,
            "tid": STREAM_TID[sp.stream], "ts": sp.start * 1e6, "dur": (sp.end - sp.start) * 1e6,
        })
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"scenario": result.scenario, "step_time_s": result.step_time_s}}


def chrome_trace_json(result) -> str:
    return json.dumps(chrome_trace(result))
