"""Block-sparse attention layouts (docs/FORMATS.md): which (query block, key block) tiles attention computes.

A layout is a boolean tensor (heads, q_blocks, k_blocks) at block size 64 or 128; heads is 1 (one layout
for every head) or the number of query heads. Attention is causal: inside a kept diagonal block the
causal mask still applies, and blocks above the diagonal hold no visible key, so `dense` and `causal`
compute the same tiles. Named layouts, written NAME[:k=v,...] (sizes in tokens):

- `dense`, `causal`;
- `sink-window:sink=S,window=W`: the first S tokens plus the last W tokens before each query (StreamingLLM);
- `strided:local=L,stride=S`: the last L tokens plus every key block that ends a stride of S tokens
  (Sparse Transformer's fixed pattern; S a multiple of the block size);
- `bigbird:window=W,global=G,random=R,seed=N`: the last W tokens, the first G tokens, and R random
  earlier key blocks per query block and head, drawn from seed N;
- `file:path=LAYOUT.safetensors`: a user tensor, the file's one tensor (read with safetensors, never
  unpickled), bool or integer of shape (q_blocks, k_blocks) or (heads, q_blocks, k_blocks) covering at
  least the sequence; its top-left corner is used.

The kernels read the compact form (`CompactLayout`), built once per (layout, length): for each head and
query tile of KERNEL_TILE tokens, the ascending list of key tiles to visit, in CSR arrays. Decode reads
`DecodeLayout`, the same lists per KV head's group of query heads (see there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from ..errors import MinferError
from ..ops import BLOCKSPARSE_TILE as KERNEL_TILE
from ..ops import (blocksparse_attention, blocksparse_decode_attention, blocksparse_tiles,
                   sink_window_decode_attention)

BLOCK_SIZES = (64, 128)
MAX_SEQ_LEN = 1 << 20


class LayoutError(MinferError):
    """A layout string, file, block size or length that cannot give a layout."""


# Each named layout's parameters, in the order its help text lists them.
NAMED_LAYOUTS: dict[str, tuple[str, ...]] = {
    "dense": (),
    "causal": (),
    "sink-window": ("sink", "window"),
    "strided": ("local", "stride"),
    "bigbird": ("window", "global", "random", "seed"),
    "file": ("path",),
}
POSITIVE_PARAMS = ("window", "local", "stride")  # the others may be 0
LAYOUT_HELP = ("dense | causal | sink-window:sink=S,window=W | strided:local=L,stride=S | "
               "bigbird:window=W,global=G,random=R,seed=N | file:path=LAYOUT.safetensors")


@dataclass(frozen=True)
class LayoutSpec:
    """A parsed layout string: its name and parameters (ints, or the path of a file layout)."""

    name: str
    params: dict = field(default_factory=dict)

    def __str__(self) -> str:
        args = ",".join(f"{k}={self.params[k]}" for k in NAMED_LAYOUTS[self.name])
        return f"{self.name}:{args}" if args else self.name


def parse_layout(text: str) -> LayoutSpec:
    """NAME[:k=v,...] -> LayoutSpec; every mistake raises one LayoutError line naming the fix."""
    name, _, arg_text = text.strip().partition(":")
    if name not in NAMED_LAYOUTS:
        raise LayoutError(f"unknown layout {name!r} in {text!r}; choose {LAYOUT_HELP}")
    wanted = NAMED_LAYOUTS[name]
    params: dict = {}
    for item in [part.strip() for part in arg_text.split(",") if part.strip()]:
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not value:
            raise LayoutError(f"layout {text!r}: {item!r} is not key=value")
        if key not in wanted:
            expected = ", ".join(wanted) if wanted else "no parameters"
            raise LayoutError(f"layout {text!r}: {name} takes {expected}, not {key!r}")
        if key in params:
            raise LayoutError(f"layout {text!r}: {key} is given twice")
        if key == "path":
            params[key] = value
            continue
        try:
            params[key] = int(value)
        except ValueError:
            raise LayoutError(f"layout {text!r}: {key}={value!r} is not a whole number") from None
        low = 1 if key in POSITIVE_PARAMS else 0
        if params[key] < low:
            raise LayoutError(f"layout {text!r}: {key} must be >= {low}, got {params[key]}")
    missing = [k for k in wanted if k not in params]
    if missing:
        raise LayoutError(f"layout {text!r}: missing {', '.join(missing)}; write {name}:"
                          + ",".join(f"{k}=..." for k in wanted))
    return LayoutSpec(name, params)


def check_block_size(block_size: int) -> None:
    if block_size not in BLOCK_SIZES:
        raise LayoutError(f"block size must be one of {BLOCK_SIZES}, got {block_size}")


def check_seq_len(seq_len: int) -> None:
    if not 1 <= seq_len <= MAX_SEQ_LEN:
        raise LayoutError(f"sequence length must be in 1..{MAX_SEQ_LEN}, got {seq_len}")


def _blocks(seq_len: int, block_size: int) -> int:
    return -(-seq_len // block_size)


def _window_blocks(n: int, block_size: int, window: int) -> torch.Tensor:
    """(n, n) key blocks holding any of the last `window` tokens before some query of the query block."""
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    # query block i's queries see keys down to i*B - window + 1; block j's last key is (j+1)*B - 1
    return (j <= i) & ((j + 1) * block_size - 1 >= i * block_size - window + 1)


def _first_tokens(n: int, block_size: int, tokens: int) -> torch.Tensor:
    """(n, n) key blocks holding any of the first `tokens` tokens."""
    return (torch.arange(n) * block_size < tokens)[None, :].expand(n, n)


def _causal_blocks(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


def _index_hash(seed: int, *indices: torch.Tensor) -> torch.Tensor:
    """A 31-bit pseudo-random integer per element of the broadcast `indices`, a function of the seed and
    the indices alone (each step's product stays below 2^62, so int64 never wraps)."""
    value = torch.tensor(seed & 0x7FFFFFFF, dtype=torch.int64)
    for index in (None, *indices):
        if index is not None:
            value = value ^ index.to(torch.int64)
        value = ((value ^ (value >> 15)) * 0x2C1B3C6D) & 0x7FFFFFFF
        value = ((value ^ (value >> 12)) * 0x297A2D39) & 0x7FFFFFFF
        value = value ^ (value >> 15)
    return value


def _bigbird_random(n: int, heads: int, random: int, seed: int) -> torch.Tensor:
    """(heads, n, n): per head and query block, `random` key blocks drawn without replacement among the
    earlier ones (all of them when fewer). A block's draw depends only on (seed, head, query block, key
    block), so the layout of a shorter sequence is the top-left corner of a longer one's: a prompt's
    prefill and the decode steps after it keep the same blocks."""
    blocks = torch.arange(n)
    scores = _index_hash(seed, torch.arange(heads)[:, None, None], blocks[None, :, None], blocks[None, None, :])
    earlier = torch.ones(n, n, dtype=torch.bool).tril(-1)
    scores = scores.masked_fill(~earlier, -1)
    picked = torch.zeros(heads, n, n, dtype=torch.bool)
    if random and n > 1:
        top = scores.topk(min(random, n - 1), dim=-1).indices
        picked.scatter_(-1, top, True)
    return picked & earlier


def _read_file_layout(path_text: str) -> torch.Tensor:
    from safetensors import SafetensorError, safe_open

    path = Path(path_text).expanduser()
    if path.suffix != ".safetensors":
        raise LayoutError(f"layout file {path}: must be a .safetensors file (layouts are never unpickled)")
    if not path.is_file():
        raise LayoutError(f"layout file {path}: no such file")
    try:
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
            if len(names) != 1:
                raise LayoutError(f"layout file {path}: must hold exactly one tensor, found {len(names)}")
            tensor = f.get_tensor(names[0])
    except (SafetensorError, OSError, ValueError) as exc:
        raise LayoutError(f"layout file {path}: not a readable safetensors file ({exc})") from None
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dim() not in (2, 3):
        raise LayoutError(f"layout file {path}: the tensor must be bool or integer of shape (q_blocks, k_blocks) "
                          f"or (heads, q_blocks, k_blocks), got {tensor.dtype} of shape {tuple(tensor.shape)}")
    return (tensor != 0) if tensor.dim() == 3 else (tensor != 0)[None]


def build_layout(spec: LayoutSpec | str, heads: int, seq_len: int, block_size: int = 64) -> torch.Tensor:
    """The boolean layout (1 or `heads`, q_blocks, k_blocks) of `spec` for a sequence of `seq_len` tokens,
    with blocks above the diagonal cleared (causal attention never reads them)."""
    spec = parse_layout(spec) if isinstance(spec, str) else spec
    check_block_size(block_size)
    check_seq_len(seq_len)
    if heads < 1:
        raise LayoutError(f"heads must be >= 1, got {heads}")
    n = _blocks(seq_len, block_size)
    p = spec.params
    if spec.name in ("dense", "causal"):
        layout = _causal_blocks(n)[None]
    elif spec.name == "sink-window":
        layout = (_first_tokens(n, block_size, p["sink"]) | _window_blocks(n, block_size, p["window"]))[None]
    elif spec.name == "strided":
        if p["stride"] % block_size:
            raise LayoutError(f"layout {spec}: stride must be a multiple of the block size {block_size}, "
                              f"got {p['stride']}")
        ends_stride = ((torch.arange(n) + 1) * block_size) % p["stride"] == 0
        layout = (_window_blocks(n, block_size, p["local"]) | ends_stride[None, :])[None]
    elif spec.name == "bigbird":
        local = _window_blocks(n, block_size, p["window"]) | _first_tokens(n, block_size, p["global"])
        layout = local[None] | _bigbird_random(n, heads, p["random"], p["seed"])
    else:
        layout = _read_file_layout(p["path"])
        if layout.shape[0] not in (1, heads) or layout.shape[1] < n or layout.shape[2] < n:
            raise LayoutError(f"layout file {p['path']}: shape {tuple(layout.shape)} does not cover {heads} heads "
                              f"(or 1) and {n} x {n} blocks of {block_size} for {seq_len} tokens")
        layout = layout[:, :n, :n].clone()
    return layout & _causal_blocks(n)


def density(layout: torch.Tensor) -> float:
    """Kept blocks over the blocks causal attention can see (1.0 for dense)."""
    n = layout.shape[-1]
    visible = n * (n + 1) // 2 * layout.shape[0]
    return float((layout & _causal_blocks(n)).sum()) / visible


@dataclass(frozen=True)
class CompactLayout:
    """What the kernels read, for one (layout, length): per head (1 or all) and query tile of KERNEL_TILE
    tokens, the kept key tiles in ascending order. Tile (h, i)'s list is
    key_tiles[tile_ptr[h * q_tiles + i] : tile_ptr[h * q_tiles + i + 1]]. int32 tensors."""

    tile_ptr: torch.Tensor
    key_tiles: torch.Tensor
    heads: int
    seq_len: int
    block_size: int

    @property
    def q_tiles(self) -> int:
        return _blocks(self.seq_len, KERNEL_TILE)

    def to(self, device: torch.device | str) -> CompactLayout:
        return CompactLayout(self.tile_ptr.to(device), self.key_tiles.to(device), self.heads, self.seq_len,
                             self.block_size)

    def tile_layout(self) -> torch.Tensor:
        """The boolean (heads, q_tiles, q_tiles) layout at KERNEL_TILE the lists describe."""
        return blocksparse_tiles(self.tile_ptr, self.key_tiles, self.heads, self.q_tiles)

    def to_layout(self) -> torch.Tensor:
        """The boolean layout at the layout's own block size (inverse of `compact`)."""
        step = self.block_size // KERNEL_TILE
        return self.tile_layout()[:, ::step, ::step].contiguous()

    def kept_fraction(self) -> float:
        return density(self.tile_layout())

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               out: torch.Tensor | None = None, kernel: str = "auto") -> torch.Tensor:
        """ops.blocksparse_attention of q [B, Hq, S, D] over k, v [B, Hkv, S, D] with this layout, which
        must be built for S tokens."""
        if q.dim() == 4 and q.shape[2] != self.seq_len:
            raise LayoutError(f"the layout was built for {self.seq_len} tokens, the attention has {q.shape[2]}; "
                              "build one per length")
        return blocksparse_attention(q, k, v, self.tile_ptr, self.key_tiles, self.heads, scale, out, kernel=kernel)


