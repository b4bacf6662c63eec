"""Layer-major passes over window batches: the FP32 reference and the engine advanced stage by stage together.

A layer-streamed model (`engine.streaming.StreamedEngine`, `evalharness.streamed_reference.StreamedReference`)
is run over all batches of an eval at once: for each stage (embedding, each decoder layer, head) its weights are
read once (one fp32 read shared by the two models on one device), every batch goes through the reference's stage
and then the engine's, and the stage's weights are dropped. Per batch the callbacks see what the resident path
shows them, in the same order per tap: tap callbacks per stage, logits at the head.

`map_logits` is the evals' one entry point for "logits of every batch" (ppl_kld, longctx's KLD by position, the
lm-eval adapter's log-likelihoods): resident models are called batch by batch, streamed ones get layer-major
passes (one, or several of at most the plan's `pass_tokens` tokens each).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from engine.streaming import stages


def is_streamed(model: Any) -> bool:
    """Whether a model (engine or reference) runs layer-streamed."""
    return bool(getattr(model, "streamed", False))


def _moved(state, device, reference: bool):
    """A between-stages state on `device` (the reference's (hidden, shape), the engine's `LayerState`)."""
    if state is None or isinstance(state, torch.Tensor):
        return state
    if reference:
        return (state[0].to(device), state[1])
    from engine.streaming import _to

    return _to(state, device)


def co_stream(inputs: Sequence[torch.Tensor], reference=None, engine=None,
              ref_tap: Callable[[int], Optional[Callable]] = lambda b: None,
              eng_tap: Callable[[int], Optional[Callable]] = lambda b: None,
              observer=None, local=None,
              ref_consume: Optional[Callable[[int, torch.Tensor], Any]] = None,
              eng_consume: Optional[Callable[[int, torch.Tensor], Any]] = None,
              layer_fed: Optional[Callable[[int, int, torch.Tensor, torch.Tensor], None]] = None,
              offload: bool | None = None, counters: dict | None = None) -> tuple[list, list]:
    """One layer-major pass of `inputs` (a (batch, t) token tensor per batch) through `reference` and / or `engine`.

    Per stage and batch, the reference's stage runs first (taps to `ref_tap(b)`), then the engine's (taps to
    `eng_tap(b)`, quantizations to `observer`, op-local sums to `local`). At the head, `ref_consume(b, logits)` /
    `eng_consume(b, logits)` give what is returned per batch (default: the logits). `layer_fed(i, b, y, ref_out)`:
    layer i of the engine fed the reference's input of that layer (`engine.streaming.layer_fed`) next to the
    reference's output. `offload` keeps the activations on the host between stages (default: the models'
    `offload` attribute, set from the memory plan). `counters` get
    `streamed_bytes_read` and `streamed_stages`. Returns (reference results, engine results) per batch.
    """
    models = [m for m in (reference, engine) if m is not None]
    if not models or not all(is_streamed(m) for m in models):
        raise ValueError("co_stream needs streamed models (StreamedReference / StreamedEngine)")
    store = models[0].store
    if offload is None:
        offload = any(getattr(m, "offload", False) for m in models)
    cfg = store.cfg
    n = len(inputs)
    ref_states: list = list(inputs) if reference is not None else [None] * n
    eng_states: list = list(inputs) if engine is not None else [None] * n
    ref_out: list = [None] * n
    eng_out: list = [None] * n
    before = store.bytes_read
    shared = reference is not None and engine is not None and reference.device == engine.device
    for stage in stages(cfg):
        master = store.load(stage, models[0].device)
        w = None
        if reference is not None:
            reference.bind(stage, master)
        if engine is not None:
            w = engine.prepare(master if shared or reference is None else store.load(stage, engine.device), stage)
        del master
        for b in range(n):
            ref_in = None
            if reference is not None:
                state = _moved(ref_states[b], reference.device, True)
                ref_in = state
                res = reference.run(stage, state, ref_tap(b))
                if stage == "head":
                    ref_out[b] = ref_consume(b, res) if ref_consume is not None else res
                    res = None
                ref_states[b] = _moved(res, "cpu", True) if offload else res
            if engine is not None:
                state = _moved(eng_states[b], engine.device, False)
                res = engine.run(stage, w, state, eng_tap(b), observer, local)
                if layer_fed is not None and isinstance(stage, int) and reference is not None:
                    y = engine.local_step(w, stage, ref_in[0].to(engine.device), state)
                    layer_fed(stage, b, y, ref_states[b][0])
                if stage == "head":
                    eng_out[b] = eng_consume(b, res) if eng_consume is not None else res
                    res = None
                eng_states[b] = _moved(res, "cpu", False) if offload else res
        if reference is not None:
            reference.release(stage)
        del w
    if counters is not None:
        counters["streamed_bytes_read"] = counters.get("streamed_bytes_read", 0) + store.bytes_read - before
        counters["streamed_stages"] = counters.get("streamed_stages", 0) + len(stages(cfg))
    return ref_out, eng_out


def map_logits(model, batches: Iterable[tuple], consume: Callable[[torch.Tensor, tuple], Any],
               counters: dict | None = None, offload: bool | None = None, pass_tokens: int | None = None) -> list:
    """`consume(logits, batch)` for every `(start, inputs, targets)` batch: batch by batch for a resident model (the
    iterable is read lazily), layer-major passes for a streamed one (same bits per batch).

    A streamed model's batches go through one pass, or several consecutive passes of at most `pass_tokens` input
    tokens each (default: the model's `pass_tokens`, set from the memory plan; None = one pass): the activations of
    a pass's batches wait between stages, and each pass reads the checkpoint once."""
    if not is_streamed(model):
        return [consume(model.logits(batch[1]), batch) for batch in batches]
    batches = list(batches)
    limit = pass_tokens if pass_tokens is not None else getattr(model, "pass_tokens", None)
    out: list = []
    for group in _passes(batches, limit):
        inputs = [batch[1] for batch in group]
        if hasattr(model, "bind"):  # a StreamedReference
            out += co_stream(inputs, reference=model, ref_consume=lambda b, lg, g=group: consume(lg, g[b]),
                             counters=counters, offload=offload)[0]
        else:
            out += co_stream(inputs, engine=model, eng_consume=lambda b, lg, g=group: consume(lg, g[b]),
                             counters=counters, offload=offload)[1]
    return out


def _passes(batches: list, limit: int | None) -> list[list]:
    """Consecutive groups of `batches` of at most `limit` input tokens each (a batch larger than that alone)."""
    if not limit:
        return [batches] if batches else []
    groups: list[list] = []
    used = limit
    for batch in batches:
        n = int(batch[1].numel())
        if used + n > limit:
            groups.append([])
            used = 0
        groups[-1].append(batch)
        used += n
    return groups


def open_streamed(source, device: str, ref_device: str, plan=None):
    """A model opened for layer-streamed evaluation, reading only headers: (a `LoadedModel` without weights, for
    its config, source, folder and checkpoint hash; the `LayerStore`; the `StreamedReference` on `ref_device`).
    `plan` (`evalharness.memory_plan.MemoryPlan`): whether activations wait on the host between stages, how many
    tokens one pass of `map_logits` keeps between stages, and the resident size that the generation error names."""
    from engine.loading import LoadedModel, checkpoint_sha256
    from engine.streaming import LayerStore
    from evalharness.streamed_reference import StreamedReference

    store = LayerStore.open(source)
    loaded = LoadedModel(store.cfg, store.hf_config, {}, str(source), store.directory, checkpoint_sha256(source))
    reference = StreamedReference(store, device=ref_device)
    store.offload = reference.offload = bool(plan is not None and plan.offload)
    store.pass_tokens = reference.pass_tokens = plan.pass_tokens if plan is not None else None
    store.resident_bytes = plan.resident_bytes if plan is not None else None
    return loaded, store, reference


def streamed_engine(store, spec, options: dict):
    """The RunSpec's engine over a `LayerStore` (`engine.streaming.StreamedEngine`)."""
    from engine.streaming import StreamedEngine

    eng = StreamedEngine(store, spec.recipe, backend=spec.backend, resident_bytes=getattr(store, "resident_bytes", None),
                         **options)
    eng.offload = getattr(store, "offload", False)
    eng.pass_tokens = getattr(store, "pass_tokens", None)
    return eng
