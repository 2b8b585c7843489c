"""minfer from Python: load a model, optionally prune its projections into a sparse format, generate.

    from minfer.api import load

    engine = load()                    # the embedded demo; or an alias, HF repo id, local folder, ...
    engine.prune(0.5, sparse=NAME)     # optional: half of each projection row by magnitude, stored in a
                                       # registered weight format (minfer.formats.format_choices())
    print(engine.generate("Once upon a time", max_new_tokens=40).text)

A thin layer over checkpoint.resolve / load_model, sparsity.prune, formats.convert and
generate.Generator, with the apps' defaults: the GPU when there is one, float16 there and float32 on
the CPU. Bad input raises a MinferError subclass naming the fix.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import ResolvedModel, load_model, resolve
from .formats import convert
from .generate import GenerationResult, Generator
from .runtime import check_memory, context_length, pick_device, pick_dtype
from .sampling import SamplingParams
from .sparsity.cli import CALIB_SAMPLES, CALIB_SEQ_LEN
from .sparsity.compressed import is_compressed, stored_weight_bytes
from .sparsity.prune import calibration_tokens, prune_model_
from .tokenizer import Tokenizer


class Engine:
    """A loaded model with its tokenizer, ready to generate on its device."""

    def __init__(self, resolved: ResolvedModel, model: torch.nn.Module, device: torch.device, max_seq_len: int):
        self.name = resolved.name
        self.config = resolved.config
        self.model = model
        self.tokenizer = Tokenizer(resolved.tokenizer_path)
        self.device = device
        self.max_seq_len = max_seq_len
        self._generator: Generator | None = None  # built at the first generate(); its CUDA graphs hold the weights

    def prune(self, density: float, sparse: str, method: str = "magnitude",
              calibration_text: str | Path | None = None, calibration_samples: int = CALIB_SAMPLES,
              calibration_seq_len: int = CALIB_SEQ_LEN) -> Engine:
        """Prune every attention and MLP projection to `density` per row, then store the projections in
        the weight format `sparse` ("dense" keeps them dense). `method` "wanda" scores weights by
        activations over `calibration_text` (a UTF-8 file; default: the corpus shipped in minfer/data)."""
        calibration = None
        if method == "wanda":
            calibration = calibration_tokens(self.tokenizer, calibration_samples, calibration_seq_len,
                                             calibration_text)
        prune_model_(self.model, density, method, calibration, progress=False)
        convert(self.model, sparse)
        self._generator = None
        return self

    def generate(self, prompt: str, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float = 1.0, seed: int = 0, chat: bool = False) -> GenerationResult:
        """The continuation of `prompt` (greedy at temperature 0), with its token ids and stats; `chat`
        wraps the prompt in the Llama-2 chat template."""
        params = SamplingParams(temperature, top_k, top_p, seed)
        if self._generator is None:
            self._generator = Generator(self.model, self.tokenizer, self.max_seq_len, self.device)
        prompt_ids = self.tokenizer.chat_prompt(prompt) if chat else self.tokenizer.encode(prompt)
        return self._generator.generate(prompt_ids, params, max_new_tokens)


def load(model: str | None = None, *, weights: str = "hf", device: str | None = None, dtype: str | None = None,
         max_seq_len: int | None = None, seed: int = 0) -> Engine:
    """Load `model` as `--model` names it (None: the embedded demo). `weights` "random" builds its
    architecture with weights drawn from `seed`; `dtype` is "float16", "bfloat16" or "float32";
    `max_seq_len` sizes the KV cache (default: the model's limit, at most 4096 positions)."""
    device = pick_device(device)
    torch_dtype = pick_dtype(dtype, device)
    resolved = resolve(model, weights)
    max_seq_len = context_length(resolved.config, max_seq_len, prompt_tokens=0)
    compressed = resolved.path is not None and is_compressed(resolved.path)
    check_memory(resolved.config, torch_dtype, device, max_seq_len,
                 stored_weight_bytes(resolved.path, torch_dtype) if compressed else None)
    return Engine(resolved, load_model(resolved, torch_dtype, device, seed=seed), device, max_seq_len)