def compact(layout: torch.Tensor, seq_len: int, block_size: int) -> CompactLayout:
    """The per-query-tile key-tile lists of `layout` (from build_layout) for `seq_len` tokens."""
    check_block_size(block_size)
    check_seq_len(seq_len)
    n = _blocks(seq_len, block_size)
    if layout.dtype != torch.bool or layout.dim() != 3 or layout.shape[1:] != (n, n):
        raise LayoutError(f"a layout for {seq_len} tokens at block size {block_size} must be bool "
                          f"(heads, {n}, {n}), got {layout.dtype} of shape {tuple(layout.shape)}")
    step = block_size // KERNEL_TILE
    tiles = _blocks(seq_len, KERNEL_TILE)
    fine = layout.cpu().repeat_interleave(step, 1).repeat_interleave(step, 2)[:, :tiles, :tiles]
    fine = fine & _causal_blocks(tiles)
    counts = fine.sum(-1).flatten()
    tile_ptr = torch.zeros(counts.numel() + 1, dtype=torch.int32)
    tile_ptr[1:] = counts.cumsum(0)
    key_tiles = fine.flatten(0, 1).nonzero()[:, 1].to(torch.int32)  # row-major: each row's keys ascending
    return CompactLayout(tile_ptr, key_tiles, layout.shape[0], seq_len, block_size)


