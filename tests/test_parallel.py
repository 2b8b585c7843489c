"""Tensor parallelism (minfer.parallel): the sharding plan, per-rank loading, the launcher, and greedy
tokens at TP 2 and 4 equal to TP 1 (gloo on the CPU; NCCL on GPUs)."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from minfer.checkpoint import copy_weights, hf_state_dict, random_init, save_hf
from minfer.config import ModelConfig
from minfer.errors import MinferError
from minfer.model import Transformer
from minfer.parallel import Sharding, launch, peers_or_nccl
from minfer.runtime import estimate_memory
from tests.helpers import APP, cli

# GQA (8 query heads on 4 KV heads), untied lm_head, a vocabulary that TP 2 and 4 split evenly.
TINY_GQA = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8, "max_position_embeddings": 256}


def gqa_model() -> Transformer:
    """Weights wider than HF's initializer, so that logits are peaked; with seed 13 the 12 greedy steps of
    _greedy_tokens have top-2 logit gaps of at least 0.24 in float32, far above float16 rounding."""
    model = random_init(Transformer(ModelConfig.from_hf(TINY_GQA)), seed=13, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        for tensor in model.checkpoint_tensors().values():
            tensor.mul_(8.0 if tensor.dim() == 2 else 1.0)
    return model


@pytest.fixture(scope="module")
def gqa_folder(tmp_path_factory):
    """The tiny GQA model as a sharded safetensors checkpoint with the stories260K tokenizer (512 pieces)."""
    folder = save_hf(gqa_model(), tmp_path_factory.mktemp("tiny-gqa"), shard_size=100_000)
    tokenizer = Path(APP).parent.parent / "minfer/assets/stories260K/tokenizer.model"
    (folder / "tokenizer.model").write_bytes(tokenizer.read_bytes())
    return folder


@pytest.mark.parametrize("world", [2, 4])
def test_rank_slices_reassemble_the_whole_model(world):
    whole = gqa_model()
    tensors = whole.checkpoint_tensors()
    hf = hf_state_dict(whole)
    ranks = [copy_weights(Transformer(whole.config, Sharding(r, world)), hf.__getitem__, torch.float32, "cpu")
             for r in range(world)]
    parts = [rank.checkpoint_tensors() for rank in ranks]
    config, q, kv = whole.config, whole.config.q_size // world, whole.config.kv_size // world
    for layer in range(config.num_layers):
        qkv = f"layers.{layer}.self_attn.qkv_proj.fmt.weight"
        for start, size, count in ((0, q, world), (q, kv, world), (q + kv, kv, world)):
            whole_rows = torch.cat([p[qkv][start:start + size] for p in parts])
            first = start * world
            assert torch.equal(whole_rows, tensors[qkv][first:first + size * count])  # q, then k, then v
        for row_parallel in (f"layers.{layer}.self_attn.o_proj.fmt.weight", f"layers.{layer}.mlp.down_proj.fmt.weight"):
            assert torch.equal(torch.cat([p[row_parallel] for p in parts], dim=1), tensors[row_parallel])
        gate_up, inter = f"layers.{layer}.mlp.gate_up_proj.fmt.weight", config.intermediate_size // world
        gates = torch.cat([p[gate_up][:inter] for p in parts])
        ups = torch.cat([p[gate_up][inter:] for p in parts])
        assert torch.equal(torch.cat([gates, ups]), tensors[gate_up])
    assert torch.equal(torch.cat([p["lm_head.fmt.weight"] for p in parts]), tensors["lm_head.fmt.weight"])
    for replicated in ("embed_tokens.weight", "norm.weight", "layers.0.input_layernorm.weight"):
        assert all(torch.equal(p[replicated], tensors[replicated]) for p in parts)
    assert ranks[1].layers[0].self_attn.num_kv_heads == config.num_kv_heads // world


def test_refuses_a_world_that_does_not_divide_the_kv_heads():
    config = ModelConfig.from_hf(TINY_GQA)
    with pytest.raises(MinferError, match=r"key/value heads \(4\) to be a multiple of 3"):
        Transformer(config, Sharding(0, 3))
    with pytest.raises(MinferError, match="tied"):
        Transformer(ModelConfig.from_hf(TINY_GQA | {"tie_word_embeddings": True}), Sharding(0, 2))


def test_memory_estimate_splits_all_but_the_embedding():
    config = ModelConfig.from_hf(TINY_GQA)
    one, two = (estimate_memory(config, torch.float16, 256, ranks=n) for n in (1, 2))
    embedding = config.vocab_size * config.hidden_size * 2
    assert two.weights == (one.weights - embedding) // 2 + embedding
    assert two.kv_cache * 2 == one.kv_cache


def test_minfer_all_reduce_falls_back_to_nccl_without_symmetric_memory(capsys):
    def unmappable():
        raise RuntimeError("CUDA driver error: peer access is not supported\nmore detail")

    assert peers_or_nccl(unmappable, explicit=False, announce=True) is None
    assert capsys.readouterr().err == ("note: no symmetric memory between these GPUs (CUDA driver error: peer access "
                                       "is not supported): the all-reduces run on NCCL\n")
    assert peers_or_nccl(unmappable, explicit=False, announce=False) is None and not capsys.readouterr().err
    with pytest.raises(MinferError, match=r"^MINFER_TP_ALLREDUCE=minfer: no symmetric memory between these GPUs "
                                          r"\(CUDA driver error: peer access is not supported\); unset it"):
        peers_or_nccl(unmappable, explicit=True, announce=True)
    made = object()
    assert peers_or_nccl(lambda: made, explicit=True, announce=True) is made


def test_launch_ends_every_rank_when_one_fails(capsys):
    """Rank 1 fails while rank 0 would wait a minute: the launcher ends rank 0 and prints rank 1's line."""
    program = ("import os, sys, time\n"
               "if os.environ['RANK'] == '1':\n"
               "    print('error: rank 1: out of memory', file=sys.stderr); sys.exit(2)\n"
               "time.sleep(60)\n")
    start = time.perf_counter()
    code = launch([sys.executable, "-c", program], 2)
    assert code == 2 and time.perf_counter() - start < 30
    assert capsys.readouterr().err.splitlines() == ["error: rank 1: out of memory"]


