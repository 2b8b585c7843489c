"""Bad input a demanding user gives the apps: each is refused with one `error:` line on stderr and exit
code 2, before anything is loaded, printed on stdout or saved; a reader that closes the output pipe
ends a run quietly. Tiny checkpoints are built here; nothing depends on the demo model."""

import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minfer.cli import CLOSED_PIPE_EXIT
from minfer.checkpoint import INDEX_FILE, hf_state_dict, load_weights, random_init, resolve, save_hf
from minfer.config import ModelConfig
from minfer.errors import CheckpointError, MinferError
from minfer.model import Transformer
from minfer.sampling import SamplingParams
from minfer.sparsity.compressed import (
    SAVE_MARKER,
    SAVE_MARKER_TEXT,
    check_save_target,
    is_compressed,
    save_compressed,
)
from minfer.tokenizer import Tokenizer, bundled_tokenizer_path
from tests.helpers import APP, NO_GPU, PROFILE_APP, assert_input_error, load_app, tiny_random_model

BENCHMARK_APP = APP.with_name("benchmark.py")


@pytest.fixture(scope="module")
def generate_app():
    return load_app(APP)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """A tiny checkpoint in four shards listed in model.safetensors.index.json."""
    folder = tmp_path_factory.mktemp("sharded")
    save_hf(tiny_random_model(), folder, shard_size=100_000)
    shutil.copyfile(bundled_tokenizer_path(), folder / "tokenizer.model")
    return folder


def copy_of(checkpoint: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(checkpoint, tmp_path / "checkpoint"))


def refused(generate_app, capsys, tmp_path, args, *fragments) -> str:
    """apps/generate.py with `args` (in this process, asked to prune and save too): exit 2, one error line
    holding `fragments`, nothing on stdout, and the --save-compressed folder never made."""
    target = tmp_path / "never-written"
    argv = ["--device", "cpu", "--max-new-tokens", "2", "--sparse", "macko", "--density", "0.5",
            "--save-compressed", str(target), *args]
    try:
        code = generate_app.main(argv)
    except SystemExit as exit_:  # argparse refuses the flag itself
        code = exit_.code
    captured = capsys.readouterr()
    assert_input_error(subprocess.CompletedProcess(argv, code, captured.out, captured.err), *fragments)
    assert captured.out == "" and not target.exists()
    return captured.err


def index_of(folder: Path) -> dict:
    return json.loads((folder / INDEX_FILE).read_text())


def write_index(folder: Path, index) -> None:
    (folder / INDEX_FILE).write_text(json.dumps(index))


# ----------------------------------------------------------------------------------------------
# The prompt and the sampling flags
# ----------------------------------------------------------------------------------------------


def test_a_prompt_with_invalid_utf8_bytes_is_refused(sharded):
    """argv bytes that are not UTF-8 reach Python as lone surrogates (surrogateescape)."""
    result = subprocess.run([sys.executable, str(APP), "--model", str(sharded), "--device", "cpu",
                             "--prompt", b"caf\xe9 au lait"], capture_output=True, text=True, timeout=300,
                            env=os.environ | {"HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"})
    assert_input_error(result, "--prompt is not valid UTF-8", "byte 0xe9 at character 3")
    assert result.stdout == ""


def test_the_tokenizer_names_the_byte_it_cannot_encode():
    tokenizer = Tokenizer(bundled_tokenizer_path())
    for text, found in (("ab\udcffc", "byte 0xff at character 2"), ("\ud800", "lone surrogate U+D800")):
        with pytest.raises(MinferError, match=re.escape(found)):
            tokenizer.encode(text)


@pytest.mark.parametrize("args, fragments", [
    (["--temperature", "nan"], ["temperature must be 0 (greedy) or a finite number", "got nan"]),
    (["--temperature", "inf"], ["temperature must be", "got inf"]),
    (["--temperature", "-0.5"], ["temperature must be", "got -0.5"]),
    (["--temperature", "1e-30"], ["temperature must be", "greedy in effect"]),
    (["--top-p", "nan"], ["top_p must be in (0, 1]"]),
    (["--top-p", "1.5"], ["top_p must be in (0, 1]"]),
    (["--top-k", "-1"], ["top_k must be >= 1"]),
    (["--seed", str(2**64)], ["seed must be in [0, 2**64 - 1]", str(2**64)]),
    (["--seed", "-1"], ["seed must be in [0, 2**64 - 1]"]),
    (["--max-new-tokens", "-3"], ["--max-new-tokens must be at least 1"]),
])
def test_sampling_flags_are_checked_before_loading(generate_app, capsys, tmp_path, sharded, args, fragments):
    refused(generate_app, capsys, tmp_path, ["--model", str(sharded), *args], *fragments)


