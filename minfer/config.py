"""Model architecture: `ModelConfig` read from an HF `config.json`, plus the known Llama aliases.

`KNOWN_CONFIGS` holds the exact HF configs of the aliased models, so `--weights random` builds
their architecture without any download.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .errors import CheckpointError

ALIASES: dict[str, str] = {
    "llama2-7b": "meta-llama/Llama-2-7b-hf",
    "llama2-7b-chat": "meta-llama/Llama-2-7b-chat-hf",
    "llama2-13b": "meta-llama/Llama-2-13b-hf",
    "llama2-13b-chat": "meta-llama/Llama-2-13b-chat-hf",
    "llama2-70b": "meta-llama/Llama-2-70b-hf",
    "llama2-70b-chat": "meta-llama/Llama-2-70b-chat-hf",
    "llama3-8b": "meta-llama/Meta-Llama-3-8B",
    "llama3.1-8b": "meta-llama/Llama-3.1-8B",
    "tinyllama-1.1b": "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
}


def _llama2(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int) -> dict:
    return {
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def _llama3_8b(max_positions: int, rope_scaling: dict | None) -> dict:
    return {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    }


_LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

KNOWN_CONFIGS: dict[str, dict] = {
    "llama2-7b": _llama2(4096, 11008, 32, 32, 32),
    "llama2-13b": _llama2(5120, 13824, 40, 40, 40),
    "llama2-70b": _llama2(8192, 28672, 80, 64, 8),
    "llama3-8b": _llama3_8b(8192, None),
    "llama3.1-8b": _llama3_8b(131072, _LLAMA31_ROPE),
    "tinyllama-1.1b": {
        **_llama2(2048, 5632, 22, 32, 4),
        "max_position_embeddings": 2048,
    },
}
for _size in ("7b", "13b", "70b"):
    KNOWN_CONFIGS[f"llama2-{_size}-chat"] = KNOWN_CONFIGS[f"llama2-{_size}"]

_ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None, or Llama-3 scaling: {"rope_type": "llama3", factor, ...}
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int
    eos_token_id: int

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        """Parse an HF Llama `config.json` dict (legacy rope_theta/rope_scaling or transformers-5
        rope_parameters); refuses architectures minfer does not implement, and values no model has
        (sizes that are negative or fractional, floats that are not finite and positive), naming the field."""
        if not isinstance(hf, dict):
            raise CheckpointError(f"config.json must hold a JSON object of fields, got {type(hf).__name__} "
                                  f"{_shown(hf)}; is this a Llama checkpoint?")
        model_type = hf.get("model_type", "llama")
        if model_type != "llama":
            raise CheckpointError(f"model_type {model_type!r} is not supported; minfer runs Llama-family checkpoints")
        if hf.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"hidden_act {hf['hidden_act']!r} is not supported; Llama uses silu")
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise CheckpointError("projection biases are not supported; Llama projections are bias-free")
        try:
            hidden, heads = _whole(hf, "hidden_size"), _whole(hf, "num_attention_heads")
            kv_heads = _whole(hf, "num_key_value_heads", default=heads)
            head_dim = _whole(hf, "head_dim", default=hidden // heads, minimum=2)
            vocab, layers, intermediate = (_whole(hf, key) for key in ("vocab_size", "num_hidden_layers",
                                                                         "intermediate_size"))
            eos = hf.get("eos_token_id", 2)
            if isinstance(eos, list) and eos:  # Llama 3.1 instruct lists several; the first ends the text
                eos = eos[0]
            config = cls(
                vocab_size=vocab,
                hidden_size=hidden,
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                intermediate_size=intermediate,
                rms_norm_eps=_positive_float("rms_norm_eps", hf.get("rms_norm_eps", 1e-6)),
                rope_theta=_positive_float("rope_theta", _rope_field(hf, "rope_theta", 10000.0)),
                rope_scaling=_parse_rope_scaling(hf),
                max_position_embeddings=_whole(hf, "max_position_embeddings", default=2048, minimum=2),
                tie_word_embeddings=_flag(hf, "tie_word_embeddings"),
                bos_token_id=_whole(hf, "bos_token_id", default=1, minimum=0),
                eos_token_id=_whole({"eos_token_id": eos}, "eos_token_id", minimum=0),
            )
        except KeyError as missing:
            raise CheckpointError(f"config.json lacks the field {missing}; is this a Llama checkpoint?") from None
        if head_dim % 2:
            raise CheckpointError(f"config.json has head_dim {head_dim}; rotary embeddings need an even head_dim")
        if heads % kv_heads:
            raise CheckpointError(f"config.json has num_attention_heads {heads}, not a multiple of "
                                  f"num_key_value_heads {kv_heads}: query heads must share key/value heads evenly")
        return config

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        try:
            with open(path, encoding="utf-8") as f:
                return cls.from_hf(json.load(f))
        except FileNotFoundError:
            raise CheckpointError(f"no config.json at {path}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path} is not valid JSON ({e})") from None
        except OSError as e:  # a folder named config.json, no permission, ...
            raise CheckpointError(f"cannot read {path} ({e.strerror})") from None

    def to_hf(self) -> dict:
        """The HF `config.json` dict (legacy rope fields, read by every transformers version)."""
        fields = asdict(self)
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "vocab_size": fields["vocab_size"],
            "hidden_size": fields["hidden_size"],
            "num_hidden_layers": fields["num_layers"],
            "num_attention_heads": fields["num_heads"],
            "num_key_value_heads": fields["num_kv_heads"],
            "head_dim": fields["head_dim"],
            "intermediate_size": fields["intermediate_size"],
            "rms_norm_eps": fields["rms_norm_eps"],
            "rope_theta": fields["rope_theta"],
            "rope_scaling": fields["rope_scaling"],
            "max_position_embeddings": fields["max_position_embeddings"],
            "tie_word_embeddings": fields["tie_word_embeddings"],
            "bos_token_id": fields["bos_token_id"],
            "eos_token_id": fields["eos_token_id"],
        }

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def param_count(self) -> int:
        """Parameters stored once (a tied lm_head shares the embedding)."""
        h = self.hidden_size
        attention = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        mlp = 3 * h * self.intermediate_size
        per_layer = attention + mlp + 2 * h
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h

    def weight_bytes(self, dtype: torch.dtype) -> int:
        return self.param_count() * dtype.itemsize



# Sizes beyond int32 fit no kernel index (and no machine's memory).
_MAX_SIZE = 2**31 - 1


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _malformed(key: str, wanted: str, value) -> CheckpointError:
    return CheckpointError(f"config.json has a malformed field: {key} must be {wanted}, got {_shown(value)}")


def _whole(fields: dict, key: str, default: int | None = None, minimum: int = 1) -> int:
    """fields[key] as a whole number in [minimum, _MAX_SIZE]; an absent or null optional field is
    `default`. 64.0 is 64, while 64.7 is refused rather than truncated."""
    value = fields[key] if default is None else fields.get(key)
    value = default if value is None else value
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= _MAX_SIZE:
        raise _malformed(key, f"a whole number in [{minimum}, {_MAX_SIZE}]", value)
    return value


def _positive_float(key: str, value) -> float:
    """A finite number > 0: a zero, negative or NaN eps or rope_theta would make every logit NaN."""
    number = math.nan
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an integer beyond float range
            number = math.inf
    if not (math.isfinite(number) and number > 0):
        raise _malformed(key, "a finite number > 0", value)
    return number


def _flag(fields: dict, key: str) -> bool:
    value = fields.get(key, False)
    if not isinstance(value, bool):  # bool("false") would be True
        raise _malformed(key, "true or false", value)
    return value


def _rope_field(hf: dict, key: str, default):
    """A rope field from transformers-5 rope_parameters, else from the top level."""
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise _malformed("rope_parameters", "an object", params)
    return params.get(key, hf.get(key, default))


def _parse_rope_scaling(hf: dict) -> dict | None:
    source = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    scaling = hf.get(source) or {}
    if not isinstance(scaling, dict):
        raise _malformed(source, "an object", scaling)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise CheckpointError(f"rope scaling {rope_type!r} is not supported; minfer implements 'llama3' scaling only")
    missing = [k for k in _ROPE_SCALING_KEYS if k not in scaling]
    if missing:
        raise CheckpointError(f"llama3 rope scaling lacks {', '.join(missing)} in config.json")
    values = {key: _positive_float(f"{source}.{key}", scaling[key])
              for key in ("factor", "low_freq_factor", "high_freq_factor")}
    if values["factor"] < 1.0:
        raise CheckpointError(f"llama3 rope scaling factor must be >= 1, got {values['factor']}")
    if values["high_freq_factor"] <= values["low_freq_factor"]:
        raise CheckpointError(f"llama3 rope scaling needs high_freq_factor > low_freq_factor in config.json, got "
                              f"{values['high_freq_factor']} and {values['low_freq_factor']}")
    key = "original_max_position_embeddings"
    return {"rope_type": "llama3", **values, key: _whole(scaling, key)}
