"""Generation loop: prefill, then decode steps captured in CUDA graphs, with streaming and stats.

One decode step (model forward on one token, sampling, feeding the sample back) reads and writes
only static device buffers, so on a GPU it is captured once and replayed. The step's last kernel
(the argmax) also writes its token into pinned host memory and advances the position (the token
hand-off, `ops.argmax`), so nothing but an event sits between two replays; the host reads token i
while steps i+1..i+LOOKAHEAD are already queued, so the GPU never waits for Python. Without minfer's
kernels on a GPU (the torch backend) the token is copied to the host behind each replay instead.

The SDPA attention path reads the cache up to `kv_len`, a static shape per graph: positions are
grouped in buckets of KV_BUCKET, and each bucket (per sampling setting) gets its own graph.

The prefill is captured too, per prompt bucket (`prefill_bucket`), from the second prompt that falls in
it (a capture costs about one more eager prefill, so a length seen once stays eager). Whenever the
prefill may be captured (on a GPU, with graphs, under an attention backend whose prefill can be) the
prompt runs padded to its bucket's length, eager or replayed, so a prompt's logits do not depend on
which buckets were captured before; they are read at its last real token. Causal attention keeps the
padding out of the prompt's tokens, and the cache rows the padding writes lie past the prompt, where each decode
step writes its row before any query can see it. An eager prefill enqueues its kernels one by one from
Python, which can take longer than the GPU needs to run them (Llama-2-7B's 512-token prefill with KS
chains or 2:4 weights on an H200); a replay enqueues them at once.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from . import ops
from .errors import ContextLengthError, MinferError
from .model import Transformer
from .sampling import SamplingParams, sample

KV_BUCKET = 256  # cache positions attended per decode graph are rounded up to a multiple of this
LOOKAHEAD = 4  # decode steps queued on the GPU ahead of the token the host is reading
PREFILL_BUCKET = 128  # captured prompt lengths: powers of two up to this, then its multiples


def prefill_bucket(tokens: int, max_seq_len: int) -> int:
    """The length a prompt of `tokens` tokens is padded to for its captured prefill."""
    if tokens <= PREFILL_BUCKET:
        return min(max_seq_len, 1 << (tokens - 1).bit_length())
    return min(max_seq_len, -(-tokens // PREFILL_BUCKET) * PREFILL_BUCKET)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    stop_reason: str = ""  # "eos", "max_new_tokens" or "context"
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0  # prefill launch to the first token on the host
    decode_tok_s: float = 0.0
    weight_gb_s: float = 0.0  # weight bytes read per decode step x decode steps per second
    peak_mem_gb: float = 0.0
    graph_capture_ms: float = 0.0  # one-time CUDA-graph setup paid inside this call (not in the above)
    warmup_ms: float = 0.0  # this Generator's first prefill, run once on a GPU to load kernels (not in the above)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class GenerationResult:
    tokens: list[int]  # generated ids, without the prompt and without the stop token
    text: str
    stats: GenerationStats = field(default_factory=GenerationStats)


class _TokenReader:
    """Device token -> host int, one pinned slot per cache position (a token sits at the position it
    will be fed at), read behind the launches. With the hand-off the step's argmax kernel writes the
    slot; otherwise `push` copies the token there."""

    def __init__(self, max_seq_len: int, device: torch.device, handoff: bool):
        self.cuda = device.type == "cuda"
        self.handoff = handoff
        self.host = torch.zeros(max_seq_len + 1, dtype=torch.int64, pin_memory=self.cuda)
        self.first_slot = 0  # the position of generated token 0 (the prompt length)
        ring = LOOKAHEAD + 2  # a slot's event is reused only after its token was read
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(ring)] if self.cuda else []
        self.first = torch.cuda.Event(enable_timing=True) if self.cuda else None
        self.times = [0.0] * (max_seq_len + 1)  # host clock (CPU device) when each token was produced

    def push(self, index: int, token: torch.Tensor) -> None:
        """Marks generated token `index` as queued (its step was just launched)."""
        if not self.handoff:
            slot = self.first_slot + index
            self.host[slot:slot + 1].copy_(token.view(-1)[:1], non_blocking=True)
        if self.cuda:
            self.events[index % len(self.events)].record()
            if index == 0:
                self.first.record()
        else:
            self.times[index] = time.perf_counter()

    def read(self, index: int) -> int:
        if self.cuda:
            self.events[index % len(self.events)].synchronize()
        return int(self.host[self.first_slot + index])

    def seconds_since_first(self, last: int) -> float:
        """Time from producing token 0 to producing token `last` (already read)."""
        if self.cuda:
            return self.first.elapsed_time(self.events[last % len(self.events)]) / 1e3
        return self.times[last] - self.times[0]


def check_prompt_ids(prompt_ids: list[int], vocab_size: int) -> None:
    """Refuse an empty prompt and token ids the model has no embedding for (a tokenizer of another
    model); callers may check before loading the weights."""
    if not prompt_ids:
        raise MinferError("the prompt is empty; pass at least one token (e.g. BOS)")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise MinferError(f"prompt token ids must lie in [0, {vocab_size}); the tokenizer does not match the model")


class Generator:
    """Runs `model` (batch 1) with a static KV cache of `max_seq_len` positions on `device`, under the ops
    backend (`ops.backend`) active when it is built, and with the `attention` backend (minfer.attention)
    and its `attention_options`."""

    def __init__(self, model: Transformer, tokenizer, max_seq_len: int, device: torch.device | str,
                 use_cuda_graph: bool = True, attention: str = "dense", attention_options: dict | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.device = torch.device(device)
        self.max_seq_len = max_seq_len
        self.backend = ops.current_backend()  # graphs and the token hand-off below are made for it
        model.setup_caches(1, max_seq_len, device=self.device, attention=attention,
                           attention_options=attention_options)
        # Captured graphs hold raw pointers: this generator keeps its caches, tables and attention workspace,
        # and puts the model back on them before each generation (another one may have set up since).
        self._state = model.cache_state
        self.use_cuda_graph = use_cuda_graph and self.device.type == "cuda"
        # Prefills run padded to their bucket (prefill_bucket) whenever they may be captured, so a prompt
        # gives the same logits whether its bucket was captured yet or not.
        self._padded_prefill = self.use_cuda_graph and model.attention.prefill_capturable
        eos = tokenizer.eos_id if tokenizer is not None else model.config.eos_token_id
        self.eos_id: int | None = eos  # None: never stop early
        # Static decode inputs: the token to feed and its position (advanced by the step itself).
        self._token = torch.zeros(1, 1, dtype=torch.int64, device=self.device)
        self._pos = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._prompt = torch.zeros(1, max_seq_len, dtype=torch.int64, device=self.device)
        self._prompt_host = torch.zeros(max_seq_len, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self._rng = torch.Generator(device=self.device)
        # The token hand-off runs in minfer's argmax kernel, or in torch ops on the CPU.
        self._handoff = self.device.type == "cpu" or ops.use_kernels(self._token)
        self._reader = _TokenReader(max_seq_len, self.device, self._handoff)
        self._last = torch.zeros(1, dtype=torch.int64, device=self.device)  # a padded prompt's last token
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._prefill_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # bucket -> graph, logits
        self._prefill_seen: set[int] = set()  # buckets of the prompts prefilled eagerly so far
        self._prefill_peak: dict[int, int] = {}  # bucket -> peak bytes allocated by its eager prefill
        self._graphs_table = 0  # the embedding table the graphs read (place_embedding may move it)
        self._pool = torch.cuda.graph_pool_handle() if self.use_cuda_graph else None
        self._prefill_warm = self.device.type != "cuda"  # kernels load lazily at their first launch

    # -- one decode step ---------------------------------------------------------------------------

    def _bucket(self, pos: int) -> int:
        return min(self.max_seq_len, -(-(pos + 1) // KV_BUCKET) * KV_BUCKET)

    def _step(self, kv_len: int, params: SamplingParams) -> None:
        self._sample_next(self.model(self._token, self._pos, kv_len), params)

    def _sample_next(self, logits: torch.Tensor, params: SamplingParams) -> None:
        """The token after `logits` becomes the next input, at position `_pos` + 1."""
        if self._handoff:
            sample(logits[:, -1], params, self._rng, out=self._token.view(1), position=self._pos,
                   host_tokens=self._reader.host)
        else:
            self._token.copy_(sample(logits[:, -1], params, self._rng).view(1, 1))
            self._pos.add_(1)

    def _capture(self, kv_len: int, params: SamplingParams) -> None:
        """Warm up (lazy library init) on a side stream, then capture one step. Only called before
        a prefill, when the cache holds nothing that the warm-up step could spoil. The warm-up runs
        at position 0: after an earlier generation `_pos` may sit at the end of the cache, where the
        torch backend's RoPE table lookup and cache write index out of bounds (a device assert)."""
        self._pos.zero_()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._step(kv_len, params)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if not params.greedy:
            graph.register_generator_state(self._rng)
        with torch.cuda.graph(graph, pool=self._pool):
            self._step(kv_len, params)
        self._graphs[(kv_len, params.kernel_key)] = graph

    # -- prefill ------------------------------------------------------------------------------------

    def _prefill(self, tokens: int, padded: bool) -> torch.Tensor:
        """Logits [1, 1, V] of the prompt's last token; `padded`: over the first `tokens` positions of the
        prompt buffer, with the last real token at `_last`."""
        return self.model(self._prompt[:, :tokens], self.model.positions[:tokens], kv_len=tokens,
                          last_logits_only=True, last_index=self._last if padded else None)

    def _capture_prefill(self, bucket: int) -> None:
        """Warm up on a side stream (it loads the kernels of this length and writes cache rows the real
        prefill rewrites), then capture."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._prefill(bucket, padded=True)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._prefill(bucket, padded=True)
        self._prefill_graphs[bucket] = (graph, logits)

    def _launch_step(self, pos: int, params: SamplingParams) -> None:
        kv_len = self._bucket(pos)
        if self.use_cuda_graph:
            self._graphs[(kv_len, params.kernel_key)].replay()
        else:
            self._step(kv_len, params)

    # -- generation ---------------------------------------------------------------------------------

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        check_prompt_ids(prompt_ids, self.model.config.vocab_size)
        if len(prompt_ids) >= self.max_seq_len:
            raise ContextLengthError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds {self.max_seq_len}; "
                f"shorten the prompt or raise --max-seq-len (this model allows up to "
                f"{self.model.config.max_position_embeddings})"
            )

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], params: SamplingParams | None = None, max_new_tokens: int = 256,
                 on_token=None) -> GenerationResult:
        """Generate up to `max_new_tokens` after `prompt_ids`; `on_token(id)` is called as each token
        arrives on the host. Stops at EOS (not returned), max_new_tokens, or the context end."""
        self.model.use_caches(self._state)
        with ops.backend(self.backend):
            return self._generate(prompt_ids, params, max_new_tokens, on_token)

    def _generate(self, prompt_ids: list[int], params: SamplingParams | None, max_new_tokens: int,
                  on_token) -> GenerationResult:
        params = params or SamplingParams()
        prompt_ids = [int(t) for t in prompt_ids]
        self._check_prompt(prompt_ids)
        n_prompt = len(prompt_ids)
        limit = min(max_new_tokens, self.max_seq_len - n_prompt)
        stats = GenerationStats(prompt_tokens=n_prompt)
        if limit <= 0:
            stats.stop_reason = "max_new_tokens"
            return GenerationResult([], "", stats)

        cuda = self.device.type == "cuda"
        bucket = prefill_bucket(n_prompt, self.max_seq_len) if self._padded_prefill else n_prompt
        self._prompt_host[:n_prompt] = torch.tensor(prompt_ids, dtype=torch.int64)
        self._prompt[:, :n_prompt].copy_(self._prompt_host[:n_prompt].view(1, -1), non_blocking=True)
        self._last.fill_(n_prompt - 1)
        if self.use_cuda_graph:
            start = time.perf_counter()
            table = self.model.embed_tokens.weight.data_ptr()
            if table != self._graphs_table:  # graphs hold raw pointers: recapture after a move
                self._graphs.clear()
                self._prefill_graphs.clear()
                self._graphs_table = table
            for pos in range(n_prompt, n_prompt + limit - 1):
                if (self._bucket(pos), params.kernel_key) not in self._graphs:
                    self._capture(self._bucket(pos), params)
            if self._padded_prefill and bucket in self._prefill_seen and bucket not in self._prefill_graphs:
                self._capture_prefill(bucket)
            stats.graph_capture_ms = (time.perf_counter() - start) * 1e3
        captured = bucket in self._prefill_graphs
        if not captured and not self._prefill_warm:
            # A first prefill loads the kernels this prompt length selects (lazily, at their first launch)
            # and grows the allocator (llama2-7b, 17 tokens, H100: 108-980 ms as the CLI measured it
            # before this). Paid once per Generator, reported as warmup_ms; a later prompt whose length
            # selects other kernels (GEMV up to 8 tokens, another HGEMM tile) loads those inside its
            # prefill. It writes the cache rows the real prefill rewrites.
            start = time.perf_counter()
            self._prefill(bucket, self._padded_prefill)
            torch.cuda.synchronize(self.device)
            stats.warmup_ms = (time.perf_counter() - start) * 1e3
            self._prefill_warm = True
        self._rng.manual_seed(params.seed)
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

        # Prefill: the prompt fills positions 0..n-1; its last logits give the first token.
        start = time.perf_counter()
        prefill_start, prefill_end = (torch.cuda.Event(enable_timing=True) for _ in range(2)) if cuda else (None, None)
        if cuda:
            prefill_start.record()
        if captured:
            graph, logits = self._prefill_graphs[bucket]
            graph.replay()
        else:
            logits = self._prefill(bucket, self._padded_prefill)
            if self._padded_prefill:
                self._prefill_seen.add(bucket)
                self._prefill_peak[bucket] = torch.cuda.max_memory_allocated(self.device)
        if cuda:
            prefill_end.record()
        else:
            stats.prefill_ms = (time.perf_counter() - start) * 1e3
        self._pos.fill_(n_prompt - 1)  # the prompt's last position; the first token goes to n_prompt
        self._sample_next(logits, params)
        reader = self._reader
        reader.first_slot = n_prompt
        reader.push(0, self._token)

        # Decode: keep LOOKAHEAD steps queued while the host reads, streams and checks for EOS.
        tokens: list[int] = []
        launched = 1  # tokens whose computation has been queued (the first came from prefill)
        stats.stop_reason = "max_new_tokens" if limit == max_new_tokens else "context"
        for index in range(limit):
            while launched < limit and launched <= index + LOOKAHEAD:
                self._launch_step(n_prompt + launched - 1, params)
                reader.push(launched, self._token)
                launched += 1
            token = reader.read(index)
            if index == 0:
                stats.ttft_ms = (time.perf_counter() - start) * 1e3
            if token == self.eos_id:
                stats.stop_reason = "eos"
                break
            tokens.append(token)
            if on_token is not None:
                on_token(token)
        last = index

        stats.new_tokens = len(tokens)
        if cuda:
            stats.prefill_ms = prefill_start.elapsed_time(prefill_end)
            # A replay allocates nothing: its activations sit in the graph pool since the eager prefill.
            stats.peak_mem_gb = max(torch.cuda.max_memory_allocated(self.device),
                                    self._prefill_peak.get(bucket, 0)) / 1e9
        if last > 0:
            stats.decode_tok_s = last / reader.seconds_since_first(last)
            stats.weight_gb_s = self.model.decode_weight_bytes() * stats.decode_tok_s / 1e9
        text = self.tokenizer.decode(tokens) if self.tokenizer is not None else ""
        return GenerationResult(tokens, text, stats)
