"""The strict scenario loader: bundled scenarios and presets load, and every kind of bad input is
named with its key path."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
import yaml

from paraplan.errors import ConfigError
from paraplan.loader import apply_overrides, load_scenario
from paraplan.specs import ArchitectureSpec, InterNodeSpec, LinkSpec, Scenario

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = sorted((ROOT / "scenarios").glob("*.yaml"))
FIXTURES = Path(__file__).resolve().parent / "fixtures"
HEADLINE = ROOT / "scenarios" / "gpt3-175b-1024xa100.yaml"
PRESETS = ROOT / "paraplan" / "presets"

# ---------------------------------------------------------------------------------------------
# GPU profiles. The loader imports hwmodels.profile.load_profile when it builds a cluster. Where
# that module does not exist yet, a stand-in with the same interface is put in sys.modules for the
# duration of each test (monkeypatch undoes it); tests that check how profile defaults merge use
# the stand-in always, so their numbers are known.

FAKE_INTRA = LinkSpec(bandwidth=1.0e11, latency=7e-6)
FAKE_INTER = InterNodeSpec(nics_per_node=4, nic_bandwidth=1.25e10, topology="fat-tree",
                           oversubscription=2.0, latency=9e-6, nodes_per_leaf=16)
FAKE_BUNDLED = ("a100-sxm-40gb", "a100-sxm-80gb", "h100-sxm-80gb", "h200-sxm-141gb", "b200-sxm-180gb")


class _FakeProfile:
    def default_intra_node(self) -> LinkSpec:
        return FAKE_INTRA

    def default_inter_node(self) -> InterNodeSpec:
        return FAKE_INTER


def _fake_load_profile(name_or_path: str) -> _FakeProfile:
    if name_or_path not in FAKE_BUNDLED and not Path(name_or_path).is_file():
        raise ConfigError("", f"unknown GPU profile {name_or_path!r}; bundled: {', '.join(FAKE_BUNDLED)}")
    return _FakeProfile()


def _fake_module() -> types.ModuleType:
    module = types.ModuleType("hwmodels.profile")
    module.load_profile = _fake_load_profile
    return module


def _has_real_profiles() -> bool:
    try:
        return importlib.util.find_spec("hwmodels.profile") is not None
    except ImportError:
        return False


REAL_PROFILES = _has_real_profiles()


@pytest.fixture(autouse=True)
def gpu_profiles(monkeypatch):
    """The real hwmodels.profile where it exists, the stand-in otherwise."""
    if not REAL_PROFILES:
        monkeypatch.setitem(sys.modules, "hwmodels.profile", _fake_module())


@pytest.fixture
def fake_profiles(monkeypatch):
    """The stand-in, even where the real module exists."""
    monkeypatch.setitem(sys.modules, "hwmodels.profile", _fake_module())


# ---------------------------------------------------------------------------------------------
# Helpers


def tiny() -> dict:
    """A small valid scenario as a mapping; tests break one thing in it."""
    return {
        "name": "tiny",
        "model": {"num_layers": 4, "hidden_size": 1024, "num_attention_heads": 16,
                  "vocab_size": 50304, "activation": "gelu"},
        "cluster": {"gpu": "a100-sxm-80gb", "num_nodes": 2, "gpus_per_node": 8},
        "training": {"seq_length": 1024, "global_batch_size": 32, "precision": "bf16"},
        "plan": {"tp": 2, "pp": 2},
    }


def error_of(source, overrides=()) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_scenario(source, overrides)
    return info.value


def write(tmp_path: Path, text: str, name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------------------------
# Bundled scenarios and presets


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_bundled_scenario_loads(path):
    scenario = load_scenario(path)
    assert isinstance(scenario, Scenario)
    assert scenario.plan.world_size == scenario.cluster.world_size
    assert isinstance(scenario.cluster.intra_node, LinkSpec)
    assert isinstance(scenario.cluster.inter_node, InterNodeSpec)
    assert path.read_text().startswith("# "), "one-line comment at the top saying what it is"
    hash(scenario)


def test_all_five_bundled_scenarios_present():
    assert {p.stem for p in SCENARIOS} >= {
        "gpt3-175b-1024xa100", "llama3-70b-1024xh100", "llama3-405b-16384xh100",
        "llama3-8b-64xh100", "tiny-gpt-8xa100"}


def test_headline_scenario():
    s = load_scenario(HEADLINE)
    assert s.name == "gpt3-175b on 128 DGX A100"
    assert s.model.name == "gpt3-175b"
    assert (s.model.num_layers, s.model.hidden_size, s.model.head_dim) == (96, 12288, 128)
    assert s.model.ffn_hidden_size == 4 * 12288 and s.model.tied_embeddings
    assert s.cluster.world_size == 1024
    assert s.cluster.inter_node.nic_bandwidth == 2.5e10
    assert s.cluster.inter_node.topology == "rail-optimized"
    p = s.plan
    assert (p.tp, p.pp, p.dp, p.cp, p.virtual_pipeline_stages) == (8, 8, 16, 1, 2)
    assert (p.schedule, p.sequence_parallel, p.zero_stage, p.recompute) == ("interleaved-1f1b", True, 1, "selective")
    assert s.num_microbatches == 96
    assert s.training.precision == "bf16"


def test_405b_uneven_first_and_last_stages():
    s = load_scenario(ROOT / "scenarios" / "llama3-405b-16384xh100.yaml")
    p = s.plan
    assert (p.tp, p.pp, p.dp, p.first_stage_layers, p.last_stage_layers) == (8, 16, 128, 7, 7)
    assert 7 + (p.pp - 2) * 8 + 7 == s.model.num_layers
    assert s.cluster.world_size == 16384


def test_tiny_scenario_derives_dp():
    s = load_scenario(ROOT / "scenarios" / "tiny-gpt-8xa100.yaml")
    assert s.plan.dp == 2 and s.name == "tiny-gpt-8xa100" and s.model.name == "tiny-gpt"


# Published parameter counts (the source of each preset is cited in models.yaml).
PUBLISHED_PARAMS = {
    "gpt3-175b": 175.0e9, "llama3-8b": 8.03e9, "llama3-70b": 70.6e9, "llama3-405b": 405.9e9,
    "llama2-7b": 6.74e9, "llama2-70b": 68.98e9, "mpt-7b": 6.7e9, "mpt-30b": 29.96e9,
    "mixtral-8x7b": 46.7e9, "mixtral-8x22b": 140.6e9, "qwen3-235b-a22b": 235e9,
    # 685B on the model card: 671B main model + its multi-token prediction module, counted there with
    # its own copies of the embedding and the head (2 x 0.93B), which paraplan's shares
    "deepseek-v3": 685e9 - 2 * 129280 * 7168,
}
TOLERANCE: dict[str, float] = {}


@pytest.mark.parametrize("preset", sorted(PUBLISHED_PARAMS))
def test_model_preset_matches_published_size(preset):
    model = load_scenario({**tiny(), "model": preset}).model
    assert model.name == preset
    assert model.total_params() == pytest.approx(PUBLISHED_PARAMS[preset], rel=TOLERANCE.get(preset, 0.01))


def test_every_model_preset_has_a_published_size():
    assert set(yaml.safe_load((PRESETS / "models.yaml").read_text())) == set(PUBLISHED_PARAMS)


@pytest.mark.parametrize("preset", sorted(yaml.safe_load((PRESETS / "clusters.yaml").read_text())))
def test_every_cluster_preset_loads(preset):
    raw = {**tiny(), "cluster": {"preset": preset, "num_nodes": 4}}
    cluster = load_scenario(raw).cluster
    assert cluster.world_size == 32 and cluster.inter_node.topology == "rail-optimized"


def test_llama3_gqa_and_swiglu():
    m = load_scenario({**tiny(), "model": "llama3-70b"}).model
    assert (m.num_kv_heads, m.head_dim, m.activation, m.ffn_matrices) == (8, 128, "swiglu", 3)


# ---------------------------------------------------------------------------------------------
# Presets: merge


def test_model_preset_with_overrides_merges():
    m = load_scenario({**tiny(), "model": {"preset": "llama3-70b", "num_layers": 40}}).model
    assert (m.num_layers, m.hidden_size, m.num_kv_heads, m.name) == (40, 8192, 8, "llama3-70b")


def test_model_preset_override_rederives_defaults():
    m = load_scenario({**tiny(), "model": {"preset": "gpt3-175b", "hidden_size": 6144, "name": "half"}}).model
    assert (m.head_dim, m.ffn_hidden_size, m.name) == (64, 4 * 6144, "half")


def test_unknown_model_preset_suggests():
    err = error_of({**tiny(), "model": "lama3-8b"})
    assert err.path == "model"
    assert "did you mean 'llama3-8b'?" in str(err) and "gpt3-175b" in str(err)
    assert error_of({**tiny(), "model": {"preset": "nope"}}).path == "model.preset"


def test_cluster_preset_merges_nested_keys():
    raw = {**tiny(), "cluster": {"preset": "dgx-h100-superpod", "num_nodes": 2,
                                 "inter_node": {"oversubscription": 2}}}
    inter = load_scenario(raw).cluster.inter_node
    assert (inter.oversubscription, inter.nics_per_node, inter.nic_bandwidth) == (2.0, 8, 5e10)


def test_cluster_preset_needs_num_nodes():
    err = error_of({**tiny(), "cluster": "dgx-a100-superpod"})
    assert str(err) == ("cluster: a preset gives the node type, not how many nodes: write "
                        "cluster: {preset: dgx-a100-superpod, num_nodes: N}")
    err = error_of({**tiny(), "cluster": {"preset": "dgx-a100-superpod"}})
    assert str(err) == "cluster.num_nodes: required key missing"


def test_model_preset_and_hf_config_together_rejected():
    err = error_of({**tiny(), "model": {"preset": "llama3-8b", "hf_config": "x.json"}})
    assert err.path == "model"


# ---------------------------------------------------------------------------------------------
# Strictness


def test_unknown_key_with_suggestion():
    raw = tiny()
    raw["plan"]["tpp"] = 2
    err = error_of(raw)
    assert err.path == "plan.tpp"
    assert str(err) == "plan.tpp: unknown key, did you mean 'tp'?"


def test_unknown_nested_key_has_full_path():
    raw = tiny()
    raw["cluster"]["inter_node"] = {"topolgy": "fat-tree"}
    err = error_of(raw)
    assert str(err) == "cluster.inter_node.topolgy: unknown key, did you mean 'topology'?"


def test_unknown_key_without_close_match_lists_allowed():
    raw = {**tiny(), "zzz": 1}
    err = error_of(raw)
    assert err.path == "zzz" and "expected one of: name, model, cluster, training, plan, search" in str(err)


def test_misspelt_top_level_section():
    raw = tiny()
    raw["trainng"] = raw.pop("training")
    assert str(error_of(raw)) == "trainng: unknown key, did you mean 'training'?"


def test_misspelt_preset_key_suggested():
    err = error_of({**tiny(), "model": {"prest": "llama3-8b"}})
    assert str(err) == "model.prest: unknown key, did you mean 'preset'?"


def test_wrong_type_named():
    raw = tiny()
    raw["plan"]["tp"] = "eight"
    assert str(error_of(raw)) == "plan.tp: expected an integer, got 'eight'"


def test_bool_is_not_an_int():
    raw = tiny()
    raw["model"]["num_layers"] = True
    assert str(error_of(raw)) == "model.num_layers: expected an integer, got true"


def test_float_is_not_an_int():
    raw = tiny()
    raw["training"]["global_batch_size"] = 32.0
    assert str(error_of(raw)) == "training.global_batch_size: expected an integer, got 32.0"


@pytest.mark.parametrize("key", ["tp", "pp", "cp", "ep", "dp", "micro_batch_size", "virtual_pipeline_stages"])
def test_degrees_must_be_positive(key):
    raw = tiny()
    raw["plan"][key] = 0
    assert str(error_of(raw)) == f"plan.{key}: expected a positive integer, got 0"


def test_num_nodes_must_be_positive():
    raw = tiny()
    raw["cluster"]["num_nodes"] = -1
    assert str(error_of(raw)) == "cluster.num_nodes: expected a positive integer, got -1"


def test_number_keys_take_ints_and_floats_and_reject_the_rest():
    raw = tiny()
    raw["cluster"]["intra_node"] = {"bandwidth_GBps": 300, "latency_us": 2.5}
    intra = load_scenario(raw).cluster.intra_node
    assert (intra.bandwidth, intra.latency) == (3e11, 2.5e-6)
    raw["cluster"]["intra_node"] = {"bandwidth_GBps": "fast"}
    assert str(error_of(raw)) == "cluster.intra_node.bandwidth_GBps: expected a number, got 'fast'"
    raw["cluster"]["intra_node"] = {"bandwidth_GBps": False}
    assert error_of(raw).path == "cluster.intra_node.bandwidth_GBps"
    raw["cluster"]["intra_node"] = {"bandwidth_GBps": 0}
    assert str(error_of(raw)) == "cluster.intra_node.bandwidth_GBps: expected a number from 0.001 to 1e+06, got 0"
    raw["cluster"]["intra_node"] = {"bandwidth_GBps": float("inf")}
    assert "finite" in str(error_of(raw))


@pytest.mark.parametrize("key,value,allowed", [
    ("intra_node.bandwidth_GBps", 1e300, "0.001 to 1e+06"),  # had failed in the network model's log
    ("intra_node.bandwidth_GBps", 1e-300, "0.001 to 1e+06"),  # had simulated to an infinite step time
    ("inter_node.nic_bandwidth_Gbps", 1e-9, "0.008 to 8e+06"),
    ("inter_node.latency_us", 1.7e308, "0 to 1e+06"),
    ("inter_node.oversubscription", 1e9, "1 to 1000"),
])
def test_link_figures_beyond_any_hardware_are_refused(key, value, allowed):
    raw = tiny()
    section, name = key.split(".")
    raw["cluster"][section] = {name: value}
    assert str(error_of(raw)) == f"cluster.{key}: expected a number from {allowed}, got {value:g}"


def test_oversubscription_below_one_rejected():
    raw = tiny()
    raw["cluster"]["inter_node"] = {"oversubscription": 0.5}
    assert str(error_of(raw)) == "cluster.inter_node.oversubscription: expected a number from 1 to 1000, got 0.5"


def test_bool_key_rejects_strings():
    raw = tiny()
    raw["plan"]["sequence_parallel"] = "yes please"
    assert str(error_of(raw)) == "plan.sequence_parallel: expected true or false, got 'yes please'"


def test_bad_enum_lists_allowed_values():
    raw = tiny()
    raw["plan"]["schedule"] = "chimera"
    assert str(error_of(raw)) == ("plan.schedule: 'chimera' is not one of gpipe, 1f1b, interleaved-1f1b, zero-bubble, "
                                  "zbv, dualpipev")


def test_bad_enum_suggests_close_value():
    raw = tiny()
    raw["cluster"]["inter_node"] = {"topology": "fat_tree"}
    err = error_of(raw)
    assert err.path == "cluster.inter_node.topology"
    assert "is not one of fat-tree, rail-optimized, did you mean 'fat-tree'?" in str(err)


@pytest.mark.parametrize("value", [5, True, "1"])
def test_zero_stage_is_an_int_enum(value):
    raw = tiny()
    raw["plan"]["zero_stage"] = value
    assert "is not one of 0, 1, 2, 3" in str(error_of(raw))


@pytest.mark.parametrize("section,key", [
    ("model", "num_layers"), ("model", "vocab_size"), ("model", "activation"),
    ("cluster", "gpu"), ("cluster", "num_nodes"), ("cluster", "gpus_per_node"),
    ("training", "seq_length"), ("training", "global_batch_size"), ("training", "precision"),
])
def test_missing_required_key_named(section, key):
    raw = tiny()
    del raw[section][key]
    assert str(error_of(raw)) == f"{section}.{key}: required key missing"


def test_missing_section_named():
    raw = tiny()
    del raw["training"]
    assert str(error_of(raw)) == "training: required key missing"


def test_plan_section_optional():
    raw = tiny()
    del raw["plan"]
    plan = load_scenario(raw).plan
    assert (plan.tp, plan.pp, plan.dp) == (1, 1, 16)


def test_section_must_be_a_mapping():
    raw = {**tiny(), "training": [1024, 32]}
    assert str(error_of(raw)) == "training: expected a mapping, got a list"


def test_model_derivations_checked():
    raw = tiny()
    raw["model"]["num_kv_heads"] = 3
    assert str(error_of(raw)) == "model.num_kv_heads: 3 does not divide num_attention_heads 16"
    raw = tiny()
    raw["model"]["num_attention_heads"] = 3
    assert error_of(raw).path == "model.head_dim"
    raw["model"]["head_dim"] = 128
    assert load_scenario(raw).model.q_channels == 384


# ---------------------------------------------------------------------------------------------
# Files


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    assert str(error_of(path)) == f"scenario file not found: {path}"
    assert str(error_of(str(path))) == f"scenario file not found: {path}"


def test_bad_yaml_one_line_with_line_number(tmp_path):
    path = write(tmp_path, "model: gpt3-175b\nplan:\n  tp: [8,\n  pp: 2\n")
    message = str(error_of(path))
    assert "\n" not in message
    assert message.startswith(f"{path}: invalid YAML: line ")


def test_yaml_line_number_is_right(tmp_path):
    path = write(tmp_path, "a: 1\nb: 2\nc: d: e\n")
    assert "line 3, column 5" in str(error_of(path))


def test_duplicate_key_rejected(tmp_path):
    path = write(tmp_path, "plan:\n  tp: 8\n  tp: 4\n")
    message = str(error_of(path))
    assert "duplicate key 'tp'" in message and "line 3" in message


def test_aliased_yaml_nodes_are_frozen_once(tmp_path):
    """Nested aliases ("billion laughs": 9 levels of 9 would expand to 9**10 numbers) cost their
    distinct nodes: an aliased node is frozen once and shared, never expanded."""
    items = ["&c0 [1, 2, 3, 4, 5, 6, 7, 8, 9]"]
    items += [f"&c{i} [" + ", ".join([f"*c{i - 1}"] * 9) + "]" for i in range(1, 10)]
    text = yaml.safe_dump(tiny(), sort_keys=False) + "search:\n  tp: [" + ", ".join(items) + "]\n"
    sc = load_scenario(write(tmp_path, text))
    tp = dict(sc.search)["tp"]
    assert len(tp) == 10 and all(a is b for a, b in zip(tp[9], tp[9][1:]))  # nine references, one node


def test_empty_file(tmp_path):
    assert "expected a mapping at the top level, got null" in str(error_of(write(tmp_path, "")))


def test_name_defaults_to_file_stem(tmp_path):
    raw = tiny()
    del raw["name"]
    path = write(tmp_path, yaml.safe_dump(raw), "my-run.yaml")
    assert load_scenario(path).name == "my-run"
    assert load_scenario(raw).name == "scenario"


def test_mapping_source_is_not_modified():
    raw = tiny()
    before = yaml.safe_dump(raw)
    load_scenario(raw, ["plan.tp=4"])
    assert yaml.safe_dump(raw) == before


# ---------------------------------------------------------------------------------------------
# Overrides


def test_overrides_parse_yaml_values():
    s = load_scenario(tiny(), ["plan.tp=4", "plan.pp=1", "plan.sequence_parallel=true",
                               "plan.recompute=full", "training.seq_length=2048"])
    assert (s.plan.tp, s.plan.pp, s.plan.dp, s.plan.sequence_parallel) == (4, 1, 4, True)
    assert (s.plan.recompute, s.training.seq_length) == ("full", 2048)


def test_override_goes_through_validation():
    assert str(error_of(tiny(), ["plan.tp=eight"])) == "plan.tp: expected an integer, got 'eight'"
    assert str(error_of(tiny(), ["plan.schedule=zb"])).startswith("plan.schedule: 'zb' is not one of")


def test_override_into_unknown_key_errors_like_unknown_key():
    assert str(error_of(tiny(), ["plan.tpp=4"])) == "plan.tpp: unknown key, did you mean 'tp'?"
    assert str(error_of(tiny(), ["plna.tp=4"])) == "plna: unknown key, did you mean 'plan'?"


def test_override_replaces_model_with_preset():
    s = load_scenario(tiny(), ["model=llama3-8b"])
    assert s.model.name == "llama3-8b" and s.model.num_kv_heads == 8


def test_override_into_preset_string():
    s = load_scenario({**tiny(), "model": "llama3-70b"}, ["model.num_layers=40"])
    assert (s.model.num_layers, s.model.hidden_size) == (40, 8192)


def test_override_null_value():
    s = load_scenario(tiny(), ["plan.first_stage_layers=3", "plan.last_stage_layers=null"])
    assert (s.plan.first_stage_layers, s.plan.last_stage_layers) == (3, None)


def test_an_edge_stage_may_hold_no_transformer_layer():
    """0 layers: the first stage runs only the embedding, the last only the loss."""
    s = load_scenario(tiny(), ["plan.first_stage_layers=0", "plan.last_stage_layers=0"])
    assert (s.plan.first_stage_layers, s.plan.last_stage_layers) == (0, 0)
    assert "plan.first_stage_layers: expected an integer >= 0, got -1" in str(error_of(tiny(), ["plan.first_stage_layers=-1"]))


@pytest.mark.parametrize("item", ["plan.tp", "=4", "plan..tp=4"])
def test_malformed_override_names_set(item):
    err = error_of(tiny(), [item])
    assert err.path == "--set" and repr(item) in str(err)


def test_override_through_a_scalar_rejected():
    err = error_of(tiny(), ["plan.tp.x=1"])
    assert err.path == "plan.tp" and "not a mapping" in str(err)


def test_apply_overrides_returns_copy():
    raw = tiny()
    out = apply_overrides(raw, ["plan.tp=4", "search.tp=[1, 2]"])
    assert out["plan"]["tp"] == 4 and raw["plan"]["tp"] == 2
    assert out["search"] == {"tp": [1, 2]} and "search" not in raw


# ---------------------------------------------------------------------------------------------
# Data parallel degree


def test_dp_mismatch_message():
    raw = tiny()
    raw["cluster"]["num_nodes"] = 128
    raw["plan"] = {"tp": 8, "pp": 8, "dp": 4}
    err = error_of(raw)
    assert err.path == "plan"
    assert str(err) == "plan: tp*pp*cp*dp = 8*8*1*4 = 256 but the cluster has 1024 GPUs (128 nodes x 8)"


def test_dp_derived():
    raw = tiny()
    raw["cluster"]["num_nodes"] = 128
    raw["plan"] = {"tp": 8, "pp": 8, "cp": 2}
    assert load_scenario(raw).plan.dp == 8


def test_dp_not_derivable():
    raw = tiny()
    raw["plan"] = {"tp": 8, "pp": 3}
    err = error_of(raw)
    assert err.path == "plan"
    assert "tp*pp*cp = 8*3*1 = 24 does not divide the cluster's 16 GPUs (2 nodes x 8)" in str(err)


# ---------------------------------------------------------------------------------------------
# Hugging Face config.json


def test_hf_llama_config(tmp_path):
    path = write(tmp_path, "model: {hf_config: " + str(FIXTURES / "hf-llama3-8b" / "config.json") + "}\n"
                 + yaml.safe_dump({k: v for k, v in tiny().items() if k not in ("model", "name")}))
    m = load_scenario(path).model
    preset = load_scenario({**tiny(), "model": "llama3-8b"}).model
    assert dataclasses.replace(m, name="llama3-8b", architecture=None) == preset  # presets' families: model_families
    assert m.name == "hf-llama3-8b"


def test_hf_config_relative_to_scenario_folder(tmp_path):
    folder = tmp_path / "models" / "gpt2"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text((FIXTURES / "hf-gpt2" / "config.json").read_text())
    raw = {**tiny(), "model": {"hf_config": "models/gpt2/config.json"}}
    m = load_scenario(write(tmp_path, yaml.safe_dump(raw))).model
    assert m.name == "gpt2"
    # a folder holding config.json works too
    raw["model"] = {"hf_config": "models/gpt2", "num_layers": 2}
    assert load_scenario(write(tmp_path, yaml.safe_dump(raw))).model.num_layers == 2


def test_paths_given_with_set_are_relative_to_the_working_directory(tmp_path, monkeypatch):
    """The scenario's own paths are read against its folder, paths typed after --set against the
    directory the command runs in (where the shell completed them), whichever way they are set."""
    scenario_dir, work = tmp_path / "scenarios", tmp_path / "work"
    scenario_dir.mkdir()
    work.mkdir()
    (work / "config.json").write_text((FIXTURES / "hf-gpt2" / "config.json").read_text())
    (work / "gpu.yaml").write_text((ROOT / "hwmodels" / "profiles" / "a100-sxm-80gb.yaml").read_text())
    path = write(scenario_dir, yaml.safe_dump(tiny()))
    monkeypatch.chdir(work)
    for overrides in (["model.hf_config=config.json", "cluster.gpu=gpu.yaml"],
                      ["model={hf_config: config.json}", "cluster={gpu: gpu.yaml, num_nodes: 2, gpus_per_node: 8}"]):
        sc = load_scenario(path, overrides)
        assert sc.model.name == "work" and sc.cluster.gpu == str(work / "gpu.yaml")
    with pytest.raises(ConfigError, match="cluster.gpu: GPU profile file not found: " + str(work / "none.yaml")):
        load_scenario(path, ["cluster.gpu=none.yaml"])


def test_hf_config_beside_a_scenario_run_from_its_folder(tmp_path, monkeypatch):
    """`cd folder && paraplan simulate sc.yaml` with hf_config: config.json: the model is named
    after the folder, not left empty (which best_plan.yaml could not load back)."""
    folder = tmp_path / "my-gpt2"
    folder.mkdir()
    (folder / "config.json").write_text((FIXTURES / "hf-gpt2" / "config.json").read_text())
    (folder / "sc.yaml").write_text(yaml.safe_dump({**tiny(), "model": {"hf_config": "config.json"}}))
    monkeypatch.chdir(folder)
    assert load_scenario("sc.yaml").model.name == "my-gpt2"


def test_hf_gpt2_config():
    raw = {**tiny(), "model": {"hf_config": str(FIXTURES / "hf-gpt2")}}
    m = load_scenario(raw).model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_kv_heads) == (12, 768, 12, 12)
    assert (m.ffn_hidden_size, m.vocab_size, m.activation, m.tied_embeddings) == (3072, 50257, "gelu", True)
    assert m.total_params() == pytest.approx(124.4e6, rel=0.01)  # GPT-2 small, biases aside


def test_hf_mistral_style_without_kv_heads_and_with_head_dim(tmp_path):
    cfg = {"model_type": "mistral", "hidden_size": 5120, "num_hidden_layers": 40,
           "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": 128,
           "intermediate_size": 14336, "vocab_size": 131072, "hidden_act": "silu"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    raw = {**tiny(), "model": {"hf_config": str(tmp_path / "config.json")}}
    m = load_scenario(raw).model
    assert (m.num_kv_heads, m.head_dim, m.activation, m.tied_embeddings) == (32, 128, "swiglu", False)


@pytest.mark.parametrize("model_type, extra, window", [
    ("mistral", {"sliding_window": 4096}, 4096),  # Mistral-7B-v0.1
    ("mistral", {}, 4096),  # MistralConfig's default
    ("mistral", {"sliding_window": None}, None),  # v0.2 on
    ("mixtral", {}, None),  # MixtralConfig's default
    ("qwen2", {"sliding_window": 4096}, None),  # use_sliding_window defaults to false
    ("qwen2", {"sliding_window": 4096, "use_sliding_window": False}, None),
    ("qwen2", {"sliding_window": 4096, "use_sliding_window": True}, 4096),
    ("qwen2", {"sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 2}, None),  # no layer from 2 on
    ("llama", {"sliding_window": 4096}, None),
])
def test_hf_sliding_window_is_read_and_a_binding_one_refused(tmp_path, model_type, extra, window):
    cfg = {"model_type": model_type, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1024, "hidden_act": "silu", **extra}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    raw = {**tiny(), "model": {"hf_config": str(tmp_path / "config.json")}}
    raw["training"] = {**raw["training"], "seq_length": 4096}
    assert load_scenario(raw).model.sliding_window == window  # a window as long as the sequence changes nothing
    raw["training"]["seq_length"] = 8192
    if window is None:
        load_scenario(raw)
        return
    err = error_of(raw)
    assert err.path == "model.sliding_window" and "4096 < training.seq_length 8192" in str(err)
    raw["model"]["sliding_window"] = None  # the user's way to price it as full causal attention
    assert load_scenario(raw).model.sliding_window is None


def test_hf_configs_give_their_architecture(tmp_path):
    """The normalization, position embedding and biases the launch configs need: Llama 3.1's from its
    config, Qwen2's query/key/value biases, Mixtral's defaults where its config leaves them out, GPT-2's
    LayerNorm and learned positions; a RoPE scaling transformers does not name is refused."""
    arch = load_scenario({**tiny(), "model": {"hf_config": str(FIXTURES / "hf-llama3-8b")}}).model.architecture
    assert arch == ArchitectureSpec(normalization="rmsnorm", norm_epsilon=1e-5, position_embedding="rope",
                                    rotary_base=500000.0, rope_scaling="llama3", rope_scaling_factor=8.0)
    gpt2 = load_scenario({**tiny(), "model": {"hf_config": str(FIXTURES / "hf-gpt2")}}).model
    assert gpt2.architecture.position_embedding == "learned" and not gpt2.rotary and gpt2.normalization == "layernorm"
    base = {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 512, "vocab_size": 1024, "hidden_act": "silu"}

    def arch_of(**cfg):
        (tmp_path / "config.json").write_text(json.dumps({**base, **cfg}))
        return load_scenario({**tiny(), "model": {"hf_config": str(tmp_path / "config.json")}}).model.architecture
    assert arch_of(model_type="qwen2").qkv_bias
    mixtral = arch_of(model_type="mixtral")
    assert (mixtral.rotary_base, mixtral.norm_epsilon, mixtral.qkv_bias) == (1e6, 1e-5, False)
    assert arch_of(model_type="llama").norm_epsilon == 1e-6  # transformers' LlamaConfig default
    assert arch_of(model_type="llama", rope_scaling={"type": "linear", "factor": 2.0}).rope_scaling == "linear"
    (tmp_path / "config.json").write_text(json.dumps({**base, "model_type": "llama",
                                                      "rope_scaling": {"rope_type": "su", "factor": 4}}))
    err = error_of({**tiny(), "model": {"hf_config": str(tmp_path / "config.json")}})
    assert err.path == "model.hf_config" and "rope_scaling type 'su' is not one of transformers'" in str(err)


def test_hf_transformers_5_rope_parameters_are_read(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 512, "vocab_size": 1024,
           "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 32.0}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    arch = load_scenario({**tiny(), "model": {"hf_config": str(tmp_path / "config.json")}}).model.architecture
    assert (arch.rotary_base, arch.rope_scaling, arch.rope_scaling_factor) == (500000.0, "llama3", 32.0)


def test_model_architecture_is_checked():
    raw = tiny()
    raw["model"] = {**raw["model"], "architecture": {"normalization": "rmsnorm", "norm_epsilon": 1e-5,
                                                     "position_embedding": "alibi", "rotary_base": 10000}}
    err = error_of(raw)
    assert err.path == "model.architecture.rotary_base" and "only with position_embedding: rope" in str(err)
    raw["model"]["architecture"] = {"normalization": "batchnorm", "norm_epsilon": 1e-5, "position_embedding": "rope"}
    assert error_of(raw).path == "model.architecture.normalization"
    raw["model"]["architecture"] = {"normalization": "rmsnorm", "norm_epsilon": 1e-5, "position_embedding": "rope",
                                    "rope_scaling_factor": 4}
    assert error_of(raw).path == "model.architecture.rope_scaling_factor"
    raw["model"]["architecture"] = {"normalization": "rmsnorm", "norm_epsilon": 1e-5, "position_embedding": "learned"}
    m = load_scenario(raw).model
    assert not m.rotary and m.norm_params() == 2 * m.hidden_size  # an RMSNorm's weight alone, however biased the linears


def test_hf_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "t5"}')
    err = error_of({**tiny(), "model": {"hf_config": str(tmp_path)}})
    assert err.path == "model.hf_config" and "'t5' is not supported" in str(err) and "llama" in str(err)


def test_hf_missing_file(tmp_path):
    err = error_of({**tiny(), "model": {"hf_config": str(tmp_path / "none.json")}})
    assert err.path == "model.hf_config" and "file not found" in str(err)


def test_hf_missing_field(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    err = error_of({**tiny(), "model": {"hf_config": str(tmp_path)}})
    assert err.path == "model.hf_config" and "missing 'num_attention_heads'" in str(err)


def test_hf_bad_json(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama",\n  oops}')
    err = error_of({**tiny(), "model": {"hf_config": str(tmp_path)}})
    assert err.path == "model.hf_config" and "invalid JSON at line 2" in str(err)


# ---------------------------------------------------------------------------------------------
# Cluster: units and GPU profile defaults


def test_unit_conversions():
    raw = tiny()
    raw["cluster"]["intra_node"] = {"bandwidth_GBps": 300, "latency_us": 3}
    raw["cluster"]["inter_node"] = {"nics_per_node": 8, "nic_bandwidth_Gbps": 200, "latency_us": 5,
                                    "topology": "fat-tree", "oversubscription": 1, "nodes_per_leaf": 32}
    c = load_scenario(raw).cluster
    assert c.intra_node == LinkSpec(bandwidth=3e11, latency=3e-6)
    assert c.inter_node == InterNodeSpec(nics_per_node=8, nic_bandwidth=2.5e10, topology="fat-tree",
                                         oversubscription=1.0, latency=5e-6, nodes_per_leaf=32)


def test_missing_link_keys_come_from_the_profile(fake_profiles):
    c = load_scenario(tiny()).cluster
    assert (c.intra_node, c.inter_node) == (FAKE_INTRA, FAKE_INTER)


def test_given_link_keys_override_single_profile_fields(fake_profiles):
    raw = tiny()
    raw["cluster"]["intra_node"] = {"latency_us": 1}
    raw["cluster"]["inter_node"] = {"nic_bandwidth_Gbps": 400, "topology": "rail-optimized"}
    c = load_scenario(raw).cluster
    assert c.intra_node == dataclasses.replace(FAKE_INTRA, latency=1e-6)
    # the profile's fat-tree leaf (16 nodes x 4 NICs = 64 ports) holds 64 nodes, one port each, as a rail leaf
    assert c.inter_node == dataclasses.replace(FAKE_INTER, nic_bandwidth=5e10, topology="rail-optimized",
                                               nodes_per_leaf=64)


def test_topology_counts_the_nodes_a_leaf_holds():
    """A rail leaf takes one NIC of each node, a fat-tree leaf all of them: the same 32-port leaves of
    the H100 SuperPOD hold 4 nodes of 8 NICs as a fat tree, 8 of 4 NICs. A given nodes_per_leaf is
    taken as is, and so is the preset's with its own topology."""
    def inter(**keys):
        raw = tiny()
        raw["cluster"] = {"preset": "dgx-h100-superpod", "num_nodes": 64, "inter_node": keys}
        return load_scenario(raw).cluster.inter_node
    assert inter().nodes_per_leaf == 32
    assert inter(topology="fat-tree").nodes_per_leaf == 4
    assert inter(topology="fat-tree", nics_per_node=4).nodes_per_leaf == 8
    assert inter(topology="fat-tree", nodes_per_leaf=12).nodes_per_leaf == 12
    assert inter(nics_per_node=4).nodes_per_leaf == 32  # a rail leaf serves one NIC a node however many
    raw = tiny()
    raw["cluster"] = {"gpu": "h100-sxm-80gb", "num_nodes": 64, "gpus_per_node": 8, "inter_node": {"topology": "fat-tree"}}
    assert load_scenario(raw).cluster.inter_node.nodes_per_leaf == 4  # from the profile's rail leaves


