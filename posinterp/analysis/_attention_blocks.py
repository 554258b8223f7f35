"""One layer's ``[batch, head, query, key]`` attention reduced in query blocks.

The statistics the analyses keep of an attention pattern (or its pre-softmax scores) are
small: a kernel by offset, a few scores per head, a pooled view. Computing them from the
whole tensor in float64, with the pads compacted away, costs several full-size copies
(about 6 x the pattern at 4,096 tokens). Here each sequence's real tokens are read a block
of queries at a time, so the extra memory is O(block x n) per head whatever n, and a hook
can reduce each layer's attention as the forward pass makes it and drop it (docs/scale.md).

Results are float64 (kernels summed in float32 over 8 queries at a time first) and equal
the whole-tensor definitions
(:func:`~posinterp.analysis.attention_kernel`, :func:`~posinterp.analysis.head_scores`,
:func:`~posinterp.analysis.induction_score`, :func:`~posinterp.analysis.kernels.pool_pattern`)
to 1e-6 relative (tests/analysis/test_attention_blocks.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ._checks import masked_scores

#: float64 elements of one query block across heads (64 MB): the working set's unit
BLOCK_ELEMENTS = 1 << 23
#: ``query_block="auto"``: inputs longer than this run in blocks of QUERY_BLOCK positions
#: through the model's KV cache where it has a verified one (one layer's whole pattern
#: at 2,048 tokens is 9 heads x 16 MB on SmolLM2; at 8,192, 2.4 GB and its softmax copies)
AUTO_BLOCK_TOKENS = 2048
QUERY_BLOCK = 512


def resolve_query_block(model, n: int, query_block) -> int | None:
    """The ``query_block`` a hook-time analysis of ``n`` positions runs with (see
    :func:`posinterp.models.backend.run_reduced`): None (each layer's whole pattern at
    once), a positive int, or ``"auto"``: :data:`QUERY_BLOCK` where ``n`` >
    :data:`AUTO_BLOCK_TOKENS` and the model's pass in blocks is verified
    (:func:`~posinterp.models.backend.check_chunked_pass`), else None.

    Raises:
        ValueError: ``query_block`` none of those.
        MissingFeatureError: an int on a model whose pass in blocks is refused.
    """
    from ..models.backend import MissingFeatureError, check_chunked_pass

    if query_block is None:
        return None
    if query_block == "auto":
        if n <= AUTO_BLOCK_TOKENS:
            return None
        try:
            check_chunked_pass(model)
        except MissingFeatureError:
            return None
        return QUERY_BLOCK
    if isinstance(query_block, bool) or not isinstance(query_block, int) or query_block < 1:
        raise ValueError(f"query_block must be None, 'auto' or a positive integer, got "
                         f"{query_block!r}")
    check_chunked_pass(model)
    return query_block


@dataclass
class BlockStats:
    """Per-sequence sums that a layer's blocks add up to (float64, CPU).

    ``kernel_sum``/``kernel_count``: ``[batch, head, pos]`` by lag i - j; ``prev``,
    ``self``, ``first``: ``[batch, head]`` sums over queries i >= start (``n_scored`` of them
    per sequence); ``induction``: ``[batch, head]`` sum of the induction mass over the
    ``n_induction`` queries that have a target; ``views``: sequence -> ``[head, m, m]``.
    """

    kernel_sum: Tensor | None = None
    kernel_count: Tensor | None = None
    prev: Tensor | None = None
    self_: Tensor | None = None
    first: Tensor | None = None
    n_scored: Tensor | None = None
    induction: Tensor | None = None
    n_induction: Tensor | None = None
    views: dict = field(default_factory=dict)

    def kernel(self) -> Tensor:
        """``[batch, head, pos]`` mean by lag; NaN where no query has that lag."""
        c = self.kernel_count
        return torch.where(c > 0, self.kernel_sum / c.clamp_min(1), torch.nan)

    def scores(self) -> dict[str, Tensor]:
        """Previous-token, self and first-token score ``[batch, head]``."""
        n = self.n_scored[:, None].double()
        return {"previous_token_score": self.prev / n, "self_score": self.self_ / n,
                "first_token_score": self.first / n}

    def induction_score(self) -> Tensor:
        """``[batch, head]`` mean induction mass; NaN for a sequence without a target."""
        n = self.n_induction[:, None]
        return torch.where(n > 0, self.induction / n.clamp_min(1), torch.nan)


def _real_positions(mask: Tensor | None, b: int, n: int) -> Tensor:
    return torch.arange(n) if mask is None else mask[b].cpu().bool().nonzero().flatten()


def _lags(block: Tensor, a: int) -> Tensor:
    """``[head, r, a + r]`` block of rows a..a+r-1 (keys 0..a+r-1) -> ``D[h, t, lag] =
    block[h, t, a + t - lag]`` (entries with lag > a + t are garbage: mask them).

    A flip and a strided view: row t of the flipped block holds key a + t - lag at column
    r' - 1 - (a + t) + lag, i.e. at flat offset t (r' - 1) + (r' - 1 - a) + lag with
    r' = a + r columns; the last valid entry is the block's last element.
    """
    h, r, w = block.shape
    f = block.flip(-1).contiguous()
    return f.as_strided((h, r, w), (r * w, w - 1, 1), f.storage_offset() + w - 1 - a)


#: rows summed in float32 before the float64 sum: a float64 copy of every block costs
#: more than the rest of the kernel; a sum of 8 float32 values is off by at most 7
#: roundings (4e-7 relative), far below the 1e-6 the kernels are compared at
_ROWS_F32 = 8


def _column_sums(w: Tensor) -> Tensor:
    """``w [head, rows, cols]`` summed over rows, float64."""
    if w.dtype == torch.float64:
        return w.sum(-2)
    w = w.float()
    h, r, c = w.shape
    cut = r - r % _ROWS_F32
    head = w[:, :cut].reshape(h, cut // _ROWS_F32, _ROWS_F32, c).sum(2)
    return head.sum(-2, dtype=torch.float64) + w[:, cut:].sum(-2, dtype=torch.float64)


class AttentionReduction:
    """:class:`BlockStats` accumulated from blocks of query rows of one layer's causal
    ``[batch, head, query, key]`` pattern or scores, in any order: the whole tensor at once
    (:func:`reduce_attention`) or the rows a forward pass makes chunk by chunk with a KV
    cache (:func:`~posinterp.models.backend.run_reduced` with ``query_block``).

    ``n``: the input's positions (padded); ``batch``, ``heads``: of the values to come;
    the other arguments as :func:`reduce_attention`'s. :meth:`add` takes rows
    ``row_start .. row_start + r - 1`` with keys ``0 .. row_start + r - 1`` (padded
    coordinates); :meth:`result` gives the sums. ``select``: keep only these heads of
    each block (``heads`` = their number).
    """

    def __init__(self, batch: int, heads: int, n: int, attention_mask: Tensor | None = None, *,
                 kernel: bool = True, scores: bool = False, start: int = 1,
                 tokens: Tensor | None = None, views: dict[int, int] | None = None,
                 block_elements: int = BLOCK_ELEMENTS, select: list[int] | None = None):
        self.n, self.start, self.block_elements = n, start, block_elements
        self.select = select  # these heads of what add() gets (``heads`` of them)
        self.idx = [_real_positions(attention_mask, s, n) for s in range(batch)]
        self.contiguous = [len(i) == n for i in self.idx]  # no pads: rows slice directly
        out = self.out = BlockStats()
        if kernel:
            out.kernel_sum = torch.zeros(batch, heads, n, dtype=torch.float64)
            out.kernel_count = torch.zeros(batch, heads, n, dtype=torch.float64)
        if scores:
            out.prev, out.self_, out.first = (torch.zeros(batch, heads, dtype=torch.float64)
                                              for _ in range(3))
            out.n_scored = torch.zeros(batch, dtype=torch.long)
        self.tok = None
        if tokens is not None:
            out.induction = torch.zeros(batch, heads, dtype=torch.float64)
            out.n_induction = torch.zeros(batch, dtype=torch.long)
            self.tok = [tokens[s].cpu()[self.idx[s]] for s in range(batch)]
        self.pool, self.acc = dict(views or {}), {}
        for s, pool in self.pool.items():
            m = -(-len(self.idx[s]) // pool)
            self.acc[s] = torch.zeros(heads, m, m, dtype=torch.float64)

    def add(self, values: Tensor, row_start: int = 0) -> None:
        """Add rows ``row_start ..`` of ``values`` ``[batch, head, r, row_start + r]``."""
        r = values.shape[2]
        if values.shape[3] != row_start + r:
            raise ValueError(f"a block of rows {row_start}..{row_start + r - 1} needs keys "
                             f"0..{row_start + r - 1}; got {values.shape[3]} keys")
        if self.select is not None:
            values = values[:, self.select]
        for s, idx in enumerate(self.idx):
            src = values[s].detach()
            if self.contiguous[s]:
                local, a = torch.arange(r), row_start
            else:  # the sequence's real rows in this block, at their compact index a + t
                local = idx[(idx >= row_start) & (idx < row_start + r)] - row_start
                a = int((idx < row_start).sum())
                keys = idx[: a + len(local)].to(values.device)
            h = src.shape[0]
            step = max(1, self.block_elements // max(1, h * (a + len(local))))
            for t in range(0, len(local), step):
                sub = local[t:t + step]
                lo = a + t  # compact index of the sub-block's first row
                if self.contiguous[s]:
                    blk = src[:, int(sub[0]):int(sub[-1]) + 1, :lo + len(sub)]
                else:
                    blk = src[:, sub.to(values.device)][:, :, keys[:lo + len(sub)]]
                self._accumulate(s, blk.cpu(), lo)

    def _accumulate(self, s: int, blk: Tensor, a: int) -> None:
        """Rows a..a+r-1 of sequence ``s``'s compact pattern (keys 0..a+r-1)."""
        out = self.out
        h, r, b = blk.shape
        i = a + torch.arange(r)  # the block's queries
        if out.kernel_sum is not None:
            d = _lags(blk, a)
            ok = torch.arange(b)[None, :] <= i[:, None]  # [r, lag]: lag <= i is a key
            if bool(masked_scores(blk).any()):  # masked scores are not scores
                ok = ok[None] & ~masked_scores(d)
            out.kernel_sum[s, :, :b] += _column_sums(torch.where(ok, d, 0))
            out.kernel_count[s, :, :b] += ok.sum(-2)
        if out.prev is not None:
            q = i >= self.start
            at = torch.arange(r)
            out.prev[s] += blk[:, at[q], i[q] - 1].double().sum(-1)
            out.self_[s] += blk[:, at[q], i[q]].double().sum(-1)
            out.first[s] += blk[:, q, 0].double().sum(-1)
            out.n_scored[s] += int(q.sum())
        if self.tok is not None and b > 1:
            tok = self.tok[s]
            # key j is a target of query i when token j - 1 is an earlier copy of token i
            hit = (tok[None, :b - 1] == tok[a:b, None]) & (torch.arange(b - 1)[None, :] < i[:, None])
            has = hit.any(-1)
            if bool(has.any()):
                mass = torch.where(hit[has], blk[:, has, 1:], 0).sum(-1, dtype=torch.float64)
                out.induction[s] += mass.sum(-1)
                out.n_induction[s] += int(has.sum())
        pool = self.pool.get(s)
        if pool is not None:
            # keys pooled in float32 (a view is shown in float32), queries in float64
            m = self.acc[s].shape[-1]
            keys = torch.zeros(h, r, m * pool, dtype=torch.float32)
            keys[:, :, :b] = blk
            self.acc[s].index_add_(1, i // pool, keys.view(h, r, m, pool).sum(-1).double())

    def result(self) -> BlockStats:
        """The sums so far (pooled views normalized by their block sizes)."""
        for s, acc in self.acc.items():
            group = torch.arange(len(self.idx[s])) // self.pool[s]
            sizes = torch.bincount(group, minlength=acc.shape[-1]).double()
            self.out.views[s] = (acc / sizes[:, None]).float()
        return self.out


def reduce_attention(values: Tensor, attention_mask: Tensor | None = None, *,
                     kernel: bool = True, scores: bool = False, start: int = 1,
                     tokens: Tensor | None = None, views: dict[int, int] | None = None,
                     block_elements: int = BLOCK_ELEMENTS) -> BlockStats:
    """Reduce ``values`` ``[batch, head, pos, pos]`` (a causal pattern or its scores, any
    device or dtype) in query blocks over each sequence's real tokens.

    ``kernel``: sums and counts by lag i - j >= 0 over real queries, masked scores
    (``<= finfo.min`` in the input's dtype) left out; ``scores``: A[i, i-1], A[i, i] and
    A[i, 0] summed over queries i >= ``start`` (>= 1); ``tokens`` (``[batch, pos]``): the induction mass
    over the queries with an earlier occurrence of their token
    (:func:`~posinterp.analysis.induction_targets`); ``views``: sequence -> block size of
    its pooled view (:func:`~posinterp.analysis.kernels.pool_pattern` of its real tokens).
    The caller has checked shapes and mask.
    """
    bsz, h, n, _ = values.shape
    acc = AttentionReduction(bsz, h, n, attention_mask, kernel=kernel, scores=scores,
                             start=start, tokens=tokens, views=views,
                             block_elements=block_elements)
    acc.add(values, 0)
    return acc.result()
