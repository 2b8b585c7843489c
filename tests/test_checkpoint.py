"""Checkpoint loading: HF names -> fused minfer tensors, shards, dtype casts, refusals that name the
tensor, random init, and resolve() for every kind of model name.
Nothing here touches the network."""

import json
import shutil

import pytest
import torch

from minfer import checkpoint
from minfer.checkpoint import hf_state_dict, load_model, load_weights, random_init, resolve, save_hf
from minfer.config import KNOWN_CONFIGS, ModelConfig
from minfer.errors import CheckpointError, UnknownModelError
from minfer.model import Transformer
from minfer.tokenizer import bundled_tokenizer_path
from tests.conftest import requires_cuda


def tiny_config(tied=False, kv_heads=2, vocab=97, rope_scaling=None) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=kv_heads,
                       head_dim=16, intermediate_size=80, rms_norm_eps=1e-5, rope_theta=10000.0,
                       rope_scaling=rope_scaling, max_position_embeddings=128, tie_word_embeddings=tied,
                       bos_token_id=1, eos_token_id=2)


def random_state(config: ModelConfig, seed=0) -> dict[str, torch.Tensor]:
    """HF-named random tensors for `config` (normal values, so every element differs)."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, (_, _, shape) in checkpoint.hf_tensor_map(config).items()}


def write_checkpoint(folder, config, state, shard_size=None):
    save_hf(state, folder, shard_size=shard_size, config=config)
    shutil.copyfile(bundled_tokenizer_path(), folder / "tokenizer.model")
    return folder


def loaded(folder, config, dtype=torch.float32):
    return load_weights(Transformer(config), folder, dtype, "cpu")


@pytest.mark.parametrize("tied, kv_heads", [(False, 4), (False, 2), (True, 1)])
def test_sharded_round_trip_fuses_qkv_and_gate_up(tmp_path, tied, kv_heads):
    config = tiny_config(tied=tied, kv_heads=kv_heads)
    state = random_state(config)
    write_checkpoint(tmp_path, config, state, shard_size=40_000)
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 2
    model = loaded(tmp_path, config)
    tensors = model.checkpoint_tensors()
    q, k, v = (state[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(tensors["layers.1.self_attn.qkv_proj.fmt.weight"], torch.cat([q, k, v]))
    gate, up = (state[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up"))
    assert torch.equal(tensors["layers.0.mlp.gate_up_proj.fmt.weight"], torch.cat([gate, up]))
    for name, tensor in hf_state_dict(model).items():
        assert torch.equal(tensor, state[name]), name
    if tied:
        assert model.lm_head.fmt.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert not any(t.is_meta for t in model.state_dict().values())


def test_loads_what_transformers_saves(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = tiny_config(kv_heads=2, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config.to_hf()))
    hf_model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / checkpoint.INDEX_FILE).is_file()
    assert ModelConfig.from_json(tmp_path / "config.json") == config
    model = loaded(tmp_path, config)
    ours = hf_state_dict(model)
    for name, tensor in hf_model.state_dict().items():
        assert torch.equal(ours[name], tensor), name


def test_casts_to_the_requested_dtype(tmp_path):
    config = tiny_config()
    state = random_state(config)
    write_checkpoint(tmp_path, config, state)
    for dtype in (torch.float16, torch.bfloat16):
        model = loaded(tmp_path, config, dtype)
        weight = model.checkpoint_tensors()["layers.0.self_attn.o_proj.fmt.weight"]
        assert weight.dtype == dtype
        assert torch.equal(weight, state["model.layers.0.self_attn.o_proj.weight"].to(dtype))


def test_tied_checkpoint_may_store_lm_head_and_inv_freq(tmp_path):
    config = tiny_config(tied=True)
    state = random_state(config)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    write_checkpoint(tmp_path, config, state)
    model = loaded(tmp_path, config)
    assert torch.equal(model.lm_head.fmt.weight, state["model.embed_tokens.weight"])


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.pop("model.layers.1.mlp.up_proj.weight"), "lacks tensor model.layers.1.mlp.up_proj.weight"),
    (lambda s: s.pop("lm_head.weight"), "lacks tensor lm_head.weight"),
    (lambda s: s.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(1)}),
     "unexpected tensor model.layers.2.mlp.up_proj.weight"),
    (lambda s: s.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}),
     r"tensor model.layers.0.self_attn.k_proj.weight .* has shape \(16, 64\), expected \(32, 64\)"),
])
def test_refuses_mismatched_checkpoints(tmp_path, edit, message):
    config = tiny_config()
    state = random_state(config)
    edit(state)
    write_checkpoint(tmp_path, config, state)
    with pytest.raises(CheckpointError, match=message):
        loaded(tmp_path, config)


def test_refuses_truncated_and_missing_shards(tmp_path):
    config = tiny_config()
    write_checkpoint(tmp_path, config, random_state(config), shard_size=40_000)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    data = shards[1].read_bytes()
    shards[1].write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=f"{shards[1].name} is truncated or corrupt"):
        loaded(tmp_path, config)
    shards[1].unlink()
    with pytest.raises(CheckpointError, match=f"shard {shards[1].name} listed in"):
        loaded(tmp_path, config)


def test_refuses_folders_without_safetensors(tmp_path):
    config = tiny_config()
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(CheckpointError, match="never pickle"):
        resolve(str(tmp_path), "hf")


def test_random_init_is_seeded_and_hf_like():
    config = tiny_config(tied=True)
    first = random_init(Transformer(config), seed=3, dtype=torch.float32, device="cpu")
    again = random_init(Transformer(config), seed=3, dtype=torch.float32, device="cpu")
    other = random_init(Transformer(config), seed=4, dtype=torch.float32, device="cpu")
    a, b, c = (m.checkpoint_tensors() for m in (first, again, other))
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["embed_tokens.weight"], c["embed_tokens.weight"])
    matrices = torch.cat([t.flatten() for t in a.values() if t.dim() == 2])
    assert abs(matrices.std().item() - checkpoint.INIT_STD) < 1e-3 and abs(matrices.mean().item()) < 1e-3
    assert all(torch.equal(t, torch.ones_like(t)) for t in a.values() if t.dim() == 1)
    assert first.lm_head.fmt.weight.data_ptr() == first.embed_tokens.weight.data_ptr()


def test_random_init_dtype():
    model = random_init(Transformer(tiny_config()), seed=0, dtype=torch.bfloat16, device="cpu")
    assert {t.dtype for t in model.checkpoint_tensors().values()} == {torch.bfloat16}


def test_resolve_alias_with_random_weights_needs_no_download():
    resolved = resolve("llama2-7b", "random")
    assert resolved.config == ModelConfig.from_hf(KNOWN_CONFIGS["llama2-7b"])
    assert resolved.is_random and resolved.path is None
    assert resolved.tokenizer_path == bundled_tokenizer_path()


def test_resolve_local_folder(tmp_path):
    config = tiny_config()
    write_checkpoint(tmp_path, config, random_state(config))
    real = resolve(str(tmp_path), "hf")
    assert (real.config, real.path, real.is_random) == (config, tmp_path, False)
    assert real.tokenizer_path == tmp_path / "tokenizer.model"
    random = resolve(str(tmp_path), "random")
    assert random.is_random and random.path is None and random.tokenizer_path == tmp_path / "tokenizer.model"
    (tmp_path / "tokenizer.model").unlink()
    assert resolve(str(tmp_path), "random").tokenizer_path == bundled_tokenizer_path()
    with pytest.raises(CheckpointError, match="neither tokenizer.model nor tokenizer.json"):
        resolve(str(tmp_path), "hf")


def test_resolve_without_weights_takes_config_and_tokenizer_only(tmp_path):
    """weights="none" (the weights come from another file): no safetensors needed, not random."""
    config = tiny_config()
    write_checkpoint(tmp_path, config, random_state(config))
    for weights in tmp_path.glob("*.safetensors*"):
        weights.unlink()
    resolved = resolve(str(tmp_path), "none")
    assert (resolved.config, resolved.path, resolved.is_random) == (config, None, False)
    assert resolved.tokenizer_path == tmp_path / "tokenizer.model"
    with pytest.raises(CheckpointError, match="resolved without weights"):
        load_model(resolved, torch.float32, "cpu")
    (tmp_path / "tokenizer.model").unlink()
    with pytest.raises(CheckpointError, match="neither tokenizer.model nor tokenizer.json"):
        resolve(str(tmp_path), "none")


def test_resolve_refuses_unknown_names_and_paths(tmp_path):
    with pytest.raises(UnknownModelError, match="unknown model 'llama9'.*llama2-7b"):
        resolve("llama9", "hf")
    with pytest.raises(CheckpointError, match="is not a directory"):
        resolve(str(tmp_path / "nowhere"), "hf")
    (tmp_path / "llama_compressed").write_bytes(b"")
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint folder.*--macko-reference"):
        resolve(str(tmp_path / "llama_compressed"), "hf")
    with pytest.raises(CheckpointError, match="no config.json"):
        resolve(str(tmp_path), "hf")
    with pytest.raises(CheckpointError, match="weights must be"):
        resolve("llama2-7b", "pickle")


def test_resolve_the_default_and_a_tokenizer_override(tmp_path):
    """No name (or minfer-demo) is the shipped stories260K folder; --tokenizer replaces a model's own."""
    resolved = resolve(None)
    assert resolved.path == checkpoint.DEMO_DIR and not resolved.is_random and resolve("minfer-demo") == resolved
    random = resolve(None, "random")
    assert random.is_random and random.path is None and random.tokenizer_path == checkpoint.DEMO_DIR / "tokenizer.model"
    assert resolve(None, tokenizer=bundled_tokenizer_path()).tokenizer_path == bundled_tokenizer_path()
    assert resolve("llama2-7b", "random", checkpoint.DEMO_DIR / "tokenizer.model").tokenizer_path == \
        checkpoint.DEMO_DIR / "tokenizer.model"
    with pytest.raises(CheckpointError, match="--tokenizer .* is not a file"):
        resolve(None, tokenizer=tmp_path)