def test_fat_tree_leaves_meet_the_oversubscribed_spine():
    """At 2:1 the fat tree's 4-node leaves send a 16-node DP ring's traffic up where the rail fabric's
    32-node leaves keep it; at 1:1 the spine costs nothing, so the two price the same."""
    from simulator.simulate import simulate

    def step(topology, oversubscription):
        raw = yaml.safe_load((ROOT / "scenarios" / "llama3-70b-512xh100.yaml").read_text())
        raw["cluster"]["inter_node"] = {"topology": topology, "oversubscription": oversubscription}
        return simulate(load_scenario(raw)).step_time_s
    assert step("fat-tree", 1) == step("rail-optimized", 1) == step("rail-optimized", 2)
    assert step("fat-tree", 2) > step("rail-optimized", 2)


def test_unknown_gpu_named_under_cluster_gpu():
    raw = tiny()
    raw["cluster"]["gpu"] = "a100-sxm-90gb"
    err = error_of(raw)
    assert err.path == "cluster.gpu" and "a100-sxm-80gb" in str(err)


def test_gpu_profile_file_resolved_against_scenario_folder(tmp_path, fake_profiles):
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "mygpu.yaml").write_text("name: mygpu\n")
    raw = tiny()
    raw["cluster"]["gpu"] = "profiles/mygpu.yaml"
    s = load_scenario(write(tmp_path, yaml.safe_dump(raw)))
    assert s.cluster.gpu == str(tmp_path / "profiles" / "mygpu.yaml")
    raw["cluster"]["gpu"] = "profiles/other.yaml"
    err = error_of(write(tmp_path, yaml.safe_dump(raw)))
    assert err.path == "cluster.gpu" and "not found" in str(err)


