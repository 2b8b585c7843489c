"""apps/generate.py end to end, through a subprocess: the offline demo, --json, local checkpoints,
and every bad input answered with one `error:` line on stderr and exit code 2. Offline throughout."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minfer.checkpoint import save_hf
from minfer.config import KNOWN_CONFIGS, ModelConfig
from minfer.errors import MinferError
from minfer.runtime import available_bytes, estimate_memory
from minfer.sparsity.compressed import SAVE_MARKER, SAVE_MARKER_TEXT
from minfer.tokenizer import Tokenizer, bundled_tokenizer_path
from tests.conftest import requires_cuda
from tests.helpers import (APP, NO_GPU, PROFILE_APP, assert_input_error, cli, in_process, load_app,
                           tiny_random_model)

@pytest.fixture(scope="module")
def local_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    save_hf(tiny_random_model(), folder, shard_size=100_000)
    shutil.copyfile(bundled_tokenizer_path(), folder / "tokenizer.model")
    return folder


def test_no_flags_tells_the_demo_story():
    result = cli("--max-new-tokens", "60")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Once upon a time, there was a little girl named Lily. She loved to play outside "
                                    "in the park.")
    assert "stories260K" in result.stderr and "RANDOM" not in result.stderr
    for stat in ("prefill", "time to first token", "tok/s", "GB/s", "peak GPU memory"):
        assert stat in result.stderr


def test_json_output(local_checkpoint):
    prompt = "Mara counts the seconds"
    result = cli("--model", str(local_checkpoint), "--device", "cpu", "--prompt", prompt, "--max-new-tokens", "9",
                 "--temperature", "0.8", "--top-k", "50", "--top-p", "0.9", "--seed", "7", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    tokenizer = Tokenizer(bundled_tokenizer_path())
    assert out["prompt_ids"] == tokenizer.encode(prompt)
    assert 0 < len(out["generated_ids"]) <= 9 and out["text"] == tokenizer.decode(out["generated_ids"])
    assert out["random_weights"] is False and out["dtype"] == "float32"
    assert {"prefill_ms", "ttft_ms", "decode_tok_s", "weight_gb_s", "peak_mem_gb"} <= set(out["stats"])
    again = json.loads(cli("--model", str(local_checkpoint), "--device", "cpu", "--prompt", prompt,
                           "--max-new-tokens", "9", "--temperature", "0.8", "--top-k", "50", "--top-p", "0.9",
                           "--seed", "7", "--json").stdout)
    assert again["generated_ids"] == out["generated_ids"]


def test_chat_and_random_weights_for_a_local_architecture(local_checkpoint):
    result = cli("--model", str(local_checkpoint), "--weights", "random", "--device", "cpu", "--chat",
                 "--prompt", "Hello", "--max-new-tokens", "4", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["random_weights"] is True
    assert out["prompt_ids"] == Tokenizer(bundled_tokenizer_path()).chat_prompt("Hello")
    assert "RANDOM weights" in result.stderr


def test_help():
    result = cli("--help")
    assert result.returncode == 0
    for flag in ("--model", "--weights", "--prompt", "--chat", "--max-new-tokens", "--temperature", "--top-k",
                 "--top-p", "--seed", "--device", "--dtype", "--sparse", "--max-seq-len", "--json", "HF_TOKEN"):
        assert flag in result.stdout


@pytest.mark.parametrize("args, fragments", [
    (["--model", "llama9"], ["unknown model 'llama9'", "tinyllama-1.1b"]),
    (["--model", "./no/such/checkpoint"], ["is not a directory"]),
    (["--model", "nobody-xyz/no-such-model"], ["cannot download nobody-xyz/no-such-model", "--weights random"]),
    (["--prompt", "word " * 40, "--max-seq-len", "16"], ["the prompt has", "--max-seq-len"]),
])
def test_bad_input_is_one_line_and_exit_2(args, fragments):
    assert_input_error(cli("--device", "cpu", *args), *fragments)


@pytest.mark.parametrize("args, fragments", [
    (["--max-seq-len", "100000"], ["--max-seq-len must be in [2, 2048]"]),
    (["--max-seq-len", "0"], ["--max-seq-len must be in [2, 2048]", "got 0"]),
    (["--dtype", "int8"], ["--dtype", "invalid choice"]),
    (["--sparse", "bogus"], ["--sparse", "invalid choice"]),
    (["--device", "tpu"], ["'tpu' is not"]),
    (["--top-p", "0"], ["top_p must be in (0, 1]"]),
    (["--max-new-tokens", "0"], ["--max-new-tokens must be at least 1"]),
    (["--max-new-tokens", "many"], ["invalid int value"]),
    (["--embedding", "host", "--backend", "torch"], ["--embedding host needs --backend minfer"]),
    (["--embedding", "disk"], ["--embedding", "invalid choice"]),
    (["--weights", "random", "--sparse", "macko"], ["random weights have no zeros", "--density"]),
    (["--sparse", "macko", "--prune", "wanda"], ["--prune sets how --density prunes"]),
    (["--sparse", "macko", "--density", "0.5", "--calib-samples", "2"], ["--calib-samples", "add --prune wanda"]),
    (["--sparse", "macko", "--density", "0.5", "--prune", "wanda", "--calib-seq-len", "5000"],
     ["--calib-seq-len 5000 exceeds the 2048 positions"]),
    (["--sparse", "macko", "--density", "1.5"], ["density must be in (0, 1]"]),
    (["--sparse", "macko", "--density", "0.5", "--save-compressed", str(APP)], ["--save-compressed", "is not a folder"]),
    (["--macko-reference", "/no/such/file"], ["--macko-reference /no/such/file does not exist"]),
    (["--sparse", "macko", "--density", "0.5", "--prune", "wanda", "--calib-samples", "0"],
     ["--calib-samples must be at least 1"]),
    (["--sparse", "macko", "--density", "0.5", "--prune", "wanda", "--calib-text", "/no/such.txt"],
     ["--calib-text /no/such.txt does not exist"]),
    (["--macko-reference", str(APP), "--weights", "random"], ["drop --weights random"]),
    (["--density", "0.5", "--save-compressed", "/no/such/folder"], ["--save-compressed writes compressed", "--sparse 2:4|ksmm|macko"]),
    (["--sparse", "macko", "--density", "0.5", "--save-compressed", ""], ["--save-compressed is empty"]),
    (["--macko-reference", ""], ["--macko-reference is empty"]),
    (["--sparse", "macko", "--density", "0.5", "--save-compressed", f"{APP}/sub"], ["--save-compressed: cannot create"]),
    (["--sparse", "macko", "--density", "0.5", "--prune", "wanda", "--calib-text", str(APP.parent)],
     ["--calib-text", "is a folder, not a file"]),
])
def test_bad_flag_values_in_process(capsys, args, fragments):
    """The same contract for flag values, through main() in this process."""
    app = load_app(APP)
    try:
        code = app.main(["--device", "cpu", *args])
    except SystemExit as exit_:  # argparse rejects the flag itself
        code = exit_.code
    captured = capsys.readouterr()
    assert_input_error(subprocess.CompletedProcess(args, code, captured.out, captured.err), *fragments)


def test_missing_files_in_a_local_checkpoint(tmp_path, local_checkpoint):
    assert_input_error(cli("--model", str(tmp_path), "--device", "cpu"), "no config.json")
    broken = tmp_path / "broken"
    shutil.copytree(local_checkpoint, broken)
    next(broken.glob("model-00002-*.safetensors")).unlink()
    assert_input_error(cli("--model", str(broken), "--device", "cpu"), "model-00002-", "is missing")


def test_cuda_without_a_gpu():
    assert_input_error(cli("--device", "cuda", env=NO_GPU), "needs a CUDA GPU", "--device cpu")


def test_more_memory_than_the_machine_has():
    config = ModelConfig.from_hf(KNOWN_CONFIGS["llama2-70b"])
    free = available_bytes(torch.device("cpu"))
    if free is None or estimate_memory(config, torch.float32, 4096).total <= free:
        pytest.skip("this machine has the RAM for a float32 Llama-2-70B")
    result = cli("--model", "llama2-70b", "--weights", "random", "--device", "cpu", "--dtype", "float32", env=NO_GPU)
    assert_input_error(result, "needs about", "GB of RAM", "float32")


@requires_cuda
def test_more_memory_than_the_gpu_has():
    config = ModelConfig.from_hf(KNOWN_CONFIGS["llama2-70b"])
    free = available_bytes(torch.device("cuda"))
    if estimate_memory(config, torch.float32, 4096).total <= free:
        pytest.skip("this GPU has the memory for a float32 Llama-2-70B")
    result = cli("--model", "llama2-70b", "--weights", "random", "--device", "cuda", "--dtype", "float32")
    assert_input_error(result, "needs about", "GPU memory is free")


def test_memory_estimate_and_check(monkeypatch):
    from minfer import runtime
    from minfer.errors import DeviceError

    config = ModelConfig.from_hf(KNOWN_CONFIGS["llama2-7b"])
    need = estimate_memory(config, torch.float16, 4096)
    assert need.weights == 2 * 6_738_415_616
    assert need.kv_cache == 2 * 32 * 32 * 128 * 4096 * 2  # K and V, 32 layers, 32 heads x 128, 4096 positions
    monkeypatch.setattr(runtime, "available_bytes", lambda device: need.total - 1)
    with pytest.raises(DeviceError, match=r"needs about 16\.\d GB \(13\.5 GB of float16 weights, 2\.1 GB of KV"):
        runtime.check_memory(config, torch.float16, torch.device("cpu"), 4096)
    monkeypatch.setattr(runtime, "available_bytes", lambda device: need.total)
    assert runtime.check_memory(config, torch.float16, torch.device("cpu"), 4096) == need


def test_device_dtype_and_context_defaults():
    from minfer import runtime

    cpu = torch.device("cpu")
    assert runtime.pick_dtype(None, cpu) == torch.float32 and runtime.pick_dtype("bfloat16", cpu) == torch.bfloat16
    assert runtime.pick_device("cpu") == cpu
    assert runtime.pick_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    llama2 = ModelConfig.from_hf(KNOWN_CONFIGS["llama2-7b"])
    assert runtime.context_length(llama2, None, 10) == 4096
    assert runtime.context_length(ModelConfig.from_hf(KNOWN_CONFIGS["llama3.1-8b"]), None, 10) == 4096
    assert runtime.context_length(llama2, 100, 99) == 100
    assert runtime.context_length(llama2, 32768, 10, random_weights=True) == 32768
    with pytest.raises(MinferError, match=r"must be in \[2, 4096\]"):
        runtime.context_length(llama2, 32768, 10)


def test_random_weights_take_a_long_context_and_a_cache_too_big_is_one_line(monkeypatch, capsys):
    """llama2-7b allows 4096 positions; random weights take 32768, and when that KV cache does not fit,
    one line says how long a context does."""
    from minfer import runtime

    config = ModelConfig.from_hf(KNOWN_CONFIGS["llama2-7b"])
    free = estimate_memory(config, torch.float16, 8192).total
    monkeypatch.setattr(runtime, "available_bytes", lambda device: free)
    result = in_process(load_app(APP), ["--model", "llama2-7b", "--weights", "random", "--device", "cpu", "--dtype",
                                        "float16", "--max-seq-len", "32768"], capsys)
    assert_input_error(result, "17.2 GB of KV cache for 32768 positions")
    assert re.search(r"--max-seq-len 819\d \(the most that fits\)", result.stderr)


def test_backend_flag_selects_the_path_and_rejects_unknown_ones(local_checkpoint):
    args = ("--model", str(local_checkpoint), "--device", "cpu", "--max-new-tokens", "6", "--json")
    minfer_ids = json.loads(cli(*args, "--backend", "minfer").stdout)["generated_ids"]
    assert json.loads(cli(*args, "--backend", "torch").stdout)["generated_ids"] == minfer_ids  # CPU: same references
    assert_input_error(cli(*args, env={"MINFER_BACKEND": "cuda-magic"}), "unknown backend 'cuda-magic'")


@pytest.mark.parametrize("argv, message", [
    (["--op", "gemv", "--timeline"], "use it with --op decode"),
    (["--op", "decode", "--timeline", "--steps", "1"], "--steps must be at least 2"),
    (["--op", "decode", "--timeline", "--sparse", "macko", "--density", "1.5"], "--density must lie in"),
    (["--op", "macko", "--sparse", "macko"], "use it with --op decode"),
    (["--op", "macko", "--density", "0.25"], "--op macko has cases at densities"),
    (["--op", "gemv", "--density", "0.5"], "--density picks the pruning of --op decode with a sparse --sparse"),
    (["--op", "decode", "--density", "0.5"], "--density picks the pruning of --op decode with a sparse --sparse"),
    (["--layers", "-1"], "--layers at least 0"),
    (["--op", "gemv", "--layers", "2"], "--layers cuts the profiled decode step"),
    (["--op", "decode", "--timeline", "--layers", "2"], "--layers cuts the profiled decode step"),
    (["--op", "decode", "--baseline"], "--baseline and --shapes choose kernel cases"),
    (["--shapes", "4096x4096"], "--baseline and --shapes choose kernel cases"),
    (["--timeline", "--iters", "3"], "--iters counts profiled runs"),
    (["--steps", "4"], "--steps counts the steps --timeline traces"),
    (["--op", "gemv", "--shapes", "4096x4096,,"], "no empty items"),
])
def test_profile_app_rejects_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_app(PROFILE_APP).main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("sparse, density, label", [("none", "0.4", "dense"), ("macko", "0.4", "macko d=0.4"),
                                                     ("2:4", None, "2:4")])
def test_profile_app_decode_model_takes_the_sparse_format(sparse, density, label, monkeypatch):
    """`--op decode --sparse macko` profiles the pruned MACKO model, `--sparse 2:4` one pruned to 2:4."""
    from minfer.bench import e2e_suite
    from minfer.formats import FORMATS

    monkeypatch.setattr(e2e_suite, "build_model", lambda name, dtype, **_: tiny_random_model(dtype))
    app = load_app(PROFILE_APP)
    argv = ["--op", "decode", "--sparse", sparse] + (["--density", density] if density else [])
    model, got_label = app.decode_model(app.build_parser().parse_args(argv))
    formats = {type(linear.fmt) for _, linear in model.projections()}
    assert formats == {FORMATS["dense" if sparse == "none" else sparse]}
    assert got_label == label


def test_profile_app_refuses_a_density_for_an_n_m_format(capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_app(PROFILE_APP).main(["--op", "decode", "--sparse", "2:4", "--density", "0.5"])
    assert exit_info.value.code == 2
    assert "prunes to its own N:M structure" in capsys.readouterr().err


@requires_cuda
@pytest.mark.parametrize("layers, stops_at_layer", [(None, 1), ("1", 1), ("0", None)])
def test_profile_app_decode_stops_profiling_after_the_chosen_layers(layers, stops_at_layer, monkeypatch, capsys):
    """The default profile of `--op decode` is the embedding and layer 0 (the layers repeat the same
    kernels): profiling stops as layer 1 starts. --layers 0 keeps the whole step."""
    events = []

    class Profiler:  # returns cudaSuccess (0) like the real calls
        def cudaProfilerStart(self):
            events.append("start")
            return 0

        def cudaProfilerStop(self):
            events.append("stop")
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", Profiler)
    app = load_app(PROFILE_APP)
    model = tiny_random_model(torch.float16).cuda()
    monkeypatch.setattr(app, "decode_model", lambda args: (model, "dense"))
    for index, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(lambda *_, index=index: events.append(f"layer {index}"))
    assert app.main(["--op", "decode", "--context", "4", *(["--layers", layers] if layers else [])]) == 0
    step = [f"layer {i}" for i in range(len(model.layers))]
    profiled = step[:stops_at_layer + 1] + ["stop"] + step[stops_at_layer + 1:] if stops_at_layer else step
    # the warm-up step, then one profiled step (--iters defaults to 1 for decode); the app's hook on
    # layer 1 runs after the recording one registered before it
    assert events == step + ["start"] + profiled + ["stop"]
    assert ("layers 0..0" if stops_at_layer else "the whole step") in capsys.readouterr().out


def test_profile_app_without_a_gpu_says_so(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert load_app(PROFILE_APP).main(["--op", "decode", "--timeline"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def sparse_json(*args: str) -> dict:
    result = cli("--device", "cpu", "--max-new-tokens", "6", "--json", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout) | {"stderr": result.stderr}


def test_prune_compress_save_and_reload(local_checkpoint, tmp_path):
    """--sparse macko --density prunes and compresses with progress bars and a report; the saved
    folder reloads as it was (same greedy tokens) and refuses to be pruned again."""
    folder = tmp_path / "macko"
    first = sparse_json("--model", str(local_checkpoint), "--sparse", "macko", "--density", "0.5",
                        "--save-compressed", str(folder))
    assert first["sparsity"]["density"] == 0.5 and first["sparsity"]["block_density"] == [0.5, 0.5]
    assert first["sparsity"]["projection_bytes_stored"] < first["sparsity"]["projection_bytes_dense"]
    for shown in ("magnitude pruning", "converting to macko", "projections: density 0.500", "saved the compressed"):
        assert shown in first["stderr"]
    again = sparse_json("--model", str(folder))
    assert again["generated_ids"] == first["generated_ids"] and again["sparsity"] == first["sparsity"]
    assert first["sparse"] == again["sparse"] == "macko" and "projections as stored compressed" in again["stderr"]
    assert again["random_weights"] is False and "loading" in again["stderr"]
    assert_input_error(cli("--device", "cpu", "--model", str(folder), "--density", "0.3"),
                       "pruned already", "dense checkpoint")
    for explicit in ("dense", "none"):
        assert_input_error(cli("--device", "cpu", "--model", str(folder), "--sparse", explicit),
                           f"--sparse {explicit}", "would not decompress")
    for source, flags in ((folder, ()), (local_checkpoint, ("--sparse", "macko", "--density", "0.5"))):
        files = {path: path.stat().st_mtime_ns for path in source.iterdir()}
        assert_input_error(cli("--device", "cpu", "--model", str(source), *flags, "--save-compressed", str(source)),
                           "is the folder the weights are read from")
        assert {path: path.stat().st_mtime_ns for path in source.iterdir()} == files  # nothing written


def test_structured_format_prunes_itself_and_reloads(local_checkpoint, tmp_path):
    """--sparse 2:4 prunes to 2 of every 4 weights (wanda with --prune wanda) without --density, saves and
    reloads as it was; random weights need no --density either, and --density is refused."""
    folder = tmp_path / "two-four"
    first = sparse_json("--model", str(local_checkpoint), "--sparse", "2:4", "--prune", "wanda", "--calib-samples",
                        "2", "--calib-seq-len", "16", "--save-compressed", str(folder))
    assert first["sparse"] == "2:4" and first["sparsity"]["density"] == 0.5
    assert "pruning the projections to 2:4 (wanda)" in first["stderr"]
    again = sparse_json("--model", str(folder))
    assert again["generated_ids"] == first["generated_ids"] and again["sparse"] == "2:4"
    assert sparse_json("--weights", "random", "--sparse", "2:4")["sparse"] == "2:4"
    assert_input_error(cli("--device", "cpu", "--sparse", "2:4", "--density", "0.5"), "--sparse 2:4",
                       "drop --density")


def test_save_compressed_refuses_a_folder_holding_another_checkpoint(local_checkpoint, tmp_path):
    """A non-empty folder is written only when an earlier compressed save made it: another
    checkpoint's files (here an HF one, also with --weights random) are never overwritten."""
    victim = tmp_path / "victim"
    shutil.copytree(local_checkpoint, victim)
    before = {path: path.stat().st_mtime_ns for path in victim.iterdir()}
    for flags, message in ((("--model", str(local_checkpoint)), "not a minfer compressed checkpoint"),
                           (("--weights", "random", "--model", str(local_checkpoint)), "not a minfer compressed"),
                           (("--weights", "random", "--model", str(victim)), "the folder the weights are read from")):
        assert_input_error(cli("--device", "cpu", *flags, "--sparse", "macko", "--density", "0.5",
                               "--save-compressed", str(victim)), "--save-compressed", message)
    assert {path: path.stat().st_mtime_ns for path in victim.iterdir()} == before
    config_only = tmp_path / "config-only"  # e.g. another model's folder for --macko-reference
    config_only.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (config_only / name).write_text('{"mine": true}')
    assert_input_error(cli("--device", "cpu", "--model", str(local_checkpoint), "--sparse", "macko", "--density",
                           "0.5", "--save-compressed", str(config_only)), "config.json, tokenizer.json")
    assert sorted(p.name for p in config_only.iterdir()) == ["config.json", "tokenizer.json"]
    assert (config_only / "config.json").read_text() == '{"mine": true}'
    leftover = tmp_path / "leftover"  # an interrupted save's marker and temporary files, and a hidden file
    leftover.mkdir()
    for name in ("model.safetensors.partial", "config.json", ".DS_Store"):
        shutil.copyfile(local_checkpoint / "config.json", leftover / name)
    (leftover / SAVE_MARKER).write_text(SAVE_MARKER_TEXT)
    sparse_json("--model", str(local_checkpoint), "--sparse", "macko", "--density", "0.5", "--save-compressed",
                str(leftover))
    assert not (leftover / "model.safetensors.partial").exists()  # overwritten by the save, then renamed
    assert sparse_json("--model", str(leftover))["sparsity"]["density"] == 0.5
    folder = tmp_path / "macko"
    for density in ("0.5", "0.25"):  # the second save replaces the first
        sparse_json("--model", str(local_checkpoint), "--sparse", "macko", "--density", density,
                    "--save-compressed", str(folder))
    assert sparse_json("--model", str(folder))["sparsity"]["density"] == 0.25


