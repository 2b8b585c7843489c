"""Find a model (alias, HF repo id, local folder, GGUF file or the embedded demo), then fill a
Transformer built on the meta device with its weights: from safetensors, GGUF (`gguf_source`), or
seeded random numbers.

Every weight is allocated once, on the target device and in the target dtype, and filled tensor by
tensor from memory-mapped safetensors; q/k/v and gate/up are written as row slices straight into
the preallocated fused qkv_proj and gate_up_proj matrices. Only safetensors and GGUF are read: never pickle.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from .config import ALIASES, KNOWN_CONFIGS, ModelConfig
from .errors import CheckpointError, MinferError, UnknownModelError
from .gguf_source import GGUFCheckpoint
from .gguf_source import find_tokenizer as gguf_tokenizer
from .model import Transformer, hf_tensor_map
from .parallel import SINGLE, Sharding
from .safetensors_io import open_safetensors
from .sparsity.compressed import holds_random_weights, is_compressed, load_compressed
from .tokenizer import bundled_tokenizer_path

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_PATTERNS = ["config.json", "tokenizer.model", "tokenizer.json", "tokenizer_config.json"]
WEIGHT_PATTERNS = ["*.safetensors", INDEX_FILE]
INIT_STD = 0.02  # HF's initializer_range for Llama
# Buffers some older checkpoints carry; minfer recomputes them.
_IGNORED_TENSORS = re.compile(r".*\.rotary_emb\.inv_freq$")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# The embedded default: stories260K, shipped converted from its GGUF file (minfer.demo rebuilds it).
DEMO_NAME = "stories260K"
DEMO_NAMES = (DEMO_NAME, "minfer-demo")  # minfer-demo: the default's name before it had real weights
DEMO_DIR = Path(__file__).resolve().parent / "assets" / DEMO_NAME
# The safetensors dtypes a weight may be stored in (copied into the model's float dtype).
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


@dataclass(frozen=True)
class ResolvedModel:
    name: str  # what the user asked for
    config: ModelConfig
    path: Path | None  # folder holding the safetensors, or a GGUF file; None means no weights to read
    tokenizer_path: Path
    is_random: bool  # the weights are random numbers: the output text means nothing


# ----------------------------------------------------------------------------------------------
# Finding a model
# ----------------------------------------------------------------------------------------------


def resolve(model: str | None, weights: str = "hf", tokenizer: str | Path | None = None) -> ResolvedModel:
    """`model`: None or a name of the embedded demo (stories260K), an alias, a local folder, a GGUF
    file or an HF repo id. `weights`: "hf" loads the checkpoint's weights, "random" builds its
    architecture with seeded random weights (aliases need no download; other models fetch
    config.json only), "none" takes only the config and the model's own tokenizer, for weights that
    come from elsewhere (path None, not random). `tokenizer`: a tokenizer file to use instead of the
    model's own (a GGUF file's is the tokenizer.model beside it)."""
    if weights not in ("hf", "random", "none"):
        raise CheckpointError(f"weights must be 'hf', 'random' or 'none', got {weights!r}")
    if tokenizer is not None and not Path(tokenizer).is_file():
        raise CheckpointError(f"--tokenizer {tokenizer} is not a file; pass a tokenizer.model or tokenizer.json")
    if model is None or model in DEMO_NAMES:
        return _resolve_folder(DEMO_NAME, DEMO_DIR, weights, tokenizer)
    if model in ALIASES and weights == "random":
        return ResolvedModel(model, ModelConfig.from_hf(KNOWN_CONFIGS[model]), None,
                             Path(tokenizer or bundled_tokenizer_path()), is_random=True)
    local = Path(os.path.expanduser(model))  # os.path's leaves ~nosuchuser as it is; Path's raises
    if local.is_dir():
        folder = local
    elif local.is_file() and local.suffix.lower() == ".gguf":
        return ResolvedModel(model, GGUFCheckpoint(local).config, local if weights == "hf" else None,
                             gguf_tokenizer(local, tokenizer), is_random=weights == "random")
    elif model in ALIASES or _REPO_ID.match(model):
        folder = download(ALIASES.get(model, model), with_weights=weights == "hf")
    elif local.is_file():
        raise CheckpointError(f"{model} is a file, not a checkpoint folder; pass a folder holding config.json and "
                              "*.safetensors, or a .gguf file (a macko_spmv compressed checkpoint file loads with "
                              "--macko-reference FILE beside --model naming its dense model)")
    elif local.exists() or os.sep in model or model.startswith((".", "~")):
        raise CheckpointError(f"{model} is not a directory; pass a folder holding config.json and *.safetensors")
    else:
        names = ", ".join([DEMO_NAME, *ALIASES])
        raise UnknownModelError(f"unknown model {model!r}: use one of {names}, an HF repo id (owner/name), "
                                "a local checkpoint folder or a .gguf file")
    return _resolve_folder(model, folder, weights, tokenizer)


def _resolve_folder(name: str, folder: Path, weights: str, tokenizer: str | Path | None) -> ResolvedModel:
    config = ModelConfig.from_json(folder / "config.json")
    if weights == "random":
        tokenizer = tokenizer or find_tokenizer(folder, required=False) or bundled_tokenizer_path()
        return ResolvedModel(name, config, None, Path(tokenizer), is_random=True)
    if weights == "none":
        return ResolvedModel(name, config, None, Path(tokenizer or find_tokenizer(folder, required=True)),
                             is_random=False)
    weight_files(folder)  # fail now, before any allocation, if there is nothing to load
    return ResolvedModel(name, config, folder, Path(tokenizer or find_tokenizer(folder, required=True)),
                         is_random=holds_random_weights(folder))


def find_tokenizer(folder: Path, required: bool) -> Path | None:
    for name in ("tokenizer.model", "tokenizer.json"):
        if (folder / name).is_file():
            return folder / name
    if required:
        raise CheckpointError(f"{folder} has neither tokenizer.model nor tokenizer.json")
    return None


def download(repo_id: str, with_weights: bool) -> Path:
    """Fetch config and tokenizer (and the safetensors weights) of an HF repo into the HF cache,
    with a progress bar. HF_TOKEN authorizes gated repos such as meta-llama's."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
    )

    patterns = CONFIG_PATTERNS + (WEIGHT_PATTERNS if with_weights else [])
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, token=os.environ.get("HF_TOKEN") or None))
    except GatedRepoError:
        raise CheckpointError(f"{repo_id} is gated: accept its license on https://huggingface.co/{repo_id}, then "
                              "set HF_TOKEN to an access token (or pass a local checkpoint folder)") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{repo_id} does not exist on the Hugging Face Hub "
                              "(a private repo needs HF_TOKEN)") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        raise CheckpointError(f"cannot download {repo_id}: no network (or HF_HUB_OFFLINE is set) and it is not in the "
                              "local HF cache; pass a local checkpoint folder, or --weights random for its "
                              "architecture with random weights") from None
    except Exception as e:  # network and HTTP failures of any kind: report them in one line
        raise CheckpointError(f"downloading {repo_id} failed: {type(e).__name__}: {e}") from None


def weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the shard index or the single model.safetensors; every
    file inside `folder` (_inside_folder)."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = _weight_map(index)
        shards = {shard: _inside_folder(folder, shard, f"{INDEX_FILE} names the shard") for shard in
                  set(weight_map.values())}
        for shard, path in sorted(shards.items()):
            if not path.is_file():
                raise CheckpointError(f"shard {shard} listed in {INDEX_FILE} is missing from {folder}")
        return {name: shards[shard] for name, shard in weight_map.items()}
    single = _inside_folder(folder, SINGLE_FILE, "the weights file")
    if single.is_file():
        with open_safetensors(single) as f:
            return {name: single for name in f.keys()}
    raise CheckpointError(f"{folder} has no {SINGLE_FILE} or {INDEX_FILE}; minfer loads safetensors only "
                          "(never pickle .bin files)")


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index} is not a valid safetensors index ({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index} is not a valid safetensors index: its weight_map is a "
                              f"{type(weight_map).__name__}, not an object mapping tensor names to shard files")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise CheckpointError(f"{index} is not a valid safetensors index: it maps tensor {name} to {shard!r}, "
                                  "not a shard file name")
    return weight_map


def _inside_folder(folder: Path, name: str, what: str) -> Path:
    """folder / name, refused unless it stays inside `folder`: no absolute path, no `..`, no link that
    leads out. The one exception is the Hugging Face cache, whose snapshot folders link every file
    to the repo's own blobs folder beside them."""
    path = folder / name
    real_folder = folder.resolve()
    roots = [real_folder]
    if real_folder.parent.name == "snapshots":  # <cache>/models--owner--name/snapshots/<revision>
        roots.append(real_folder.parent.parent / "blobs")
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts:
        raise CheckpointError(f"{what} {name}, which is outside {folder}; minfer reads only files inside the "
                              "checkpoint folder")
    real = path.resolve()
    if not any(real.is_relative_to(root) for root in roots):
        raise CheckpointError(f"{what} {name} in {folder}, a link to {real} outside that folder; minfer reads only "
                              "files inside the checkpoint folder (copy the file in instead of linking it)")
    return path