# ---------------------------------------------------------------------------------------------
# search


def test_search_is_frozen_and_sorted():
    raw = {**tiny(), "search": {"tp": [1, 2, 4], "budget": 50, "fixed": {"zero_stage": 1, "cp": [1]}}}
    s = load_scenario(raw)
    assert s.search == (("budget", 50), ("fixed", (("cp", (1,)), ("zero_stage", 1))), ("tp", (1, 2, 4)))
    hash(s)


def test_search_must_be_a_mapping():
    assert str(error_of({**tiny(), "search": [1, 2]})) == "search: expected a mapping, got a list"


def test_overriding_a_degree_rederives_dp():
    """The issue's own example: llama3-70b-1024xh100 pins dp 32 for tp 8 pp 4; --set plan.tp=4
    --set plan.pp=4 means dp 64, not an error. dp given with them, or in the file alone, is kept."""
    path = ROOT / "scenarios" / "llama3-70b-1024xh100.yaml"
    assert load_scenario(path).plan.dp == 32
    assert load_scenario(path, ["plan.tp=4", "plan.pp=4"]).plan.dp == 64
    assert load_scenario(path, ["cluster.num_nodes=64"]).plan.dp == 16
    assert load_scenario(path, ["plan.dp=null", "plan.tp=8"]).plan.dp == 32
    assert load_scenario(path, ["cluster={gpu: h100-sxm-80gb, num_nodes: 32, gpus_per_node: 8}"]).plan.dp == 8
    with pytest.raises(ConfigError, match=r"tp\*pp\*cp\*dp = 4\*4\*1\*32 = 512"):
        load_scenario(path, ["plan.tp=4", "plan.pp=4", "plan.dp=32"])


