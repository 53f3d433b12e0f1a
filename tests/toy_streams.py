"""Toy autoregressive models on a tiny vocabulary and a batched speculative-decoding loop over them, to test
verifiers by the law of whole generated streams (several iterations, verifier state threaded through)."""
from __future__ import annotations

import itertools

import numpy as np
import torch
from scipy import stats

from spectr_gbv.verifiers import Verifier


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
    """Chi-square goodness of fit of sampled sequences to an exact law; a sample outside the support fails outright."""
    counts = {}
    for row in map(tuple, samples.tolist()):
        counts[row] = counts.get(row, 0) + 1
    if any(law.get(seq, 0.0) <= 0 for seq in counts):
        return 0.0
    support = [seq for seq, prob in law.items() if prob > 0]
    observed = np.array([counts.get(seq, 0) for seq in support], float)
    expected = np.array([law[seq] for seq in support]) * len(samples)
    return float(stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)
