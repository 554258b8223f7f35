"""``run_with_cache`` for every model kind (:func:`run_cached`): masks, eval mode, sites
other plugins replaced (:func:`site_module`, :func:`hooks_at_sites`), a bridged BERT's
hooks under TL 3.9's names, and every cached pattern hook verified; :func:`run_reduced`,
the same pass reducing each hook's activation as it fires instead of caching it."""

from __future__ import annotations

import contextlib
import re

import torch
from torch import Tensor

from .hooks import _PATTERN_HOOK, verify_pattern_hook
from .modes import eager, eval_mode, unwrap
from .surface import is_bridge, is_post_ln


def site_module(model, name: str):
    """The module that computes hook site ``name`` now, or None where the model has none.

    Usually the ``HookPoint`` of ``hook_dict``. Other plugins may put a module of their
    own there: SAELens's ``HookedSAETransformer.add_sae`` replaces the HookPoint with the
    SAE (TL 3.9: the name leaves ``hook_dict``, only ``name + ".hook_sae_output"`` and its
    siblings stay; TL 4's ``SAETransformerBridge`` registers the SAE under the name). Its
    output is what the rest of the model reads at that site.
    """
    mod = model.hook_dict.get(name)
    if mod is not None:
        return mod
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


@contextlib.contextmanager
def hooks_at_sites(model, fwd_hooks):
    """``model.hooks(fwd_hooks=...)`` for sites another plugin may have taken over.

    A site still computed by its ``HookPoint`` gets a TransformerLens hook; one whose
    module was replaced (:func:`site_module`: an SAE attached by SAELens) gets a torch
    forward hook on that module, called as ``fn(output, hook=None)`` with what the rest of
    the model reads there. Such hooks read, they cannot edit. Yields ``model``; every hook
    is removed on exit.
    """
    from transformer_lens.hook_points import HookPoint

    lens, handles = [], []

    def reader(fn):
        def hook(_module, _inputs, output):
            fn(output[0] if isinstance(output, tuple) else output, hook=None)
        return hook

    try:
        for name, fn in fwd_hooks:
            mod = site_module(model, name)
            if mod is None or isinstance(mod, HookPoint):
                lens.append((name, fn))
            else:
                handles.append(mod.register_forward_hook(reader(fn)))
        with model.hooks(fwd_hooks=lens):
            yield model
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _capture_outputs(modules: dict):
    """Record the forward output of each module (``{name: module}``) as ``{name: tensor}``."""
    out, handles = {}, []

    def recorder(name):
        def hook(_module, _inputs, output):
            value = output[0] if isinstance(output, tuple) else output
            out[name] = value.detach()
        return hook

    try:
        for name, module in modules.items():
            handles.append(module.register_forward_hook(recorder(name)))
        yield out
    finally:
        for h in handles:
            h.remove()


def run_cached(model, tokens: Tensor, mask: Tensor | None, names_filter, return_logits: bool = False):
    """``run_with_cache`` across model kinds: the one place that knows their differences.

    TL 3.9 ``HookedEncoder`` (BERT) takes ``one_zero_attention_mask`` and no
    ``return_type=None``; ``HookedTransformer`` and TL 4 bridges take ``attention_mask``
    (bridges derive positions from it, as TL 3.9 does).

    ``names_filter``: a callable on hook names, or a collection of site names; a name
    whose HookPoint another plugin replaced with its own module (an SAE,
    :func:`site_module`) is then read from that module's output.

    The forward pass runs in eval mode (:func:`eval_mode`; the caller's modes are
    restored) on the model's device (``tokens`` and ``mask`` are moved
    there); the cached activations (only those ``names_filter`` keeps) and the logits
    come back on CPU, where every metric is computed (docs/scale.md).

    Runs under ``torch.no_grad()``: activations are read here, never differentiated, and
    an autograd graph would keep every layer's intermediates alive (12 GB for SmolLM2-135M
    at 2048 tokens, instead of a few hundred MB).

    Returns:
        the cache, or ``(logits, cache)`` with ``return_logits``. For a TL 4 bridge over
        HF BERT the cache is a dict keyed by TL 3.9 ``HookedEncoder`` names, holding the
        quantities those names mean in TL 3.9 (``_tl39_encoder_hooks``).

    Raises:
        ValueError: a cached ``hook_pattern`` that :func:`verify_pattern_hook` cannot tie
            to the layer's attention on this model.
    """
    if isinstance(names_filter, str):  # one hook name, as TransformerLens accepts it
        names_filter = [names_filter]
    renamed = _tl39_encoder_hooks(model)
    if renamed is not None:  # a bridged BERT: ask for the hooks with TL 3.9's meanings
        return _run_renamed(model, tokens, mask, names_filter, return_logits, renamed)
    return _run_plain(model, tokens, mask, names_filter, return_logits)