# Multi-head latent attention


def test_deepseek_v3_preset_has_the_published_total_and_active_parameters():
    """671B total, 37B activated per token (DeepSeek-V3 technical report, arXiv 2412.19437, Sec. 1);
    per layer the MLA projections are 7168x1536 + 1536x(128x192) + 7168x576 + 512x(128x256) +
    (128x128)x7168 (config.json: q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128)."""
    m = load_scenario({**tiny(), "model": "deepseek-v3"}).model
    by_hand = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
    assert m.attention_params() == by_hand + 2 * 7168 + 1536 + 512  # two RMSNorms' weights, the latents' norms
    inactive = sum((m.moe.num_experts - m.moe.top_k) * m.expert_params()
                   for i in range(m.num_layers) if m.is_moe_layer(i))
    main = m.total_params() - m.mtp_module_params()
    assert main == pytest.approx(671e9, rel=0.002)
    assert main - inactive == pytest.approx(37e9, rel=0.02)  # embedding and head included
    assert m.mtp_layers == 1 and m.mtp_module_params() == m.layer_params(60) + 2 * 7168 ** 2 + 3 * 7168


def test_mla_params_per_tensor_parallel_rank_keep_the_down_projections_whole():
    m = load_scenario({**tiny(), "model": "deepseek-v3"}).model
    down = 7168 * 1536 + 7168 * 576
    split = 1536 * 128 * 192 + 512 * 128 * 256 + 128 * 128 * 7168
    norms = 2 * 7168 + 1536 + 512  # RMSNorm weights, replicated on every TP rank
    assert m.attention_params(8) == pytest.approx(down + split / 8 + norms)


