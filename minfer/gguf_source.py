"""Llama checkpoints in llama.cpp's GGUF format, read with the `gguf` package (llama.cpp's own reader).

A GGUF file holds the architecture as metadata and the tensors under llama.cpp names. This module
turns the metadata into a `ModelConfig`, renames the tensors to HF names, and undoes the rotary
layout llama.cpp gives q and k: their rows are stored per head in the interleaved (adjacent-pair)
order, while minfer, like HF, rotates the two halves of a head. F32, F16 and BF16 tensors load;
quantized ones are refused. The file is memory-mapped read-only and nothing in it is executed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .config import ModelConfig
from .errors import CheckpointError
from .model import hf_tensor_map

ARCHITECTURE = "llama"
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_BLOCK_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name for an HF Llama tensor name (model.layers.N.<x> -> blk.N.<y>)."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_BLOCK_NAMES[rest]}"


def _shortest(value):
    """GGUF stores these floats as float32: the shortest decimal that rounds to it (1e-05, not
    9.999999747378752e-06), the value the model's authors wrote. Non-floats pass for the config's checks."""
    return float(str(np.float32(value))) if isinstance(value, float) else value


def halves_from_interleaved(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Reorder each head's rows from the interleaved rotary layout to the half-split one: row 2i + j
    (j in {0, 1}) of a head of dimension h becomes row j * h/2 + i."""
    rows, cols = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