GENERATE = ("--json", "--max-new-tokens", "12", "--prompt", "Once upon a time")


def _greedy_tokens(folder, tp: int, *flags: str, env: dict | None = None) -> list[int]:
    result = cli("--model", str(folder), *GENERATE, "--tp", str(tp), *flags, env=env)
    assert result.returncode == 0, result.stderr
    output = json.loads(result.stdout)
    assert output["tensor_parallel"] == tp
    return output["generated_ids"]


def test_greedy_tokens_at_tp_2_and_4_equal_tp_1_on_gloo(gqa_folder):
    expected = _greedy_tokens(gqa_folder, 1, "--device", "cpu")
    assert len(set(expected)) > 3  # the model does not repeat one token
    for tp in (2, 4):
        assert _greedy_tokens(gqa_folder, tp, "--device", "cpu") == expected, f"TP {tp}"


def test_torchrun_starts_the_same_ranks(gqa_folder):
    """torchrun's environment instead of --tp: rank 0 alone prints, the tokens are TP 1's."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(APP),
               "--model", str(gqa_folder), "--device", "cpu", *GENERATE]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    output = json.loads(result.stdout)
    assert output["tensor_parallel"] == 2
    assert output["generated_ids"] == _greedy_tokens(gqa_folder, 1, "--device", "cpu")


def test_each_rank_compresses_its_own_slices(gqa_folder):
    result = cli("--model", str(gqa_folder), "--device", "cpu", "--tp", "2", "--sparse", "macko", "--density", "0.5",
                 *GENERATE)
    assert result.returncode == 0, result.stderr
    output = json.loads(result.stdout)
    assert output["sparse"] == "macko" and output["sparsity"]["density"] == 0.5
    assert len(output["generated_ids"]) == 12


def test_tp_refusals_are_one_line(gqa_folder):
    result = cli("--model", str(gqa_folder), "--device", "cpu", "--tp", "3")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "multiple of 3" in lines[0] and lines[0].startswith("error: "), result.stderr
    result = cli("--model", str(gqa_folder), "--device", "cpu", "--tp", "2", "--sparse", "macko", "--density", "0.5",
                 "--save-compressed", str(gqa_folder.parent / "out"))
    lines = result.stderr.splitlines()
    assert result.returncode == 2 and lines[-1].startswith("error: --save-compressed runs on one"), result.stderr
    assert not (gqa_folder.parent / "out").exists()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (run on a multi-GPU device)")
@pytest.mark.parametrize("allreduce", ["minfer", "nccl"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_greedy_tokens_equal_tp_1_on_gpus(gqa_folder, dtype, allreduce):
    """The all-reduces (minfer's one-shot or NCCL's) and NCCL's gather inside each rank's captured decode
    graph (minfer's kernels in float16)."""
    expected = _greedy_tokens(gqa_folder, 1, "--dtype", dtype)
    for tp in (2, 4) if torch.cuda.device_count() >= 4 else (2,):
        tokens = _greedy_tokens(gqa_folder, tp, "--dtype", dtype, env={"MINFER_TP_ALLREDUCE": allreduce})
        assert tokens == expected, f"TP {tp}"
