"""The planner: search the plan space of a scenario with the simulator as the objective.

    scenario.py    loading the scenario: its own plan may not fit the cluster (the baseline is then invalid)
    space.py       the `search:` section, canonical candidate plans, validity, enumeration
    objective.py   memoised evaluation (structural check, then simulate) and the objectives
    strategies.py  exhaustive and TPE (+ local refinement) behind one small interface
    search.py      the Optuna study: storage, workers, resume
    journal.py     the default storage: an Optuna journal file with an flock lock
    report.py      ranking, rejection summary, top_plans.json, plots
    emit.py        the best plan as an executor config, Megatron-LM arguments, torchtitan TOML

`paraplan plan` (paraplan/cli/plan.py) wires them together.
"""