def test_the_widest_seed_and_smallest_temperature_are_usable():
    params = SamplingParams(temperature=1e-5, seed=2**64 - 1)
    torch.Generator().manual_seed(params.seed)  # what generation does with it


@pytest.mark.parametrize("app, flag", [(APP, "--temp"), (APP, "--max-new"), (BENCHMARK_APP, "--sui"),
                                       (PROFILE_APP, "--cont")])
def test_abbreviated_flags_are_refused(capsys, app, flag):
    with pytest.raises(SystemExit) as exit_:
        load_app(app).main([flag, "4"])
    captured = capsys.readouterr()
    assert_input_error(subprocess.CompletedProcess([flag], exit_.value.code, captured.out, captured.err),
                       f"unrecognized arguments: {flag}")


@pytest.mark.parametrize("module, flag", [("gemv_sweep", "--rep"), ("hgemm_suite", "--replay"),
                                          ("macko_suite", "--rep")])
def test_the_bench_modules_refuse_abbreviated_flags_too(capsys, module, flag):
    import importlib

    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(f"minfer.bench.{module}").main([flag, "3"])
    assert exit_.value.code == 2 and f"unrecognized arguments: {flag}" in capsys.readouterr().err


def test_an_empty_prompt_generates_after_bos(generate_app, capsys, sharded):
    assert generate_app.main(["--model", str(sharded), "--device", "cpu", "--prompt", "", "--max-new-tokens", "2",
                              "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_ids"] == [Tokenizer(bundled_tokenizer_path()).bos_id] and len(out["generated_ids"]) == 2


def test_a_tokenizer_larger_than_the_model_is_refused_before_loading(generate_app, capsys, tmp_path):
    folder = tmp_path / "small-vocab"
    small = dataclasses.replace(tiny_random_model().config, vocab_size=97)
    save_hf(random_init(Transformer(small), seed=0, dtype=torch.float32, device="cpu"), folder)
    shutil.copyfile(bundled_tokenizer_path(), folder / "tokenizer.model")
    refused(generate_app, capsys, tmp_path, ["--model", str(folder)], "must lie in [0, 97)",
            "the tokenizer does not match")


def test_an_unknown_users_home_is_a_missing_path_not_a_crash(generate_app, capsys, tmp_path):
    """Path.expanduser raises for ~nosuchuser; the shell, and minfer, leave it as it is."""
    refused(generate_app, capsys, tmp_path, ["--model", "~no-such-user-of-minfer/model"],
            "~no-such-user-of-minfer/model is not a directory")
    assert check_save_target("~no-such-user-of-minfer/saved") == Path("~no-such-user-of-minfer/saved")


def test_output_the_terminal_cannot_encode_is_replaced(sharded):
    result = subprocess.run([sys.executable, str(APP), "--model", str(sharded), "--device", "cpu", "--prompt", "café",
                             "--max-new-tokens", "2"], capture_output=True, timeout=300,
                            env=os.environ | {"PYTHONIOENCODING": "ascii", "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0 and result.stdout.startswith(b"caf?"), result.stderr


def test_a_folder_given_as_the_tokenizer_is_named(tmp_path):
    with pytest.raises(CheckpointError, match=f"tokenizer file {tmp_path} is a folder"):
        Tokenizer(tmp_path)


# ----------------------------------------------------------------------------------------------
# config.json
# ----------------------------------------------------------------------------------------------

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


@pytest.mark.parametrize("change, fragments", [
    ([1, 2], ["config.json must hold a JSON object", "got list"]),
    ({"hidden_size": -64}, ["hidden_size must be a whole number", "got -64"]),
    ({"vocab_size": -1000}, ["vocab_size must be a whole number", "got -1000"]),
    ({"num_attention_heads": -4}, ["num_attention_heads must be a whole number"]),
    ({"intermediate_size": -96}, ["intermediate_size must be a whole number"]),
    ({"hidden_size": 64.7}, ["hidden_size must be a whole number", "got 64.7"]),
    ({"num_hidden_layers": True}, ["num_hidden_layers must be a whole number", "got True"]),
    ({"intermediate_size": "96"}, ["intermediate_size must be a whole number", "got '96'"]),
    ({"vocab_size": 2**40}, ["vocab_size must be a whole number in [1, 2147483647]"]),
    ({"rms_norm_eps": 0}, ["rms_norm_eps must be a finite number > 0", "got 0"]),
    ({"rms_norm_eps": -1e-5}, ["rms_norm_eps must be a finite number > 0"]),
    ({"rms_norm_eps": math.inf}, ["rms_norm_eps must be a finite number > 0", "got inf"]),
    ({"rope_theta": math.nan}, ["rope_theta must be a finite number > 0", "got nan"]),
    ({"rope_theta": None}, ["rope_theta must be a finite number > 0", "got None"]),
    ({"max_position_embeddings": -1}, ["max_position_embeddings must be a whole number", "got -1"]),
    ({"tie_word_embeddings": "false"}, ["tie_word_embeddings must be true or false"]),
    ({"num_key_value_heads": 3}, ["num_attention_heads 4, not a multiple of num_key_value_heads 3"]),
    ({"head_dim": 15}, ["head_dim 15", "even"]),
    ({"rope_scaling": [8.0]}, ["rope_scaling must be an object"]),
    ({"rope_scaling": {**LLAMA3_ROPE, "low_freq_factor": math.nan}}, ["rope_scaling.low_freq_factor must be"]),
    ({"rope_scaling": {**LLAMA3_ROPE, "high_freq_factor": 1.0}}, ["high_freq_factor > low_freq_factor"]),
    ({"rope_scaling": {**LLAMA3_ROPE, "original_max_position_embeddings": 31.5}},
     ["original_max_position_embeddings must be a whole number", "got 31.5"]),
])
def test_impossible_configs_are_refused_naming_the_field(generate_app, capsys, tmp_path, change, fragments):
    folder = tmp_path / "model"
    folder.mkdir()
    fields = change if isinstance(change, list) else tiny_random_model().config.to_hf() | change
    (folder / "config.json").write_text(json.dumps(fields))  # NaN and Infinity as Python's json writes them
    line = refused(generate_app, capsys, tmp_path, ["--model", str(folder)], *fragments)
    assert "--max-seq-len" not in line


def test_whole_floats_are_sizes_and_the_parsed_sizes_are_ints():
    fields = tiny_random_model().config.to_hf() | {"hidden_size": 64.0, "max_position_embeddings": 64.0}
    config = ModelConfig.from_hf(fields)
    assert type(config.hidden_size) is int and config.hidden_size == 64 and config.max_position_embeddings == 64


@pytest.mark.parametrize("write, message", [
    (lambda path: path.mkdir(), "cannot read"),
    (lambda path: path.write_bytes(b'{"vocab_size": "\xff"}'), "is not valid JSON"),
])
def test_an_unreadable_config_json_is_named(tmp_path, write, message):
    write(tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=message):
        resolve(str(tmp_path), "hf")


# ----------------------------------------------------------------------------------------------
# The safetensors index, and files outside the checkpoint folder
# ----------------------------------------------------------------------------------------------

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize("edit, fragments", [
    (lambda index: [index], ["is not a valid safetensors index"]),
    (lambda index: {"metadata": {}}, ["is not a valid safetensors index", "weight_map"]),
    (lambda index: index | {"weight_map": list(index["weight_map"].items())},
     ["its weight_map is a list, not an object"]),
    (lambda index: index | {"weight_map": index["weight_map"] | {Q_PROJ: 1}}, [f"maps tensor {Q_PROJ} to 1"]),
    (lambda index: index | {"weight_map": index["weight_map"] | {Q_PROJ: None}}, [f"maps tensor {Q_PROJ} to None"]),
    (lambda index: index | {"weight_map": index["weight_map"] | {Q_PROJ: "model-00004-of-00004.safetensors"}},
     [f"lists tensor {Q_PROJ} in model-00004-of-00004.safetensors, which lacks it"]),
])
def test_malformed_shard_indexes_are_refused(generate_app, capsys, tmp_path, sharded, edit, fragments):
    folder = copy_of(sharded, tmp_path)
    assert index_of(folder)["weight_map"][Q_PROJ] != "model-00004-of-00004.safetensors"
    write_index(folder, edit(index_of(folder)))
    stderr = refused(generate_app, capsys, tmp_path, ["--model", str(folder)], *fragments)
    assert "minfer:" not in stderr  # the header comes only after the weights loaded


@pytest.fixture
def outside_shard(tmp_path, sharded) -> tuple[Path, str]:
    """A copy of the shard holding q_proj, readable but outside the checkpoint folder, and that shard's name."""
    shard = index_of(sharded)["weight_map"][Q_PROJ]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    return Path(shutil.copyfile(sharded / shard, elsewhere / shard)), shard


@pytest.mark.parametrize("pointer", ["relative", "absolute"])
def test_a_weight_map_pointing_outside_the_folder_is_refused(generate_app, capsys, tmp_path, sharded, outside_shard,
                                                             pointer):
    folder = copy_of(sharded, tmp_path)
    outside, shard = outside_shard
    named = f"../elsewhere/{shard}" if pointer == "relative" else str(outside)
    index = index_of(folder)
    write_index(folder, index | {"weight_map": {name: named if file == shard else file
                                                for name, file in index["weight_map"].items()}})
    stderr = refused(generate_app, capsys, tmp_path, ["--model", str(folder)], f"names the shard {named}",
                     "outside", "reads only files inside the checkpoint folder")
    assert "delete" not in stderr and outside.is_file()


def test_a_shard_linked_from_outside_the_folder_is_refused(generate_app, capsys, tmp_path, sharded, outside_shard):
    folder = copy_of(sharded, tmp_path)
    outside, shard = outside_shard
    (folder / shard).unlink()
    (folder / shard).symlink_to(outside)
    refused(generate_app, capsys, tmp_path, ["--model", str(folder)], f"a link to {outside.resolve()}",
            "outside that folder")
    single = tmp_path / "single"
    save_hf(tiny_random_model(), tmp_path / "real")
    single.mkdir()
    shutil.copyfile(bundled_tokenizer_path(), single / "tokenizer.model")
    shutil.copyfile(tmp_path / "real" / "config.json", single / "config.json")
    (single / "model.safetensors").symlink_to(tmp_path / "real" / "model.safetensors")
    with pytest.raises(CheckpointError, match="the weights file model.safetensors in .*, a link to"):
        resolve(str(single), "hf")


def test_a_hugging_face_cache_snapshot_still_loads(tmp_path, sharded):
    """The Hub cache links every snapshot file to the repo's blobs folder beside the snapshots."""
    repo = tmp_path / "models--owner--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(sharded.iterdir())):
        shutil.copyfile(file, repo / "blobs" / f"blob{i}")
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", f"blob{i}"))
    resolved = resolve(str(snapshot), "hf")
    model = load_weights(Transformer(resolved.config), snapshot, torch.float32, "cpu")
    expected = load_weights(Transformer(resolved.config), sharded, torch.float32, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), expected.state_dict().values()))


def test_a_corrupt_shard_is_named_without_advice_to_delete_it(generate_app, capsys, tmp_path, sharded):
    folder = copy_of(sharded, tmp_path)
    shard = folder / index_of(folder)["weight_map"][Q_PROJ]
    shard.write_bytes(shard.read_bytes()[:-100])
    stderr = refused(generate_app, capsys, tmp_path, ["--model", str(folder)], f"{shard} is truncated or corrupt")
    assert "delete" not in stderr


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.bool])
def test_integer_and_bool_weights_are_refused_not_cast(generate_app, capsys, tmp_path, dtype):
    state = {name: tensor.clone() for name, tensor in hf_state_dict(tiny_random_model()).items()}
    state[Q_PROJ] = (state[Q_PROJ] * 100).to(dtype)
    folder = tmp_path / "integer"
    save_hf(state, folder, config=tiny_random_model().config)
    shutil.copyfile(bundled_tokenizer_path(), folder / "tokenizer.model")
    stored = {torch.int32: "I32", torch.int8: "I8", torch.bool: "BOOL"}[dtype]
    stderr = refused(generate_app, capsys, tmp_path, ["--model", str(folder)],
                     f"tensor {Q_PROJ} in model.safetensors is stored as {stored}, expected float weights")
    assert "minfer:" not in stderr


