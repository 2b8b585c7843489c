"""Tensor parallelism over the GPUs of one host, Megatron style (the plan of gpt-fast's tp.py).

Each of N ranks holds a slice of every projection: qkv_proj and gate_up_proj by rows (column-parallel:
whole KV groups of heads, whole halves of gate and up), o_proj and down_proj by columns (row-parallel:
each rank's partial product is summed by one all-reduce per sublayer), and lm_head by rows (vocabulary
slices, gathered into the full logits). Embeddings and norms are replicated, and so is the residual
stream: after every all-reduce each rank holds the same hidden state, and after the gather the same
logits, so every rank samples the same token with the same seed (no broadcast).

The residual add rides in the all-reduce: rank 0 adds its partial product into the residual stream
(the fused GEMV epilogue), the other ranks keep theirs apart, and the sum over the ranks, written into
every rank's residual, is residual + o_proj(x). `Sharding` carries the rank, the group and these steps; the default one (one
rank) makes every step a no-op, so the single-GPU model is the same code.

Process groups come from the torch.distributed environment (torchrun's, or `launch`'s): NCCL on CUDA,
gloo on the CPU, with NVLink multicast kept off (`RANK_ENV`). A decode step's all-reduces (one hidden
vector each) are latency-bound: on GPUs they run minfer's one-shot all-reduce (`PeerAllReduce`: each rank
reads its peers' symmetric-memory buffers over NVLink, no multicast), or NCCL's with
MINFER_TP_ALLREDUCE=nccl.
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .config import ModelConfig
from . import ops
from .errors import MinferError

# Every rank's environment: NVLink SHARP (multicast) off in NCCL and in torch's symmetric memory.
RANK_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
# How long a rank waits in a collective for the others (a rank that died ends the rest by then).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
ALLREDUCE_CHOICES = ("minfer", "nccl")  # $MINFER_TP_ALLREDUCE; minfer's needs GPUs


class PeerAllReduce:
    """minfer's one-shot all-reduce (ops.one_shot_all_reduce) for the small all-reduces of a decode step:
    each rank copies its part into a symmetric-memory buffer (torch's: every rank maps every other's),
    raises a flag in each peer's signal pad, and sums the peers' buffers read over NVLink, in one kernel.
    Made in `init`, eagerly on every rank, before any graph capture; larger tensors go to NCCL."""

    def __init__(self, device: torch.device, group_name: str):
        from torch.distributed import _symmetric_memory as symm_mem

        self.slot_bytes = ops.ALL_REDUCE_MAX_BYTES
        self.buffer = symm_mem.empty(2 * self.slot_bytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(self.buffer, group_name)
        self.rank = handle.rank
        self.buffers = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)
        self.signals = torch.tensor(handle.signal_pad_ptrs, dtype=torch.int64, device=device)
        self.epochs = torch.zeros(ops.ALL_REDUCE_MAX_BLOCKS, dtype=torch.int32, device=device)
        # Flags start at zero on every rank before any rank raises one in a peer's pad.
        handle.get_signal_pad(handle.rank, (handle.signal_pad_size // 4,), torch.int32).zero_()
        torch.cuda.synchronize(device)
        dist.barrier(device_ids=[device.index])

    def fits(self, part: torch.Tensor) -> bool:
        return ops.one_shot_all_reduce_fits(part, self.slot_bytes)

    def __call__(self, part: torch.Tensor, out: torch.Tensor) -> None:
        ops.one_shot_all_reduce(part, out, self.buffers, self.signals, self.epochs, self.slot_bytes, self.rank)


@dataclass(frozen=True)
class Sharding:
    """This process's place among `world` ranks, and the collectives a sharded model runs."""

    rank: int = 0
    world: int = 1
    peers: PeerAllReduce | None = field(default=None, compare=False)  # small all-reduces, else NCCL

    @property
    def active(self) -> bool:
        return self.world > 1

    def check(self, config: ModelConfig) -> None:
        """Refuse a model this many ranks cannot split evenly (GQA: each rank holds whole KV groups)."""
        for what, size in (("key/value heads", config.num_kv_heads), ("MLP width", config.intermediate_size),
                           ("vocabulary", config.vocab_size)):
            if size % self.world:
                raise MinferError(f"tensor parallelism over {self.world} ranks needs the model's {what} ({size}) to "
                                  f"be a multiple of {self.world}; use a divisor of {config.num_kv_heads} ranks")

    def layer_config(self, config: ModelConfig) -> ModelConfig:
        """The config one rank's layers are built from: its heads, KV heads and MLP width."""
        if not self.active:
            return config
        self.check(config)
        return dataclasses.replace(config, num_heads=config.num_heads // self.world,
                                   num_kv_heads=config.num_kv_heads // self.world,
                                   intermediate_size=config.intermediate_size // self.world)

    def reduce_into_(self, part: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out = the sum over the ranks of each rank's `part` (which may be `out` itself); graph-capturable."""
        if self.peers is not None and self.peers.fits(part):
            self.peers(part, out)
        elif self.active:
            if part is not out:
                out.copy_(part)
            dist.all_reduce(out)
        return out

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place."""
        return self.reduce_into_(tensor, tensor)

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Each rank's [..., n] slice -> the [..., world * n] tensor of all of them in rank order."""
        if not self.active:
            return tensor
        shape = tensor.shape
        flat = tensor.reshape(-1, shape[-1])
        parts = flat.new_empty(self.world * flat.shape[0], shape[-1])  # rank r's rows at r * rows (gloo's layout)
        dist.all_gather_into_tensor(parts, flat.contiguous())
        return parts.view(self.world, *shape).movedim(0, -2).reshape(*shape[:-1], self.world * shape[-1])


SINGLE = Sharding()


def shard_index(full: tuple[int, ...], local: tuple[int, ...], rank: int) -> tuple[slice, ...]:
    """This rank's slice of a tensor of shape `full` that ranks split evenly into `local`-shaped parts
    (along the one dimension where the shapes differ; whole when they are equal)."""
    return tuple(slice(None) if f == n else slice(rank * n, (rank + 1) * n) for f, n in zip(full, local))


# ----------------------------------------------------------------------------------------------
# Process groups
# ----------------------------------------------------------------------------------------------


def launched_world() -> int:
    """The number of ranks a launcher (torchrun, or `launch`) started this process among; 1 otherwise."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init(device_type: str) -> tuple[Sharding, torch.device]:
    """Join the process group the launcher's environment describes (NCCL for CUDA, gloo for the CPU)
    and return this rank's Sharding and device (cuda:LOCAL_RANK). The decode step's all-reduces run as
    $MINFER_TP_ALLREDUCE names: "minfer" (PeerAllReduce, the default on GPUs) or "nccl"."""
    world = launched_world()
    if world == 1:
        raise MinferError("init: this process was not started by a tensor-parallel launcher (WORLD_SIZE is unset)")
    allreduce = os.environ.get("MINFER_TP_ALLREDUCE", "minfer" if device_type == "cuda" else "nccl")
    if allreduce not in ALLREDUCE_CHOICES:
        raise MinferError(f"MINFER_TP_ALLREDUCE={allreduce} is not one of {', '.join(ALLREDUCE_CHOICES)}")
    if allreduce == "minfer" and device_type != "cuda":
        raise MinferError("MINFER_TP_ALLREDUCE=minfer needs CUDA GPUs; unset it for a CPU run")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    for key, value in RANK_ENV.items():
        os.environ.setdefault(key, value)
    if device_type == "cuda":
        if torch.cuda.device_count() < world:
            raise MinferError(f"tensor parallelism over {world} ranks needs {world} GPUs; "
                              f"{torch.cuda.device_count()} are visible")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=COLLECTIVE_TIMEOUT, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    peers = None
    if allreduce == "minfer":
        peers = peers_or_nccl(lambda: PeerAllReduce(device, dist.group.WORLD.group_name),
                              explicit="MINFER_TP_ALLREDUCE" in os.environ, announce=rank == 0)
    return Sharding(rank, world, peers), device


def peers_or_nccl(make, explicit: bool, announce: bool) -> PeerAllReduce | None:
    """make() (a PeerAllReduce), or None (NCCL) where the GPUs cannot map each other's memory: then a note
    when `announce`, and a one-line MinferError instead when the user asked for minfer's all-reduce."""
    try:
        return make()
    except RuntimeError as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if explicit:
            raise MinferError(f"MINFER_TP_ALLREDUCE=minfer: no symmetric memory between these GPUs ({reason}); "
                              "unset it to run NCCL's all-reduce") from None
        if announce:
            print(f"note: no symmetric memory between these GPUs ({reason}): the all-reduces run on NCCL",
                  file=sys.stderr, flush=True)
        return None


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# Launching the ranks of one command
# ----------------------------------------------------------------------------------------------


class _ErrorLinesOnly(io.TextIOBase):
    """A rank > 0's stderr: the notes and progress bars rank 0 prints too are dropped; an `error:` line
    passes, marked with the rank."""

    def __init__(self, rank: int, stream):
        self.rank, self.stream, self.pending = rank, stream, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        *lines, self.pending = (self.pending + text).split("\n")
        for line in lines:
            if line.startswith("error:"):
                self.stream.write(f"error: rank {self.rank}:{line.removeprefix('error:')}\n")
                self.stream.flush()
        return len(text)


def quiet_other_ranks(sharding: Sharding) -> None:
    """Rank 0 alone prints and streams; the others keep only their error lines."""
    if sharding.rank:
        sys.stdout = open(os.devnull, "w")
        sys.stderr = _ErrorLinesOnly(sharding.rank, sys.stderr)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(command: list[str], world: int, poll_s: float = 0.1, grace_s: float = 2.0) -> int:
    """Run `command` as `world` ranks on this host (the environment torchrun would give them, with
    RANK_ENV) and return its exit status. The first rank to fail ends the others, after `grace_s` for
    rank 0 to report the same error itself: one error line (rank 0's, else the failed rank's), never a hang."""
    port = _free_port()
    ranks, logs = [], []
    # A launcher ended by SIGTERM (`timeout`, a job scheduler) still ends its ranks, in the finally below.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    failed = None
    try:
        for rank in range(world):
            env = os.environ | RANK_ENV | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                           "WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank),
                                           "LOCAL_WORLD_SIZE": str(world)}
            logs.append(tempfile.TemporaryFile("w+") if rank else None)  # a file, not a pipe: it never fills up
            ranks.append(subprocess.Popen(command, env=env, stderr=logs[-1]))
        while failed is None and any(p.poll() is None for p in ranks):
            failed = next((r for r, p in enumerate(ranks) if p.poll() not in (None, 0)), None)
            time.sleep(poll_s)
        failed = next((r for r, p in enumerate(ranks) if p.poll() not in (None, 0)), None)
        if failed:
            try:
                ranks[0].wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
        for p in ranks:
            p.wait()
        signal.signal(signal.SIGTERM, previous)
    if failed is None:
        return 0
    code = ranks[failed].returncode
    if failed and ranks[0].returncode <= 0:  # rank 0 finished or was ended here: it printed no error
        logs[failed].seek(0)
        errors = [line for line in logs[failed].read().splitlines() if line.startswith("error:")]
        print(errors[-1] if errors else f"error: rank {failed} of {world} ended with exit status {code}",
              file=sys.stderr, flush=True)
    return ranks[0].returncode if ranks[0].returncode > 0 else (code if code > 0 else 1)