# ----------------------------------------------------------------------------------------------
# HF tensor names -> minfer tensors
# ----------------------------------------------------------------------------------------------


def _targets(model: nn.Module, dtype: torch.dtype, device: torch.device | str) -> dict[str, torch.Tensor]:
    """Allocate the meta-built model on `device` (every weight once, uninitialized) and return its
    checkpoint tensors, after checking they are exactly the ones the HF layout fills (on a tensor-parallel
    rank: its slices)."""
    expected: dict[str, tuple[int, ...]] = {}
    for name, row, shape, _ in model.tensor_places().values():
        expected[name] = (max(expected.get(name, (0,))[0], row + shape[0]), *shape[1:])
    model.materialize(device, dtype)
    targets = model.checkpoint_tensors()
    if {n: tuple(t.shape) for n, t in targets.items()} != expected:
        raise CheckpointError("the model's tensors do not match the HF layout of its config")
    return targets


# ----------------------------------------------------------------------------------------------
# Loading, random init, saving
# ----------------------------------------------------------------------------------------------


def load_model(resolved: ResolvedModel, dtype: torch.dtype, device: torch.device | str, seed: int = 0,
               progress: bool = False, sharding: Sharding = SINGLE) -> nn.Module:
    """The Transformer of a resolved model on `device`: its checkpoint, or seeded random weights; with a
    `sharding` of several ranks, this rank's part of it (each rank reads only its slices)."""
    model = Transformer(resolved.config, sharding)
    if resolved.path is None:
        if not resolved.is_random:
            raise CheckpointError(f"{resolved.name} was resolved without weights; load them from their own file")
        return random_init(model, seed, dtype, device)
    if sharding.active and (resolved.path.is_file() or is_compressed(resolved.path)):
        raise CheckpointError(f"{resolved.name}: tensor parallelism loads safetensors checkpoints (dense, then "
                              "--sparse per rank) and random weights; run a GGUF file or a compressed folder on one "
                              "GPU")
    if resolved.path.is_file():  # resolve() takes files only as GGUF
        return load_gguf(model, resolved.path, dtype, device, progress)
    if is_compressed(resolved.path):  # written by --save-compressed: projections in their formats
        return load_compressed(model, resolved.path, dtype, device, progress)
    return load_weights(model, resolved.path, dtype, device, progress)


def load_weights(model: nn.Module, path: str | Path, dtype: torch.dtype, device: torch.device | str,
                 progress: bool = False) -> nn.Module:
    """Fill a meta-built Transformer from the safetensors checkpoint in folder `path`.

    Checks the checkpoint before allocating anything: every expected tensor present, nothing
    unexpected, every shape right. Then copies tensor by tensor from the memory-mapped files (cast
    to `dtype`) into the weights preallocated on `device`.
    """
    folder = Path(path)
    files = weight_files(folder)
    layout = hf_tensor_map(model.config)
    present = {name for name in files if not _IGNORED_TENSORS.match(name)}
    if model.config.tie_word_embeddings:
        present.discard("lm_head.weight")  # some tied checkpoints store the shared matrix twice
    _refuse_difference(folder, "lacks", sorted(set(layout) - present))
    _refuse_difference(folder, "has unexpected", sorted(present - set(layout)))

    with ExitStack() as stack:
        handles = {file: stack.enter_context(open_safetensors(file)) for file in sorted({files[n] for n in layout})}
        held = {file: set(handle.keys()) for file, handle in handles.items()}
        for name, (_, _, shape) in layout.items():
            file = files[name]
            if name not in held[file]:
                raise CheckpointError(f"{INDEX_FILE} in {folder} lists tensor {name} in {file.name}, which lacks it")
            stored = handles[file].get_slice(name)
            if tuple(stored.get_shape()) != shape:
                raise CheckpointError(f"tensor {name} in {file.name} has shape {tuple(stored.get_shape())}, "
                                      f"expected {shape}")
            if stored.get_dtype() not in _FLOAT_DTYPES:  # integers or booleans would be cast into nonsense weights
                raise CheckpointError(f"tensor {name} in {file.name} is stored as {stored.get_dtype()}, expected "
                                      f"float weights ({', '.join(_FLOAT_DTYPES)})")
        # one tensor (or a tensor-parallel rank's slice of it) at a time, from the mmap
        return copy_weights(model, lambda name: handles[files[name]].get_slice(name), dtype, device, progress)


