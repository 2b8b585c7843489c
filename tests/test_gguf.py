"""GGUF checkpoints and the embedded default, stories260K: the shipped copy is a fresh conversion of
the GGUF file, it tells the documented story, it equals transformers, and `--model file.gguf`
(F32, F16, BF16) gives what the converted model gives; damaged or unsupported files are refused
in one line. GGUF files beyond the shared original are written here with llama.cpp's gguf writer."""

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from minfer.checkpoint import hf_state_dict, load_model, random_init, resolve
from minfer.checkpoint import DEMO_DIR
from minfer.demo import DEMO_PROMPT, save_as_hf
from minfer.demo import main as demo_main
from minfer.errors import CheckpointError
from minfer.generate import Generator
from minfer.gguf_source import GGUFCheckpoint, gguf_name
from minfer.model import Transformer
from minfer.tokenizer import Tokenizer
from tests.conftest import requires_cuda
from tests.helpers import APP, assert_input_error, cli, in_process, load_app

TOKENIZER = DEMO_DIR / "tokenizer.model"

REPO = Path(__file__).resolve().parent.parent
# The original GGUF file: shared/ sits beside the clone (CI), or inside a checkout that carries it.
SHARED = next((root / "shared" / "data" / "stories260K" for root in (REPO.parent, REPO)
               if (root / "shared" / "data" / "stories260K").is_dir()), None)
requires_shared = pytest.mark.skipif(SHARED is None, reason="the original GGUF is absent: no "
                                     "../shared/data/stories260K beside the repository")
STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, "
         "she saw a big, red ball. She wanted to play with it, but it was too high.")


@pytest.fixture(scope="module")
def demo():
    return load_model(resolve(None), torch.float32, "cpu")


def greedy(model, tokenizer: Tokenizer, prompt: str, new_tokens: int) -> list[int]:
    return Generator(model, tokenizer, 256, "cpu").generate(tokenizer.encode(prompt), max_new_tokens=new_tokens).tokens


def interleaved_from_halves(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order, as its HF converter permutes it: per head, the rotate-halves pair
    (i, i + h/2) becomes the adjacent rows 2i, 2i + 1."""
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def write_gguf(path: Path, model, tensor_type: str = "F32", architecture: str = "llama",
               drop: tuple[str, ...] = (), quantize: tuple[str, ...] = ()) -> Path:
    """`model` as a llama.cpp GGUF file: tensors of `tensor_type` (F32, F16, BF16), those named in
    `quantize` as Q8_0, those in `drop` left out."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}
    for hf, tensor in hf_state_dict(model).items():
        name = gguf_name(hf)
        if name in drop:
            continue
        rows_of = heads.get(hf.split(".")[-2])
        data = (tensor if rows_of is None else interleaved_from_halves(tensor, rows_of)).float().contiguous().numpy()
        kind = gguf.GGMLQuantizationType["Q8_0" if name in quantize else tensor_type]
        writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@requires_shared
def test_shipped_default_is_a_fresh_conversion_of_the_gguf(tmp_path):
    save_as_hf(SHARED / "stories260K.gguf", tmp_path)
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / name).read_bytes() == (DEMO_DIR / name).read_bytes(), name
    assert (DEMO_DIR / "tokenizer.model").read_bytes() == (SHARED / "tok512.model").read_bytes()
    for licence in ("LICENSE-llama2c", "LICENSE-python-gen-worker"):
        assert (DEMO_DIR / licence).read_bytes() == (SHARED / licence).read_bytes()
    assert "python -m minfer.demo --convert" in (DEMO_DIR / "NOTICE.md").read_text()


