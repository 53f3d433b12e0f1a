"""Exact float64 laws of every verifier on tiny vocabularies, by enumeration (the project's oracle).

A *model* is a callable `cond(prefix) -> np.ndarray[V]`: the next-token distribution after the block-relative
`prefix` (a tuple of ints); it may depend on the whole prefix. Drafts are enumerated with their probabilities under
q, every uniform of a verifier is integrated out analytically, so every number here is exact up to float64
rounding. Nothing here is fast: V^(L*K) draft tuples are enumerated. numpy only, no torch.

tau = accepted: docs/algorithms.md's symbol for the number of accepted draft tokens of one iteration.

One verification iteration is described by `outcomes(name, p, q, drafts)`: a list of
`(probability, emitted_tokens, cont)` where `emitted_tokens` is the accepted prefix plus the recovered or bonus token
and `cont(seq)` the conditional that continues the stream after `seq` (block-relative). `cont` is the target `p`
except for `gbv`, whose target is modified for the rest of the block window (docs/algorithms.md §4.2 to §4.4).
"""

import functools
import itertools

import numpy as np

from spectr_gbv.verifiers import ALIASES, verifier_class


# ---------------------------------------------------------------------------------------------------------------
# Models and laws
# ---------------------------------------------------------------------------------------------------------------
class ConstModel:
    """Context-independent model (the anchors of docs/algorithms.md §12)."""

    def __init__(self, dist):
        self.dist = np.asarray(dist, dtype=np.float64)

    def __call__(self, prefix):
        return self.dist


# The anchors of docs/algorithms.md §12, name: (target p, drafter q, L, K), for the audit and the tests; the values
# they must give are pinned once, in tests/test_reference.py.
ANCHORS = {
    "A": ((1 / 3, 2 / 3), (2 / 3, 1 / 3), 2, 2),
    "B": ((0.5, 0.3, 0.2), (0.2, 0.3, 0.5), 2, 2),
    "C": ((0.6, 0.3, 0.1), (0.3, 0.3, 0.4), 3, 2),
}


def anchor(name):
    """Anchor `name` as the functions below take it: (ConstModel(p), ConstModel(q), L, K)."""
    p, q, L, K = ANCHORS[name]
    return ConstModel(p), ConstModel(q), L, K


class RandModel:
    """Context-dependent random model: a Dirichlet draw per prefix, seeded by (seed, prefix) so that it does not
    depend on the order of the calls. `zero_prob` zeroes entries at random (never all) to mimic top-k / top-p."""

    def __init__(self, vocab_size, seed, concentration=1.0, zero_prob=0.0):
        self.vocab_size, self.seed = vocab_size, seed
        self.concentration, self.zero_prob = concentration, zero_prob
        self._cache = {}

    def __call__(self, prefix):
        prefix = tuple(prefix)
        if prefix not in self._cache:
            rng = np.random.default_rng([self.seed, len(prefix), *prefix])
            dist = rng.dirichlet(np.full(self.vocab_size, self.concentration))
            zero = rng.random(self.vocab_size) < self.zero_prob
            zero[rng.integers(self.vocab_size)] = False
            dist = np.where(zero, 0.0, dist)
            self._cache[prefix] = dist / dist.sum()
        return self._cache[prefix]


class TableModel:
    """Model given by a table {prefix: distribution}, e.g. a real model's laws renormalised on a tree of its top
    tokens (tools/audit.py --real). The enumeration asks for prefixes of length <= L only."""

    def __init__(self, table):
        self.table = {tuple(prefix): np.asarray(dist, dtype=np.float64) for prefix, dist in table.items()}

    def __call__(self, prefix):
        return self.table[tuple(prefix)]


def vocab_size(model):
    return len(model(()))


@functools.lru_cache(maxsize=1 << 18)
def joint(model, seq):
    """Joint probability of the tuple `seq` under `model`, from the block start. Memoised (models are pure
    functions of the prefix): the enumeration asks for the same prefixes over and over."""
    if not seq:
        return 1.0
    head = joint(model, seq[:-1])
    return head * model(seq[:-1])[seq[-1]] if head > 0 else 0.0