def test_download_fetches_only_config_tokenizer_and_safetensors(tmp_path, monkeypatch):
    import huggingface_hub

    config = tiny_config()
    write_checkpoint(tmp_path, config, random_state(config))
    calls = []

    def fake_snapshot_download(repo_id, allow_patterns, token):
        calls.append((repo_id, allow_patterns, token))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    real = resolve("tinyllama-1.1b", "hf")
    assert (real.path, real.is_random, real.config) == (tmp_path, False, config)
    random = resolve("someone/tiny-llama", "random")
    assert random.is_random and random.path is None and random.config == config
    assert calls == [
        ("TinyLlama/TinyLlama-1.1B-Chat-v1.0", checkpoint.CONFIG_PATTERNS + checkpoint.WEIGHT_PATTERNS, "hf_secret"),
        ("someone/tiny-llama", checkpoint.CONFIG_PATTERNS, "hf_secret"),
    ]
    assert not any("*.bin" in p or "*.pt" in p for _, patterns, _ in calls for p in patterns)


@pytest.mark.parametrize("error, message", [
    ("GatedRepoError", "is gated: accept its license .* set HF_TOKEN"),
    ("RepositoryNotFoundError", "does not exist on the Hugging Face Hub"),
    ("LocalEntryNotFoundError", "cannot download meta-llama/Llama-2-7b-hf: no network"),
    ("OfflineModeIsEnabled", "cannot download meta-llama/Llama-2-7b-hf: no network"),
    (TimeoutError, "downloading meta-llama/Llama-2-7b-hf failed: TimeoutError"),
])
def test_download_failures_are_clear(monkeypatch, error, message):
    import huggingface_hub
    import huggingface_hub.errors

    cls = getattr(huggingface_hub.errors, error) if isinstance(error, str) else error

    def failing_snapshot_download(repo_id, **kwargs):
        exception = cls.__new__(cls)  # HTTP errors want a live response object; the message is all we need
        Exception.__init__(exception, "simulated")
        raise exception

    monkeypatch.setattr(huggingface_hub, "snapshot_download", failing_snapshot_download)
    with pytest.raises(CheckpointError, match=message):
        resolve("llama2-7b", "hf")


@requires_cuda
def test_loads_straight_to_the_gpu(tmp_path):
    config = tiny_config(tied=True)
    state = random_state(config)
    write_checkpoint(tmp_path, config, state, shard_size=40_000)
    model = load_weights(Transformer(config), tmp_path, torch.float16, "cuda")
    for name, tensor in hf_state_dict(model).items():
        assert tensor.is_cuda and tensor.dtype == torch.float16
        assert torch.equal(tensor.cpu(), state[name].half()), name
    first = random_init(Transformer(config), seed=5, dtype=torch.bfloat16, device="cuda").checkpoint_tensors()
    again = random_init(Transformer(config), seed=5, dtype=torch.bfloat16, device="cuda").checkpoint_tensors()
    assert all(t.is_cuda and torch.equal(t, again[n]) for n, t in first.items())