def test_hf_deepseek_config_loads_its_latent_attention(tmp_path):
    cfg = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128,
           "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
           "qk_rope_head_dim": 64, "v_head_dim": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048,
           "vocab_size": 129280, "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1,
           "first_k_dense_replace": 3, "moe_layer_freq": 1, "tie_word_embeddings": False,
           "num_nextn_predict_layers": 1, "n_group": 8, "topk_group": 4}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf = load_scenario({**tiny(), "model": {"hf_config": str(tmp_path)}}).model
    preset = load_scenario({**tiny(), "model": "deepseek-v3"}).model
    assert hf.mla == preset.mla and hf.head_dim == 128 and hf.num_kv_heads == 128 and hf.mtp_layers == 1
    assert hf.total_params() == preset.total_params()
    assert (hf.moe.expert_groups, hf.moe.groups_per_token) == (preset.moe.expert_groups, preset.moe.groups_per_token) \
        == (8, 4)


def test_hf_qwen3_moe_config_normalises_queries_and_keys(tmp_path):
    """transformers' Qwen3 and Qwen3-MoE attention has q_norm / k_norm: model.qk_layernorm, as in the
    preset; Llama's has none."""
    cfg = {"model_type": "qwen3_moe", "num_hidden_layers": 94, "hidden_size": 4096, "num_attention_heads": 64,
           "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 12288, "moe_intermediate_size": 1536,
           "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
           "tie_word_embeddings": False, "hidden_act": "silu"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf = load_scenario({**tiny(), "model": {"hf_config": str(tmp_path)}}).model
    preset = load_scenario({**tiny(), "model": "qwen3-235b-a22b"}).model
    assert hf.qk_layernorm and preset.qk_layernorm
    assert dataclasses.replace(hf, name=preset.name, architecture=None) == preset
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen3"}))
    assert load_scenario({**tiny(), "model": {"hf_config": str(tmp_path)}}).model.qk_layernorm
    assert not load_scenario({**tiny(), "model": "llama3-8b"}).model.qk_layernorm


@pytest.mark.parametrize("extra, key, words", [
    ({"qk_layernorm": True}, "model.qk_layernorm", "MLA's latent norms"),
    ({"num_kv_heads": 8}, "model.num_kv_heads", "every head has its own keys and values"),
    ({"head_dim": 192}, "model.head_dim", "v_head_dim (128)"),
    ({"preset": "llama3-8b", "num_kv_heads": 32,
      "mla": {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_head_dim": 128, "qk_rope_head_dim": 64}},
     "model.mla.v_head_dim", "required"),
    ({"mla": {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_head_dim": 128, "qk_rope_head_dim": 64,
              "v_head_dim": 128, "rope_dim": 64}}, "model.mla.rope_dim", "unknown"),
])
def test_mla_bad_input_names_the_key(extra, key, words):
    err = error_of({**tiny(), "model": {"preset": "deepseek-v3", **extra}})  # extra may name another preset
    assert err.path == key and words in str(err)


def test_negative_mtp_layers_is_rejected():
    err = error_of({**tiny(), "model": {"preset": "deepseek-v3", "mtp_layers": -1}})
    assert err.path == "model.mtp_layers"
    # bounded as the layers are (it had overflowed at 2**63, and run for minutes at 3e7)
    err = error_of({**tiny(), "model": {"preset": "deepseek-v3", "mtp_layers": 2**63}})
    assert str(err) == f"model.mtp_layers: expected an integer from 0 to 100000, got {2**63}"


def test_dropout_defaults_to_megatrons_and_the_presets_say_theirs():
    assert load_scenario(tiny()).model.dropout == 0.1  # Megatron's --hidden-dropout / --attention-dropout
    assert load_scenario({**tiny(), "model": "gpt3-175b"}).model.dropout == 0.1
    for preset in ("llama3-8b", "llama2-7b", "mpt-7b", "mixtral-8x7b", "qwen3-235b-a22b", "deepseek-v3"):
        assert load_scenario({**tiny(), "model": preset}).model.dropout == 0.0, preset
    assert load_scenario(tiny(), ["model.dropout=0"]).model.dropout == 0.0
    for bad, words in (("1.0", "expected a probability in [0, 1), got 1.0"), ("-0.1", "expected a number >= 0"),
                       ("true", "expected a number")):
        err = error_of(tiny(), [f"model.dropout={bad}"])
        assert err.path == "model.dropout" and words in str(err)


def test_linear_biases_default_by_activation_and_the_presets_say_theirs():
    """GELU models have linear biases (GPT-2, GPT-3: Megatron's default), SwiGLU ones do not (the
    Llama family); MPT is a GELU model without them (llm-foundry no_bias)."""
    assert load_scenario(tiny()).model.linear_bias and load_scenario({**tiny(), "model": "gpt3-175b"}).model.linear_bias
    for preset in ("llama3-8b", "mpt-7b", "mpt-30b", "mixtral-8x7b", "qwen3-235b-a22b", "deepseek-v3"):
        assert not load_scenario({**tiny(), "model": preset}).model.linear_bias, preset
    assert load_scenario({**tiny(), "model": {"hf_config": str(FIXTURES / "hf-gpt2")}}).model.linear_bias
    assert not load_scenario({**tiny(), "model": {"hf_config": str(FIXTURES / "hf-llama3-8b")}}).model.linear_bias
    assert not load_scenario(tiny(), ["model.linear_bias=false"]).model.linear_bias
    err = error_of(tiny(), ["model.linear_bias=1"])
    assert err.path == "model.linear_bias" and "expected true or false" in str(err)


@pytest.mark.parametrize("fixture, want", [("hf-gpt2", 0.1), ("hf-llama3-8b", 0.0)])
def test_hf_configs_give_their_dropout(tmp_path, fixture, want):
    folder = FIXTURES / fixture
    assert load_scenario({**tiny(), "model": {"hf_config": str(folder)}}).model.dropout == want


def test_hf_config_dropout_is_read_not_defaulted(tmp_path):
    """The fixtures' values equal the defaults (GPT-2 0.1, Llama 0.0); a config that says otherwise
    is followed."""
    for fixture, key, value in (("hf-gpt2", "resid_pdrop", 0.0), ("hf-llama3-8b", "attention_dropout", 0.05)):
        cfg = json.loads((FIXTURES / fixture / "config.json").read_text())
        cfg[key] = value
        (tmp_path / fixture).mkdir()
        (tmp_path / fixture / "config.json").write_text(json.dumps(cfg))
        assert load_scenario({**tiny(), "model": {"hf_config": str(tmp_path / fixture)}}).model.dropout == value


def test_hf_config_numbers_of_the_wrong_type_are_named(tmp_path):
    """A dropout field that is not a number is named (it was converted with float() and raised a
    traceback); a list as model_type is an unsupported type, not a crash."""
    for fixture, key, value in (("hf-llama3-8b", "attention_dropout", "abc"), ("hf-gpt2", "resid_pdrop", [1])):
        cfg = json.loads((FIXTURES / fixture / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**cfg, key: value}))
        err = error_of({**tiny(), "model": {"hf_config": str(tmp_path)}})
        assert err.path == "model.hf_config" and f"{key}: expected a number" in str(err)
    (tmp_path / "config.json").write_text('{"model_type": ["llama"]}')
    err = error_of({**tiny(), "model": {"hf_config": str(tmp_path)}})
    assert "model_type ['llama'] is not supported" in str(err)


def test_hf_mixtral_config_takes_transformers_expert_defaults(tmp_path):
    """A Mixtral config.json without num_local_experts / num_experts_per_tok is transformers'
    MixtralConfig default, 8 experts top 2: an MoE, not a dense model."""
    cfg = {"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    moe = load_scenario({**tiny(), "model": {"hf_config": str(tmp_path)}}).model.moe
    assert (moe.num_experts, moe.top_k, moe.expert_ffn_hidden_size) == (8, 2, 14336)


MIXTRAL_HF = {"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000}
DEEPSEEK_HF = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128,
               "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
               "qk_rope_head_dim": 64, "v_head_dim": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048,
               "vocab_size": 129280, "n_routed_experts": 256, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4}


@pytest.mark.parametrize("cfg, key", [
    ({**MIXTRAL_HF, "num_local_experts": 0}, "model.moe.num_experts"),  # had become a dense model
    ({**MIXTRAL_HF, "model_type": "llama", "num_key_value_heads": 0}, "model.num_kv_heads"),  # had become MHA
    ({**DEEPSEEK_HF, "n_group": 0}, "model.moe.expert_groups"),  # had become 1
    ({**DEEPSEEK_HF, "moe_layer_freq": 0}, "model.moe.moe_layer_freq"),
    ({**DEEPSEEK_HF, "num_nextn_predict_layers": 1e20}, "model.mtp_layers"),  # had overflowed
])
def test_hf_config_zeros_and_nonsense_are_refused_not_defaulted(tmp_path, cfg, key):
    """transformers' defaults stand in for absent or null keys only."""
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    err = error_of({**tiny(), "model": {"hf_config": str(tmp_path)}})
    assert err.path == key and str(err).endswith(f"(in the model read from hf_config {tmp_path})")


@pytest.mark.parametrize("key, value, limit", [
    ("model.hidden_size", 10**9, "2**20"), ("model.vocab_size", 10**13, "2**24"),
    ("cluster.num_nodes", 10**8, "2**20"), ("training.seq_length", 10**9, "2**26"),
])
def test_sizes_beyond_any_model_or_cluster_are_refused_at_once(key, value, limit):
    """Widths, vocabularies, clusters and sequences far above any published one are refused when
    loaded, instead of a simulation that exhausts the host's memory before reporting an OOM."""
    err = error_of(tiny(), [f"{key}={value}"])
    assert err.path == key and f"expected an integer from 1 to {limit}, got {value}" in str(err)


def test_yaml_nested_too_deep_or_self_referencing_is_one_error(tmp_path):
    for text in ("x: " + "[" * 500 + "]" * 500 + "\n", "a: &a [*a]\n"):
        err = error_of(write(tmp_path, text))
        assert "invalid YAML: nested too deeply" in str(err)
    err = error_of(tiny(), ["search=&a {x: *a}"])
    assert err.path == "--set" and "nested too deeply" in str(err)
    # an anchor used twice side by side is not a cycle
    assert load_scenario(tiny(), ["plan={tp: &t 2, pp: *t}"]).plan.pp == 2


def test_floats_without_a_dot_are_numbers():
    """YAML 1.2 reads 2e0 and 1e-3 as floats; PyYAML's YAML 1.1 rules would leave them strings."""
    sc = load_scenario("scenarios/mixtral-8x7b-64xh100.yaml", ["model.moe.capacity_factor=2e0"])
    assert sc.model.moe.capacity_factor == 2.0


def test_a_histogram_whose_sum_overflows_is_refused():
    err = error_of("scenarios/mixtral-8x7b-64xh100.yaml", [
        "model.moe.routing.distribution=histogram",
        "model.moe.routing.tokens_per_expert=[1.7e+308, 1.7e+308, 1.7e+308, 1, 1, 1, 1, 1]"])
    assert err.path == "model.moe.routing.tokens_per_expert" and "beyond a float's range" in str(err)


def test_an_integer_with_a_leading_zero_is_refused_not_read_as_octal():
    """YAML 1.1 reads 040 as 32 (and 016 as 14): a batch of 40 would have run as 32."""
    err = error_of(tiny(), ["training.global_batch_size=040"])
    assert "'040' has a leading zero, which YAML 1.1 reads as octal" in str(err)
    assert load_scenario(tiny(), ["training.global_batch_size=40"]).training.global_batch_size == 40