def test_compressed_random_weights_reload_as_random(tmp_path):
    folder = tmp_path / "random-macko"
    saved = sparse_json("--weights", "random", "--sparse", "macko", "--density", "0.5", "--save-compressed",
                        str(folder))
    again = sparse_json("--model", str(folder), "--sparse", "macko")  # as stored: no --density asked
    assert saved["random_weights"] is again["random_weights"] is True and "RANDOM" in again["stderr"]


def test_calibration_and_density_are_checked_before_loading(tmp_path, capsys):
    """Text too short for wanda, or a density that keeps no weight of a row: refused before the weights
    load (one line, no progress bars), and the --save-compressed folder is not made."""
    app = load_app(APP)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    target = tmp_path / "never-made"
    for flags, message in ((["--density", "0.5", "--prune", "wanda", "--calib-text", str(empty), "--calib-seq-len",
                             "8"], "the calibration text has 0 tokens"),
                           (["--density", "0.001"], "keeps round(0.001 * ")):
        code = app.main(["--device", "cpu", "--sparse", "macko", *flags, "--save-compressed", str(target)])
        captured = capsys.readouterr()
        assert_input_error(subprocess.CompletedProcess(flags, code, captured.out, captured.err), message)
        assert not target.exists()


def test_saved_weights_are_readable_as_the_umask_allows(local_checkpoint, tmp_path):
    import stat

    folder = tmp_path / "macko"
    sparse_json("--model", str(local_checkpoint), "--sparse", "macko", "--density", "0.5", "--save-compressed",
                str(folder))
    umask = os.umask(0)
    os.umask(umask)
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in folder.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o666 & ~umask, modes


