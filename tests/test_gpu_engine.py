"""The engine on a GPU: graph-captured decode equals eager decode, fp16 logits track fp32 CPU
logits, and decoding never synchronizes with the host."""

import contextlib

import pytest
import torch

from minfer import ops
from minfer.checkpoint import random_init
from minfer.config import ModelConfig
from minfer.formats import convert
from minfer.formats.macko import MackoWeight
from minfer.generate import Generator
from minfer.model import Transformer
from minfer.sampling import SamplingParams
from minfer.sparsity import prune_model_
from minfer.sparsity.factorize import factorize_model
from tests.conftest import requires_cuda

# Small, but with Llama-2's head size and a vocabulary that is not a multiple of 64.
CONFIG = {"model_type": "llama", "vocab_size": 1999, "hidden_size": 256, "intermediate_size": 688,
          "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
          "max_position_embeddings": 1024, "eos_token_id": 2}
PROMPT = list(range(3, 250))  # decoding crosses the first KV bucket (256 positions)
SAMPLED = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=11)


def cpu_model() -> Transformer:
    model = random_init(Transformer(ModelConfig.from_hf(CONFIG)), 0, torch.float32, "cpu")
    with torch.no_grad():  # peaked logits: fp16 rounding must not flip greedy choices
        for tensor in model.checkpoint_tensors().values():
            if tensor.dim() == 2:
                tensor.mul_(4.0)
    return model


def gpu_model(dtype=torch.float16, source: Transformer | None = None) -> Transformer:
    """The weights of `source` (cpu_model() by default) on the GPU in `dtype`."""
    model = Transformer(ModelConfig.from_hf(CONFIG)).materialize("cuda", dtype)
    with torch.no_grad():
        for name, tensor in (source or cpu_model()).checkpoint_tensors().items():
            model.checkpoint_tensors()[name].copy_(tensor)
    return model


