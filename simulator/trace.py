"""Chrome / Perfetto trace of a simulated iteration: one process per simulated rank (pipeline
stage), one thread per stream (Trace Event Format, "X" complete events, microsecond times). An
op's event carries its cost by component in its args (compute, recompute, the tensor-, expert- and
context-parallel communication it leaves exposed): the engine plays an op as one block, so the
components have no order inside it to draw."""
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
        event = {"ph": "X", "name": sp.name, "cat": sp.category, "pid": sp.stage,
                 "tid": STREAM_TID[sp.stream], "ts": sp.start * 1e6, "dur": (sp.end - sp.start) * 1e6}
        if sp.parts:  # an op's time by component (exposed TP, EP and CP communication among them), ms
            event["args"] = {f"{k} ms": round(v * 1e3, 6) for k, v in sp.parts.items() if v}
        events.append(event)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"scenario": result.scenario, "step_time_s": result.step_time_s}}


def chrome_trace_json(result) -> str:
    return json.dumps(chrome_trace(result))