def _forward_kwargs(model, tokens: Tensor, mask: Tensor | None, return_logits: bool) -> dict:
    """The forward pass's mask, position and return arguments for this model kind
    (``tokens`` and ``mask`` already on its device)."""
    bidirectional = getattr(model.cfg, "attention_dir", "causal") == "bidirectional"
    kwargs = {}
    if mask is not None:
        kwargs["one_zero_attention_mask" if bidirectional and not is_bridge(model)
               else "attention_mask"] = mask
        if bidirectional and is_bridge(model):
            # HF's BERT (and TL 3.9's HookedEncoder) count positions by index under any
            # padding; a bridge would derive them from the mask instead
            kwargs["position_ids"] = torch.arange(tokens.shape[1], device=tokens.device).expand(
                tokens.shape[0], -1)
    if not bidirectional and not return_logits:
        kwargs["return_type"] = None
    if is_bridge(model) and not bidirectional:
        # HF fills a KV cache in any forward pass it is not told otherwise, and TL 4's
        # bridges now use it (backend.guard_kv_cache): every layer's keys and values kept
        # for the whole pass, which an analysis pass never reads
        kwargs["use_cache"] = False
    return kwargs


def _run_plain(model, tokens: Tensor, mask: Tensor | None, names_filter, return_logits: bool):
    from ...devices import model_device

    model = unwrap(model)
    device = model_device(model)
    tokens = tokens.to(device)
    mask = None if mask is None else mask.to(device)
    kwargs = {"names_filter": names_filter, **_forward_kwargs(model, tokens, mask, return_logits)}
    replaced = {}
    if not callable(names_filter):  # a collection of site names
        from transformer_lens.hook_points import HookPoint

        names = set(names_filter)
        mods = {n: site_module(model, n) for n in names}
        replaced = {n: m for n, m in mods.items() if m is not None and not isinstance(m, HookPoint)}
        hooked = names - set(replaced)
        kwargs["names_filter"] = lambda n: n in hooked
    # eagerly (hooks do not fire inside a compiled graph), in eval mode
    # no autograd graph: the cache is read, never differentiated (memory at real scale)
    with torch.no_grad(), eager(model), eval_mode(model), _capture_outputs(replaced) as captured:
        out, cache = model.run_with_cache(tokens, **kwargs)
    if device.type != "cpu":
        cache = cache.to("cpu")
        out = out.cpu() if isinstance(out, Tensor) else out
    if replaced:
        cache = {**{n: cache[n] for n in cache.keys()}, **{n: v.cpu() for n, v in captured.items()}}
    for name in cache.keys():
        found = _PATTERN_HOOK.fullmatch(name)
        if found and name not in replaced:
            verify_pattern_hook(model, int(found.group(1)))
    return (out, cache) if return_logits else cache


