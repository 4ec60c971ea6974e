"""paraplan.serialize: a scenario back to the loader's YAML, exactly."""
import dataclasses
from pathlib import Path

import pytest
import yaml

from paraplan.loader import load_scenario
from paraplan.serialize import scenario_to_mapping
from paraplan.specs import MoESpec, RoutingSpec, RunSpec

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = sorted((ROOT / "scenarios").glob("*.yaml"))


def _through_yaml(mapping):
    """What a user gets back from the file: safe_dump then safe_load."""
    return yaml.safe_load(yaml.safe_dump(mapping, sort_keys=False))


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_round_trip_of_every_bundled_scenario(path):
    sc = load_scenario(path)
    back = load_scenario(_through_yaml(scenario_to_mapping(sc)))
    assert back == dataclasses.replace(sc, search=())


@pytest.mark.parametrize("overrides", [["model=mpt-7b"], ["model.linear_bias=false"], ["model=llama3-8b",
                                                                                     "model.linear_bias=true"]])
def test_linear_biases_that_are_not_the_activations_default_survive_the_round_trip(overrides):
    """MPT is a GELU model without biases, and either default can be overridden: written back,
    the flag is kept rather than re-derived from the activation."""
    sc = load_scenario(ROOT / "scenarios" / "tiny-gpt-8xa100.yaml", overrides)
    assert sc.model.linear_bias != (sc.model.activation == "gelu")
    back = load_scenario(_through_yaml(scenario_to_mapping(sc)))
    assert back.model.linear_bias == sc.model.linear_bias and back == dataclasses.replace(sc, search=())


def test_a_sliding_window_and_a_fat_tree_survive_the_round_trip():
    sc = load_scenario(ROOT / "scenarios" / "tiny-gpt-8xa100.yaml",
                       ["model.sliding_window=4096", "cluster.inter_node.topology=fat-tree"])
    back = load_scenario(_through_yaml(scenario_to_mapping(sc)))
    assert back.model.sliding_window == 4096 and back.cluster.inter_node.nodes_per_leaf == 2  # 20 rail ports / 8 NICs
    assert back == dataclasses.replace(sc, search=())


@pytest.mark.parametrize("fixture", ["hf-llama3-8b", "hf-gpt2"])
def test_an_architecture_read_from_a_config_survives_the_round_trip(fixture):
    sc = load_scenario(ROOT / "scenarios" / "tiny-gpt-8xa100.yaml", [f"model={{hf_config: {ROOT / 'tests' / 'fixtures' / fixture}}}"])
    assert sc.model.architecture is not None
    back = load_scenario(_through_yaml(scenario_to_mapping(sc)))
    assert back.model == sc.model


def test_units_are_the_loaders_and_read_cleanly():
    sc = load_scenario(ROOT / "scenarios" / "gpt3-175b-1024xa100.yaml")
    m = scenario_to_mapping(sc)
    inter = m["cluster"]["inter_node"]
    assert inter["nic_bandwidth_Gbps"] == 200.0            # 25e9 bytes/s written back in Gb/s
    assert sc.cluster.inter_node.nic_bandwidth == 25e9
    assert inter["latency_us"] == pytest.approx(sc.cluster.inter_node.latency * 1e6)
    assert len(repr(inter["latency_us"])) <= 6              # the shortest decimal, not 4.999999999999999
    assert m["cluster"]["intra_node"]["bandwidth_GBps"] == sc.cluster.intra_node.bandwidth / 1e9
    assert m["cluster"]["gpu"] == "a100-sxm-80gb"


def test_model_is_written_in_full_and_search_is_left_out():
    sc = load_scenario(ROOT / "scenarios" / "llama3-8b-64xh100.yaml", ["search.tp=[1, 2]"])
    assert sc.search
    m = scenario_to_mapping(sc)
    assert "search" not in m
    assert m["model"]["num_kv_heads"] == 8 and m["model"]["head_dim"] == 128
    assert m["model"]["activation"] == "swiglu" and "preset" not in m["model"]
    assert m["run"] == {k: v for k, v in dataclasses.asdict(RunSpec()).items() if v is not None}
    assert set(m) == {"name", "model", "cluster", "training", "plan", "run"}


def test_plan_keeps_core_keys_and_drops_defaults():
    sc = load_scenario(ROOT / "scenarios" / "llama3-405b-16384xh100.yaml")
    plan = scenario_to_mapping(sc)["plan"]
    assert plan["first_stage_layers"] == 7 and plan["last_stage_layers"] == 7
    for key in ("tp", "pp", "dp", "cp", "micro_batch_size", "schedule", "zero_stage", "recompute"):
        assert key in plan
    assert "tp_comm_overlap" not in plan  # at its default


def test_moe_is_written_with_routing():
    sc = load_scenario(ROOT / "scenarios" / "tiny-gpt-8xa100.yaml")
    moe = MoESpec(num_experts=8, top_k=2, expert_ffn_hidden_size=512, capacity_factor=1.25,
                  routing=RoutingSpec(distribution="zipf", s=1.1, seed=3))
    sc = dataclasses.replace(sc, model=dataclasses.replace(sc.model, moe=moe))
    m = scenario_to_mapping(sc)["model"]["moe"]
    assert m["routing"] == {"distribution": "zipf", "s": 1.1, "seed": 3}
    assert m["capacity_factor"] == 1.25 and m["num_experts"] == 8
    back = load_scenario(_through_yaml(scenario_to_mapping(sc)))
    assert back.model.moe == moe
    uniform = dataclasses.replace(moe, routing=RoutingSpec(distribution="uniform", seed=3))
    sc = dataclasses.replace(sc, model=dataclasses.replace(sc.model, moe=uniform))
    assert scenario_to_mapping(sc)["model"]["moe"]["routing"] == {"distribution": "uniform", "seed": 3}
    assert load_scenario(_through_yaml(scenario_to_mapping(sc))).model.moe == uniform


def test_profile_file_path_becomes_absolute(tmp_path):
    sc = load_scenario(ROOT / "scenarios" / "tiny-gpt-8xa100.yaml")
    sc = dataclasses.replace(sc, cluster=dataclasses.replace(sc.cluster, gpu="profiles/my-gpu.yaml"))
    assert Path(scenario_to_mapping(sc)["cluster"]["gpu"]).is_absolute()
