"""The model architecture that megatron_args.txt and torchtitan.toml build: the emitted arguments
parsed the way Megatron-LM's pretrain_gpt.py parses them must give the preset's normalization,
position embedding, biases, attention, router and vocabulary, not Megatron's GPT-2 defaults."""
import argparse
import dataclasses
import math
from pathlib import Path

import pytest

from paraplan.loader import load_scenario
from planner.emit import megatron_args, megatron_args_text, torchtitan_toml
from planner.model_families import FAMILIES, LLAMA3, family_of, megatron_architecture_args

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "scenarios" / "tiny-gpt-8xa100.yaml"
SCENARIOS = sorted(p.stem for p in (ROOT / "scenarios").glob("*.yaml"))
tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def scenario(name, *overrides):
    return load_scenario(ROOT / "scenarios" / f"{name}.yaml", list(overrides))


def megatron_parse(args, *, defaults=True):
    """`args` as pretrain_gpt.py reads the architecture from them: flag names, actions and defaults
    restated from megatron/training/arguments.py (_add_network_size_args, _add_training_args for
    --disable-bias-linear / --add-qkv-bias / --rope-type, _add_vision_args for --qk-layernorm,
    _add_moe_args, _add_mla_args). defaults=False leaves the choice-valued defaults unset, to see
    what the file states itself rather than what today's Megatron would assume."""
    d = (lambda value: value) if defaults else (lambda value: None)
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--normalization", default=d("LayerNorm"), choices=["LayerNorm", "RMSNorm"])
    p.add_argument("--norm-epsilon", type=float, default=d(1e-5))
    p.add_argument("--position-embedding-type", default=d("learned_absolute"),
                   choices=["learned_absolute", "rope", "mrope", "relative", "none"])
    p.add_argument("--rotary-base", type=int, default=10000)
    p.add_argument("--use-rope-scaling", action="store_true")
    p.add_argument("--rope-type", default=None, choices=["rope", "yarn"])
    p.add_argument("--rotary-scaling-factor", type=float, default=1.0)
    p.add_argument("--mscale", type=float, default=1.0)
    p.add_argument("--mscale-all-dim", type=float, default=0.0)
    p.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    p.add_argument("--add-qkv-bias", action="store_true")
    p.add_argument("--qk-layernorm", action="store_true")
    p.add_argument("--swiglu", action="store_true")
    p.add_argument("--hidden-dropout", type=float, default=0.1)
    p.add_argument("--attention-dropout", type=float, default=0.1)
    p.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    p.add_argument("--group-query-attention", action="store_true")
    p.add_argument("--num-query-groups", type=int, default=1)
    p.add_argument("--num-attention-heads", type=int)
    p.add_argument("--kv-channels", type=int)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument("--num-experts", type=int)
    p.add_argument("--moe-router-score-function", default="softmax", choices=["softmax", "sigmoid"])
    p.add_argument("--moe-router-enable-expert-bias", action="store_true")
    p.add_argument("--moe-router-pre-softmax", action="store_true")
    p.add_argument("--moe-router-topk-scaling-factor", type=float)
    p.add_argument("--moe-router-num-groups", type=int)
    p.add_argument("--moe-router-group-topk", type=int)
    ns, _ = p.parse_known_args(args)
    return ns


def padded_vocabulary(ns, tokenizer_size):
    """megatron/training/tokenizer/tokenizer.py _vocab_size_with_padding."""
    multiple = ns.make_vocab_size_divisible_by * ns.tensor_model_parallel_size
    return math.ceil(tokenizer_size / multiple) * multiple


@pytest.mark.parametrize("name", ["llama3-8b-64xh100", "llama3-70b-512xh100", "llama3-405b-16384xh100"])
def test_llama_arguments_build_llama(name):
    """meta-llama/Llama-3.1-*/config.json: RMSNorm 1e-5, RoPE 500000 with llama3 scaling, no
    biases, 8 KV heads of 128, SwiGLU, untied; the 128256-entry vocabulary kept at any tp."""
    sc = scenario(name)
    ns = megatron_parse(megatron_args(sc))
    assert (ns.normalization, ns.norm_epsilon) == ("RMSNorm", 1e-5)
    assert (ns.position_embedding_type, ns.rotary_base, ns.use_rope_scaling) == ("rope", 500000, True)
    assert not ns.add_bias_linear and not ns.add_qkv_bias and not ns.qk_layernorm
    assert ns.swiglu and ns.untie_embeddings_and_output_weights
    assert (ns.group_query_attention, ns.num_query_groups, ns.kv_channels) == (True, 8, 128)
    assert padded_vocabulary(ns, 128256) == 128256