def _sequences(vocab, length):
    return list(itertools.product(range(vocab), repeat=length))


def target_law(p, n):
    """Law of the first n tokens of the target's own sampling."""
    return {s: joint(p, s) for s in _sequences(vocab_size(p), n) if joint(p, s) > 0}


def max_abs_diff(law_a, law_b):
    return max(abs(law_a.get(s, 0.0) - law_b.get(s, 0.0)) for s in set(law_a) | set(law_b))


def accepted_law(h):
    """P(tau = i), i = 0..L, of the accepted count tau = max{i >= 1 : U_i < h_i} (0 if none), h = (h_1..h_L)."""
    probs, none_above = np.zeros(len(h) + 1), 1.0
    for i in range(len(h), 0, -1):
        probs[i] = none_above * h[i - 1]
        none_above *= 1.0 - h[i - 1]
    probs[0] = none_above
    return probs


def _normalise(r, fallback):
    """norm(r), else `fallback`: for the lossless rules a residual has zero mass only at contexts of probability
    zero, where any law will do; spectr_gbv_paper falls back to p (docs/algorithms.md §11, note 3)."""
    total = r.sum()
    return r / total if total > 0 else fallback


def _emit(prob, prefix, dist, cont):
    return [(prob * dist[c], prefix + (c,), cont) for c in range(len(dist)) if dist[c] > 0]


# ---------------------------------------------------------------------------------------------------------------
# Single-draft block rules: token-level SD (docs/algorithms.md §2) and block verification (§3)
# ---------------------------------------------------------------------------------------------------------------
def _token_h(p, q, x):
    """Token SD stops at the first U_i >= a_i; written in the backward form of accepted_law:
    h_i = P(tau = i | tau <= i) = A_i (1 - a_{i+1}) / (1 - A_{i+1}), A_i = prod_{j<=i} a_j."""
    a = [min(1.0, p(x[:i])[x[i]] / q(x[:i])[x[i]]) for i in range(len(x))]
    reach = np.cumprod(a)  # reach[i-1] = A_i
    h = [reach[i - 1] * (1 - a[i]) / (1 - reach[i]) if reach[i] < 1 else 1.0 for i in range(1, len(x))]
    return np.array(h + [reach[-1]])


def _bv_weights(p, q, x):
    """w_0..w_L of block verification: w_i = min(1, w_{i-1} p(x_i|x^{i-1}) / q(x_i|x^{i-1}))."""
    w = [1.0]
    for i in range(len(x)):
        w.append(min(1.0, w[-1] * p(x[:i])[x[i]] / q(x[:i])[x[i]]))
    return w


def _bv_h(p, q, x):
    w = _bv_weights(p, q, x)
    h = []
    for i in range(1, len(x)):
        excess = np.maximum(w[i] * p(x[:i]) - q(x[:i]), 0.0).sum()
        h.append(1.0 if w[i] >= 1 else excess / (excess + 1 - w[i]))
    return np.array(h + [w[-1]])


def _single_path(p, q, x, h, w):
    """Outcomes of a single-path rule with backward posteriors h and, after `accepted` tokens, the recovered token
    from norm((w_accepted p - q)_+)."""
    L, outs = len(x), []
    for accepted, prob in enumerate(accepted_law(h)):
        if prob <= 0:
            continue
        v = x[:accepted]
        dist = p(v) if accepted == L else _normalise(np.maximum(w[accepted] * p(v) - q(v), 0.0), p(v))
        outs += _emit(prob, v, dist, p)
    return outs


def _one_draft(name, drafts):
    if len(drafts) != 1:
        raise ValueError(f"verifier={name} takes a single draft, got K={len(drafts)}")
    return drafts[0]


def token(p, q, drafts):
    x = _one_draft("token", drafts)
    return _single_path(p, q, x, _token_h(p, q, x), [1.0] * (len(x) + 1))


def bv(p, q, drafts):
    x = _one_draft("bv", drafts)
    return _single_path(p, q, x, _bv_h(p, q, x), _bv_weights(p, q, x))