class GGUFCheckpoint:
    """A GGUF file opened for reading: its config, and its tensors under HF names in the HF layout."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        try:
            self._reader = gguf.GGUFReader(self.path, "r")
        except Exception as e:  # the reader raises ValueError, IndexError, ... for damaged headers
            raise CheckpointError(f"{self.path} is not a readable GGUF file ({type(e).__name__}: {e})") from None
        self._tensors = {tensor.name: tensor for tensor in self._reader.tensors}
        architecture = self._field("general.architecture")
        if architecture != ARCHITECTURE:
            raise CheckpointError(f"{self.path} holds a {architecture!r} model; minfer reads Llama GGUF files "
                                  f"(general.architecture = {ARCHITECTURE!r})")
        for name, tensor in self._tensors.items():
            if tensor.tensor_type.name not in FLOAT_TYPES:
                raise CheckpointError(f"{self.path}: tensor {name} is quantized ({tensor.tensor_type.name}); minfer "
                                      f"reads {', '.join(FLOAT_TYPES)} tensors only: convert the model from its "
                                      "unquantized weights")
        self.config = self._read_config()
        layout = hf_tensor_map(self.config)  # no lm_head when it is tied
        self._names = {hf: gguf_name(hf) for hf in layout}
        missing = [name for name in self._names.values() if name not in self._tensors]
        unexpected = sorted(set(self._tensors) - set(self._names.values()) - {"output.weight"})
        if missing or unexpected:
            what = f"lacks tensor {missing[0]}" if missing else f"has tensor {unexpected[0]}, which minfer's Llama " \
                "of this config does not use"
            raise CheckpointError(f"{self.path} {what}")
        for hf, (_, _, expected) in layout.items():
            if self.shape(hf) != expected:
                raise CheckpointError(f"{self.path}: tensor {self._names[hf]} has shape {self.shape(hf)}, expected "
                                      f"{expected} from the file's metadata")

    def _field(self, key: str, default=None):
        field = self._reader.fields.get(key)
        if field is None:
            if default is None:
                raise CheckpointError(f"{self.path} lacks the metadata field {key}; is this a Llama GGUF file?")
            return default
        try:
            return field.contents()
        except Exception as e:  # a value of an unexpected type
            raise CheckpointError(f"{self.path} has an unreadable metadata field {key} ({e})") from None

    def _shape(self, name: str) -> tuple[int, ...]:
        """A tensor's logical shape in PyTorch order (GGUF lists the fastest dimension first)."""
        if name not in self._tensors:
            raise CheckpointError(f"{self.path} lacks tensor {name}")
        return tuple(int(n) for n in reversed(self._tensors[name].shape.tolist()))

    def _read_config(self) -> ModelConfig:
        arch = ARCHITECTURE
        scaling = self._field(f"{arch}.rope.scaling.type", "none")
        if scaling != "none":
            raise CheckpointError(f"{self.path} uses {scaling!r} rope scaling, which minfer does not read from GGUF")
        heads = self._field(f"{arch}.attention.head_count")
        hf = {
            "model_type": "llama",
            "vocab_size": self._shape("token_embd.weight")[0],
            "hidden_size": self._field(f"{arch}.embedding_length"),
            "intermediate_size": self._field(f"{arch}.feed_forward_length"),
            "num_hidden_layers": self._field(f"{arch}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._field(f"{arch}.attention.head_count_kv", heads),
            "rms_norm_eps": _shortest(self._field(f"{arch}.attention.layer_norm_rms_epsilon")),
            "rope_theta": _shortest(self._field(f"{arch}.rope.freq_base", 10000.0)),
            "max_position_embeddings": self._field(f"{arch}.context_length"),
            "tie_word_embeddings": self._output_is_tied(),
            "bos_token_id": self._field("tokenizer.ggml.bos_token_id", 1),
            "eos_token_id": self._field("tokenizer.ggml.eos_token_id", 2),
        }
        if f"{arch}.attention.key_length" in self._reader.fields:  # else hidden / heads, as in HF configs
            hf["head_dim"] = self._field(f"{arch}.attention.key_length")
        config = ModelConfig.from_hf(hf)
        rotary = self._field(f"{arch}.rope.dimension_count", config.head_dim)
        if rotary != config.head_dim or rotary % 2:
            raise CheckpointError(f"{self.path} rotates {rotary} of each head's {config.head_dim} dimensions; "
                                  "minfer's Llama rotates them all, in pairs")
        return config

    def _output_is_tied(self) -> bool:
        """No output.weight means llama.cpp reuses the embedding; one equal to it is stored only once."""
        if "output.weight" not in self._tensors:
            return True
        return self._shape("output.weight") == self._shape("token_embd.weight") and torch.equal(
            self._read("output.weight"), self._read("token_embd.weight"))

    def _read(self, name: str) -> torch.Tensor:
        """One tensor as stored (F32, F16 or BF16), copied out of the memory map."""
        shape = self._shape(name)
        data = self._tensors[name].data
        try:
            if self._tensors[name].tensor_type.name == "BF16":  # the reader hands BF16 out as raw bytes
                return torch.from_numpy(np.array(data).view(np.uint16)).view(torch.bfloat16).reshape(shape)
            return torch.from_numpy(np.array(data)).reshape(shape)
        except (ValueError, RuntimeError) as e:  # a tensor cut short by a truncated file
            raise CheckpointError(f"{self.path}: tensor {name} is damaged or truncated ({e})") from None

    def shape(self, hf_name: str) -> tuple[int, ...]:
        return self._shape(self._names[hf_name])

    def dtype(self, hf_name: str) -> torch.dtype:
        """The dtype a tensor is stored in."""
        return FLOAT_TYPES[self._tensors[self._names[hf_name]].tensor_type.name]

    def tensor(self, hf_name: str) -> torch.Tensor:
        """A tensor under its HF name in the HF layout: q and k rows in rotate-halves order."""
        weight = self._read(self._names[hf_name])
        heads = {"q_proj": self.config.num_heads, "k_proj": self.config.num_kv_heads}.get(hf_name.split(".")[-2])
        return weight if heads is None else halves_from_interleaved(weight, heads)


def find_tokenizer(path: Path, tokenizer: str | Path | None) -> Path:
    """The tokenizer of a GGUF model: `tokenizer` when given, else tokenizer.model beside the file."""
    if tokenizer is not None:
        return Path(tokenizer)
    beside = path.with_name("tokenizer.model")
    if not beside.is_file():
        raise CheckpointError(f"{path} needs a tokenizer: pass --tokenizer FILE (its sentencepiece tokenizer.model "
                              f"or tokenizer.json) or put tokenizer.model beside it")
    return beside
