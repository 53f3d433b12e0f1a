"""Toy autoregressive models on a tiny vocabulary and a batched speculative-decoding loop over them, to test a
verifier by the law of whole generated streams (several iterations, verifier state threaded through). The tests
check every built-in with it; the audit (tools/audit.py --verifier) checks a researcher's kernel, a black box, with
it. torch only: the chi-square p-value comes from torch.special.gammaincc, so scipy stays a test dependency.
"""
from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import torch

from .base import Verifier

MIN_EXPECTED = 5.0  # cells expected fewer times are pooled: the chi-square approximation needs counts of about 5


class ToyModel:
    """Next-token law depends on the last two tokens (context-dependent, so block structure matters); zeros mimic
    top-k / top-p truncation. Rows are tables [V+1, V+1, V] indexed by (second-to-last, last), V = no token yet."""

    def __init__(self, vocab: int, seed: int, zero_prob: float = 0.0, one_hot: bool = False, const=None):
        rng = np.random.default_rng(seed)
        if const is not None:
            table = np.broadcast_to(np.asarray(const, float), (vocab + 1, vocab + 1, vocab)).copy()
        else:
            table = rng.dirichlet(0.8 * np.ones(vocab), size=(vocab + 1, vocab + 1))
            if zero_prob:
                mask = rng.random(table.shape) < zero_prob
                mask[..., 0] &= ~mask[..., 1:].all(-1)  # keep one token per row
                table = np.where(mask, 0.0, table)
            if one_hot:
                table = np.eye(vocab)[table.argmax(-1)]
        self.table = torch.tensor(table / table.sum(-1, keepdims=True), dtype=torch.float64)
        self.vocab = vocab

    def __call__(self, prev2: torch.Tensor, prev1: torch.Tensor) -> torch.Tensor:
        return self.table[prev2, prev1]

    def cond(self, prefix: tuple) -> np.ndarray:
        """The law after `prefix` from the empty context, as verifiers/reference.py's models give it: the same
        instance can be sampled here and enumerated there."""
        prev2, prev1 = ((self.vocab, self.vocab) + tuple(prefix))[-2:]
        return self.table[prev2, prev1].numpy()

    def law(self, n: int) -> dict[tuple, float]:
        """Exact law of the first n tokens generated from the empty context."""
        law = {}
        for seq in itertools.product(range(self.vocab), repeat=n):
            prob, prev2, prev1 = 1.0, self.vocab, self.vocab
            for tok in seq:
                prob *= float(self.table[prev2, prev1, tok])
                prev2, prev1 = prev1, tok
            law[seq] = prob
        return law


def generate_streams(verifier: Verifier, target: ToyModel, drafter: ToyModel, rows: int, num_drafts: int,
                     block_length: int, num_tokens: int, seed: int = 0, keep_state: bool = True,
                     dtype=torch.float64):
    """Decode `rows` independent streams until each has num_tokens tokens; returns tokens [rows, num_tokens] and the
    accepted length of every row's first iteration."""
    g = torch.Generator().manual_seed(seed)
    V, K, L = target.vocab, num_drafts, block_length
    # each row's stream so far, preceded by two "no token" markers that the models read as the empty context
    streams = torch.full((rows, 2 + num_tokens * (L + 1) + 1), V)  # the last column takes discarded writes
    length = torch.full((rows,), 2)
    state, first_accepted = None, None
    for _ in range(num_tokens):  # every iteration emits at least one token
        a = streams.gather(1, length[:, None] - 2).expand(rows, K)
        b = streams.gather(1, length[:, None] - 1).expand(rows, K)
        tokens, q_rows, p_rows = [], [], []
        for _ in range(L):
            q, p = drafter(a, b), target(a, b)
            x = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(rows, K)
            tokens.append(x), q_rows.append(q), p_rows.append(p)
            a, b = b, x
        p_rows.append(target(a, b))
        tokens = torch.stack(tokens, 2)
        out = verifier(tokens, torch.stack(q_rows, 2).to(dtype), torch.stack(p_rows, 2).to(dtype),
                       generator=g, state=state if keep_state else None)
        state = out.state
        emitted = torch.cat([tokens[torch.arange(rows), out.draft_index], out.next_token[:, None]], 1)
        emitted.scatter_(1, out.num_accepted[:, None], out.next_token[:, None])
        offset = torch.arange(L + 1)
        keep = offset <= out.num_accepted[:, None]
        target_pos = torch.where(keep, length[:, None] + offset, streams.shape[1] - 1)
        streams.scatter_(1, target_pos, torch.where(keep, emitted, V))
        length += out.num_accepted + 1
        if first_accepted is None:
            first_accepted = out.num_accepted.double()
    return streams[:, 2: 2 + num_tokens], first_accepted


def law_p_value(samples: torch.Tensor, law: dict[tuple, float]) -> float:
    """Chi-square goodness of fit of sampled sequences [rows, n] to an exact law; a sample outside the support fails
    outright (p = 0). Cells expected fewer than MIN_EXPECTED times are pooled into one, so that rare sequences cannot
    fake a tiny p-value."""
    counts = Counter(map(tuple, samples.tolist()))
    if any(law.get(seq, 0.0) <= 0 for seq in counts):
        return 0.0
    support = [seq for seq, prob in law.items() if prob > 0]
    observed = torch.tensor([counts[seq] for seq in support], dtype=torch.float64)
    expected = torch.tensor([law[seq] for seq in support], dtype=torch.float64)
    expected *= len(samples) / expected.sum()
    rare = expected < MIN_EXPECTED
    if rare.any():
        observed = torch.cat([observed[~rare], observed[rare].sum()[None]])
        expected = torch.cat([expected[~rare], expected[rare].sum()[None]])
    if len(observed) == 1:  # all the mass in one cell, and every sample in it
        return 1.0
    statistic = ((observed - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((len(observed) - 1) / 2, dtype=torch.float64), statistic / 2))
