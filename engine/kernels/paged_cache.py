"""Paged KV cache: FP8 (or bf16 / fp16 / fp32) pages with per-(token, kv_head) scales. Pure torch to import.

`PagedKVCache` keeps every layer's K and V in fixed-size pages ("blocks" of
`block_size` tokens) handed out from a host free list; a sequence's block
table (a row of an int32 device tensor) maps its logical blocks to pages. A
write quantizes the new chunk exactly as the emulation's `Numerics.kv_store`
does and scatters it into the pages on the device (no host sync):

* K `e4m3:head`: one scale per KV head over all the tokens of that write call
  (all sequences of the call together, as `kv_store` quantizes its
  (batch, kv_heads, t, d) input); stored per (token, kv_head), so chunks
  written by different calls keep their own scales. `e4m3:token`: one scale
  per (sequence, kv_head, token).
* V `e4m3:1x128`: one scale per (token, kv_head, 128-group of head_dim);
  `e4m3:token`: one scale per (token, kv_head), stored in every group slot.

Two bit-identical write paths: `write` calls `engine.formats.quantize` itself
(the reference, and the emulated backends' path); `write(..., kernel=kv_write)`
runs one fused quantize + scatter kernel (`engine.kernels.paged_kv.kv_write`,
passed in by the native backend's `paged_attention`), tested bit-exact against
the library. bf16 / fp16 / fp32 caches store the values cast, with no scales.

This module imports no Triton, so the CPU runtime and CI can use the cache;
`engine.kernels.paged_kv` holds the kernels (paged decode attention, write).
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Union

import torch

PAGE_SIZES = (16, 32, 64, 128, 256)
_FP8 = torch.float8_e4m3fn
_K_SPECS = ("e4m3:head", "e4m3:token")
_V_SPECS = ("e4m3:1x128", "e4m3:token")
V_LAYOUTS = ("token", "dim")
IntsLike = Union[torch.Tensor, Sequence[int], int]


class PagedKVCache:
    """Paged K/V storage for `num_layers` layers.

    Per layer (pages = num_blocks + 1: the last page is a trash page that absorbs writes through
    unallocated block-table entries, so a bad position never corrupts another sequence):

    * k (pages, kv_heads, block_size, head_dim), v (pages, kv_heads, block_size, head_dim_v) in `dtype`
      (FP8 kept as uint8 bits; `k_data` / `v_data` return float8_e4m3fn views);
    * FP8 only: k_scale (pages, kv_heads, block_size) and v_scale (pages, kv_heads, block_size,
      ceil(head_dim_v/128)) fp32.

    `v_layout`: how a V page lies in memory. "token": token-major, each token's head_dim_v values
    contiguous (like K); "dim": dimension-major, each dimension's block_size tokens contiguous (the
    storage is (pages, kv_heads, head_dim_v, block_size); `v_data` still returns the (pages, kv_heads,
    block_size, head_dim_v) view, so indexing code does not change). "auto" (default): "dim" for FP8,
    "token" otherwise. The decode kernel's PV product reduces over tokens; FP8 tensor-core operands want
    the reduction dimension contiguous, and with token-major FP8 V the compiler gathers V byte by byte
    from shared memory (there is no 8-bit transposing matrix load on sm_90); dimension-major V loads like
    K (16-byte global copies, ldmatrix, one conversion per two values). Values and scales are the same in
    both layouts.

    `block_tables` (max_seqs, max_blocks_per_seq) int32 and `seq_lens` (max_seqs,) int32 live on the
    device; the free list and each sequence's pages also live on the host. MLA stores its RoPE key as
    K (kv_heads=1, head_dim=rope dim) and the latent as V (head_dim_v=kv_lora_rank).
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 head_dim_v: Optional[int] = None, *, dtype: torch.dtype = _FP8, max_seqs: int = 64,
                 max_blocks_per_seq: Optional[int] = None, k_spec: str = "e4m3:head", v_spec: str = "e4m3:1x128",
                 device: Union[str, torch.device] = "cuda", v_layout: str = "auto"):
        if block_size not in PAGE_SIZES:
            raise ValueError(f"block_size {block_size}: use one of {PAGE_SIZES}")
        if dtype not in (_FP8, torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"cache dtype {dtype}: use torch.float8_e4m3fn, bfloat16, float16 or float32")
        if dtype == _FP8 and (k_spec not in _K_SPECS or v_spec not in _V_SPECS):
            raise ValueError(f"FP8 cache specs k_spec={k_spec!r} (one of {_K_SPECS}), "
                             f"v_spec={v_spec!r} (one of {_V_SPECS})")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.head_dim_v = head_dim if head_dim_v is None else head_dim_v
        self.dtype, self.k_spec, self.v_spec = dtype, k_spec, v_spec
        self.device = torch.device(device)
        if v_layout not in ("auto",) + V_LAYOUTS:
            raise ValueError(f"v_layout {v_layout!r}: use 'auto', 'token' or 'dim'")
        self.v_layout = ("dim" if dtype == _FP8 else "token") if v_layout == "auto" else v_layout
        self.max_seqs = max_seqs
        self.max_blocks_per_seq = max_blocks_per_seq or num_blocks
        self.fp8 = dtype == _FP8
        self.v_groups = math.ceil(self.head_dim_v / 128)
        self.trash = num_blocks  # index of the trash page
        pages = num_blocks + 1
        store = torch.uint8 if self.fp8 else dtype
        dev = self.device
        self._k = torch.zeros((num_layers, pages, kv_heads, block_size, head_dim), dtype=store, device=dev)
        if self.v_layout == "dim":  # stored (..., head_dim_v, block_size); _v is the token-major view of it
            self._v = torch.zeros((num_layers, pages, kv_heads, self.head_dim_v, block_size), dtype=store,
                                  device=dev).transpose(-1, -2)
        else:
            self._v = torch.zeros((num_layers, pages, kv_heads, block_size, self.head_dim_v), dtype=store, device=dev)
        if self.fp8:
            self._ks = torch.ones((num_layers, pages, kv_heads, block_size), dtype=torch.float32, device=dev)
            self._vs = torch.ones((num_layers, pages, kv_heads, block_size, self.v_groups), dtype=torch.float32,
                                  device=dev)
        self.block_tables = torch.full((max_seqs, self.max_blocks_per_seq), self.trash, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device=dev)
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low page ids first
        self._pages: list[list[int]] = [[] for _ in range(max_seqs)]
        self._host_len: list[Optional[int]] = [0] * max_seqs

    # ------------------------------------------------------------- allocation
    def capacity(self, seq_id: int) -> int:
        """Tokens the sequence can hold with its allocated pages."""
        return len(self._pages[seq_id]) * self.block_size

    def free_blocks(self) -> int:
        """Pages left on the free list."""
        return len(self._free)

    def allocate(self, seq_id: int, num_tokens: int) -> None:
        """Grow sequence `seq_id` so that it can hold `num_tokens` tokens (host free list; one small copy
        of the new block-table entries to the device, never a sync)."""
        if not 0 <= seq_id < self.max_seqs:
            raise ValueError(f"seq_id {seq_id} out of range [0, {self.max_seqs})")
        need = math.ceil(num_tokens / self.block_size) - len(self._pages[seq_id])
        if need <= 0:
            return
        have = len(self._pages[seq_id])
        if have + need > self.max_blocks_per_seq:
            raise ValueError(f"sequence {seq_id}: {num_tokens} tokens need {have + need} blocks of {self.block_size}, "
                             f"more than max_blocks_per_seq={self.max_blocks_per_seq}")
        if need > len(self._free):
            raise RuntimeError(f"KV cache out of pages: sequence {seq_id} needs {need} more, {len(self._free)} free "
                               f"of {self.num_blocks}; free finished sequences or build a larger cache")
        new = [self._free.pop() for _ in range(need)]
        self._pages[seq_id].extend(new)
        self.block_tables[seq_id, have:have + need] = _to_device(torch.tensor(new, dtype=torch.int32), self.device)

    def copy_prefix(self, src: int, dst: int, num_tokens: int) -> None:
        """Prefix-cache hit: give sequence `dst` the first `num_tokens` (whole pages) of sequence `src`.

        Copies page contents and scales of every layer (no sharing, so no reference counts): the
        stored values -- including each chunk's K scale from the call that wrote it -- are exactly
        what `src` holds. `dst` must already have pages allocated for them.
        """
        if num_tokens % self.block_size:
            raise ValueError(f"copy_prefix: {num_tokens} tokens is not a whole number of {self.block_size}-token pages")
        nb = num_tokens // self.block_size
        if nb > len(self._pages[src]) or nb > len(self._pages[dst]):
            raise ValueError(f"copy_prefix: {nb} pages needed, src {src} has {len(self._pages[src])}, "
                             f"dst {dst} has {len(self._pages[dst])}")
        s = torch.tensor(self._pages[src][:nb], dtype=torch.long, device=self.device)
        d = torch.tensor(self._pages[dst][:nb], dtype=torch.long, device=self.device)
        for buf in (self._k, self._v) + ((self._ks, self._vs) if self.fp8 else ()):
            buf[:, d] = buf[:, s]
        self.seq_lens[dst] = num_tokens
        self._host_len[dst] = num_tokens

    def free(self, seq_id: int) -> None:
        """Return the sequence's pages to the free list and reset its table row and length."""
        self._free.extend(reversed(self._pages[seq_id]))
        self._pages[seq_id] = []
        self.block_tables[seq_id].fill_(self.trash)
        self.seq_lens[seq_id].fill_(0)
        self._host_len[seq_id] = 0

    # ------------------------------------------------------------------ write
    def write(self, layer: int, seq_ids: IntsLike, start: IntsLike, k: torch.Tensor, v: torch.Tensor,
              kernel: Optional[Callable[..., None]] = None) -> None:
        """Quantize and store one chunk: token j of row b goes to position start[b] + j of sequence seq_ids[b].

        k: (batch, kv_heads, t, head_dim), v: (batch, kv_heads, t, head_dim_v) (the `Numerics.kv_store`
        layout); seq_ids, start: (batch,) ints or int tensors (device tensors: no host work at all, and no
        capacity check: positions beyond the allocated pages land in the trash page). Updates seq_lens to
        max(seq_len, start + t) on the device.
        `kernel`: a fused quantize + scatter kernel called as ``kernel(cache, layer, seq_ids, start, k, v,
        update_lens=True)`` (`engine.kernels.paged_kv.kv_write`: no sync, graph-capturable); None: the formats
        library's quantization and torch indexing (the reference).
        """
        if k.dim() != 4 or tuple(k.shape[1:2]) + tuple(k.shape[3:]) != (self.kv_heads, self.head_dim):
            raise ValueError(f"k must be (batch, {self.kv_heads}, t, {self.head_dim}), got {tuple(k.shape)}")
        b, h, t, _ = k.shape
        if tuple(v.shape) != (b, h, t, self.head_dim_v):
            raise ValueError(f"v must be ({b}, {h}, {t}, {self.head_dim_v}), got {tuple(v.shape)}")
        if b == 0 or t == 0:
            return
        host_ids, host_start = _host_ints(seq_ids, b), _host_ints(start, b)
        if host_ids is not None and host_start is not None:
            for sid, st in zip(host_ids, host_start):
                if st + t > self.capacity(sid):
                    raise ValueError(f"sequence {sid}: writing positions [{st}, {st + t}) beyond its capacity "
                                     f"{self.capacity(sid)}; call allocate({sid}, {st + t}) first")
                if self._host_len[sid] is not None:
                    self._host_len[sid] = max(self._host_len[sid], st + t)
        else:  # lengths now only known on the device (all of them when the rows are not known either)
            for sid in (host_ids if host_ids is not None else range(self.max_seqs)):
                self._host_len[sid] = None
        dev = self.device
        sid = _to_device(torch.as_tensor(seq_ids).reshape(-1).expand(b), dev).long()
        st = _to_device(torch.as_tensor(start).reshape(-1).expand(b), dev).long()
        if kernel is not None:
            kernel(self, layer, sid, st, k, v, update_lens=True)  # seq_lens raised in the same launch
        else:
            self._write_library(layer, sid, st, k, v)
            self.seq_lens[sid] = torch.maximum(self.seq_lens[sid], (st + t).to(torch.int32))

    def _write_library(self, layer: int, sid: torch.Tensor, st: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Quantize with engine.formats.quantize (the emulation's own calls) and scatter with torch indexing."""
        t = k.shape[2]
        pos = st[:, None] + torch.arange(t, device=self.device)  # (batch, t)
        blk = pos // self.block_size
        inside = blk < self.max_blocks_per_seq  # beyond the table: trash page, never an out-of-bounds index
        page = self.block_tables[sid[:, None], blk.clamp_max(self.max_blocks_per_seq - 1)].long()  # (batch, t)
        page = torch.where(inside, page, torch.full_like(page, self.trash))
        slot = pos % self.block_size
        kd, ks, vd, vs = self._encode(k, v)
        self._k[layer][page, :, slot] = kd  # (batch, t, kv_heads, head_dim) into (pages, kv_heads, block, dim)
        self._v[layer][page, :, slot] = vd
        if self.fp8:
            self._ks[layer][page, :, slot] = ks  # (batch, t, kv_heads)
            self._vs[layer][page, :, slot] = vs  # (batch, t, kv_heads, groups)

    def _encode(self, k: torch.Tensor, v: torch.Tensor):
        """Storage values of a chunk, token-major: (k (b, t, h, d), k_scale (b, t, h), v (b, t, h, dv),
        v_scale (b, t, h, groups)); the quantization is the formats library's (as `Numerics.kv_store`)."""
        b, h, t, d = k.shape
        if not self.fp8:
            return (k.to(self.dtype).permute(0, 2, 1, 3), None, v.to(self.dtype).permute(0, 2, 1, 3), None)
        from engine.formats import quantize

        if self.k_spec == "e4m3:head":
            rows = k.transpose(0, 1).reshape(h, b * t * d)  # (kv_heads, batch*t*head_dim): one scale per head
            kq = quantize(rows, "e4m3:token")
            kd = kq.data.view(torch.uint8).reshape(h, b, t, d).permute(1, 2, 0, 3)  # (b, t, h, d)
            ks = kq.scale.reshape(1, 1, h).expand(b, t, h)
        else:
            kq = quantize(k, "e4m3:token")  # scale (b, h, t, 1)
            kd = kq.data.view(torch.uint8).permute(0, 2, 1, 3)
            ks = kq.scale[..., 0].permute(0, 2, 1)
        vq = quantize(v, self.v_spec)  # scale (b, h, t, groups) for 1x128, (b, h, t, 1) for token
        vd = vq.data.view(torch.uint8).permute(0, 2, 1, 3)
        vs = vq.scale.permute(0, 2, 1, 3).expand(b, t, h, self.v_groups)
        return kd, ks, vd, vs

    # ------------------------------------------------------------------- read
    def k_data(self, layer: int) -> torch.Tensor:
        """Layer K pages (pages, kv_heads, block_size, head_dim) in the cache dtype."""
        return self._k[layer].view(_FP8) if self.fp8 else self._k[layer]

    def v_data(self, layer: int) -> torch.Tensor:
        """Layer V pages (pages, kv_heads, block_size, head_dim_v) in the cache dtype."""
        return self._v[layer].view(_FP8) if self.fp8 else self._v[layer]

    def k_scale(self, layer: int) -> Optional[torch.Tensor]:
        """Layer K scales (pages, kv_heads, block_size) fp32, None for a non-FP8 cache."""
        return self._ks[layer] if self.fp8 else None

    def v_scale(self, layer: int) -> Optional[torch.Tensor]:
        """Layer V scales (pages, kv_heads, block_size, groups) fp32, None for a non-FP8 cache."""
        return self._vs[layer] if self.fp8 else None

    def length(self, seq_id: int) -> int:
        """Current length of a sequence (host value when known, else read from the device: a sync)."""
        n = self._host_len[seq_id]
        return int(self.seq_lens[seq_id].item()) if n is None else n

    def context_bound(self, seq_ids: Optional[IntsLike], batch: int) -> int:
        """An upper bound of the context length of these sequences known on the host (no sync)."""
        ids = list(range(batch)) if seq_ids is None else _host_ints(seq_ids, batch)
        if ids is None:
            return self.max_blocks_per_seq * self.block_size
        return max(1, max(self.capacity(i) for i in ids))

    def gather_rows(self, layer: int, seq_ids: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the first `num_blocks` pages of each sequence in `seq_ids` (a (batch,) device tensor), through
        the block table on the device: (k (batch, kv_heads, num_blocks * block_size, head_dim), v (..., head_dim_v))
        fp32 values (FP8 pages dequantized with their scales as `gather` does), no host read (graph-capturable).
        Positions past a sequence's length hold whatever its pages (or the trash page) hold: the caller masks them."""
        if not 1 <= num_blocks <= self.max_blocks_per_seq:
            raise ValueError(f"num_blocks {num_blocks}: between 1 and max_blocks_per_seq {self.max_blocks_per_seq}")
        pages = self.block_tables[seq_ids.long(), :num_blocks].long()  # (batch, num_blocks)

        def take(x: torch.Tensor) -> torch.Tensor:
            """(pages, h, block, ...) -> (batch, h, num_blocks * block, ...)."""
            y = x[pages].transpose(1, 2)  # (batch, h, num_blocks, block, ...)
            return y.reshape(y.shape[0], y.shape[1], num_blocks * self.block_size, *y.shape[4:])

        ks, vs = (take(self._ks[layer]), take(self._vs[layer])) if self.fp8 else (None, None)
        return self._values(take(self.k_data(layer)), ks, take(self.v_data(layer)), vs)

    def gather(self, layer: int, seq_id: int, length: Optional[int] = None, dequantize: bool = True):
        """Contiguous K/V of one sequence (the emulated paged attention's read, MLA's latent read, tests). The pages
        come from the device block table (no host-to-device copy, so no sync); `length` defaults to the host's
        record of the sequence's length, which syncs when only the device knows it.

        dequantize=True: (k (1, kv_heads, L, head_dim), v (1, kv_heads, L, head_dim_v)) fp32 = stored
        value * scale. dequantize=False: (k, k_scale (1, kv_heads, L) or None, v, v_scale
        (1, kv_heads, L, groups) or None) in storage dtype.
        """
        n = self.length(seq_id) if length is None else length
        nb = math.ceil(n / self.block_size)
        if nb > len(self._pages[seq_id]):
            raise ValueError(f"sequence {seq_id} holds {self.capacity(seq_id)} tokens, asked for {n}")
        pages = self.block_tables[seq_id, :nb].long()

        def take(x: torch.Tensor) -> torch.Tensor:
            """(pages, h, block, ...) -> (1, h, n, ...) of this sequence."""
            y = x[pages].transpose(0, 1)  # (h, nb, block, ...)
            return y.reshape(y.shape[0], nb * self.block_size, *y.shape[3:])[:, :n][None]

        k, v = take(self.k_data(layer)), take(self.v_data(layer))
        ks = take(self._ks[layer]) if self.fp8 else None
        vs = take(self._vs[layer]) if self.fp8 else None
        if not dequantize:
            return k, ks, v, vs
        return self._values(k, ks, v, vs)

    def _values(self, k: torch.Tensor, ks: Optional[torch.Tensor], v: torch.Tensor,
                vs: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 values of stored K / V read from the pages (any leading shape): FP8 codes times their scales (K one
        per token and head, V one per 128-group of head_dim_v), float pages as they are (scales None)."""
        k, v = k.float(), v.float()
        if ks is not None:
            k = k * ks[..., None]
            v = v * vs.repeat_interleave(128, dim=-1)[..., :self.head_dim_v]
        return k, v

    def kv_bytes(self, tokens: int) -> int:
        """Bytes one layer reads for `tokens` cached tokens: K and V data plus their scales."""
        per = self.kv_heads * (self.head_dim + self.head_dim_v) * self._k.element_size()
        if self.fp8:
            per += self.kv_heads * (1 + self.v_groups) * 4
        return tokens * per


def _host_ints(x: IntsLike, n: int) -> Optional[list[int]]:
    """Python ints of a host value (int, sequence, CPU tensor), None for a device tensor."""
    if isinstance(x, torch.Tensor):
        return None if x.device.type != "cpu" else [int(i) for i in x.reshape(-1).expand(n).tolist()]
    if isinstance(x, int):
        return [x] * n
    return [int(i) for i in x]


def _to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small host tensor to the device without a stream sync (pinned + non_blocking)."""
    if x.device == device:
        return x
    if device.type == "cuda" and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)
