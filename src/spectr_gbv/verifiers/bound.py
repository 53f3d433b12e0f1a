"""The optimal-transport bound every multi-draft verifier is measured against (docs/algorithms.md §10)."""
from __future__ import annotations

import torch
from torch import Tensor


def optimal_acceptance(p: Tensor, q: Tensor, num_drafts: int | list[int]) -> Tensor:
    """alpha*(p, q, K) = max over couplings of K i.i.d. drafts ~ q with Y ~ p of P(Y is one of the drafts)
    = min over token sets A of p(A) + 1 - q(A)^K, attained by a prefix of the tokens sorted by increasing p/q.
    p, q [..., V] -> [...], or [..., len(num_drafts)] for a list of draft counts (one sort serves them all);
    O(V log V)."""
    ratio = torch.where(q > 0, p / q.clamp_min(torch.finfo(q.dtype).tiny), torch.full_like(p, float("inf")))
    order = ratio.argsort(-1)
    below_p, below_q = p.gather(-1, order).cumsum(-1), q.gather(-1, order).cumsum(-1).clamp(max=1)
    alpha = [(below_p + 1 - below_q ** k).amin(-1).clamp(max=1)  # the empty set's cut is 1
             for k in (num_drafts if isinstance(num_drafts, list) else [num_drafts])]
    return torch.stack(alpha, -1) if isinstance(num_drafts, list) else alpha[0]
