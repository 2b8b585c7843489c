"""Perplexity (minfer.perplexity, apps/evaluate.py): equal to transformers' on a checkpoint it saved,
pruning the demo model costs perplexity, and bad input is one line and exit code 2."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minfer.corpus import corpus_lines
from minfer.errors import MinferError
from minfer.perplexity import DEFAULT_TEXT, text_windows
from minfer.tokenizer import Tokenizer, bundled_tokenizer_path
from tests.conftest import requires_cuda
from tests.helpers import assert_input_error, in_process, load_app
from tests.tiny_llama import VARIANTS, hf_tiny_llama, save_sharded

APP = Path(__file__).resolve().parent.parent / "apps" / "evaluate.py"


def evaluate(capsys, *argv: str, device: str = "cpu") -> dict:
    result = in_process(load_app(APP), ["--device", device, "--json", *argv], capsys)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_windows_start_with_bos_and_drop_the_remainder():
    windows = text_windows(list(range(10, 20)), seq_len=4, bos_id=1, vocab_size=20)
    assert windows.tolist() == [[1, 10, 11, 12], [1, 13, 14, 15], [1, 16, 17, 18]]
    with pytest.raises(MinferError, match="ids up to 18 but the model's vocabulary has 18"):
        text_windows(list(range(10, 20)), seq_len=4, bos_id=1, vocab_size=18)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_perplexity_equals_transformers(tmp_path, capsys, variant):
    """exp of the mean cross-entropy transformers gives over the same windows: BOS, then 63 tokens."""
    hf = hf_tiny_llama(variant, vocab_size=1000)  # the bundled tokenizer's vocabulary
    folder = save_sharded(hf, tmp_path / "tiny")
    shutil.copyfile(bundled_tokenizer_path(), folder / "tokenizer.model")
    text = "\n".join(corpus_lines()[:40])
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    out = evaluate(capsys, "--model", str(folder), "--text", str(tmp_path / "text.txt"), "--seq-len", "64")

    ids = Tokenizer(bundled_tokenizer_path()).encode(text, bos=False)
    windows = len(ids) // 63
    assert windows >= 3 and (out["windows"], out["tokens"], out["seq_len"]) == (windows, windows * 63, 64)
    total = 0.0
    with torch.no_grad():
        for w in range(windows):
            window = torch.tensor([[1, *ids[w * 63:(w + 1) * 63]]])
            total += F.cross_entropy(hf(window).logits[0, :-1], window[0, 1:], reduction="sum").item()
    expected = math.exp(total / (windows * 63))
    [result] = out["results"]
    assert result["weights"] == "dense" and abs(result["perplexity"] - expected) / expected < 1e-4


def test_pruning_the_demo_model_costs_perplexity(capsys):
    out = evaluate(capsys, "--sparse", "macko", "--density", "0.5", "--compare-dense")
    dense, pruned = out["results"]
    assert (dense["weights"], pruned["weights"]) == ("dense", "macko d=0.5 magnitude")
    assert out["model"] == "stories260K" and out["text"] == str(DEFAULT_TEXT) and out["windows"] >= 20
    assert math.isfinite(dense["perplexity"]) and 1 < dense["perplexity"] < pruned["perplexity"]
    assert pruned["weight_bytes"] < dense["weight_bytes"] and pruned["sparsity"]["density"] == 0.5


@requires_cuda
@pytest.mark.parametrize("flags", [(), ("--sparse", "macko", "--density", "0.5")])
def test_gpu_kernels_agree_with_the_cpu_references(capsys, flags):
    """float16 on the GPU (minfer's kernels, head_dim 8 included) against float32 on the CPU."""
    [cpu] = evaluate(capsys, *flags)["results"]
    [gpu] = evaluate(capsys, *flags, device="cuda")["results"]
    assert abs(gpu["perplexity"] - cpu["perplexity"]) / cpu["perplexity"] < 1e-2


def test_help_lists_the_flags(capsys):
    result = in_process(load_app(APP), ["--help"], capsys)
    assert result.returncode == 0
    for flag in ("--model", "--tokenizer", "--text", "--seq-len", "--compare-dense", "--json", "--sparse",
                 "--density", "--prune", "--device", "--dtype"):
        assert flag in result.stdout


def test_the_default_text_is_a_few_thousand_words():
    assert len(DEFAULT_TEXT.read_text(encoding="utf-8").split()) >= 3000


def test_table_output(tmp_path, capsys):
    result = in_process(load_app(APP), ["--device", "cpu", "--seq-len", "256"], capsys)
    assert result.returncode == 0, result.stderr
    header, dense = result.stdout.splitlines()
    assert header.split() == ["weights", "perplexity", "weight", "MB"] and dense.split()[0] == "dense"
    assert "perplexity on stories.txt" in result.stderr


@pytest.mark.parametrize("argv, fragments", [
    (["--text", "/no/such.txt"], ["--text /no/such.txt does not exist"]),
    (["--seq-len", "1"], ["--seq-len must be at least 2"]),
    (["--seq-len", "4096"], ["--seq-len 4096 exceeds the 2048 positions"]),
    (["--compare-dense"], ["--compare-dense compares", "--sparse macko"]),
    (["--seq", "8"], ["unrecognized arguments: --seq"]),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, fragments):
    assert_input_error(in_process(load_app(APP), ["--device", "cpu", *argv], capsys), *fragments)


def test_bad_text_files_are_one_line_and_exit_2(tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("Once upon a time.")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe not text")
    for path, message in ((short, "fewer than one window of 511"), (binary, "is not UTF-8 text"),
                          (tmp_path, "is a folder, not a file")):
        assert_input_error(in_process(load_app(APP), ["--device", "cpu", "--text", str(path)], capsys), message)