def test_gpt3_arguments_state_gpt3_and_nothing_of_llama():
    """Brown et al. 2020: GPT-2's architecture (LayerNorm, learned positions, biases, GELU, tied
    embeddings, full multi-head attention), stated in the file rather than left to Megatron's
    defaults; GPT-2's 50257-token tokenizer padded to the simulated 51200."""
    sc = scenario("gpt3-175b-1024xa100")
    args = megatron_args(sc)
    ns = megatron_parse(args, defaults=False)
    assert (ns.normalization, ns.norm_epsilon, ns.position_embedding_type) == ("LayerNorm", 1e-5, "learned_absolute")
    assert ns.add_bias_linear and not ns.swiglu and not ns.untie_embeddings_and_output_weights
    assert not ns.group_query_attention and not ns.qk_layernorm and not ns.use_rope_scaling
    assert padded_vocabulary(ns, 50257) == 51200
    assert "Architecture: GPT-3: LayerNorm" in megatron_args_text(sc)


@pytest.mark.parametrize("name", SCENARIOS)
def test_megatron_keeps_the_simulated_vocabulary(name):
    """A tokenizer of vocab_size entries comes out at vocab_size, not padded to 128 x tp."""
    sc = scenario(name)
    assert padded_vocabulary(megatron_parse(megatron_args(sc)), sc.model.vocab_size) == sc.model.vocab_size