# ---------------------------------------------------------------------------------------------------------------
# gbv: greedy block verification with the target modification (K=1, docs/algorithms.md §4.1-4.2) = RGBV (K>1, §4.3)
# ---------------------------------------------------------------------------------------------------------------
class _Measure:
    """A law of the target block given by its conditionals (memoised; residual chains call them repeatedly)."""

    def __init__(self, cond):
        self._cond, self._cache = cond, {}

    def cond(self, v):
        if v not in self._cache:
            self._cache[v] = self._cond(v)
        return self._cache[v]

    def joint(self, v):
        return joint(self.cond, v)


def _residual(measure, q, u):
    """Law of the target block Y given Y^|u| = u and that Y diverged from the draft right after u:
    point masses along u, then norm((M(v) M(.|v) - S(v) q(.|v))_+) below u."""

    def cond(v):
        if len(v) < len(u):
            return np.eye(len(q(())))[u[len(v)]]
        excess = np.maximum(measure.joint(v) * measure.cond(v) - joint(q, v) * q(v), 0.0)
        return _normalise(excess, measure.cond(v))

    return _Measure(cond)


def _greedy_h(measure, q, x):
    """Greedy-coupling posteriors of draft x against the target block law (docs/algorithms.md §4.1, p -> measure)."""
    h = []
    for i in range(1, len(x) + 1):
        v = x[:i]
        rho = measure.joint(v) / joint(q, v)  # unclamped joint ratio; 0 off the known prefix of Y
        if i == len(x) or rho >= 1:
            h.append(min(1.0, rho))
            continue
        mu = np.minimum(q(v), rho * measure.cond(v)).sum()
        h.append(max(0.0, rho - mu) / (1 - mu))
    return np.array(h)


def gbv(p, q, drafts):
    """RGBV: couple each draft in turn with the current conditional law of the target block."""
    L, outs = len(drafts[0]), []

    def visit(prob, k, measure, best):
        if k == len(drafts):  # recovered token from the final law; the rest of the window continues from it
            cont = lambda v: measure.cond(v) if len(v) < L else p(v)  # noqa: E731
            outs.extend(_emit(prob, best, measure.cond(best), cont))
            return
        x = drafts[k]
        for accepted_k, prob_k in enumerate(accepted_law(_greedy_h(measure, q, x))):
            if prob_k <= 0:
                continue
            if accepted_k == L:  # the whole block agrees with Y: bonus, beyond every pending window
                outs.extend(_emit(prob * prob_k, x, p(x), p))
            else:
                u = x[:accepted_k]
                visit(prob * prob_k, k + 1, _residual(measure, q, u), max(best, u, key=len))

    visit(1.0, 0, _Measure(p), ())
    return outs


# ---------------------------------------------------------------------------------------------------------------
# Token-level tree verifiers: SpecTr K-SEQ (docs/algorithms.md §5), SpecInfer (§6), NSS (§7)
# ---------------------------------------------------------------------------------------------------------------
# Bisection to float64's fixed point: the bracket [1, k] stops moving once it spans adjacent doubles,
# (k - 1) / 2^steps <= their spacing at 1, 2^-52. 64 = 52 + 12 steps get there for any k <= 2^12 + 1, so rho* is
# exact to the last bit and the laws do not depend on the count (the kernel stops earlier: tree.RHO_BISECTION_STEPS).
EXACT_RHO_BISECTION_STEPS = 64