def test_convert_command_refuses_a_bad_file_in_one_line(tmp_path, capsys):
    garbage = tmp_path / "x.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 8)
    before = {path: path.read_bytes() for path in DEMO_DIR.iterdir()}
    assert demo_main(["--convert", str(garbage)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "not a readable GGUF file" in err[0]
    assert {path: path.read_bytes() for path in DEMO_DIR.iterdir()} == before


def test_default_model_is_stories260k_in_float32():
    resolved = resolve(None)
    config = resolved.config
    assert (resolved.name, resolved.path, resolved.is_random) == ("stories260K", DEMO_DIR, False)
    assert (config.vocab_size, config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads,
            config.head_dim, config.intermediate_size, config.tie_word_embeddings) == (512, 64, 5, 8, 4, 8, 172, True)
    assert resolve("minfer-demo") == resolve("stories260K") == resolved
    from safetensors import safe_open

    with safe_open(str(DEMO_DIR / "model.safetensors"), "pt") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"F32"}


def test_greedy_decoding_tells_the_documented_story(demo):
    tokenizer = Tokenizer(TOKENIZER)
    text = DEMO_PROMPT + tokenizer.decode(greedy(demo, tokenizer, DEMO_PROMPT, 60))
    assert text.startswith(STORY), text


@requires_cuda
def test_the_default_tells_its_story_on_the_gpu():
    """float16 through minfer's kernels; decode attention has no kernel for head_dim 8 and runs its reference."""
    result = cli("--device", "cuda", "--max-new-tokens", "60")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(STORY[:STORY.index(" One day")]), result.stdout


def test_logits_equal_transformers(demo):
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(DEMO_DIR, dtype=torch.float32).eval()
    tokens = torch.tensor([Tokenizer(TOKENIZER).encode(STORY)])
    with torch.no_grad():
        expected = hf(tokens).logits
    demo.setup_caches(1, tokens.shape[1])
    with torch.inference_mode():
        ours = demo(tokens, torch.arange(tokens.shape[1]), kv_len=tokens.shape[1])
    assert ((ours - expected).norm() / expected.norm()).item() < 1e-5


@requires_shared
def test_the_original_gguf_gives_the_default_models_tokens(capsys):
    app = load_app(APP)
    flags = ["--device", "cpu", "--max-new-tokens", "60", "--json"]
    default = in_process(app, flags, capsys)
    from_gguf = in_process(app, [*flags, "--model", str(SHARED / "stories260K.gguf"), "--tokenizer",
                                 str(SHARED / "tok512.model")], capsys)
    assert default.returncode == from_gguf.returncode == 0, from_gguf.stderr
    default, from_gguf = json.loads(default.stdout), json.loads(from_gguf.stdout)
    assert from_gguf["generated_ids"] == default["generated_ids"] and len(default["generated_ids"]) == 60
    assert (DEMO_PROMPT + from_gguf["text"]).startswith(STORY)


@pytest.mark.parametrize("tensor_type, dtype", [("F32", torch.float32), ("F16", torch.float16),
                                                ("BF16", torch.bfloat16)])
def test_float_gguf_files_load_as_stored(demo, tmp_path, tensor_type, dtype):
    """Written from the default model: the same config, and weights equal to it rounded to the type."""
    path = write_gguf(tmp_path / "model.gguf", demo, tensor_type)
    checkpoint = GGUFCheckpoint(path)
    assert checkpoint.config == demo.config
    loaded = hf_state_dict(load_model(resolve(str(path), tokenizer=TOKENIZER), torch.float32, "cpu"))
    for name, tensor in hf_state_dict(demo).items():
        assert torch.equal(loaded[name], tensor.to(dtype).float()), name
    if tensor_type == "F32":
        shutil.copyfile(TOKENIZER, tmp_path / "tokenizer.model")  # found beside the file
        resolved = resolve(str(path))
        assert resolved.tokenizer_path == tmp_path / "tokenizer.model"
        tokenizer = Tokenizer(resolved.tokenizer_path)
        model = load_model(resolved, torch.float32, "cpu")
        assert greedy(model, tokenizer, DEMO_PROMPT, 40) == greedy(demo, tokenizer, DEMO_PROMPT, 40)


def test_untied_output_and_random_weights(demo, tmp_path):
    """An output.weight that differs from the embedding loads as an untied lm_head; --weights random
    takes only the architecture."""
    config = replace(demo.config, tie_word_embeddings=False)
    model = random_init(Transformer(config), seed=3, dtype=torch.float32, device="cpu")
    path = write_gguf(tmp_path / "untied.gguf", model)
    resolved = resolve(str(path), tokenizer=TOKENIZER)
    assert resolved.config == config and resolved.path == path
    loaded = hf_state_dict(load_model(resolved, torch.float32, "cpu"))
    assert all(torch.equal(loaded[name], tensor) for name, tensor in hf_state_dict(model).items())
    random = resolve(str(path), "random", TOKENIZER)
    assert random.is_random and random.path is None and random.config == config


@pytest.mark.parametrize("change, message", [
    (dict(quantize=("blk.2.ffn_up.weight",)), "tensor blk.2.ffn_up.weight is quantized (Q8_0)"),
    (dict(architecture="qwen2"), "holds a 'qwen2' model"),
    (dict(drop=("blk.4.attn_v.weight",)), "lacks tensor blk.4.attn_v.weight"),
    (dict(drop=("token_embd.weight",)), "lacks tensor token_embd.weight"),
])
def test_unsupported_gguf_files_are_refused_in_one_line(demo, tmp_path, capsys, change, message):
    path = write_gguf(tmp_path / "bad.gguf", demo, **change)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        GGUFCheckpoint(path)
    app = load_app(APP)
    assert_input_error(in_process(app, ["--device", "cpu", "--model", str(path), "--tokenizer", str(TOKENIZER)],
                                  capsys), message)


def test_garbage_truncated_and_tokenizerless_files_are_refused(demo, tmp_path, capsys):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(bytes(range(256)) * 16)
    whole = write_gguf(tmp_path / "whole.gguf", demo).read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(whole[: len(whole) // 2])
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(whole[:40])
    app = load_app(APP)
    for path in (garbage, header_only, truncated):
        result = in_process(app, ["--device", "cpu", "--model", str(path), "--tokenizer", str(TOKENIZER)], capsys)
        assert_input_error(result, str(path), "is not a readable GGUF file")
    whole_path = str(tmp_path / "whole.gguf")
    assert_input_error(in_process(app, ["--device", "cpu", "--model", whole_path], capsys),
                       "needs a tokenizer", "--tokenizer FILE")
    assert_input_error(in_process(app, ["--device", "cpu", "--model", whole_path, "--tokenizer",
                                        str(tmp_path / "nothing.model")], capsys), "--tokenizer", "is not a file")


def test_gguf_config_reads_as_json_config(demo, tmp_path):
    """The config a GGUF file gives is the one its HF conversion writes."""
    path = write_gguf(tmp_path / "model.gguf", demo)
    folder = save_as_hf(path, tmp_path / "hf")
    assert json.loads((folder / "config.json").read_text()) == demo.config.to_hf()