def test_deepseek_v3_arguments_build_its_attention_and_router():
    """deepseek-ai/DeepSeek-V3 config.json: RMSNorm 1e-6 (also on the MLA latents), YaRN factor
    40 with mscale = mscale_all_dim = 1, no biases; sigmoid router with expert bias, top-8 of 4 of
    8 groups, scaled by 2.5 (transformer_config.py: experts divisible by the groups)."""
    ns = megatron_parse(megatron_args(scenario("deepseek-v3-2048xh800")))
    assert (ns.normalization, ns.norm_epsilon, ns.position_embedding_type) == ("RMSNorm", 1e-6, "rope")
    assert (ns.rope_type, ns.rotary_base, ns.rotary_scaling_factor, ns.mscale, ns.mscale_all_dim) == \
        ("yarn", 10000, 40.0, 1.0, 1.0)
    assert ns.qk_layernorm and not ns.add_bias_linear and ns.swiglu and ns.untie_embeddings_and_output_weights
    assert (ns.moe_router_score_function, ns.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert (ns.moe_router_num_groups, ns.moe_router_group_topk, ns.moe_router_topk_scaling_factor) == (8, 4, 2.5)
    assert ns.num_experts % ns.moe_router_num_groups == 0


def test_group_limited_routing_follows_the_model():
    """The simulated groups are the emitted ones: none without a limit, the scenario's own with one."""
    sc = scenario("deepseek-v3-2048xh800")
    free = dataclasses.replace(sc, model=dataclasses.replace(
        sc.model, moe=dataclasses.replace(sc.model.moe, groups_per_token=sc.model.moe.expert_groups)))
    assert "--moe-router-num-groups" not in megatron_args(free)
    assert "--moe-router-score-function" in megatron_architecture_args(free.model)
    mixtral = scenario("mixtral-8x7b-64xh100")
    grouped = dataclasses.replace(mixtral, model=dataclasses.replace(
        mixtral.model, moe=dataclasses.replace(mixtral.model.moe, expert_groups=4, groups_per_token=2)))
    ns = megatron_parse(megatron_args(grouped))
    assert (ns.moe_router_num_groups, ns.moe_router_group_topk) == (4, 2)


@pytest.mark.parametrize("name, groups, base, eps", [("qwen3-235b-256xh100", 4, 1000000, 1e-6),
                                                      ("mixtral-8x7b-64xh100", 8, 1000000, 1e-5)])
def test_moe_presets_build_their_attention(name, groups, base, eps):
    """Qwen/Qwen3-235B-A22B (QK norm) and mistralai/Mixtral-8x7B-v0.1 config.json; both routers
    are Megatron's default (top-k, then softmax)."""
    ns = megatron_parse(megatron_args(scenario(name)))
    assert (ns.normalization, ns.norm_epsilon, ns.position_embedding_type, ns.rotary_base) == \
        ("RMSNorm", eps, "rope", base)
    assert ns.qk_layernorm == name.startswith("qwen3")
    assert megatron_args(scenario(name)).count("--qk-layernorm") == name.startswith("qwen3")
    assert (ns.num_query_groups, ns.add_bias_linear, ns.moe_router_score_function) == (groups, False, "softmax")


def test_query_key_norm_is_the_models_own_flag():
    """--qk-layernorm follows model.qk_layernorm (any model); a Qwen3-named model without it has left
    the family; DeepSeek-V3's latent norms still get the flag from its family, once."""
    llama = scenario("llama3-8b-64xh100")
    normed = dataclasses.replace(llama, model=dataclasses.replace(llama.model, qk_layernorm=True))
    assert megatron_parse(megatron_args(normed)).qk_layernorm and not megatron_parse(megatron_args(llama)).qk_layernorm
    assert family_of(normed.model) is None  # Llama 3 has no query/key norm
    qwen = scenario("qwen3-235b-256xh100")
    assert family_of(dataclasses.replace(qwen.model, qk_layernorm=False)) is None
    assert megatron_args(scenario("deepseek-v3-2048xh800")).count("--qk-layernorm") == 1


def test_families_agree_with_the_bundled_presets():
    """Every preset a family names loads into that family; MPT (ALiBi) belongs to none."""
    for fam in FAMILIES:
        for preset in fam.presets:
            assert family_of(load_scenario(TINY, [f"model={preset}"]).model) is fam, preset
    for preset in ("mpt-7b", "mpt-30b"):
        assert family_of(load_scenario(TINY, [f"model={preset}"]).model) is None


def test_a_model_that_left_its_family_gets_no_guessed_flags():
    """Sizes may change (the family holds); an activation, tying, biases or attention kind unlike
    the family's drops it, and the file names the flags to set instead. So does a model of no
    family. Its linear biases are the model's own: --disable-bias-linear where it has none."""
    bigger = load_scenario(TINY, ["model=llama3-8b", "model.num_layers=8"])
    assert megatron_parse(megatron_args(bigger)).normalization == "RMSNorm"
    for sc, biased in ((load_scenario(TINY, ["model=llama3-8b", "model.tied_embeddings=true"]), False),
                       (load_scenario(TINY, ["model=llama3-8b", "model.linear_bias=true"]), True),
                       (scenario("tiny-gpt-8xa100"), True),
                       (load_scenario(TINY, ["model.linear_bias=false"]), False)):
        args, text = megatron_args(sc), megatron_args_text(sc)
        assert family_of(sc.model) is None
        assert "--normalization" not in args and ("--disable-bias-linear" in args) == (not biased)
        assert megatron_parse(args).add_bias_linear == biased
        assert "leave Megatron-LM's defaults" in text and "--position-embedding-type (rope with --rotary-base)" in text


@pytest.mark.parametrize("config, want", [
    ({"model_type": "qwen2", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0},
     dict(normalization="RMSNorm", norm_epsilon=1e-6, position_embedding_type="rope", rotary_base=1000000,
          add_qkv_bias=True, add_bias_linear=False, use_rope_scaling=False)),
    ({"model_type": "llama", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
      "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     dict(normalization="RMSNorm", norm_epsilon=1e-5, position_embedding_type="rope", rotary_base=500000,
          add_qkv_bias=False, add_bias_linear=False, use_rope_scaling=True)),
    ({"model_type": "mistral"},  # transformers' MistralConfig defaults
     dict(normalization="RMSNorm", norm_epsilon=1e-6, position_embedding_type="rope", rotary_base=10000,
          add_qkv_bias=False, add_bias_linear=False, use_rope_scaling=False)),
])
def test_a_config_json_model_builds_its_own_architecture(tmp_path, config, want):
    """A model read from a Hugging Face config.json is no bundled family, but its config states the
    normalization, position embedding and biases: the Megatron-LM arguments build those, not
    Megatron's GPT-2 defaults."""
    import json

    shape = {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 512, "vocab_size": 1024, "hidden_act": "silu"}
    (tmp_path / "config.json").write_text(json.dumps({**shape, **config}))
    sc = load_scenario(TINY, [f"model={{hf_config: {tmp_path / 'config.json'}}}"])
    ns = megatron_parse(megatron_args(sc), defaults=False)
    assert {k: getattr(ns, k) for k in want} == want
    assert "Architecture: as model.architecture states it" in megatron_args_text(sc)


@pytest.mark.parametrize("scaling, flags, note", [
    ({"type": "linear", "factor": 4.0}, ["--rotary-seq-len-interpolation-factor", "4"], None),
    ({"rope_type": "dynamic", "factor": 2.0}, [], "Megatron-LM has no flag for the config's dynamic scaling"),
    # Megatron-LM reads --rope-type for multi-latent attention only: nothing to write for a Llama
    ({"rope_type": "yarn", "factor": 4.0}, [], "Megatron-LM builds YaRN for multi-latent attention only"),
    ({"rope_type": "llama3", "factor": 32.0}, ["--use-rope-scaling", "--rope-scaling-factor", "32"], None),
])
def test_a_config_json_rope_scaling_is_built_or_said_to_be_left_out(tmp_path, scaling, flags, note):
    import json

    cfg = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 512, "vocab_size": 1024, "rope_scaling": scaling}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    sc = load_scenario(TINY, [f"model={{hf_config: {tmp_path / 'config.json'}}}"])
    args = megatron_args(sc)
    assert all(f in args for f in flags) and ("--use-rope-scaling" in args) == ("--use-rope-scaling" in flags)
    assert ("--rope-type" in args) == ("--rope-type" in flags)
    assert (note in megatron_args_text(sc)) if note else "Note: Megatron-LM has no flag" not in megatron_args_text(sc)