@dataclass(frozen=True)
class DecodeLayout:
    """What block-sparse decode reads (ops.blocksparse_decode_attention), for a cache of `seq_len` positions:
    per layout group and query tile of KERNEL_TILE tokens, the ascending key tiles
    key_tiles[tile_ptr[g * q_tiles + i] : tile_ptr[g * q_tiles + i + 1]] and, for each, head_bits: bit j
    set when query head j of the group keeps that tile. A layout shared by all heads has one group (every
    bit set); a per-head layout has one group per KV head, listing the union of its query heads' tiles,
    so each K/V tile is read once for the whole group and heads that do not keep it mask it out.
    int32 tensors. A sink-window layout also keeps its (sink, window, block_size): its kernel computes the
    same tiles from the position instead of reading the lists."""

    tile_ptr: torch.Tensor
    key_tiles: torch.Tensor
    head_bits: torch.Tensor
    groups: int
    seq_len: int
    sink_window: tuple[int, int, int] | None = None

    @property
    def q_tiles(self) -> int:
        return _blocks(self.seq_len, KERNEL_TILE)

    @cached_property
    def most_kept_positions(self) -> int:
        """The longest list in positions: what the split-K workspace and ring are sized for (read back once,
        so decode steps that use it stay free of host syncs)."""
        return int((self.tile_ptr[1:] - self.tile_ptr[:-1]).max()) * KERNEL_TILE

    def to(self, device: torch.device | str) -> DecodeLayout:
        return DecodeLayout(self.tile_ptr.to(device), self.key_tiles.to(device), self.head_bits.to(device),
                            self.groups, self.seq_len, self.sink_window)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, input_pos: torch.Tensor,
               scale: float, out: torch.Tensor | None = None, workspace: torch.Tensor | None = None,
               listed: bool = False, stages: int | None = None) -> torch.Tensor:
        """Decode attention of q [B, Hq, D] at position input_pos over caches of seq_len positions with this
        layout (sink-window through its own kernel path unless `listed`; `listed` and `stages`, the K/V ring
        depth, are knobs for benchmarks: None fits the ring to the most kept positions)."""
        if self.sink_window is not None and not listed:
            return sink_window_decode_attention(q, k_cache, v_cache, input_pos, scale, *self.sink_window, out=out,
                                                workspace=workspace, stages=stages,
                                                kept_positions=self.most_kept_positions)
        return blocksparse_decode_attention(q, k_cache, v_cache, input_pos, scale, self.tile_ptr, self.key_tiles,
                                            self.head_bits, self.groups, out=out, workspace=workspace, stages=stages,
                                            kept_positions=self.most_kept_positions)