# ----------------------------------------------------------------------------------------------
# The --save-compressed guard
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("marker_text", [None, "my notes\n"])
def test_save_compressed_keeps_a_users_folder_with_partial_named_files(generate_app, capsys, tmp_path, sharded,
                                                                       marker_text):
    """File names anybody may use (config.json.partial) or a marker minfer did not write do not make a
    folder an interrupted save."""
    users = tmp_path / "users"
    users.mkdir()
    files = {"config.json": '{"mine": true}', "tokenizer.model": "my tokenizer", "config.json.partial": "draft"}
    if marker_text is not None:
        files[SAVE_MARKER] = marker_text
    for name, text in files.items():
        (users / name).write_text(text)
    refused(generate_app, capsys, tmp_path, ["--model", str(sharded), "--save-compressed", str(users)],
            "--save-compressed", "not a minfer compressed checkpoint", "config.json")
    assert {path.name: path.read_text() for path in users.iterdir()} == files


def test_an_interrupted_save_is_recognized_by_its_marker(tmp_path, monkeypatch):
    """The marker is written first and removed last: a save cut short leaves it, a later save takes
    the folder over, and a finished save leaves no marker behind."""
    import safetensors.torch

    folder = tmp_path / "compressed"
    model = tiny_random_model()

    def cut_short(tensors, path, metadata=None):
        Path(path).write_bytes(b"half a file")
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(safetensors.torch, "save_file", cut_short)
        with pytest.raises(KeyboardInterrupt):
            save_compressed(model, folder, bundled_tokenizer_path())
    assert sorted(path.name for path in folder.iterdir()) == [SAVE_MARKER]
    assert (folder / SAVE_MARKER).read_text() == SAVE_MARKER_TEXT
    (folder / "config.json.partial").write_text("{}")  # what a killed save may also leave
    save_compressed(model, folder, bundled_tokenizer_path())
    assert sorted(path.name for path in folder.iterdir()) == ["config.json", "model.safetensors", "tokenizer.model"]
    assert is_compressed(folder)