def copy_weights(model: nn.Module, read: Callable[[str], torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str, progress: bool = False) -> nn.Module:
    """Allocate a meta-built Transformer on `device` and copy each HF-named tensor `read(name)` into
    its place (cast to `dtype`); `read` may return a lazy slice (safetensors' get_slice), of which only
    this rank's part is read. The caller has checked that every tensor is there in its shape."""
    targets = _targets(model, dtype, device)
    with torch.no_grad():
        for name, (target, row, shape, index) in tqdm(model.tensor_places().items(), desc="loading", unit="tensor",
                                                      disable=not progress):
            targets[target][row:row + shape[0]].copy_(read(name)[index])
    return model


def load_gguf(model: nn.Module, path: str | Path, dtype: torch.dtype, device: torch.device | str,
              progress: bool = False) -> nn.Module:
    """Fill a meta-built Transformer from a GGUF file (checked whole before anything is allocated)."""
    checkpoint = GGUFCheckpoint(path)
    if checkpoint.config != model.config:
        raise CheckpointError(f"{path} holds another architecture than the model being loaded")
    return copy_weights(model, checkpoint.tensor, dtype, device, progress)


def _refuse_difference(folder: Path, verb: str, names: list[str]) -> None:
    if names:
        more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
        hint = "" if verb == "lacks" else "; does config.json belong to these weights?"
        raise CheckpointError(f"checkpoint {folder} {verb} tensor {names[0]}{more}{hint}")


def random_init(model: nn.Module, seed: int, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """Fill a meta-built Transformer with seeded random weights directly on `device`: matrices
    normal(0, 0.02) as HF initializes Llama, norm weights 1. The same seed and device give the
    same weights (the CPU and CUDA generators differ from each other)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for tensor in _targets(model, dtype, device).values():
            if tensor.dim() == 1:
                tensor.fill_(1.0)
            else:
                tensor.normal_(0.0, INIT_STD, generator=generator)
    return model


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under HF names (views), fused matrices split back into q/k/v and gate/up."""
    if model.sharding.active:
        raise MinferError("saving writes a whole model; a tensor-parallel rank holds only its slices")
    tensors = model.checkpoint_tensors()
    return {name: tensors[target][row:row + shape[0]]
            for name, (target, row, shape) in hf_tensor_map(model.config).items()}


def save_hf(model_or_state: nn.Module | dict[str, torch.Tensor], path: str | Path,
            shard_size: int | None = None, config: ModelConfig | None = None) -> Path:
    """Write an HF-layout safetensors checkpoint (plus config.json when the config is known).

    A Transformer is saved under HF names; a dict is saved as given. With `shard_size` (bytes),
    tensors are spread over model-0000i-of-0000n.safetensors files listed in the index.
    """
    from safetensors.torch import save_file

    if isinstance(model_or_state, nn.Module):
        config = config or model_or_state.config
        state = hf_state_dict(model_or_state)
    else:
        state = model_or_state
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in state.items():
        size = tensor.numel() * tensor.element_size()
        if shard_size is not None and shards[-1] and shard_bytes + size > shard_size:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor.detach().to("cpu").contiguous().clone()  # own storage: no shared views
        shard_bytes += size
    if len(shards) == 1:
        save_file(shards[0], folder / SINGLE_FILE, metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, folder / file, metadata={"format": "pt"})
            weight_map |= {name: file for name in shard}
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config.to_hf(), indent=2))
    return folder