def decode_layout(packed: CompactLayout, kv_heads: int, spec: LayoutSpec | None = None) -> DecodeLayout:
    """The decode form of a compact layout for attention with `kv_heads` KV heads (query heads are the
    layout's heads when it has more than one); `spec`, the layout it was built from, names a sink-window."""
    if packed.heads == 1:
        sink_window = None
        if spec is not None and spec.name == "sink-window":
            sink_window = (spec.params["sink"], spec.params["window"], packed.block_size)
        return DecodeLayout(packed.tile_ptr, packed.key_tiles, torch.full_like(packed.key_tiles, -1), 1,
                            packed.seq_len, sink_window)
    if packed.heads % kv_heads:
        raise LayoutError(f"a layout of {packed.heads} heads does not split into {kv_heads} KV head groups")
    group = packed.heads // kv_heads
    tiles = packed.tile_layout().view(kv_heads, group, packed.q_tiles, packed.q_tiles)
    bits = (tiles.int() << torch.arange(group, dtype=torch.int32)[None, :, None, None]).sum(1, dtype=torch.int32)
    union = tiles.any(1)
    counts = union.sum(-1).flatten()
    tile_ptr = torch.zeros(counts.numel() + 1, dtype=torch.int32)
    tile_ptr[1:] = counts.cumsum(0)
    kept = union.flatten(0, 1).nonzero()  # row-major: each list ascending
    key_tiles = kept[:, 1].to(torch.int32)
    head_bits = bits.flatten(0, 1)[kept[:, 0], kept[:, 1]]
    return DecodeLayout(tile_ptr, key_tiles, head_bits, kv_heads, packed.seq_len)


_compact_cache: dict[tuple, CompactLayout] = {}


def compact_layout(spec: LayoutSpec | str, heads: int, seq_len: int, block_size: int = 64,
                   device: torch.device | str = "cpu") -> CompactLayout:
    """The compact form of a named layout on `device`, built once per (layout, heads, length, block, device)."""
    spec = parse_layout(spec) if isinstance(spec, str) else spec
    key = (str(spec), heads, seq_len, block_size, str(device))
    if key not in _compact_cache:
        _compact_cache[key] = compact(build_layout(spec, heads, seq_len, block_size), seq_len, block_size).to(device)
    return _compact_cache[key]


def plot_layout(layout: torch.Tensor, path: str | Path, title: str, head: int = 0) -> None:
    """A PNG of one head's layout: kept blocks dark, with the density in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 6))
    ax.imshow(layout[head].float().numpy(), cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
    ax.set_xlabel("key block")
    ax.set_ylabel("query block")
    ax.set_title(f"{title} (density {density(layout):.3f})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