# ----------------------------------------------------------------------------------------------
# A closed output pipe (`| head -c 20`)
# ----------------------------------------------------------------------------------------------


def run_into_closed_pipe(app: Path, *args: str, stderr_too: bool = False) -> subprocess.CompletedProcess:
    """Run an app with stdout (and stderr, with `stderr_too`) a pipe whose reader is already gone."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, str(app), *args], stdout=write_end,
                              stderr=write_end if stderr_too else subprocess.PIPE, text=True, timeout=300,
                              env=os.environ | NO_GPU | {"HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"})
    finally:
        os.close(write_end)


@pytest.mark.parametrize("json_output", [False, True])
def test_generate_exits_quietly_when_the_reader_goes_away(sharded, json_output):
    result = run_into_closed_pipe(APP, "--model", str(sharded), "--device", "cpu", "--max-new-tokens", "4",
                                  *(["--json"] if json_output else []))
    assert result.returncode == CLOSED_PIPE_EXIT == 141
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr and "error" not in result.stderr
    both = run_into_closed_pipe(APP, "--model", str(sharded), "--device", "cpu", "--max-new-tokens", "4",
                                stderr_too=True)
    assert both.returncode == CLOSED_PIPE_EXIT


@pytest.mark.parametrize("app, args", [(BENCHMARK_APP, ["--suite", "kernels"]),
                                       (PROFILE_APP, ["--op", "decode", "--context", "4"])])
def test_benchmark_and_profile_exit_quietly_when_the_reader_goes_away(app, args):
    """Without a GPU both apps print one error line; into a closed pipe that is a quiet exit too."""
    assert run_into_closed_pipe(app, *args, stderr_too=True).returncode == CLOSED_PIPE_EXIT