def test_a_stated_architecture_wins_over_the_preset_name():
    """model.architecture on a preset-named model is what the simulator prices, so it is what the
    launch configs build; a rope without a base still gets its scaling flags."""
    sc = load_scenario(TINY, ["model={preset: llama3-8b, architecture: {normalization: layernorm, norm_epsilon: 1e-6, "
                              "position_embedding: learned}}"])
    ns = megatron_parse(megatron_args(sc), defaults=False)
    assert (ns.normalization, ns.position_embedding_type) == ("LayerNorm", "learned_absolute") and not sc.model.rotary
    sc = load_scenario(TINY, ["model.activation=swiglu", "model.architecture={normalization: rmsnorm, norm_epsilon: 1e-5, "
                              "position_embedding: rope, rope_scaling: llama3, rope_scaling_factor: 32}"])
    args = megatron_args(sc)
    assert "--rotary-base" not in args and args[args.index("--rope-scaling-factor") + 1] == "32"
    assert "RoPE (Megatron-LM's base) with Llama 3.1 scaling (factor 32)" in megatron_args_text(sc)


def test_a_llama_attention_bias_is_built_where_megatron_can_and_said_where_it_cannot(tmp_path):
    """transformers' LlamaAttention biases q, k, v and o with attention_bias: Megatron's --add-qkv-bias
    gives the first three, and the file says the output projection's is left out."""
    import json

    cfg = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 512, "vocab_size": 1024, "attention_bias": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    sc = load_scenario(TINY, [f"model={{hf_config: {tmp_path / 'config.json'}}}"])
    assert megatron_parse(megatron_args(sc)).add_qkv_bias
    assert "also biases the attention's output projection" in megatron_args_text(sc)


def test_gpt2_config_builds_layernorm_and_learned_positions():
    sc = load_scenario(TINY, [f"model={{hf_config: {ROOT / 'tests' / 'fixtures' / 'hf-gpt2'}}}"])
    ns = megatron_parse(megatron_args(sc), defaults=False)
    assert (ns.normalization, ns.position_embedding_type, ns.add_bias_linear) == ("LayerNorm", "learned_absolute", True)


def llama3_ffn(dim, multiple_of, multiplier):
    """torchtitan compute_ffn_hidden_dim (models/llama3): 2/3 of 4 x dim, times the multiplier,
    rounded up to a multiple."""
    hidden = int(multiplier * int(2 * 4 * dim / 3))
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def test_torchtitan_llama3_flavors_are_the_ones_torchtitan_defines():
    """torchtitan/models/llama3/__init__.py: 8B (4096, 32 layers, 32/8 heads, multiple_of 1024,
    x1.3), 70B (8192, 80, 64/8, 4096, x1.3), 405B (16384, 126, 128/8, 4096, x1.2)."""
    defined = {"8B": (32, 4096, 32, 8, llama3_ffn(4096, 1024, 1.3)),
               "70B": (80, 8192, 64, 8, llama3_ffn(8192, 4096, 1.3)),
               "405B": (126, 16384, 128, 8, llama3_ffn(16384, 4096, 1.2))}
    assert dict(LLAMA3.torchtitan_flavors) == defined


@pytest.mark.parametrize("overrides, name, flavor", [
    (["model=llama3-70b"], "llama3", "70B"),
    (["model=llama3-70b", "model.num_layers=40"], "llama3", "CHANGE-ME"),  # no torchtitan flavor of that depth
    (["model=llama2-7b"], "llama3", "CHANGE-ME"),  # Llama's architecture, RoPE base 10000: a flavor to define
    (["model=mixtral-8x7b"], "CHANGE-ME", "CHANGE-ME"),
    (["model.activation=swiglu"], "CHANGE-ME", "CHANGE-ME"),  # a SwiGLU model of no known family
])
def test_torchtitan_names_a_model_only_where_it_is_that_model(overrides, name, flavor):
    text = torchtitan_toml(load_scenario(TINY, overrides))
    model = tomllib.loads(text)["model"]
    assert (model["name"], model["flavor"]) == (name, flavor)
    assert "# Architecture: " in text


@pytest.mark.parametrize("name, dropout", [("gpt3-175b-1024xa100", 0.1), ("llama3-70b-1024xh100", 0.0),
                                           ("deepseek-v3-2048xh800", 0.0)])
def test_megatron_trains_with_the_simulated_dropout(name, dropout):
    ns = megatron_parse(megatron_args(scenario(name)))
    assert ns.hidden_dropout == ns.attention_dropout == dropout == scenario(name).model.dropout
