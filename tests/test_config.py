"""ModelConfig: the known architectures, HF config parsing (legacy and transformers-5 rope fields),
Llama-3 rope scaling, and clear refusals of what minfer does not implement."""

import json

import pytest
import torch

from minfer.config import ALIASES, KNOWN_CONFIGS, ModelConfig
from minfer.errors import CheckpointError

# Published parameter counts of the HF checkpoints.
PARAMS = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "tinyllama-1.1b": 1_100_048_384,
}

LLAMA31_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}


def tiny_hf(**overrides) -> dict:
    base = {"model_type": "llama", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    return base | overrides


def test_every_alias_has_an_embedded_config():
    assert set(ALIASES) == set(KNOWN_CONFIGS)
    for alias in ALIASES:
        assert ALIASES[alias].count("/") == 1


@pytest.mark.parametrize("alias", sorted(PARAMS))
def test_known_configs_have_the_published_size(alias):
    config = ModelConfig.from_hf(KNOWN_CONFIGS[alias])
    assert config.param_count() == PARAMS[alias]
    assert config.weight_bytes(torch.float16) == 2 * PARAMS[alias]


def test_known_architecture_details():
    llama2_70b = ModelConfig.from_hf(KNOWN_CONFIGS["llama2-70b"])
    assert (llama2_70b.num_heads, llama2_70b.num_kv_heads, llama2_70b.head_dim) == (64, 8, 128)
    llama3 = ModelConfig.from_hf(KNOWN_CONFIGS["llama3-8b"])
    assert (llama3.rope_theta, llama3.vocab_size, llama3.bos_token_id) == (500000.0, 128256, 128000)
    assert llama3.rope_scaling is None
    assert ModelConfig.from_hf(KNOWN_CONFIGS["llama3.1-8b"]).rope_scaling == LLAMA31_SCALING
    assert KNOWN_CONFIGS["llama2-7b-chat"] == KNOWN_CONFIGS["llama2-7b"]


def test_defaults_for_optional_fields():
    config = ModelConfig.from_hf(tiny_hf(num_key_value_heads=None, eos_token_id=[7, 8, 9]))
    assert config.num_kv_heads == 4 and config.head_dim == 16
    assert config.eos_token_id == 7
    assert config.rope_scaling is None and config.rope_theta == 10000.0


def test_legacy_and_transformers5_rope_fields_agree():
    legacy = ModelConfig.from_hf(tiny_hf(rope_theta=500000.0, rope_scaling=dict(LLAMA31_SCALING)))
    modern = ModelConfig.from_hf(tiny_hf(rope_parameters={"rope_theta": 500000.0, **LLAMA31_SCALING}))
    old_style_type = ModelConfig.from_hf(tiny_hf(rope_theta=500000.0, rope_scaling={
        "type": "llama3", **{k: v for k, v in LLAMA31_SCALING.items() if k != "rope_type"}}))
    assert legacy == modern == old_style_type
    assert legacy.rope_scaling == LLAMA31_SCALING
    plain = ModelConfig.from_hf(tiny_hf(rope_parameters={"rope_type": "default", "rope_theta": 1234.0}))
    assert (plain.rope_theta, plain.rope_scaling) == (1234.0, None)


def test_round_trip_through_transformers():
    transformers = pytest.importorskip("transformers")
    config = ModelConfig.from_hf(tiny_hf(rope_theta=500000.0, rope_scaling=dict(LLAMA31_SCALING),
                                         tie_word_embeddings=True, rms_norm_eps=1e-5))
    hf = transformers.LlamaConfig(**config.to_hf())
    assert ModelConfig.from_hf(hf.to_dict()) == config
    assert ModelConfig.from_hf(config.to_hf()) == config


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"attention_bias": True}, "biases are not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn' is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks low_freq_factor"),
])
def test_unsupported_configs_are_refused(change, message):
    with pytest.raises(CheckpointError, match=message):
        ModelConfig.from_hf(tiny_hf(**change))


def test_missing_field_is_named():
    hf = tiny_hf()
    del hf["intermediate_size"]
    with pytest.raises(CheckpointError, match="intermediate_size"):
        ModelConfig.from_hf(hf)


@pytest.mark.parametrize("change", [{"hidden_size": None}, {"num_key_value_heads": "eight"},
                                    {"num_attention_heads": 0}])
def test_malformed_field_is_a_checkpoint_error(change):
    with pytest.raises(CheckpointError, match="malformed field"):
        ModelConfig.from_hf(tiny_hf(**change))


def test_from_json(tmp_path):
    path = tmp_path / "config.json"
    with pytest.raises(CheckpointError, match="no config.json"):
        ModelConfig.from_json(path)
    path.write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        ModelConfig.from_json(path)
    path.write_text(json.dumps(tiny_hf()))
    assert ModelConfig.from_json(path).vocab_size == 97