@contextlib.contextmanager
def sync_debug_error():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def rel_err(out, ref):
    return ((out.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm()).item()


@requires_cuda
@pytest.mark.parametrize("params", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_graph_decode_equals_eager_decode(params):
    graphed = Generator(gpu_model(), None, max_seq_len=512, device="cuda", use_cuda_graph=True)
    eager = Generator(gpu_model(), None, max_seq_len=512, device="cuda", use_cuda_graph=False)
    graphed.eos_id = eager.eos_id = None
    ours = graphed.generate(PROMPT, params, max_new_tokens=40)
    again = graphed.generate(PROMPT, params, max_new_tokens=40)  # replays the graphs captured above
    reference = eager.generate(PROMPT, params, max_new_tokens=40)
    assert len(ours.tokens) == 40
    assert ours.tokens == reference.tokens == again.tokens
    assert ours.stats.decode_tok_s > 0 and ours.stats.peak_mem_gb > 0
    # The first call warms the prefill up once (same cache rows, same tokens); later calls do not.
    assert ours.stats.warmup_ms > 0 and again.stats.warmup_ms == 0


def model_in(weights: str) -> Transformer:
    """The test model on the GPU with its projections in `weights`: a format or a factorization."""
    if weights == "dense":
        return gpu_model()
    if weights == "ksmm":
        model = gpu_model()
        factorize_model(model, "monarch-50")
        return model
    structure = (2, 4) if weights == "2:4" else None
    return convert(gpu_model(source=prune_model_(cpu_model(), None if structure else 0.5, structure=structure,
                                                 progress=False)), weights)


@requires_cuda
@pytest.mark.parametrize("weights, attention", [("dense", "blocksparse"), ("macko", "dense"), ("2:4", "dense"),
                                                ("ksmm", "dense")])
@pytest.mark.parametrize("prompt_tokens", [5, 130])  # buckets of 8 and 256: GEMV-sized and GEMM-sized prefills
def test_captured_prefill_equals_eager_prefill(weights, attention, prompt_tokens):
    """A prompt padded to its bucket and replayed from a graph gives the tokens of an eager prefill of
    the prompt alone: the bucket's first prompt runs eagerly (padded), the second captures it, the third
    replays, with the first one's tokens and no lower a peak memory."""
    options = {"layout": "sink-window:sink=64,window=128"} if attention == "blocksparse" else None
    graphed, eager = (Generator(model_in(weights), None, max_seq_len=512, device="cuda", use_cuda_graph=graph,
                                attention=attention, attention_options=options) for graph in (True, False))
    graphed.eos_id = eager.eos_id = None
    results = []
    for prompt in (PROMPT[:prompt_tokens], PROMPT[2:prompt_tokens + 3], PROMPT[:prompt_tokens]):
        results.append(graphed.generate(prompt, max_new_tokens=12))
        assert results[-1].tokens == eager.generate(prompt, max_new_tokens=12).tokens
    assert list(graphed._prefill_graphs) == [8 if prompt_tokens == 5 else 256]
    assert results[2].tokens == results[0].tokens and results[2].stats.peak_mem_gb >= results[0].stats.peak_mem_gb


@requires_cuda
def test_a_prefill_that_cannot_be_captured_runs_eagerly():
    """Block-sparse attention's reference path (here under the torch backend) reads its layout on the host:
    the generator keeps that prefill eager and unpadded."""
    with ops.backend("torch"):
        generator = Generator(gpu_model(), None, max_seq_len=512, device="cuda", attention="blocksparse",
                              attention_options={"layout": "sink-window:sink=64,window=128"})
    generator.eos_id = None
    first = generator.generate(PROMPT[:130], max_new_tokens=8).tokens
    assert generator.generate(PROMPT[:130], max_new_tokens=8).tokens == first
    assert generator.generate(PROMPT[:130], max_new_tokens=8).tokens == first
    assert not generator._prefill_graphs and generator._graphs


@requires_cuda
def test_a_captured_macko_prefill_keeps_off_the_shared_scratch():
    """The eager prefill's decompression buffer can be released (or outgrown) while a captured prefill
    lives, so a replay must not write to it."""
    from minfer.formats import macko

    generator = Generator(model_in("macko"), None, max_seq_len=512, device="cuda")
    generator.eos_id = None
    first = generator.generate(PROMPT[:130], max_new_tokens=8).tokens  # eager
    assert generator.generate(PROMPT[:130], max_new_tokens=8).tokens == first  # captured
    scratch = macko._scratch[(torch.device("cuda", torch.cuda.current_device()), torch.float16)]
    with torch.inference_mode():  # the buffer was made in the generator's inference mode
        scratch.fill_(float("nan"))
        assert generator.generate(PROMPT[:130], max_new_tokens=8).tokens == first  # a replay
        assert torch.isnan(scratch).all()


def assert_logits_track(reference: Transformer, model: Transformer) -> None:
    """The GPU model's prefill and four decode steps stay within 1% of the CPU reference's logits."""
    reference.setup_caches(1, 320)
    model.setup_caches(1, 320)
    tokens = torch.tensor([PROMPT])
    with torch.inference_mode():
        expected = reference(tokens, torch.arange(len(PROMPT)), kv_len=len(PROMPT))
        out = model(tokens.cuda(), torch.arange(len(PROMPT), device="cuda"), kv_len=len(PROMPT))
        assert rel_err(out, expected) < 1e-2
        for pos, token in enumerate([5, 77, 1998, 400], start=len(PROMPT)):
            step_ref = reference(torch.tensor([[token]]), torch.tensor([pos]), kv_len=320)
            step = model(torch.tensor([[token]], device="cuda"), torch.tensor([pos], device="cuda"), kv_len=256 + 64)
            assert rel_err(step, step_ref) < 1e-2, f"decode step at position {pos}"


@requires_cuda
def test_fp16_gpu_logits_track_fp32_cpu():
    reference, model = cpu_model(), gpu_model()
    assert_logits_track(reference, model)


@requires_cuda
def test_macko_decode_tracks_fp32_cpu():
    """A pruned model stored as MACKO: prefill (decompressed blocks) and decode steps (the SpMV with the
    RMSNorm and the residual add fused into it) track the pruned fp32 model on the CPU."""
    reference = prune_model_(cpu_model(), 0.5, progress=False)
    model = convert(gpu_model(source=reference), "macko")
    assert all(isinstance(linear.fmt, MackoWeight) for _, linear in model.projections())
    assert_logits_track(reference, model)


@requires_cuda
@pytest.mark.parametrize("use_cuda_graph", [True, False], ids=["graph", "eager"])
@pytest.mark.parametrize("params", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_generation_never_syncs_with_the_host(use_cuda_graph, params):
    """Once graphs exist, a whole generate() (prefill, decode, streaming the tokens back through
    pinned memory and events) runs without one synchronizing CUDA call."""
    generator = Generator(gpu_model(), None, max_seq_len=512, device="cuda", use_cuda_graph=use_cuda_graph)
    generator.eos_id = None
    warm = generator.generate(PROMPT, params, max_new_tokens=24)  # lazy init, the decode graphs
    assert generator.generate(PROMPT, params, max_new_tokens=24).tokens == warm.tokens  # the prefill graph
    with sync_debug_error():
        result = generator.generate(PROMPT, params, max_new_tokens=24)
    assert result.tokens == warm.tokens


@requires_cuda
def test_decode_step_never_syncs():
    generator = Generator(gpu_model(), None, max_seq_len=512, device="cuda", use_cuda_graph=False)
    generator.generate(PROMPT[:8], SAMPLED, max_new_tokens=4)
    with sync_debug_error(), torch.inference_mode():
        for pos in range(12, 20):
            generator._launch_step(pos, SAMPLED)
    torch.cuda.synchronize()


@requires_cuda
def test_embedding_in_host_memory_changes_nothing_but_memory():
    """place_embedding("host"): the table's bytes leave the GPU, and one generator gives the same
    tokens before, after and back (its graphs are recaptured each time the table moves)."""
    model = gpu_model()
    generator = Generator(model, None, max_seq_len=512, device="cuda")
    generator.eos_id = None
    on_gpu = generator.generate(PROMPT, SAMPLED, max_new_tokens=20).tokens
    table_bytes = model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    before = torch.cuda.memory_allocated()
    model.place_embedding("host")
    assert before - torch.cuda.memory_allocated() >= table_bytes
    assert model.embed_tokens.weight.is_pinned() and model.embedding_place() == "host"
    assert generator.generate(PROMPT, SAMPLED, max_new_tokens=20).tokens == on_gpu
    model.place_embedding("gpu")
    assert model.embed_tokens.weight.is_cuda and model.embedding_place() == "gpu"
    assert generator.generate(PROMPT, SAMPLED, max_new_tokens=20).tokens == on_gpu


@requires_cuda
def test_loaded_kernels_cost_no_build_lookups(monkeypatch):
    """Every op wrapper asks use_kernels; once the extension is loaded neither that nor another build()
    may rebuild the build folder's path (it took ~4 ms of host time per 512-token MACKO prefill, which
    is host-bound)."""
    from minfer.ops import runtime

    folder = ops.build()
    monkeypatch.setattr(runtime, "build_dir", lambda: pytest.fail("build_dir called after the kernels loaded"))
    assert ops.use_kernels(torch.zeros(1, device="cuda"))
    assert ops.build() == folder
