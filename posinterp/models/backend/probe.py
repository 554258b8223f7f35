"""What each attention hook really carries, verified on the loaded model.

TL 4 changed what several hooks carry without renaming them (OPT/GPT-Neo bridges fire
``hook_attn_scores`` with the pattern, after the fact; native models never fire
``hook_rot_q``), so no feature trusts a hook by its name: :func:`hook_meaning` probes each
hook's meaning once per model and caches the verdict on the model object (docs/tl4.md,
"Hook meanings").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..rope_layout import rotate_pairs
from .mla import mla_settings
from .modes import _in_float32, eager, eval_mode, unwrap
from .output_edit import _module, arm_output_edit, install_output_edit, pattern_edit
from .rotary import rope_rotate, rotary_spec
from .surface import _soft_cap_setting, attention_weights, attn_scale, attn_soft_cap, positional_type

_VERDICTS = "posinterp_hook_meaning"  # attribute on the model: {layer: HookMeaning}


@dataclass(frozen=True)
class HookMeaning:
    """What one layer's attention hooks were verified to carry (:func:`hook_meaning`).

    ``scores``: the hook carrying pre-softmax scores (masked, bias added) whose edits
    change the output, else None. ``pattern``: where there is no such hook, the hook
    carrying the pattern the module goes on to use, whose edits change the output (TL 4
    native models), else None. ``output_edit``: the wrapped attention module returns
    ``(output, pattern)`` and posinterp can replace both (the route for score edits where
    no pre-softmax hook exists). ``content_qk``: hooks whose ``q_i · k_j / attn_scale``
    is the content term of the scores (rotated q/k for RoPE; see
    :func:`content_qk_from`), else None. ``query_qk``:
    ``hook_q``/``hook_k`` verified as the query/key before any rotation, whose edits take
    effect, else None. ``z``: ``hook_z``, verified as each head's pattern-weighted values
    (``[batch, pos, head, d_head]``, z_h = p_h v_h) whose edits take effect, else None.
    ``found``: what the probe saw, for error messages. ``soft_cap``: the attention
    soft-cap T the model applies to the content term (score = T tanh(q·k / (attn_scale T))
    + position terms; :func:`attn_soft_cap`), else None: ``content_qk``/``query_qk`` were
    then verified as the q/k of the **pre-cap** content term, which every reader of them
    must pass through the cap (or refuse, :func:`check_no_soft_cap`).
    """

    scores: str | None
    pattern: str | None
    output_edit: bool
    content_qk: tuple[str, ...] | None
    query_qk: tuple[str, str] | None
    z: str | None
    found: str
    soft_cap: float | None = None


def _allowed(model, n: int) -> Tensor:
    causal = getattr(model.cfg, "attention_dir", "causal") == "causal"
    full = torch.ones(n, n, dtype=torch.bool)
    return full.tril() if causal else full


def _explains(pattern: Tensor, content: Tensor, allowed: Tensor, rtol: float = 1e-3) -> bool:
    """True if ``log pattern - content`` depends on positions only (on two probe
    sequences of different tokens): then content is the score's q·k term and everything
    else the model adds (mask, ALiBi, biases folded into positions) is token-independent.

    log p_ij = c_ij + b_ij - LSE_i, so centring each row at a shared key removes LSE_i.
    ``rtol``: relative to the largest |content|; a half-precision model's RoPE tables keep
    their half-precision rounding (about 4e-3) in the float32 probe, hence a looser one.
    """
    p = pattern.double()
    ok = allowed & (p > 1e-30).all(0)  # [head, query, key], both sequences
    if not ok.any():
        return False
    r = p.clamp_min(1e-300).log() - content.double()
    # centre each row at its best-resolved key (largest smaller probability of the two)
    ref = torch.where(ok, p.amin(0), -1.0).argmax(-1, keepdim=True)  # [head, query, 1]
    r = r - r.gather(-1, ref[None].expand(r.shape[0], -1, -1, -1))
    diff = (r[0] - r[1]).abs()[ok]
    tol = rtol * (1.0 + float(content.double().abs()[:, ok].max()))
    return bool(diff.max() <= tol)


def _probe_tokens(model) -> Tensor:
    n = int(min(8, model.cfg.n_ctx))
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, model.cfg.d_vocab, (2, n), generator=gen)


def _qk(cache, q_name, k_name, H):
    q, k = cache[q_name].double(), cache[k_name].double()
    if k.shape[2] != H:
        k = torch.repeat_interleave(k, H // k.shape[2], dim=2)
    return q, k


def content_qk_from(names: tuple[str, ...], captured, n_heads: int) -> tuple[Tensor, Tensor]:
    """``(q, k)`` float64 ``[batch, pos, head, d_head]`` (k expanded over grouped-query
    heads) of the content score, from the tensors of :func:`content_qk_hooks` (a dict
    name -> tensor): two hooks carry them rotated; four (q, k, cos, sin) carry the
    unrotated q/k and the call's RoPE tables ``[batch or 1, pos, rotary_dim]``, applied as
    HF does: x cos + rotate_half(x) sin on the leading rotary_dim dims (split halves)."""
    q, k = _qk(captured, names[0], names[1], n_heads)
    if len(names) == 4:
        cos, sin = captured[names[2]].double()[:, :, None], captured[names[3]].double()[:, :, None]
        rd = cos.shape[-1]

        def rot(x):
            half = rotate_pairs(x[..., :rd], adjacent_pairs=False)  # HF passes split-half tables
            return torch.cat([x[..., :rd] * cos.to(x.device) + half * sin.to(x.device), x[..., rd:]], -1)
        q, k = rot(q), rot(k)
    return q, k


def _content(q, k, scale, cap: float | None = None):
    """q·k / scale, through the soft-cap T tanh(. / T) where the model has one."""
    c = torch.einsum("bihd,bjhd->bhij", q, k) / scale
    return c if cap is None else cap * torch.tanh(c / cap)


def _changes_output(model, tokens, clean, hooks) -> bool:
    out = model.run_with_hooks(tokens, fwd_hooks=hooks)
    return not torch.allclose(out.double(), clean.double(), rtol=0, atol=1e-6)


def _noise(seed, rows: slice | None = None):
    """A hook adding seeded N(0, 1) noise to the whole activation, or (``rows``) to one
    copy of the probe batch only, with the same draw."""
    def hook(x, hook):
        g = torch.Generator().manual_seed(seed)
        part = x if rows is None else x[rows]
        noise = torch.randn(part.shape, generator=g, dtype=torch.float64).to(x.device, x.dtype)
        if rows is None:
            return x + noise
        x = x.clone()
        x[rows] += noise
        return x
    return hook


_EDITS_PER_PASS = 32


def _edits_change_output(model, tokens, clean, edits: list[tuple[str, int]]) -> list[bool]:
    """For each edit ``(hook name, noise seed)``: does adding that noise at that hook
    change the logits (as :func:`_changes_output` with :func:`_noise`)?

    Batched, because one forward pass per edit made the probe cost ~90 passes on a
    30-layer model: copy c of the probe batch carries edit c alone, two unedited copies
    (first and last) stand for the clean run, all of the first probe sequence. Batch
    elements do not interact, which is checked: the unedited copies must equal the
    unbatched clean logits to the tolerance, and any pass that fails (or whose hook sees
    no batch dimension) is redone one edit at a time. The tolerance covers the rounding
    by which rows of one batched matmul may differ (1e-4 of the largest |logit|); an edit
    that takes effect moves the logits by far more (N(0, 1) noise on a score, query or
    head output).
    """
    tokens, clean = tokens[:1], clean[:1].double()  # one sequence shows an edit's effect
    b = 1
    tol = max(1e-6, 1e-4 * float(clean.abs().max()))
    out: list[bool] = []
    for start in range(0, len(edits), _EDITS_PER_PASS):
        group = edits[start:start + _EDITS_PER_PASS]
        k = len(group)
        batch = tokens.repeat(k + 2, 1)
        by_name: dict[str, list] = {}
        for c, (name, seed) in enumerate(group, start=1):
            by_name.setdefault(name, []).append(_noise(seed, slice(c * b, (c + 1) * b)))
        seen_shapes: list[int] = []

        def chain(fns, seen=seen_shapes):
            def hook(x, hook):
                seen.append(x.shape[0])
                for f in fns:
                    x = f(x, hook)
                return x
            return hook
        logits = model.run_with_hooks(batch, fwd_hooks=[(n, chain(f)) for n, f in by_name.items()])
        logits = logits.double()
        copies = logits.reshape(k + 2, b, *logits.shape[1:])
        if (logits.shape[0] != batch.shape[0] or any(s != batch.shape[0] for s in seen_shapes)
                or (copies[0] - clean).abs().max() > tol or (copies[-1] - clean).abs().max() > tol):
            out += [_changes_output(model, tokens, clean, [(n, _noise(s))]) for n, s in group]
            continue
        ref = copies[0]
        out += [bool((copies[c] - ref).abs().max() > tol) for c in range(1, k + 1)]
    return out


def hook_meaning(model, layer: int) -> HookMeaning:
    """The verified meaning of ``layer``'s attention hooks on this model (see
    :class:`HookMeaning`), probed once per model on two random 8-token sequences and
    cached on the model object.

    Checks: softmax of ``hook_attn_scores`` equals ``hook_pattern`` and an edit of it
    changes the logits; q·k/attn_scale of the candidate q/k hooks explains the pattern
    up to a token-independent term (:func:`_explains`); an edit of ``hook_q`` changes
    the logits; where no pre-softmax hook exists, the wrapped module's ``(output,
    pattern)`` satisfies output = Σ_h pattern_h v_h W_O,h + b_O and replacing it takes
    effect.

    A ``torch.compile(model)`` wrapper is probed (and answered for) through the module
    it wraps, eagerly.

    Raises:
        ValueError: for a layer outside ``[0, n_layers)``.
    """
    model = unwrap(model)
    if not 0 <= layer < model.cfg.n_layers:
        raise ValueError(f"layer must be in [0, {model.cfg.n_layers - 1}], got {layer}")
    verdicts = model.__dict__.get(_VERDICTS)
    if verdicts is None:
        # eval mode: dropout moves the pattern and makes every edit look effective; every
        # module's own mode comes back afterwards (eval_mode)
        with eval_mode(model), _in_float32(model) as half, eager(model), torch.no_grad(), \
                _without_lens_hooks(model):
            verdicts = _probe(model, 3e-2 if half else 1e-3)
        object.__setattr__(model, _VERDICTS, verdicts)
    return verdicts[layer]


class _without_lens_hooks:  # noqa: N801
    """Hide the TransformerLens hooks already added (a user's, an outer ``intervene``'s)
    during the probe: it must see the model, and must not make those hooks fire. Hooks
    registered on hook points directly with torch (posinterp's ALiBi bias) are part of
    the model and stay."""

    def __init__(self, model):
        self.points = list(model.hook_dict.values())
        self.saved = []

    def __enter__(self):
        for hp in self.points:
            ids = {h.hook.id for h in getattr(hp, "fwd_hooks", ())}
            taken = [(i, hp._forward_hooks.pop(i)) for i in list(hp._forward_hooks) if i in ids]
            if taken:
                self.saved.append((hp, taken))

    def __exit__(self, *exc):
        for hp, taken in self.saved:
            hp._forward_hooks.update(taken)  # after the model's own hooks, as before
        return False


def _probe(model, rtol: float = 1e-3) -> dict[int, HookMeaning]:
    from ...devices import model_device

    tokens = _probe_tokens(model).to(model_device(model))
    H = model.cfg.n_heads
    n = tokens.shape[1]
    allowed = _allowed(model, n)
    names = {f"blocks.{layer}.attn.hook_{s}" for layer in range(model.cfg.n_layers)
             for s in ("attn_scores", "pattern", "q", "k", "v", "z", "rot_q", "rot_k", "cos", "sin")}
    names &= set(model.hook_dict)
    clean, cache = model.run_with_cache(tokens, names_filter=lambda x: x in names)
    cache = {k: v.detach().cpu() for k, v in cache.items()}
    rotary = positional_type(model) == "rotary"
    # MLA: hook_q/hook_k hold [nope | rope] concatenations of another width than d_head and
    # hook_z values of v_head_dim; no q/k/z meaning is probed (readers refuse by name)
    mla = mla_settings(model)
    # First what the clean cache shows; the edits whose effect decides a verdict are then
    # checked together (_edits_change_output), the pattern's only where no score hook is.
    seen, edits = {}, []
    for layer in range(model.cfg.n_layers):
        p = f"blocks.{layer}.attn."
        found = []
        pattern = cache.get(p + "hook_pattern")
        if pattern is None:
            continue
        r = seen[layer] = {"found": found, "scores": None, "q": None, "z": None,
                           "content_qk": None, "rot_found": []}
        scale = attn_scale(model, layer)
        cap = r["cap"] = attn_soft_cap(model, layer)
        if cap is not None:
            found.append(f"q/k checked through the attention soft-cap ({_soft_cap_setting(model, layer)})")
        # pre-softmax scores
        s = cache.get(p + "hook_attn_scores")
        if s is None:
            found.append("hook_attn_scores does not fire")
        elif not torch.allclose(s.double().softmax(-1), pattern.double(), atol=1e-5, rtol=1e-4):
            found.append("hook_attn_scores holds the post-softmax pattern" if torch.allclose(s, pattern)
                         else "softmax of hook_attn_scores is not hook_pattern")
        else:
            r["scores"] = (p + "hook_attn_scores", layer)
        # q/k whose product is the content term
        if mla:
            found.append("multi-head latent attention (MLA): hook_q/hook_k/hook_z not probed")
        elif p + "hook_q" in cache and p + "hook_k" in cache:
            q, k = _qk(cache, p + "hook_q", p + "hook_k", H)
            if rotary:
                spec = rotary_spec(model, layer)
                pos = torch.arange(n)[None].expand(2, n)
                q, k = rope_rotate(q, spec, pos), rope_rotate(k, spec, pos)
            r["q_found"] = "hook_q/hook_k do not give the scores' q·k term"
            if _explains(pattern, _content(q, k, scale, cap), allowed, rtol):
                r["q"] = (p + "hook_q", 100 + layer)
        if rotary and not mla:
            if p + "hook_rot_q" in cache and p + "hook_rot_k" in cache:
                q, k = _qk(cache, p + "hook_rot_q", p + "hook_rot_k", H)
                if _explains(pattern, _content(q, k, scale, cap), allowed, rtol):
                    r["content_qk"] = (p + "hook_rot_q", p + "hook_rot_k")
                else:
                    r["rot_found"].append("hook_rot_q/hook_rot_k do not give the scores' q·k term")
            else:
                r["rot_found"].append("hook_rot_q/hook_rot_k do not fire")
        if p + "hook_z" in cache and p + "hook_v" in cache and not mla:
            v = cache[p + "hook_v"].double()
            v = v if v.shape[2] == H else torch.repeat_interleave(v, H // v.shape[2], dim=2)
            pv = torch.einsum("bhij,bjhd->bihd", pattern.double(), v)
            if pv.shape == cache[p + "hook_z"].shape and torch.allclose(
                    pv, cache[p + "hook_z"].double(), atol=1e-5, rtol=1e-4):
                r["z"] = (p + "hook_z", 300 + layer)
        edits += [r[t] for t in ("scores", "q", "z") if r[t] is not None]
    takes = dict(zip(edits, _edits_change_output(model, tokens, clean, edits), strict=True))
    patterns = [(f"blocks.{layer}.attn.hook_pattern", 200 + layer) for layer, r in seen.items()
                if not takes.get(r["scores"], False)]
    takes.update(zip(patterns, _edits_change_output(model, tokens, clean, patterns), strict=True))
    out = {}
    for layer in range(model.cfg.n_layers):
        p = f"blocks.{layer}.attn."
        if layer not in seen:
            out[layer] = HookMeaning(None, None, False, None, None, None, "hook_pattern does not fire")
            continue
        r = seen[layer]
        found = r["found"]
        scores_name = None
        if r["scores"] is not None and takes[r["scores"]]:
            scores_name = r["scores"][0]
        elif r["scores"] is not None:
            found.append("edits of hook_attn_scores are discarded")
        query_qk = None
        if r["q"] is not None and takes[r["q"]]:
            query_qk = (p + "hook_q", p + "hook_k")
        elif "q_found" in r:
            found.append(r["q_found"])
        found += r["rot_found"]
        content_qk = query_qk if not rotary else r["content_qk"]
        if rotary and not mla and content_qk is None:
            tables = (p + "hook_q", p + "hook_k", p + "hook_cos", p + "hook_sin")
            if all(t in cache for t in tables):
                # GPT-NeoX bridges fire the cos/sin each call used (positions from the mask)
                q, k = content_qk_from(tables, cache, H)
                if _explains(cache[p + "hook_pattern"], _content(
                        q, k, attn_scale(model, layer), r["cap"]), allowed, rtol):
                    content_qk = tables
                    found.append("hook_q/hook_k rotated by hook_cos/hook_sin give the scores")
        pattern_name, output_edit = None, False
        if scores_name is None and takes[(p + "hook_pattern", 200 + layer)]:
            pattern_name = p + "hook_pattern"
        elif scores_name is None:
            found.append("edits of hook_pattern are discarded")
        if scores_name is None and pattern_name is None and p + "hook_v" in cache:
            output_edit = _verify_output_edit(model, layer, tokens, clean, cache)
            if not output_edit:
                found.append("its attention module's output cannot be edited with the pattern")
        z_name = None
        if r["z"] is not None and takes[r["z"]]:
            z_name = p + "hook_z"
        elif p + "hook_z" in cache and p + "hook_v" in cache and not mla:
            found.append("hook_z is not the pattern-weighted values or edits are discarded")
        out[layer] = HookMeaning(scores_name, pattern_name, output_edit, content_qk, query_qk,
                                 z_name, "; ".join(found), r["cap"])
    return out


def _verify_output_edit(model, layer, tokens, clean, cache) -> bool:
    comp = _module(model, layer)
    if comp is None:
        return False
    p = f"blocks.{layer}.attn."
    H = model.cfg.n_heads
    install_output_edit(model, layer)
    seen = {}

    def grab(output):
        seen["out"] = output
        return output

    def arm(x, hook):
        arm_output_edit(model, layer, grab)
        return x
    model.run_with_hooks(tokens, fwd_hooks=[(p + "hook_v", arm)])
    out = seen.get("out")
    if not (isinstance(out, tuple) and len(out) >= 2 and isinstance(out[1], Tensor)):
        return False
    pattern = out[1].detach().cpu().double()
    if pattern.shape != cache[p + "hook_pattern"].shape or not torch.allclose(
            pattern, cache[p + "hook_pattern"].double(), atol=1e-6):
        return False
    v = cache[p + "hook_v"].double()
    v = v if v.shape[2] == H else torch.repeat_interleave(v, H // v.shape[2], dim=2)
    w = attention_weights(model, layer)
    b_O = getattr(model.blocks[layer].attn, "b_O", None)
    b_O = 0.0 if b_O is None else b_O.detach().cpu().double()
    want = torch.einsum("bhij,bjhd,hdm->bim", pattern, v, w["W_O"]) + b_O
    if not torch.allclose(out[0].detach().cpu().double(), want, atol=1e-4, rtol=1e-4):
        return False
    # and replacing it takes effect
    uniform = _allowed(model, tokens.shape[1]).double()
    uniform = uniform / uniform.sum(-1, keepdim=True)

    def arm_uniform(x, hook):
        arm_output_edit(model, layer, pattern_edit(model, layer, list(range(H)),
                                                   lambda old: uniform.to(old.device).expand_as(old),
                                                   x.detach()))
        return x
    return _changes_output(model, tokens, clean, [(p + "hook_v", arm_uniform)])