@functools.lru_cache(maxsize=1 << 12)
def _kseq_rho(p_bytes, q_bytes, k):
    """Smallest rho in [1, k] with 1 - (1 - beta(rho))^k <= rho beta(rho) (bisection, valid upper end).
    Memoised on the bytes of p and q: the same nodes recur in many draft tuples."""
    p, q = np.frombuffer(p_bytes), np.frombuffer(q_bytes)
    lo, hi = 1.0, float(k)
    for _ in range(EXACT_RHO_BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        beta = np.minimum(q, p / mid).sum()
        lo, hi = (mid, hi) if 1 - (1 - beta) ** k >= mid * beta else (lo, mid)
    return hi


def _kseq_node(p, q, children):
    rho = _kseq_rho(p.tobytes(), q.tobytes(), len(children)) if len(children) > 1 else 1.0
    beta = np.minimum(q, p / rho).sum()
    if beta <= 0:
        return p.copy()
    law, reach = np.zeros(len(p)), 1.0
    for c in children:
        accept = min(1.0, p[c] / (rho * q[c]))
        law[c] += reach * accept
        reach *= 1 - accept
    residual = np.maximum(p - np.minimum(q, p / rho) * (1 - (1 - beta) ** len(children)) / beta, 0.0)
    return law + reach * _normalise(residual, p)


def _specinfer_node(p, q, children):
    law, reach, current = np.zeros(len(p)), 1.0, p.copy()
    for c in children:
        accept = min(1.0, current[c] / q[c])
        law[c] += reach * accept
        reach *= 1 - accept
        if reach <= 0:
            return law
        current = _normalise(np.maximum(current - q, 0.0), current)
    return law + reach * current


def _nss_node(p, q, children):
    return p.copy()


def _tree(node_law):
    """Top-down walk of the draft trie: sample the node's output law, descend while the token is a child
    (even when it came from a residual), else it is the recovered token; bonus at depth L."""

    def verify(p, q, drafts):
        L, outs = len(drafts[0]), []

        def visit(prob, v, alive):
            if len(v) == L:
                outs.extend(_emit(prob, v, p(v), p))
                return
            law = node_law(p(v), q(v), [d[len(v)] for d in alive])
            for c in np.flatnonzero(law > 0):
                through = [d for d in alive if d[len(v)] == c]
                if through:
                    visit(prob * law[c], v + (int(c),), through)
                else:
                    outs.append((prob * law[c], v + (int(c),), p))

        visit(1.0, (), list(drafts))
        return outs

    return verify


# ---------------------------------------------------------------------------------------------------------------
# multipath: Thomas and Pal's greedy multi-path block verification (docs/algorithms.md §8), tie-breaking fixed
# ---------------------------------------------------------------------------------------------------------------
def _key(p, q, v, c):
    """Strict per-node order, used both to select the path and to compute its law: (min(1, p/q), token id)."""
    qc = q(v)[c]
    return (min(1.0, p(v)[c] / qc) if qc > 0 else -1.0, c)


@functools.lru_cache(maxsize=1 << 12)
def _skewed_draft(p, q, path, K):
    """q~(.|path^i), i < L: the exact law of the next token of the best of K i.i.d. paths (stable form).
    Memoised: the same path is selected from many draft tuples."""
    skew, below, mass = {}, 0.0, 1.0  # below = draft mass of depth-i prefixes ordered before path^i; mass = S(path^i)
    for i in range(len(path)):
        v, qv = path[:i], q(path[:i])
        before = np.zeros(len(qv))  # F^-(c): draft mass of the tokens ordered before c
        order = sorted(range(len(qv)), key=lambda c: _key(p, q, v, c))
        before[order] = np.concatenate([[0.0], np.cumsum(qv[order])[:-1]])
        total = below + mass
        u, w, t = (below + mass * before) / total, mass * qv / total, below / total
        j = np.arange(K)[:, None]
        skew[v] = qv * ((u + w) ** j * u ** (K - 1 - j)).sum(0) / (t ** np.arange(K)).sum()
        below, mass = below + mass * before[path[i]], mass * qv[path[i]]
    return skew


def multipath(p, q, drafts):
    K, L = len(drafts), len(drafts[0])
    best = max(drafts, key=lambda x: [_key(p, q, x[:i], x[i]) for i in range(L)])
    skew = _skewed_draft(p, q, best, K)
    q_best = lambda v: skew[v]  # noqa: E731  (only queried along the selected path)
    return _single_path(p, q_best, best, _bv_h(p, q_best, best), _bv_weights(p, q_best, best))


# ---------------------------------------------------------------------------------------------------------------
# traversal: Weng et al.'s traversal verification on the draft trie (docs/algorithms.md §14)
# ---------------------------------------------------------------------------------------------------------------
def _children(drafts, v):
    """The distinct next tokens of the drafts through v, in order of first appearance among the drafts: the order
    that makes the next child a draw from q(.|v) without the children already visited (§14)."""
    return list(dict.fromkeys(d[len(v)] for d in drafts if d[:len(v)] == v))


def traversal(p, q, drafts):
    """Leaf to root: test the first leaf in depth-first order with its weight; on a rejection delete it, turn its
    parent's target into the weighted residual and drop the leaf's token from the parent's draft law."""
    L, outs = len(drafts[0]), []

    def visit(prob, v, w, target):
        """Outcomes of the subtree of v, entered with weight w and target conditional `target` at v, are added to
        outs; returns the probability that v itself is rejected (0 at the root, whose weight stays 1)."""
        draft = q(v) if len(v) < L else None
        for c in _children(drafts, v) if len(v) < L else []:
            prob = visit(prob, v + (c,), min(1.0, w * target[c] / draft[c]), p(v + (c,)))
            if prob <= 0:
                return 0.0
            excess = np.maximum(w * target - draft, 0.0)
            total = excess.sum()
            w = total / (total + (1 - w)) if total + (1 - w) > 0 else 1.0
            target = _normalise(excess, target)
            draft = _normalise(np.where(np.arange(len(draft)) == c, 0.0, draft), draft)
        if w > 0:
            outs.extend(_emit(prob * w, v, target, p))
        return prob * (1 - w)

    visit(1.0, (), 1.0, p(()))
    return outs


# ---------------------------------------------------------------------------------------------------------------
# spectr_gbv_paper: the published SpecTr-GBV rule as released (docs/algorithms.md §9); NOT lossless at T > 0
# ---------------------------------------------------------------------------------------------------------------
def spectr_gbv_paper(p, q, drafts):
    K, L, V = len(drafts), len(drafts[0]), vocab_size(p)
    outs = []

    @functools.cache
    def gain(v):  # G(v) = B(v) f(v), f = 1 - (1 - min(1, S/B))^K
        b = joint(p, v)
        return b * (1 - (1 - min(1.0, joint(q, v) / b)) ** K) if b > 0 else 0.0

    def covered(v):  # sigma(v): probability that some of the K drafts passes through v
        return 1 - (1 - joint(q, v)) ** K

    def h_sub(u):
        children = sum(gain(u + (c,)) for c in range(V))
        den = covered(u) - children
        return min(1.0, max(0.0, (gain(u) - children) / den)) if den > 0 else 0.0

    def finish(prob, acc):
        b, s = joint(p, acc), joint(q, acc)
        pb, qs = p(acc), q(acc)
        target = b * pb
        ratio = np.divide(s * qs, target, out=np.ones_like(target), where=target > 0)
        r = target * (1 - np.minimum(1.0, ratio)) ** K
        outs.extend(_emit(prob, acc, _normalise(r, pb), p))

    def test(prob, k, length, acc, seen):
        """Draft k tests its sub-blocks of lengths length..L-1 (the range starts after the accepted sub-block acc),
        then its full block."""
        if prob <= 0:
            return
        if k == K:
            return finish(prob, acc)
        x = drafts[k]
        if length < L:
            u = x[:length]
            if u in seen:
                return test(prob, k, length + 1, acc, seen)
            h = h_sub(u)
            test(prob * h, k, length + 1, u, seen)
            return test(prob * (1 - h), k, length + 1, acc, seen | {u})
        h_full = min(1.0, gain(x) / covered(x))
        if h_full > 0:
            outs.extend(_emit(prob * h_full, x, p(x), p))
        test(prob * (1 - h_full), k + 1, len(acc) + 1, acc, seen)

    test(1.0, 0, 1, (), frozenset())
    return outs


# ---------------------------------------------------------------------------------------------------------------
# ot: the optimal token-level coupling (docs/algorithms.md §15). Here only, not a registered verifier: its
# construction is sequential over the vocabulary, so this exact law is what a batched kernel would have to match.
# ---------------------------------------------------------------------------------------------------------------
# Bisection steps for a slid run's start in [0, 1]: 2^-100 is below float64's spacing there, so the start reaches
# its fixed point. Lossless at any count (the rule tests against the realised law t of its selection); the count
# only sets how closely t meets p at a slid token, hence how closely the acceptance reaches alpha*.
OT_BISECTION_STEPS = 100


def _ot_take(free, start, length):
    """The pieces of the free ranks (sorted disjoint intervals) between free lengths start and start + length."""
    out, seen = [], 0.0
    for a, b in free:
        lo, hi = max(a, a + start - seen), min(b, a + start + length - seen)
        if hi > lo:
            out.append((lo, hi))
        seen += b - a
    return out


def _ot_cut(interval, pieces):
    """interval minus the pieces (sorted, disjoint)."""
    (a, b), out = interval, []
    for lo, hi in pieces:
        if hi <= a or lo >= b:
            continue
        if lo > a:
            out.append((a, lo))
        a = hi
    return out + [(a, b)] if b > a else out


def _ot_mass(pieces, k, r0):
    """P(the highest of k uniform ranks lies in the pieces and above r0)."""
    return sum(max(b, r0) ** k - max(a, r0) ** k for a, b in pieces)


@functools.lru_cache(maxsize=1 << 10)
def _ot_ranks(p_bytes, q_bytes, k):
    """(each token's rank set in [0, 1], intervals of total length q(y); r0). Tokens in decreasing p/q take, in
    turn, a run of q(y) of the ranks still free, contiguous in free length (it may straddle runs given earlier): the
    top run if its mass is <= p(y), else the run of mass exactly p(y), found by bisection (the mass grows with the
    run's start; the bottom run's is <= p(y)). §15 shows that every token finds its run."""
    p, q = np.frombuffer(p_bytes), np.frombuffer(q_bytes)
    r0 = max(0.0, 1.0 - alpha_star(p, q, k)) ** (1.0 / k)
    with np.errstate(divide="ignore", invalid="ignore"):
        order = np.argsort(-np.where(q > 0, p / q, np.inf), kind="stable")
    tokens, free, sets = [y for y in order if q[y] > 0], [(0.0, 1.0)], {}
    for i, y in enumerate(tokens):
        total = sum(b - a for a, b in free)
        length = total if i == len(tokens) - 1 else min(q[y], total)  # the last one takes what rounding left
        start = total - length
        if _ot_mass(_ot_take(free, start, length), k, r0) > p[y]:
            fits, too_high = 0.0, start
            for _ in range(OT_BISECTION_STEPS):
                mid = 0.5 * (fits + too_high)
                fits, too_high = (mid, too_high) if _ot_mass(_ot_take(free, mid, length), k, r0) <= p[y] \
                    else (fits, mid)
            start = fits
        sets[y] = _ot_take(free, start, length)
        free = [piece for a, b in free for piece in _ot_cut((a, b), sets[y])]
    return sets, r0


def ot_selection_law(p, q, k):
    """t: the sub-probability law of the token ot's node rule selects with k drafts, the draft of highest rank when
    that rank is >= r0, each rank uniform on its token's set; t <= p and t sums to alpha*(p, q, k) (§15)."""
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    sets, r0 = _ot_ranks(p.tobytes(), q.tobytes(), k)
    t = np.zeros(len(p))
    for y, pieces in sets.items():
        t[y] = _ot_mass(pieces, k, r0)
    return t


def _ot_highest(sets, r0, children, vocab):
    """P(the highest of the children's ranks is >= r0 and a draft of token y), exactly: between r0 and the sets'
    endpoints every rank's CDF is linear, so the integrand is a polynomial of degree < k, which k Gauss-Legendre
    nodes integrate exactly."""
    k, tokens = len(children), sorted(set(children))
    ends = np.unique([r0, 1.0, *(x for y in tokens for piece in sets[y] for x in piece if x > r0)])
    nodes, weights = np.polynomial.legendre.leggauss(k)
    r = ((ends[:-1] + ends[1:])[:, None] + np.diff(ends)[:, None] * nodes) / 2  # [pieces, nodes]
    w = np.diff(ends)[:, None] * weights / 2
    cdf, density = {}, {}
    for y in tokens:
        length = sum(b - a for a, b in sets[y])
        cdf[y] = sum(np.clip(r - a, 0.0, b - a) for a, b in sets[y]) / length
        density[y] = sum(((r >= a) & (r < b)).astype(float) for a, b in sets[y]) / length
    law = np.zeros(vocab)
    for y in tokens:  # each of y's drafts is the highest with the same probability
        others = np.prod([cdf[x] ** (children.count(x) - (x == y)) for x in tokens], axis=0)
        law[y] = children.count(y) * (w * density[y] * others).sum()
    return law


@functools.lru_cache(maxsize=1 << 14)
def _ot_node_cached(p_bytes, q_bytes, children):
    """Select the child of highest rank if that rank is >= r0, accept it with min(1, p/t), else sample
    norm(p - min(p, t)): the single-draft rule of §2 applied to a selection of law t, which the rank sets keep below
    p, so the test accepts every selection up to rounding."""
    p, q = np.frombuffer(p_bytes), np.frombuffer(q_bytes)
    t = ot_selection_law(p, q, len(children))
    chosen = _ot_highest(*_ot_ranks(p_bytes, q_bytes, len(children)), children, len(p))
    accepted = chosen * np.where(t > 0, np.minimum(1.0, p / np.where(t > 0, t, 1.0)), 0.0)
    return accepted + (1 - accepted.sum()) * _normalise(np.maximum(p - np.minimum(p, t), 0.0), p)


def _ot_node(p, q, children):
    return _ot_node_cached(p.tobytes(), q.tobytes(), tuple(sorted(int(c) for c in children)))


ot = _tree(_ot_node)


# ---------------------------------------------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------------------------------------------
# The exact law of each built-in verifier, by its registry name (spectr_gbv.verifiers.VERIFIERS says which are
# lossless and how many drafts each takes; the tests check that both name the same verifiers).
LAWS = {
    "token": token,
    "bv": bv,
    "gbv": gbv,
    "spectr": _tree(_kseq_node),
    "specinfer": _tree(_specinfer_node),
    "nss": _tree(_nss_node),
    "multipath": multipath,
    "spectr_gbv_paper": spectr_gbv_paper,
    "traversal": traversal,
}


def exact_law(name):
    """The function giving the exact law of one iteration of verifier `name`: a built-in's from LAWS, or a
    researcher's class's optional hook `exact_outcomes(p, q, drafts)` (same contract; docs/custom_verifiers.md);
    None when the class gives none."""
    name = ALIASES.get(name, name)
    return LAWS[name] if name in LAWS else getattr(verifier_class(name), "exact_outcomes", None)


def outcomes(name, p, q, drafts):
    """Exact law of one iteration given the K draft paths: [(prob, accepted prefix + next token, cont)]."""
    law = exact_law(name)
    if law is None:
        raise ValueError(f"verifier {name} gives no exact law: its class has no exact_outcomes(p, q, drafts)")
    return law(p, q, tuple(tuple(d) for d in drafts))


def _draft_tuples(q, L, K):
    """All K-tuples of i.i.d. draft paths of length L with their probability under q."""
    paths = [(x, joint(q, x)) for x in _sequences(vocab_size(q), L)]
    paths = [(x, w) for x, w in paths if w > 0]
    for combo in itertools.product(paths, repeat=K):
        yield tuple(x for x, _ in combo), float(np.prod([w for _, w in combo]))


@functools.lru_cache(maxsize=64)
def iteration_law(name, p, q, L, K):
    """One iteration with the K i.i.d. drafts integrated out: {(emitted tokens, cont): probability}.
    Memoised so that E[tau] and the law error of the same instance share one enumeration."""
    law = {}
    for drafts, w in _draft_tuples(q, L, K):
        for prob, emitted, cont in outcomes(name, p, q, drafts):
            law[emitted, cont] = law.get((emitted, cont), 0.0) + w * prob
    return law


def expected_accepted(name, p, q, L, K):
    """E[tau] of one iteration (accepted draft tokens; block efficiency = E[tau] + 1)."""
    return float(sum(prob * (len(emitted) - 1) for (emitted, _), prob in iteration_law(name, p, q, L, K).items()))


def stream_law(name, p, q, L, K, n, iterations=1):
    """Law of the first n generated tokens: `iterations` verification iterations, each on fresh drafts from q
    after the emitted tokens and verified against the previous iteration's continuation (the modified target for
    gbv), then the stream is continued by the last continuation."""
    law = {}

    def extend(prob, seq, cond):
        if len(seq) >= n:
            law[seq[:n]] = law.get(seq[:n], 0.0) + prob
            return
        dist = cond(seq)
        for c in np.flatnonzero(dist > 0):
            extend(prob * dist[c], seq + (int(c),), cond)

    def iterate(prob, seq, target, it):  # seq, target: absolute (from the stream start)
        if it == iterations or len(seq) >= n:
            return extend(prob, seq, target)
        # the first iteration uses p and q themselves, so that it shares iteration_law's memo with E[tau]
        p_block = (lambda v: target(seq + v)) if seq else target
        q_block = (lambda v: q(seq + v)) if seq else q
        for (emitted, cont), o_prob in iteration_law(name, p_block, q_block, L, K).items():
            shifted = lambda v, cont=cont: cont(v[len(seq):])  # noqa: E731
            iterate(prob * o_prob, seq + emitted, shifted, it + 1)

    iterate(1.0, (), p, 0)
    return law


def law_error(name, p, q, L, K, iterations=1, n=None):
    """max |law - target law| of the first n tokens (default L+1: the next block plus its recovered or bonus token)."""
    n = L + 1 if n is None else n
    return max_abs_diff(stream_law(name, p, q, L, K, n, iterations), target_law(p, n))


def block_acceptance(name, p, q, draft):
    """h_1..h_L of a single draft for token, bv and gbv (K=1), in the form tau = max{i : U_i < h_i}: the same
    posteriors a batched kernel must compute on the same inputs. (Token SD's forward rule `stop at the first
    U_i >= min(1, p/q)` is rewritten in this backward form; its law of tau is the same.)"""
    x = tuple(draft)
    rules = {"token": _token_h, "bv": _bv_h, "gbv": lambda p, q, x: _greedy_h(_Measure(p), q, x)}
    if name not in rules:
        raise ValueError(f"block_acceptance: name={name!r}; allowed: {sorted(rules)}")
    return rules[name](p, q, x)


# ---------------------------------------------------------------------------------------------------------------
# Bounds: optimal-transport acceptance (docs/algorithms.md §10.1-10.2) and the paper's claimed optimum (§10.3)
# ---------------------------------------------------------------------------------------------------------------
def alpha_star_brute(p_vec, q_vec, K):
    """min over all subsets A of p(A) + 1 - q(A)^K (max-flow / min-cut form of the OT optimum)."""
    idx = range(len(p_vec))
    return min(
        p_vec[list(A)].sum() + 1 - q_vec[list(A)].sum() ** K
        for r in range(len(p_vec) + 1)
        for A in itertools.combinations(idx, r)
    )


def alpha_star(p_vec, q_vec, K):
    """Same optimum, with A restricted to prefixes of the tokens sorted by increasing p/q (O(V log V))."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(q_vec > 0, p_vec / q_vec, np.inf)
    order = np.argsort(ratio, kind="stable")
    cuts = np.cumsum(p_vec[order]) + 1 - np.cumsum(q_vec[order]) ** K
    return float(min(1.0, cuts.min()))


def _depth_laws(p, q, t):
    seqs = _sequences(vocab_size(p), t)
    return np.array([joint(p, s) for s in seqs]), np.array([joint(q, s) for s in seqs])


def bound_sum(p, q, L, K):
    """sum_t alpha*_t: the OT optimum of the depth-t prefix laws, an upper bound on E[tau] of any lossless
    verifier with K i.i.d. drafts."""
    return sum(alpha_star(*_depth_laws(p, q, t), K) for t in range(1, L + 1))


def claimed_C(p, q, L, K):
    """The paper's claimed optimum C_L(K) = sum_t sum_x B(x) [1 - (1 - min(1, S/B))^K]."""
    total = 0.0
    for t in range(1, L + 1):
        b, s = _depth_laws(p, q, t)
        with np.errstate(divide="ignore", invalid="ignore"):
            total += np.where(b > 0, b * (1 - (1 - np.minimum(1.0, s / b)) ** K), 0.0).sum()
    return float(total)
