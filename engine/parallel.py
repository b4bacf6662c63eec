"""Tensor and expert parallelism of the engine over `torch.distributed` (NCCL on GPUs, gloo on CPU).

One model-parallel group of ``size = max(tp, ep)`` ranks serves one model;
each of ``tp`` and ``ep`` is 1 or that size (DeepSeek-style: attention and
dense MLPs split over the same ranks that hold the experts).

* **Attention** (tensor parallel): heads are split into ``tp`` contiguous
  slices. GQA: q_proj rows by query head, k_proj / v_proj rows by KV head
  (sharded when ``kv_heads % tp == 0``, else each KV head replicated on the
  ``tp / kv_heads`` ranks whose query heads read it); MLA: the per-head
  q_proj / q_b_proj / kv_b_proj rows, while the shared latent projections
  (q_a_proj, kv_a_proj_with_mqa, their norms) and the latent KV cache are
  replicated. o_proj is row-parallel (its input columns are the local heads).
* **Dense MLP** (and the MoE shared expert): gate/up column-parallel (rows of
  the intermediate dimension), down row-parallel.
* **Row-parallel GEMMs** (o_proj, down_proj): each rank's partial GEMM runs
  through the same `Numerics` dispatch point with the recipe's input format
  and accumulator model; the fp32 partial outputs are summed with one
  all-reduce; only then are the bias added and the ``linear.output``
  rounding applied, to the reduced sum. *This is where TP changes numerics
  against TP=1*: the K-reduction is split into per-rank partial sums added
  in a different order. A row-parallel GEMM's input is also quantized on
  the rank's K-slice (what a real TP deployment does): identical to TP=1
  for 1xC groups whose boundaries fall on the slice boundary (e.g. 1x128
  with 128-aligned slices), different for per-token / per-tensor scales or
  misaligned groups.
* **Routed experts** (expert parallel): experts are partitioned in ``ep``
  contiguous ranges. Every rank routes all tokens (router replicated, fp32
  by recipe) but dispatches only its 1/ep slice of them: token copies
  sorted by expert (`engine.routing.dispatch_plan`) travel with
  ``all_to_all_single`` to the expert owners as the FP8 codes + scales of
  the ``moe.input`` quantization made once before dispatch (bit views, no
  re-quantization on the receiving rank), come back the same way (in the
  ``linear.output`` storage type when that is a 16-bit float: lossless),
  are weighted and summed per token in the single-process order, and the
  token slices are all-gathered. With ``fp32`` GEMMs and row-local input
  formats this reproduces EP=1 bit for bit.
* Embeddings, norms, router and LM head stay replicated.

Weights are prepared (quantized) whole and then sharded, as a pre-quantized
checkpoint is sharded: weight numerics never change with the parallel degree.
Taps of sharded activations are all-gathered along the last dimension
before they reach the tap callback, so evals see the same shapes as TP=1.

The GPU path uses the same code with NCCL; the host-side permutations below
are fine for the emulation but a serving kernel would build them on device.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.distributed as dist

from engine.config import ModelConfig
from engine.errors import EngineError
from engine.formats import QTensor
from engine.formats.elements import decode_codes
from engine.formats.grouping import group_shape
from engine.routing import DispatchPlan, dispatch_plan
from engine.weights import module_path

if TYPE_CHECKING:  # pragma: no cover
    from engine.model import Transformer
    from engine.numerics import Numerics

__all__ = ["ExchangePlan", "ParallelConfig", "ParallelContext", "ParallelError", "check_parallel",
           "exchange_plan", "receive_order", "token_bounds"]


class ParallelError(EngineError):
    """A parallel degree the model or the process group cannot serve."""


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Tensor-parallel (`tp`) and expert-parallel (`ep`) degree of one engine.

    Both run on one group of ``size = max(tp, ep)`` ranks, so each must be 1
    or that size (tp=2, ep=2 shares two ranks; tp=2, ep=4 is rejected).
    """

    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for key in ("tp", "ep"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ParallelError(f"parallel config: '{key}' must be a positive integer, got {v!r}")
        if self.tp > 1 and self.ep > 1 and self.tp != self.ep:
            raise ParallelError(f"parallel config: tp={self.tp} and ep={self.ep} must be equal when both are > 1 "
                                "(one model-parallel group serves attention and experts); use tp=ep or set one to 1")

    @property
    def size(self) -> int:
        """Ranks of the model-parallel group."""
        return max(self.tp, self.ep)


def check_parallel(config: ParallelConfig, cfg: ModelConfig, where: str = "model") -> None:
    """Raise `ParallelError` when `cfg` cannot be split `config`'s way (naming the dimension and the fix)."""
    tp, ep = config.tp, config.ep
    if tp > 1:
        h, hkv = cfg.num_heads, cfg.num_kv_heads
        if h % tp:
            raise ParallelError(f"{where}: tp={tp} does not divide num_attention_heads={h}; pick tp from the divisors "
                                f"of {h}")
        if hkv % tp and tp % hkv:
            raise ParallelError(f"{where}: tp={tp} must divide num_key_value_heads={hkv} or be a multiple of it "
                                "(KV heads are sharded or replicated, never split)")
        if cfg.qk_norm == "full":
            raise ParallelError(f"{where}: q/k RMSNorm over the whole projection ({cfg.model_type}) needs every head "
                                "on one rank; tensor parallelism is not supported for it (use tp=1)")
        if any(not cfg.is_moe(i) for i in range(cfg.num_layers)) and cfg.intermediate_size % tp:
            raise ParallelError(f"{where}: tp={tp} does not divide intermediate_size={cfg.intermediate_size}")
        if cfg.moe is not None and cfg.moe.shared_intermediate_size % tp:
            raise ParallelError(f"{where}: tp={tp} does not divide the shared expert's intermediate size "
                                f"{cfg.moe.shared_intermediate_size}")
    if ep > 1 and cfg.moe is not None and cfg.moe.num_experts % ep:
        raise ParallelError(f"{where}: ep={ep} does not divide the {cfg.moe.num_experts} routed experts; pick ep from "
                            f"the divisors of {cfg.moe.num_experts}")


# Weight name -> how it is split (HF names, see engine.weights).
_HEAD_ROWS = re.compile(r"\.self_attn\.(q_proj|q_b_proj|kv_b_proj)\.(weight|bias)$")
_KV_ROWS = re.compile(r"\.self_attn\.(k_proj|v_proj)\.(weight|bias)$")
_MLP_ROWS = re.compile(r"\.mlp\.(shared_experts?\.)?(gate_proj|up_proj)\.(weight|bias)$")
_ROW_PARALLEL = re.compile(r"(\.self_attn\.o_proj|\.mlp\.(shared_experts?\.)?down_proj)\.weight$")
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")
# Tap suffixes whose last dimension is split over the tensor-parallel ranks (heads or intermediate columns).
_SHARDED_TAPS = ("attn.q", "attn.k", "attn.v", "attn.kv", "attn.out", "attn.q_norm", "attn.k_norm", "mlp.act")
_KV_TAPS = ("attn.k", "attn.v", "attn.k_norm")


def _wire(t: torch.Tensor) -> torch.Tensor:
    """Bit view of `t` (rows, ...) as bytes (rows, row_bytes): FP8 / E8M0 / int8 / 16-bit floats travel unchanged."""
    t = t.contiguous()
    return t.reshape(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)


def _unwire(b: torch.Tensor, dtype: torch.dtype, cols: int) -> torch.Tensor:
    """Inverse of `_wire`: bytes (rows, row_bytes) back to (rows, cols) of `dtype`."""
    return b.view(dtype).reshape(b.shape[0], cols)


def token_bounds(n: int, size: int) -> list[int]:
    """Token slice boundaries of an expert-parallel group: rank r dispatches tokens bounds[r]:bounds[r+1]."""
    return [n * i // size for i in range(size + 1)]


@dataclasses.dataclass(frozen=True)
class ExchangePlan:
    """One rank's send side of an expert-parallel dispatch (`exchange_plan`).

    lo:hi: the tokens this rank dispatches; plan: their (token, expert) copies sorted by expert (stable), so
    also by destination rank (experts are held in contiguous ranges); counts[j][e]: copies going to rank j's
    e-th expert; send[j]: rows going to rank j (the split sizes of the all-to-all).
    """

    lo: int
    hi: int
    plan: DispatchPlan
    counts: list[list[int]]
    send: list[int]


def exchange_plan(ids: torch.Tensor, rank: int, size: int, num_experts: int) -> ExchangePlan:
    """The send side of rank `rank`'s dispatch of the (tokens, k) expert choices `ids` (identical on every rank)
    over `size` ranks holding `num_experts / size` contiguous experts each."""
    bounds = token_bounds(ids.shape[0], size)
    lo, hi = bounds[rank], bounds[rank + 1]
    plan = dispatch_plan(ids[lo:hi], num_experts)  # my tokens' copies, sorted by expert
    per = num_experts // size
    counts = [plan.counts[j * per:(j + 1) * per] for j in range(size)]  # (dest rank, its expert)
    return ExchangePlan(lo, hi, plan, counts, [sum(c) for c in counts])


def receive_order(recv_counts: list[list[int]], rank: int, num_experts: int) -> tuple[list[int], list[int], list[int]]:
    """The receive side: recv_counts[src][e] rows of my e-th expert arrive from rank src, (source, expert)-major.
    Returns (rows from each source, the permutation to (expert, source)-major segments, the per-expert row
    counts over all `num_experts` (zero for experts held elsewhere))."""
    size, per = len(recv_counts), len(recv_counts[0])
    starts, s0 = [], 0
    for src in range(size):
        starts.append([])
        for e in range(per):
            starts[src].append(s0)
            s0 += recv_counts[src][e]
    perm = [j for e in range(per) for src in range(size)
            for j in range(starts[src][e], starts[src][e] + recv_counts[src][e])]
    local_counts = [0] * num_experts
    for e in range(per):
        local_counts[rank * per + e] = sum(recv_counts[src][e] for src in range(size))
    return [sum(row) for row in recv_counts], perm, local_counts


class ParallelContext:
    """One rank's share of a model-parallel group: weight sharding, partial-sum reduction, expert dispatch.

    Installed as ``Numerics.parallel`` by `engine.api.Engine`; the model calls
    it only through three hooks: `Transformer.prepare` (`holds` /
    `shard_weight`), `Numerics._gemm` (`reduce_partial`), `Numerics.moe`
    (`moe`), plus `Numerics.emit` (`gather_tap`).
    """

    def __init__(self, config: ParallelConfig, cfg: ModelConfig, group: dist.ProcessGroup | None = None,
                 device: torch.device | str = "cpu"):
        if not (dist.is_available() and dist.is_initialized()):
            raise ParallelError(f"tp={config.tp}, ep={config.ep} needs torch.distributed: launch with "
                                f"`torchrun --nproc-per-node {config.size} ...` (evalharness initialises the process "
                                "group itself) or call torch.distributed.init_process_group first")
        size = dist.get_world_size(group)
        if size != config.size:
            raise ParallelError(f"tp={config.tp}, ep={config.ep} needs a process group of {config.size} ranks; the "
                                f"group has {size} (launch `torchrun --nproc-per-node {config.size}` or pass a "
                                "sub-group)")
        device = torch.device(device)
        backend = dist.get_backend(group)
        if (backend == "nccl") != (device.type == "cuda"):
            raise ParallelError(f"process-group backend '{backend}' cannot serve {device.type} tensors: use nccl "
                                "with the cuda backends and gloo with cpu-emulated")
        check_parallel(config, cfg, f"model '{cfg.model_type}'")
        self.config, self.cfg, self.group, self.device = config, cfg, group, device
        self.rank = dist.get_rank(group)
        self.tp, self.ep = config.tp, config.ep
        self.num_experts = cfg.moe.num_experts if cfg.moe is not None else 0
        h, hkv = cfg.num_heads, cfg.num_kv_heads
        # KV heads held here: a contiguous slice, or one head replicated on tp/hkv ranks.
        self.kv_replication = self.tp // hkv if self.tp > hkv else 1
        self.local_kv_heads = 1 if self.kv_replication > 1 else hkv // self.tp
        self.local_cfg = dataclasses.replace(cfg, num_heads=h // self.tp, num_kv_heads=self.local_kv_heads)
        self.row_parallel: set[str] = set()
        self.wire_bytes = 0  # bytes this rank sent to other ranks in expert-parallel exchanges (`_exchange`)

    # ------------------------------------------------------------- weights
    def local_model(self, model: "Transformer") -> "Transformer":
        """A shallow copy of `model` whose config has this rank's head counts (master weights shared)."""
        local = copy.copy(model)
        local.cfg = self.local_cfg
        return local

    def owner(self, expert: int) -> int:
        """Rank (in the group) that holds routed expert `expert`."""
        return expert // (self.num_experts // self.ep)

    def holds(self, name: str) -> bool:
        """False for another rank's routed expert (it is then never prepared here)."""
        m = _EXPERT.search(name)
        return m is None or self.ep == 1 or self.owner(int(m.group(1))) == self.rank

    def shard_range(self, name: str, shape: Sequence[int]) -> tuple[int, int, int] | None:
        """The sharding plan of the weight `name` (HF name) of `shape`: (dim, start, length) of this rank's slice,
        or None for a tensor every rank holds whole (replicated; a routed expert is held whole or not at all).
        dim 0: output rows (q/k/v / q_b / kv_b heads, gate/up intermediate rows); dim 1: input columns of a
        row-parallel GEMM (o_proj, down_proj)."""
        if self.tp == 1 or _EXPERT.search(name):
            return None
        if _HEAD_ROWS.search(name) or _MLP_ROWS.search(name) or (_KV_ROWS.search(name) and self.kv_replication == 1):
            n = shape[0] // self.tp
            return 0, self.rank * n, n
        if _KV_ROWS.search(name):  # one KV head, replicated on the kv_replication ranks whose query heads read it
            hd = shape[0] // self.cfg.num_kv_heads
            return 0, (self.rank // self.kv_replication) * hd, hd
        if _ROW_PARALLEL.search(name):
            n = shape[1] // self.tp
            return 1, self.rank * n, n
        return None

    def shard_weight(self, name: str, w, cut: Callable | None = None):
        """This rank's part of the prepared weight `name` (HF name); replicated tensors pass through. `cut(w, dim,
        start, length)` slices a backend's prepared weight (`Numerics.slice_prepared`; default: a contiguous
        narrow of a tensor). Row-parallel modules are recorded for `reduce_partial`."""
        rng = self.shard_range(name, tuple(w.shape))
        if rng is None:
            return w
        dim, start, length = rng
        if dim == 1:
            self.row_parallel.add(module_path(name))
        return w.narrow(dim, start, length).contiguous() if cut is None else cut(w, dim, start, length)

    def is_row_parallel(self, module: str) -> bool:
        """Whether `module`'s GEMM is row-parallel here: its fp32 output is a partial sum to all-reduce before the
        bias and the output rounding (`reduce_partial`)."""
        return module in self.row_parallel

    # ------------------------------------------------------------- hooks
    def reduce_partial(self, y: torch.Tensor, module: str) -> torch.Tensor:
        """Sum a row-parallel GEMM's fp32 partial output (tokens, N) over the group; other GEMMs pass through."""
        if self.is_row_parallel(module):
            y = y.contiguous()
            dist.all_reduce(y, op=dist.ReduceOp.SUM, group=self.group)
        return y

    def gather_tap(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """All-gather a sharded tap (..., local) to the full last dimension (..., local*tp), head order kept."""
        if self.tp == 1 or not name.endswith(_SHARDED_TAPS):  # e.g. attn.q_a / attn.kv_a are replicated
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        if self.kv_replication > 1 and name.endswith(_KV_TAPS):
            parts = parts[::self.kv_replication]  # one copy of each replicated KV head
        return torch.cat(parts, dim=-1)

    def moe(self, nx: "Numerics", xq: QTensor, weights: torch.Tensor, ids: torch.Tensor,
            experts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None], module: str) -> torch.Tensor:
        """Expert-parallel routed experts: (tokens, d) out, replicated on every rank of the group.

        xq: the (tokens, d) `moe.input` QTensor of all tokens (identical on every
        rank); weights / ids: (tokens, k) routing, identical on every rank;
        experts[e] is None for experts held elsewhere. The backend runs its experts on the received rows
        (`Numerics.run_dispatched`: the rows' codes + scales as stored) and weights and sums each token's
        copies (`Numerics.combine_dispatched`); this method moves the rows.
        """
        g, r = self.ep, self.rank
        n, d = xq.shape[0], xq.shape[-1]
        dev = xq.data.device
        ex = exchange_plan(ids, r, g, self.num_experts)
        counts = torch.tensor(ex.counts, dtype=torch.int64, device=dev)  # (dest rank, its expert)
        recv_counts = torch.empty_like(counts)  # (source rank, my expert)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        recv, perm, local_counts = receive_order(recv_counts.tolist(), r, self.num_experts)

        # ---- dispatch: FP8 codes + per-row scales of the single moe.input quantization
        data, scales = self._wire_rows(xq, ex.lo + ex.plan.token)  # my sorted copies, by destination rank
        data_in = _unwire(self._exchange(_wire(data), recv, ex.send), data.dtype, data.shape[1])
        scales_in = (None if scales is None else
                     _unwire(self._exchange(_wire(scales), recv, ex.send), torch.float32, scales.shape[1]))
        # received blocks are (source, expert)-major; experts need (expert, source)-major segments
        perm_t = torch.tensor(perm, dtype=torch.int64, device=dev)
        data_in = data_in.view(torch.uint8).index_select(0, perm_t).view(data.dtype)
        scales_in = None if scales_in is None else scales_in.index_select(0, perm_t)
        out = nx.run_dispatched(xq, data_in, scales_in, local_counts, experts, module)  # (received, d) fp32
        back = torch.empty_like(out).index_copy_(0, perm_t, out)  # (source, expert)-major again

        # ---- combine: outputs return to the token's rank, weighted and summed in the single-process order
        dt = self._combine_dtype(nx, module)
        ret = _unwire(self._exchange(_wire(back.to(dt)), ex.send, recv), dt, d).float()  # (my copies, d)
        mine = nx.combine_dispatched(ret, weights[ex.lo:ex.hi], ids[ex.lo:ex.hi], ex.plan)  # (my tokens, d)
        bounds = token_bounds(n, g)
        width = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        padded = torch.zeros(width, d, device=dev)
        padded[: ex.hi - ex.lo] = mine
        parts = [torch.empty_like(padded) for _ in range(g)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([p[: b - a] for p, a, b in zip(parts, bounds[:-1], bounds[1:])])  # (tokens, d)

    # ------------------------------------------------------------- EP wire
    def _exchange(self, payload: torch.Tensor, recv: list[int], send: list[int]) -> torch.Tensor:
        """all_to_all_single of byte rows: `send[j]` rows to rank j, `recv[j]` rows from rank j (the bytes sent
        to other ranks are added to `wire_bytes`)."""
        out = payload.new_empty((sum(recv), payload.shape[1]))
        self.wire_bytes += (sum(send) - send[self.rank]) * payload.shape[1]
        dist.all_to_all_single(out, payload, output_split_sizes=recv, input_split_sizes=send, group=self.group)
        return out

    @staticmethod
    def _wire_rows(q: QTensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The dispatched copies of `q` as stored: element data (copies, d) and per-row scales (copies, groups).

        Scales are None for passthrough specs and for one per-tensor scale
        (every rank already holds it: the quantization ran on all tokens).
        2-D tiles (R > 1) send each row its tile row's scales.
        """
        d = q.shape[-1]
        data = q.data.reshape(-1, d).index_select(0, rows)
        if q.spec.is_passthrough or q.spec.granularity == "tensor":
            return data, None
        m = q.data.numel() // d
        grid = q.group_scale_grid()  # (ceil(m/R), ceil(d/C)); NVFP4: block x tensor scale
        r_rows = group_shape(q.spec, m, d)[0]
        if r_rows > 1:
            grid = grid.repeat_interleave(r_rows, dim=0)[:m]
        return data, grid.index_select(0, rows).float().contiguous()

    @staticmethod
    def _wire_values(q: QTensor, data: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        """Dequantized fp32 values (copies, d) of received rows: the same products as `QTensor.dequantize`."""
        d = q.shape[-1]
        if q.spec.is_passthrough:
            return data.to(torch.float32)
        elems = decode_codes(data, q.spec.elem).reshape(data.shape)
        if scales is None:  # per-tensor: the scale every rank computed
            return elems * q.group_scale_grid().reshape(1, 1).expand_as(elems)
        c = group_shape(q.spec, data.shape[0], d)[1]
        s = scales.expand(-1, d) if c >= d else scales.repeat_interleave(c, dim=1)[:, :d]
        return elems * s

    def _combine_dtype(self, nx: "Numerics", module: str) -> torch.dtype:
        """bf16/fp16 when every expert's down_proj output is stored in it (lossless on the wire), else fp32."""
        specs = {nx.recipe.spec("linear.output", f"{module}.experts.{e}.down_proj") for e in range(self.num_experts)}
        if len(specs) == 1 and (s := specs.pop()) in ("bf16", "fp16"):
            return torch.bfloat16 if s == "bf16" else torch.float16
        return torch.float32