def test_corrupt_macko_arrays_are_refused_when_loaded(local_checkpoint, tmp_path, capsys):
    """row_ptr out of order or past the values, and entries past the last column: one error line
    naming the projection, not a crash in the kernels or the reference path."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "macko"
    sparse_json("--model", str(local_checkpoint), "--sparse", "macko", "--density", "0.5",
                "--save-compressed", str(folder))
    file = folder / "model.safetensors"
    with safe_open(str(file), "pt") as f:
        metadata = f.metadata()
    original = load_file(str(file))
    key = next(name for name in original if name.endswith("qkv_proj.fmt.row_ptr"))
    deltas_key = key.replace("row_ptr", "deltas")
    swapped = original[key].clone()
    swapped[[1, 2]] = swapped[[2, 1]]  # from 0 to the stored count, but decreasing once
    assert swapped[1] > swapped[2]
    for corrupt in ({key: original[key].flip(0).contiguous()}, {key: original[key] + 1000}, {key: swapped},
                    {deltas_key: torch.full_like(original[deltas_key], 255)}):
        save_file({**original, **corrupt}, str(file), metadata=metadata)
        result = cli("--device", "cpu", "--model", str(folder))
        last = result.stderr.splitlines()[-1]
        assert result.returncode == 2 and last.startswith("error: ") and "qkv_proj" in last and "MACKO" in last, \
            result.stderr
    # stored as the wrong kind (no silent cast), values and nibbles of different lengths, damaged metadata
    values_key = key.replace("row_ptr", "values")
    layout = json.loads(metadata["minfer_formats"])
    no_shape = {**layout, next(iter(layout)): {"format": "macko"}}
    app = load_app(APP)
    for tensors, meta, message in (
            ({values_key: original[values_key].to(torch.int32)}, {}, "MACKO values must be a 1-D float tensor"),
            ({key: original[key].float()}, {}, "MACKO row_ptr must be int32"),
            ({deltas_key: original[deltas_key].view(torch.int8)}, {}, "MACKO deltas must be uint8"),
            ({values_key: original[values_key][:-8].contiguous()}, {}, "bytes (one nibble per value)"),
            ({}, {"minfer_formats": "{not json"}, "unreadable minfer_formats metadata"),
            ({}, {"minfer_formats": "[1, 2]"}, "malformed minfer_formats metadata"),
            ({}, {"minfer_formats": json.dumps(no_shape)}, "malformed minfer_formats metadata"),
            ({}, {"minfer_random_weights": "yes"}, "unreadable minfer_random_weights metadata")):
        save_file({**original, **tensors}, str(file), metadata={**metadata, **meta})
        code = app.main(["--device", "cpu", "--max-new-tokens", "2", "--model", str(folder)])
        captured = capsys.readouterr()
        last = captured.err.splitlines()[-1]
        assert code == 2 and last.startswith("error: ") and message in last, captured.err
        assert "Traceback" not in captured.err


def test_density_without_a_sparse_format_says_the_weights_stay_dense(local_checkpoint):
    out = sparse_json("--model", str(local_checkpoint), "--density", "0.5")
    assert out["sparse"] == "dense" and out["sparsity"]["density"] == 0.5
    assert "stay dense" in out["stderr"] and "more memory" not in out["stderr"]


def test_compressing_without_pruning_warns_when_it_takes_more_memory(local_checkpoint):
    out = sparse_json("--model", str(local_checkpoint), "--sparse", "macko")
    assert out["sparse"] == "macko" and "take more memory as macko than dense" in out["stderr"]


def test_wanda_from_the_command_line(local_checkpoint):
    out = sparse_json("--model", str(local_checkpoint), "--sparse", "macko", "--density", "0.25", "--prune", "wanda",
                      "--calib-samples", "2", "--calib-seq-len", "16")
    assert out["sparsity"]["density"] == 0.25 and "wanda pruning" in out["stderr"]


def reference_checkpoint(local_checkpoint, folder: Path) -> tuple[dict, Path]:
    """The tiny model pruned to d = 0.5 as the reference tool's compression script stores it (HF names,
    `.c_0` ... `.c_4` for the projections), and a folder with only its config and tokenizer."""
    from minfer.checkpoint import hf_state_dict
    from minfer.formats.macko import compress
    from minfer.sparsity import prune_model_

    model = prune_model_(tiny_random_model(torch.float16), 0.5, progress=False)
    state = {}
    for name, tensor in hf_state_dict(model).items():
        if "self_attn" in name or "mlp" in name:
            for i, part in enumerate((*compress(tensor.contiguous()), *tensor.shape)):
                state[name.replace("weight", f"c_{i}")] = part
        else:
            state[name] = tensor.clone()
    config_only = folder / "config-only"
    config_only.mkdir()
    for name in ("config.json", "tokenizer.model"):
        shutil.copyfile(local_checkpoint / name, config_only / name)
    return state, config_only


def test_macko_reference_takes_only_config_and_tokenizer_from_the_model(local_checkpoint, tmp_path):
    """A folder with config.json and the tokenizer, no weights: --macko-reference brings them."""
    state, config_only = reference_checkpoint(local_checkpoint, tmp_path)
    torch.save(state, tmp_path / "reference_compressed.pt")
    out = sparse_json("--model", str(config_only), "--macko-reference", str(tmp_path / "reference_compressed.pt"),
                      "--dtype", "float16")
    assert out["random_weights"] is False and out["sparsity"]["density"] == 0.5
    assert "RANDOM" not in out["stderr"]


def test_malformed_reference_checkpoints_are_refused(local_checkpoint, tmp_path, capsys):
    """Arrays of the wrong kind or rank, sizes that are not integers, a missing dense tensor: one line
    naming the key, before the kernels see anything (int8 nibbles would unpack negative and pass the
    column check)."""
    state, config_only = reference_checkpoint(local_checkpoint, tmp_path)
    q = "model.layers.0.self_attn.q_proj."
    app = load_app(APP)
    for change, message in (({q + "c_1": state[q + "c_1"].view(torch.int8)}, "deltas must be a uint8 1-D"),
                            ({q + "c_0": state[q + "c_0"].view(torch.int16)}, "values must be a float 1-D"),
                            ({q + "c_0": state[q + "c_0"].view(-1, 8)}, "values must be a float 1-D"),
                            ({q + "c_2": state[q + "c_2"].float()}, "row_ptr must be an int32 or int64"),
                            ({q + "c_3": torch.tensor([64, 64])}, q + "c_3 in"),
                            ({q + "c_3": "abc"}, q + "c_3 in"),
                            ({"model.norm.weight": None}, "lacks model.norm.weight")):
        file = tmp_path / "reference.pt"
        torch.save({k: v for k, v in {**state, **change}.items() if v is not None}, file)
        code = app.main(["--device", "cpu", "--max-new-tokens", "2", "--model", str(config_only), "--dtype",
                         "float16", "--macko-reference", str(file)])
        captured = capsys.readouterr()
        last = captured.err.splitlines()[-1]
        assert code == 2 and last.startswith("error: ") and message in last, captured.err
        assert "Traceback" not in captured.err


def test_profile_app_checks_the_context_against_the_model():
    result = subprocess.run([sys.executable, str(PROFILE_APP), "--op", "decode", "--context", "5000"],
                            capture_output=True, text=True, env=os.environ | NO_GPU, timeout=120)
    assert result.returncode == 2 and "--context 5000 needs 5001 cache positions" in result.stderr
    assert "4096 llama2-7b supports" in result.stderr
