"""The serving runtime: many requests over a paged KV cache, chunked prefill, batched decode, CUDA graphs.

`PagedRuntime` wraps an `Engine` (any backend; under tensor / expert parallelism every rank runs the same
runtime on the same requests, its pages holding this rank's KV heads, its steps eager). Each
request gets a sequence slot in a `PagedKVCache` (pages of `kv_block_size`
tokens, K/V stored in the recipe's cache formats: FP8 with per-head K scales
and 1x128 V scales, bf16 or fp32; any other KV format is stored as the
emulation's dequantized values in fp32 so numerics never change). Prompts
are prefilled one request at a time in chunks of `prefill_chunk` tokens, then
all live requests decode together, one token per step, each at its own
position. On `cuda-native` the attention reads the pages directly (Triton
paged decode kernel); the emulated backends gather each sequence's pages and
run the emulated attention (so the runtime is tested on the CPU in CI, and
its only numerical difference from `Engine.generate` is batch composition). MLA models keep their RoPE'd
key and latent in the pages (one K head, the latent as V) and rebuild the batch's keys and values from them
per step (every row at once, padded to the longest), as `Engine.generate` does on its contiguous latent
cache. With `cuda_graphs`, the decode step of each batch size is captured once and replayed (static token,
slot and position buffers; no host sync inside a step; GQA/MQA on a backend whose paged attention reads
nothing on the host).

The serving configuration is frozen data (`ServingConfig`), so a suite can
sweep it and the invariance eval can compare two configurations.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from engine.generation import Generation, GenerationRequest, Recorder, cap_requests, finished
from engine.kernels import sm_count
from engine.serving import ServingConfig

if TYPE_CHECKING:
    from engine.api import Engine
    from engine.formats import QTensor

_PAGED_K = ("e4m3:head", "e4m3:token")
_PAGED_V = ("e4m3:1x128", "e4m3:token")
_FLOAT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class _PagedView:
    """What `Transformer.forward` sees as its cache inside the runtime: slots, positions, paged attention."""

    def __init__(self, rt: "PagedRuntime", seq_ids: torch.Tensor, start: torch.Tensor):
        self.rt, self.seq_ids, self.start = rt, seq_ids, start  # (batch,) int64 on the device
        self.length = 0  # the model's contiguous-cache counter; positions come from `start`
        self._rows: dict[int, tuple] = {}  # t -> the kernels' int32 row tensors, built once per forward
        self._host: tuple[list[int], list[int]] | None = None

    def positions(self, t: int) -> torch.Tensor:
        """(batch, t) absolute positions of this call's tokens."""
        return self.start[:, None] + torch.arange(t, device=self.start.device)

    def host_rows(self) -> tuple[list[int], list[int]]:
        """(sequence ids, start positions) of the rows as host ints, read once per forward (one sync) for every
        layer's gathered-page attention."""
        if self._host is None:
            self._host = (self.seq_ids.tolist(), self.start.tolist())
        return self._host

    def kernel_rows(self, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(seq_ids, seq_lens = start + t, q positions (batch, t)) as int32, shared by every layer's attention
        call of this forward (each layer used to rebuild them: 5 small launches per layer)."""
        if t not in self._rows:
            q_pos = self.positions(t)
            self._rows[t] = (self.seq_ids.to(torch.int32).contiguous(), (self.start + t).to(torch.int32).contiguous(),
                             q_pos.to(torch.int32).contiguous())
        return self._rows[t]

    def attend(self, nx, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, module: str,
               window: Optional[int]) -> tuple[torch.Tensor, Optional[QTensor]]:
        """Store this call's K/V (batch, kv_heads, t, d) in the pages, then attend: ((batch, t, heads*dv) fp32,
        the kernel's own quantization of it for o_proj or None) -- the backend's `paged_attention`."""
        return nx.paged_attention(self, layer, q, k, v, module, window)


class PagedRuntime:
    """Serve many greedy requests with an `Engine` over a paged KV cache (module docstring)."""

    def __init__(self, engine: Engine, config: ServingConfig = ServingConfig(), num_blocks: Optional[int] = None):
        cfg = engine.model.cfg  # this rank's heads under tensor parallelism: the pages hold its KV heads only
        parallel = getattr(engine, "parallel", None)
        self.engine, self.config, self.device = engine, config, engine.device
        if config.cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs needs the cuda-emulated or cuda-native backend")
        from engine.kernels.paged_cache import PagedKVCache

        ks, vs = engine.recipe.spec("kv.k"), engine.recipe.spec("kv.v")
        if ks in _PAGED_K and vs in _PAGED_V:
            dtype, kw = torch.float8_e4m3fn, {"k_spec": ks, "v_spec": vs}
        elif ks == vs and ks in _FLOAT:
            dtype, kw = _FLOAT[ks], {}
        else:
            dtype, kw = torch.float32, {}
        self.store_emulated = dtype == torch.float32 and not (ks == vs == "fp32")
        # MLA pages hold the RoPE'd key as one K head and the latent as V (`Numerics.paged_latent`); no kernel reads them
        mla = cfg.mla
        # whether the backend's kernels attend on these pages in place (`Numerics.pages_native`)
        self.native_attention = mla is None and engine.nx.pages_native(dtype)
        # The emulation's gathered-page attention (and MLA's) reads each sequence's length on the host, which a CUDA
        # graph cannot hold: only a backend whose paged attention reads nothing on the host (`Numerics.paged_graphs`)
        # captures its decode steps (`graphs`); the others run eager, counted in the engine's work as decode steps
        # without `decode_graph_steps`.
        # Under tensor / expert parallelism every decode step runs collectives: those steps run eager.
        self.graphs = (config.cuda_graphs and mla is None and engine.nx.paged_graphs(dtype)
                       and (parallel is None or parallel.size == 1))
        per_seq = -(-config.max_tokens // config.kv_block_size)
        mb = config.max_batch
        # slots [0, max_batch) serve requests; with CUDA graphs, slots [max_batch, 2*max_batch) are scratch
        # sequences (one page each) that the warm-up and capture write into, never a live request's pages
        scratch = mb if self.graphs else 0
        heads, dims = ((1, (mla.qk_rope_head_dim, mla.kv_lora_rank)) if mla is not None else
                       (cfg.num_kv_heads, (cfg.head_dim, cfg.head_dim)))
        self.kv = PagedKVCache(cfg.num_layers, (num_blocks or per_seq * mb) + scratch, config.kv_block_size,
                               heads, *dims, dtype=dtype, max_seqs=mb + scratch,
                               max_blocks_per_seq=per_seq, device=self.device, **kw)
        for slot in range(mb, mb + scratch):
            self.kv.allocate(slot, 1)
        self.attn_block = getattr(engine.nx, "attn_block", 64)
        if self.native_attention:  # the kernels read bf16 queries: RoPE writes them in its own launch
            for nx in (engine.nx, getattr(engine, "hp_nx", None)):
                if nx is not None:
                    nx.use_query_carrier()
        # None: `splits_for` picks the paged decode kernel's split count per batch size (set it to fix one count)
        self.num_splits: int | None = None
        self._capacity = per_seq * config.kv_block_size
        self._graphs: dict[int, tuple] = {}
        self._prefixes: dict[tuple[int, ...], set[int]] = {}  # whole-page token prefix -> slots holding it
        self.last_prefix_hit = 0  # tokens reused by the last prefill (prefix cache)

    def splits_for(self, batch: int) -> int | None:
        """Split count of the paged decode attention for a call on `batch` sequences: `num_splits` when set; on
        CUDA the kernel's default policy (`decode_plan`) on the cache's capacity instead of each call's
        context, at most 64: a count fixed per batch size, eager and CUDA-graph steps alike (every replay of a
        batch's graph has the same grid, and gives the eager step's bits). None off CUDA (the emulated attention
        has no splits)."""
        if self.num_splits is not None or self.device.type != "cuda":
            return self.num_splits
        from engine.kernels.paged_kv import decode_plan

        return decode_plan(self.kv, sm_count(self.device), batch, self._capacity, self.attn_block, cap=64)[2]

    # ----------------------------------------------------------------- steps
    def _forward(self, tokens: torch.Tensor, seq_ids: torch.Tensor, start: torch.Tensor,
                 high_precision: bool = False) -> torch.Tensor:
        """Logits (batch, t, vocab) of `tokens` appended to the given sequences at positions `start`."""
        nx, w = self.engine._path(high_precision)
        return self.engine.model.forward(nx, w, tokens, _PagedView(self, seq_ids, start))

    def _decode(self, tokens: torch.Tensor, seq_ids: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """One decode step (batch, 1) -> last logits (batch, vocab); replays a CUDA graph when enabled. Counted in
        the engine's `work`."""
        self.engine.work["decode_steps"] += 1
        self.engine.work["decode_rows"] += tokens.shape[0]
        if not self.graphs:
            return self._forward(tokens, seq_ids, start)[:, -1]
        self.engine.work["decode_graph_steps"] += 1
        b = tokens.shape[0]
        if b not in self._graphs:
            self._graphs[b] = self._capture(b)
        graph, tok_buf, ids_buf, start_buf, out_buf = self._graphs[b]
        tok_buf.copy_(tokens)
        ids_buf.copy_(seq_ids)
        start_buf.copy_(start)
        graph.replay()
        return out_buf

    def _capture(self, b: int) -> tuple:
        """Capture the decode step for batch `b` on static buffers (after a warm-up on a side stream)."""
        tok = torch.zeros((b, 1), dtype=torch.long, device=self.device)
        mb = self.config.max_batch
        ids = torch.arange(mb, mb + b, dtype=torch.long, device=self.device)  # scratch slots (see __init__)
        start = torch.zeros(b, dtype=torch.long, device=self.device)
        lens_before = self.kv.seq_lens.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: Triton compilation and allocator pools outside the capture
            for _ in range(2):
                self._forward(tok, ids, start)[:, -1]
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._forward(tok, ids, start)[:, -1]
        self.kv.seq_lens.copy_(lens_before)  # the warm-up / capture writes were scratch
        return graph, tok, ids, start, out

    # -------------------------------------------------------------- requests
    def _lookup_prefix(self, slot: int, prompt: Sequence[int]) -> tuple[int, int]:
        """(source slot, tokens) of the longest whole-page prefix of `prompt` another slot holds; (-1, 0) if none.
        At least one prompt token is always left to prefill (its logits start the generation)."""
        bs = self.config.kv_block_size
        for n in range((len(prompt) - 1) // bs * bs, 0, -bs):
            holders = self._prefixes.get(tuple(prompt[:n]), set()) - {slot}
            if holders:
                return min(holders), n
        return -1, 0

    @torch.no_grad()
    def prefill(self, slot: int, prompt: Sequence[int], high_precision: bool = False) -> torch.Tensor:
        """Write `prompt` into sequence `slot` (chunked); returns the logits of the prompt tokens it computed
        (t - last_prefix_hit, vocab): all of them, or with a prefix-cache hit only those after the reused pages."""
        for holders in self._prefixes.values():  # this slot's pages are recycled
            holders.discard(slot)
        self.kv.free(slot)
        self.kv.allocate(slot, self.config.max_tokens)
        prompt = list(prompt)
        src, hit = self._lookup_prefix(slot, prompt) if self.config.prefix_cache else (-1, 0)
        if hit:
            self.kv.copy_prefix(src, slot, hit)
        self.last_prefix_hit = hit
        self.engine.work["prefill_tokens"] += len(prompt) - hit
        toks = torch.tensor([prompt], dtype=torch.long, device=self.device)
        chunk = self.config.prefill_chunk or toks.shape[1]
        ids = torch.tensor([slot], dtype=torch.long, device=self.device)
        parts = []
        for s in range(hit, toks.shape[1], chunk):
            start = torch.tensor([s], dtype=torch.long, device=self.device)
            parts.append(self._forward(toks[:, s:s + chunk], ids, start, high_precision)[0])
        if self.config.prefix_cache:
            bs = self.config.kv_block_size
            for n in range(bs, len(prompt) + 1, bs):
                self._prefixes.setdefault(tuple(prompt[:n]), set()).add(slot)
        return torch.cat(parts)

    @torch.no_grad()
    def score(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (batch, t, vocab) of full sequences through the paged cache (prefill path), slot per row."""
        if tokens.shape[0] > self.config.max_batch or tokens.shape[1] > self.config.max_tokens:
            raise ValueError(f"score: {tuple(tokens.shape)} exceeds max_batch {self.config.max_batch} x "
                             f"max_tokens {self.config.max_tokens}")
        if self.config.prefix_cache:
            raise ValueError("score: whole-sequence logits need every position computed; use prefill with "
                             "prefix_cache (it returns the positions after the reused pages)")
        return torch.stack([self.prefill(i, row.tolist()) for i, row in enumerate(tokens)])

    @torch.no_grad()
    def serve(self, requests: Sequence[GenerationRequest], step_stats: bool = False,
              keep_logits: bool = False, on_done: Optional[Callable[[int], None]] = None) -> list[Generation]:
        """Greedy generations of all `requests` with continuous batching: up to `max_batch` requests decode
        together, one token per step each at its own position; a finished request (its budget used, or a stop
        id produced) leaves the batch and its slot takes the next waiting request (prefilled, then decoding with
        the others). Results in request order; per-step statistics as `engine.generation.Recorder` keeps them.

        Nothing leaves the device per step: stop ids are matched on the device and read back every
        `stop_check_every` steps (`ServingConfig`), a request past its stop id decoding on until then (its extra
        tokens cut off). With CUDA graphs, each batch size's decode step is captured once and replayed.
        `on_done(n)` is told each time n more requests finished (a progress bar).
        """
        requests = cap_requests(requests, self.engine.cfg.max_position)
        for i, r in enumerate(requests):
            if len(r.prompt) + r.max_new_tokens > self.config.max_tokens:
                raise ValueError(f"request {i}: a prompt of {len(r.prompt)} tokens + {r.max_new_tokens} new exceeds "
                                 f"max_tokens {self.config.max_tokens}")
        dev = self.device
        rec = Recorder(len(requests), max((r.max_new_tokens for r in requests), default=1), dev, step_stats,
                       keep_logits)
        lengths = [0] * len(requests)
        waiting = deque(range(len(requests)))
        free = list(range(self.config.max_batch - 1, -1, -1))  # pop() hands out low slots first
        live: list[tuple[int, int]] = []  # (request, slot) decoding together, in admission order
        tokens = torch.zeros(0, dtype=torch.long, device=dev)  # the live requests' latest tokens (b,)
        while waiting or live:
            admitted, firsts = [], []
            while waiting and free:  # prefill newcomers into free slots; their first token comes from the prompt
                i, slot = waiting.popleft(), free.pop()
                logits = self.prefill(slot, requests[i].prompt)[-1:]  # (1, vocab)
                one = torch.tensor([i], dtype=torch.long, device=dev)
                firsts.append(rec.record(one, torch.zeros_like(one), logits, [i]))
                lengths[i] = 1
                admitted.append((i, slot))
            if admitted:  # a request can end on its first token (a stop id, or a budget of one)
                new = torch.cat(firsts)
                keep = self._unfinished(requests, admitted, new, lengths)
                if on_done is not None and len(keep) < len(admitted):
                    on_done(len(admitted) - len(keep))
                free.extend(slot for j, (_, slot) in enumerate(admitted) if j not in keep)
                live += [admitted[j] for j in keep]
                tokens = torch.cat([tokens, new[keep]])
            if not live:
                continue
            ids = torch.tensor([slot for _, slot in live], dtype=torch.long, device=dev)
            rows = torch.tensor([i for i, _ in live], dtype=torch.long, device=dev)
            start = torch.tensor([len(requests[i].prompt) + lengths[i] - 1 for i, _ in live], dtype=torch.long,
                                 device=dev)
            pos = torch.tensor([lengths[i] for i, _ in live], dtype=torch.long, device=dev)
            host_rows = [i for i, _ in live]
            stops = self._stop_table(requests, host_rows)  # (b, S) or None: no live request has stop ids
            stop_at = torch.full_like(pos, -1)  # output position of each row's first stop id (-1: none yet)
            steps = 0
            while True:  # decode steps of this batch composition
                logits = self._decode(tokens[:, None], ids, start)  # (b, vocab)
                tokens = rec.record(rows, pos, logits, host_rows)
                if stops is not None:
                    stop_at = torch.where(((tokens[:, None] == stops).any(1)) & (stop_at < 0), pos, stop_at)
                start, pos, steps = start + 1, pos + 1, steps + 1
                for i in host_rows:
                    lengths[i] += 1
                budget = [lengths[i] >= requests[i].max_new_tokens for i in host_rows]
                # stop ids are read back every stop_check_every steps (and when the batch changes anyway): a row
                # past its stop id decodes on until then, its extra tokens cut off by its length
                check = stops is not None and (any(budget) or steps % self.config.stop_check_every == 0)
                at = stop_at.tolist() if check else [-1] * len(live)
                keep = []
                for j, i in enumerate(host_rows):
                    if at[j] >= 0:
                        lengths[i] = at[j] + 1
                    elif not budget[j]:
                        keep.append(j)
                if len(keep) < len(live):  # the batch changes: rebuild its tensors (and admit waiting requests)
                    if on_done is not None:
                        on_done(len(live) - len(keep))
                    free.extend(slot for j, (_, slot) in enumerate(live) if j not in keep)
                    live = [live[j] for j in keep]
                    tokens = tokens[keep]
                    break
        return rec.results(lengths)

    def _stop_table(self, requests: Sequence[GenerationRequest], rows: list[int]) -> Optional[torch.Tensor]:
        """The stop ids of requests `rows` as a (b, S) device tensor padded with -1 (no token); None if none has any."""
        width = max(len(requests[i].stop_ids) for i in rows)
        if not width:
            return None
        return torch.tensor([list(requests[i].stop_ids) + [-1] * (width - len(requests[i].stop_ids)) for i in rows],
                            dtype=torch.long, device=self.device)

    @staticmethod
    def _unfinished(requests: Sequence[GenerationRequest], batch: list[tuple[int, int]], tokens: torch.Tensor,
                    lengths: list[int]) -> list[int]:
        """Positions in `batch` of the requests not finished after their latest token `tokens` (b,), which is read
        back to the host only when one of them has stop ids."""
        host = tokens.tolist() if any(requests[i].stop_ids for i, _ in batch) else [None] * len(batch)
        return [j for j, (i, _) in enumerate(batch) if not finished(requests[i], lengths[i], host[j])]

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: tuple[int, ...] = (),
                 return_logits: bool = False):
        """Greedy continuations of all `prompts` (`serve` with one budget and stop set for all).

        Returns the new tokens per prompt (and, with `return_logits`, each prompt's (new, vocab) step logits).
        """
        gens = self.serve([GenerationRequest(tuple(p), max_new_tokens, tuple(stop_ids)) for p in prompts],
                          keep_logits=return_logits)
        outs = [g.tokens for g in gens]
        return (outs, [g.logits for g in gens]) if return_logits else outs