def run_reduced(model, tokens: Tensor, mask: Tensor | None, reducers,
                query_block: int | None = None) -> list:
    """One forward pass that hands each named activation to its reducer as the pass makes
    it and keeps only what the reducer returns: peak memory is one layer's activations,
    not a cache of every layer's (docs/scale.md).

    ``reducers``: ``[(hook_name, fn)]`` (several may share a name), each either a function
    ``fn(activation)`` called under ``torch.no_grad()`` with the activation on the model's
    device, or a row reducer of a ``[batch, head, query, key]`` hook: an object with
    ``add(rows, row_start)`` and ``result()`` (e.g.
    :class:`~posinterp.analysis._attention_blocks.AttentionReduction`). Pattern hooks
    are verified first, as :func:`run_cached` verifies the ones it caches; sites another
    plugin replaced are read from their module (:func:`hooks_at_sites`); on a bridged
    BERT a TL 3.9 name is read where the bridge carries its quantity, as in
    :func:`run_cached`.

    ``query_block``: run the pass that many positions at a time through the model's KV
    cache (:func:`~.chunked.chunked_pass`), so no layer's ``[pos, pos]`` attention is ever
    made: row reducers get each block's rows; a function gets its hook's activation once
    the last block has run (the blocks joined along positions, ``[batch, pos, ...]``
    hooks only).

    Returns:
        each reducer's result, in ``reducers``' order.

    Raises:
        ValueError: a pattern hook :func:`verify_pattern_hook` cannot tie to its layer's
            attention, a hook that did not fire, or with ``query_block`` a function on an
            attention hook (its rows cannot be joined: give a row reducer).
        MissingFeatureError: ``query_block`` on a model whose pass in blocks
            (:func:`~.chunked.check_chunked_pass`) is refused.
    """
    from ...devices import model_device

    model = unwrap(model)
    # a bridged BERT: each TL 3.9 name is read at the bridge hook carrying its quantity
    renamed = _tl39_encoder_hooks(model) or {}
    reducers = [(renamed.get(name, name), fn) for name, fn in reducers]
    for name, _ in reducers:
        found = _PATTERN_HOOK.fullmatch(name)
        if found and isinstance(site_module(model, name), _hook_point()):
            verify_pattern_hook(model, int(found.group(1)))
    device = model_device(model)
    results: dict[int, object] = {}
    fired: set[int] = set()
    chunked = query_block is not None and tokens.shape[1] > query_block
    if chunked:
        for name, fn in reducers:
            if _ATTENTION_HOOK.search(name) and not hasattr(fn, "add"):
                raise ValueError(f"{name} fires in blocks of query rows with query_block: "
                                 "its reducer needs add(rows, row_start) and result()")
    parts: dict[int, list] = {}
    where = {"a": 0}
    last = (tokens.shape[1] - 1) // query_block * query_block if chunked else 0

    def call(i, fn):
        def hook(act, hook=None):
            fired.add(i)
            if hasattr(fn, "add"):
                fn.add(act.detach(), where["a"])
            elif chunked:  # joined once its last block ran: one layer's at a time
                parts.setdefault(i, []).append(act.detach())
                if where["a"] == last:
                    results[i] = fn(torch.cat(parts.pop(i), 1))
            else:
                results[i] = fn(act.detach())
        return hook

    tokens = tokens.to(device)
    hooks = [(n, call(i, fn)) for i, (n, fn) in enumerate(reducers)]
    if chunked:
        from .chunked import check_chunked_pass, chunked_pass

        check_chunked_pass(model)  # before the hooks go on: its probe must not reach them

        def at(a, _b):
            where["a"] = a

        with hooks_at_sites(model, hooks):
            chunked_pass(model, tokens, mask, query_block, on_block=at)
    else:
        kwargs = _forward_kwargs(model, tokens, None if mask is None else mask.to(device), False)
        with torch.no_grad(), eager(model), eval_mode(model), hooks_at_sites(model, hooks):
            model(tokens, **kwargs)
    missing = sorted({reducers[i][0] for i in range(len(reducers)) if i not in fired})
    if missing:
        raise ValueError(f"hooks {missing} did not fire during the forward pass")
    for i, (_, fn) in enumerate(reducers):
        if hasattr(fn, "add"):
            results[i] = fn.result()
    return [results[i] for i in range(len(reducers))]


_ATTENTION_HOOK = re.compile(r"hook_(pattern|attn_scores)$")


def _hook_point():
    from transformer_lens.hook_points import HookPoint

    return HookPoint


def _tl39_encoder_hooks(model) -> dict[str, str] | None:
    """For a TL 4 bridge over HF BERT: TL 3.9 ``HookedEncoder`` hook name -> the bridge hook
    carrying that quantity (None for other models). TL 4's BERT adapter fires
    ``hook_resid_post`` with the block's normalized output (TL 3.9: the sum before ``ln2``)
    and ``hook_attn_out`` after the attention's LayerNorm (TL 3.9: the output projection);
    tests/models/test_pretrained.py checks each entry against HF's hidden states."""
    if not (is_bridge(model) and is_post_ln(model)):
        return None
    out = {}
    for layer in range(model.cfg.n_layers):
        p = f"blocks.{layer}."
        out.update({p + "hook_attn_out": p + "attn.o.hook_out",
                    p + "hook_resid_mid": p + "ln1.hook_in",
                    p + "hook_mlp_out": p + "mlp.out.hook_out",
                    p + "hook_resid_post": p + "ln2.hook_in",
                    p + "hook_normalized_resid_post": p + "ln2.hook_out"})
    return out


def _run_renamed(model, tokens, mask, names_filter, return_logits, renamed: dict[str, str]):
    """:func:`run_cached` caching the bridge hooks ``renamed`` maps TL 3.9 names to, under
    the TL 3.9 names (a plain dict); a bridge hook whose name TL 3.9 uses for another
    quantity is never returned under that name."""
    if isinstance(names_filter, str):
        names_filter = {names_filter}
    wanted = names_filter if callable(names_filter) else (lambda n, s=set(names_filter): n in s)
    back = {v: k for k, v in renamed.items()}

    def bridge_filter(name: str) -> bool:
        if name in back:
            return bool(wanted(back[name]))
        return name not in renamed and bool(wanted(name))

    out, cache = _run_plain(model, tokens, mask, bridge_filter, True)
    cache = {back.get(k, k): v for k, v in cache.items()}
    return (out, cache) if return_logits else cache
