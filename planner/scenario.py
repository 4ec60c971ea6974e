"""Load a scenario for `paraplan plan`: as `paraplan simulate` does, except that the scenario's own
plan may not fit the cluster.

The loader refuses a plan whose degrees do not multiply out to the cluster's GPUs: it derives dp =
world / (tp x pp x cp), or checks the dp given (paraplan/loader.py, `_data_parallel`), and
`paraplan simulate` must keep refusing it. For the planner the scenario's plan is only the baseline
it compares against: asking "what is best on 1 node?" of a scenario written for 2,048 GPUs must not
need the plan rewritten. So here that one error is not fatal. The scenario loads with the plan's
degrees as written, and with dp = 0 when no dp completes them (the planner's marker for "not
derivable", as in `PlanSpace.candidate`); the search runs, and the report says the scenario's plan
is invalid and why (`PlanSpace.problems`). Every other error (an unknown key, a bad type or value,
a search or run section that does not validate) stays fatal, exactly as the loader reports it.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from paraplan.errors import ConfigError
from paraplan.loader import apply_overrides, load_scenario, read_scenario_file
from paraplan.specs import PlanSpec, Scenario

DEGREES = ("tp", "pp", "cp")
# Degrees that always multiply out: the scenario loads with these to validate everything else.
NEUTRAL_DEGREES = ("plan.tp=1", "plan.pp=1", "plan.cp=1", "plan.dp=null")


def load_for_planning(source: str | os.PathLike | Mapping, overrides: Iterable[str] = ()) -> Scenario:
    """`load_scenario(source, overrides)`, but a plan whose degrees do not match the cluster's GPU
    count loads (dp 0 when it cannot be derived) instead of raising; see the module docstring."""
    overrides = list(overrides)
    try:
        return load_scenario(source, overrides)
    except ConfigError as exc:
        if exc.path != "plan":  # the degree rule reports on "plan" itself; every other key is fatal
            raise
        degree_error = exc
    written = _written_degrees(source, overrides)
    if written is None:  # the plan section is not a mapping: that is what the error says
        raise degree_error
    scenario = load_scenario(source, [*overrides, *NEUTRAL_DEGREES])  # validates the rest; raises as usual
    tp, pp, cp, dp = (written[k] for k in ("tp", "pp", "cp", "dp"))
    world = scenario.cluster.world_size
    layout = tp * pp * cp
    if (dp is None and world % layout == 0) or (dp is not None and layout * dp == world):
        raise degree_error  # not the degree rule after all: report the loader's error unchanged
    if dp is None:
        dp = 0  # no dp completes the plan (world % (tp*pp*cp) != 0)
    plan = dataclasses.replace(scenario.plan, tp=tp, pp=pp, cp=cp, dp=dp)
    return dataclasses.replace(scenario, plan=plan)


def _written_degrees(source: str | os.PathLike | Mapping, overrides: list[str]) -> dict | None:
    """tp, pp, cp (PlanSpec's defaults when absent) and dp (None: to be derived) as the scenario
    and its overrides write them; None when the plan section is not a mapping. The loader has
    already read, parsed and type-checked them when it raised its degree error."""
    raw = dict(source) if isinstance(source, Mapping) else read_scenario_file(Path(source))
    plan = apply_overrides(raw, overrides).get("plan", {})
    if not isinstance(plan, Mapping):
        return None
    defaults = PlanSpec()
    out = {k: plan.get(k, getattr(defaults, k)) for k in DEGREES}
    out["dp"] = plan.get("dp")
    return out
