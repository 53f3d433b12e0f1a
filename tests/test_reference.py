"""The exact reference laws: every lossless verifier reproduces the target law, the published SpecTr-GBV rule does
not, and the numbers match the anchors and identities of docs/algorithms.md §12. Everything here is exact
enumeration (float64)."""

import itertools

import numpy as np
import pytest
import torch
from scipy.optimize import linprog

from spectr_gbv.verifiers import VERIFIERS, optimal_acceptance, verifier_names
from spectr_gbv.verifiers import reference as ref
from spectr_gbv.verifiers.reference import (
    ANCHORS,
    RandModel,
    accepted_law,
    alpha_star,
    alpha_star_brute,
    anchor,
    block_acceptance,
    bound_sum,
    claimed_C,
    expected_accepted,
    joint,
    law_error,
)

EXACT = 1e-12

# The anchors' values of docs/algorithms.md §12, written out only here (the instances are reference.ANCHORS).
# E[tau] of the first iteration; single-draft verifiers and "gbv@1" at K=1, the others at the anchor's K.
ANCHOR_MEAN_ACCEPTED = {
    "A": dict(token=1.111111, bv=1.222222, **{"gbv@1": 1.333333}, nss=1.012346, specinfer=1.333333,
              spectr=1.405487, multipath=1.617284, gbv=1.481481, spectr_gbv_paper=1.403435,
              traversal=1.419753),
    "B": dict(token=1.190000, bv=1.250000, **{"gbv@1": 1.310000}, nss=0.641791, specinfer=1.305800,
              spectr=1.367192, multipath=1.325200, gbv=1.405400, spectr_gbv_paper=1.297984,
              traversal=1.359800),
    "C": dict(token=1.533000, bv=1.632000, **{"gbv@1": 1.737000}, nss=0.764460, specinfer=1.768116,
              spectr=1.861485, multipath=1.816284, gbv=1.946313, spectr_gbv_paper=1.827053,
              traversal=1.862256),
}
ANCHOR_BOUNDS = {"A": (1.583333, 1.654321), "B": (1.535600, 1.604400), "C": (2.169375, 2.297379)}  # C_L(K), sum a*

# (V, L, K) small enough to enumerate V^(L K) draft tuples quickly; all with zeros in p and q.
SHAPES = [(2, 1, 1), (3, 1, 3), (2, 2, 2), (3, 2, 1), (3, 2, 2), (2, 3, 1), (2, 3, 3), (3, 3, 1), (2, 2, 3)]


def random_pair(vocab, seed):
    """Context-dependent target and drafter with zeros in both (top-k-like truncation)."""
    return (RandModel(vocab, 100 + seed, concentration=0.8, zero_prob=0.25),
            RandModel(vocab, 200 + seed, concentration=0.8, zero_prob=0.25))


def drafts_for(name, K):
    return 1 if VERIFIERS[name].max_drafts == 1 else K


# --- losslessness -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", verifier_names(lossless=True))
@pytest.mark.parametrize("vocab,L,K", SHAPES)
def test_lossless_verifiers_give_the_target_law(name, vocab, L, K):
    for seed in range(2):
        p, q = random_pair(vocab, seed)
        assert law_error(name, p, q, L, drafts_for(name, K)) < EXACT


@pytest.mark.parametrize("vocab,L,K", [(2, 2, 1), (3, 2, 1), (2, 3, 1), (2, 2, 2), (2, 3, 2)])
def test_gbv_stays_exact_over_two_iterations(vocab, L, K):
    p, q = random_pair(vocab, seed=7)
    assert law_error("gbv", p, q, L, K, iterations=2, n=2 * L + 1) < EXACT


def gbv_without_modification(p, q, drafts):
    """Broken control: gbv's acceptance and correction, but the stream continues from the plain target."""
    return [(prob, emitted, p) for prob, emitted, _ in ref.gbv(p, q, drafts)]


@pytest.mark.parametrize("vocab,L,K,iterations", [(2, 3, 1, 1), (2, 3, 2, 1), (3, 2, 1, 2), (2, 2, 2, 2)])
def test_gbv_without_its_modification_is_caught(monkeypatch, vocab, L, K, iterations):
    monkeypatch.setitem(ref.LAWS, "gbv_unmodified", gbv_without_modification)
    p, q = random_pair(vocab, seed=7)
    assert law_error("gbv_unmodified", p, q, L, K, iterations=iterations, n=2 * L + 1) > 1e-3


def test_gbv_without_its_modification_on_the_toy_example(monkeypatch):
    monkeypatch.setitem(ref.LAWS, "gbv_unmodified", gbv_without_modification)
    p, q, L, _ = anchor("A")
    assert law_error("gbv_unmodified", p, q, L, 1) == pytest.approx(0.074, abs=5e-4)  # docs/algorithms.md §4.2


def traversal_in_token_order(p, q, drafts):
    """Broken control: traversal visiting a node's children in token-id order instead of order of first appearance;
    the first child visited is then not a draw from q."""
    return ref.traversal(p, q, tuple(sorted(drafts)))


def traversal_in_node_index_order(p, q, drafts):
    """Broken control, the rule as the public reference code runs it (`traversal_verify`): nodes numbered by first
    appearance over the drafts, draft after draft; the leaf of smallest number is tested next; a rejection turns the
    parent's target into the weighted residual, drops the leaf's token from its draft law and recomputes the weights
    of all the parent's remaining descendants. From K = 3 that is not depth-first: a sibling subtree is entered
    before a half-visited one is finished, whose updated weights the recomputation then overwrites."""
    L, outs = len(drafts[0]), []
    nodes = list(dict.fromkeys(d[:i] for d in drafts for i in range(L + 1)))

    def reweigh(weight, target, draft, below, alive):
        for v in alive:  # parents before children
            if len(v) > len(below) and v[:len(below)] == below:
                weight[v] = min(1.0, weight[v[:-1]] * target[v[:-1]][v[-1]] / draft[v[:-1]][v[-1]])

    def run(prob, weight, target, draft, alive):
        leaf = min((v for v in alive if not any(c[:-1] == v for c in alive if c)), key=nodes.index)
        w = weight[leaf] if leaf else 1.0
        outs.extend(ref._emit(prob * w, leaf, target[leaf], p))
        if not leaf or prob * (1 - w) <= 0:
            return
        weight, target, draft, parent = dict(weight), dict(target), dict(draft), leaf[:-1]
        excess = np.maximum(weight[parent] * target[parent] - draft[parent], 0.0)
        total = excess.sum()
        weight[parent] = total / (total + 1 - weight[parent]) if total > 0 else 0.0
        target[parent] = ref._normalise(excess, target[parent])
        draft[parent] = ref._normalise(np.where(np.arange(len(excess)) == leaf[-1], 0.0, draft[parent]), draft[parent])
        alive = [v for v in alive if v != leaf]
        reweigh(weight, target, draft, parent, alive)
        run(prob * (1 - w), weight, target, draft, alive)

    weight = {(): 1.0}
    target, draft = {v: p(v) for v in nodes}, {v: q(v) for v in nodes if len(v) < L}
    reweigh(weight, target, draft, (), nodes)
    run(1.0, weight, target, draft, nodes)
    return outs


@pytest.mark.parametrize("broken", [traversal_in_token_order, traversal_in_node_index_order])
@pytest.mark.parametrize("vocab,L,K", [(2, 2, 3), (2, 3, 3), (3, 2, 3)])
def test_traversal_in_another_order_is_caught(monkeypatch, broken, vocab, L, K):
    monkeypatch.setitem(ref.LAWS, broken.__name__, broken)
    assert max(law_error(broken.__name__, *random_pair(vocab, seed), L, K) for seed in range(3)) > 1e-3


def test_the_public_codes_order_is_depth_first_up_to_two_drafts(monkeypatch):
    monkeypatch.setitem(ref.LAWS, "node_index_order", traversal_in_node_index_order)
    for vocab, L in [(2, 3), (3, 2)]:
        p, q = random_pair(vocab, seed=0)
        assert law_error("node_index_order", p, q, L, 2) < EXACT
        assert (expected_accepted("node_index_order", p, q, L, 2)
                == pytest.approx(expected_accepted("traversal", p, q, L, 2), abs=EXACT))


@pytest.mark.parametrize("name", ANCHORS)
def test_spectr_gbv_paper_is_biased_at_the_anchors(name):
    p, q, L, K = anchor(name)
    assert law_error("spectr_gbv_paper", p, q, L, K) > 0.01


def one_hot_target(vocab, seed):
    base = RandModel(vocab, 300 + seed)
    return lambda prefix: np.eye(vocab)[np.argmax(base(prefix))]


@pytest.mark.parametrize("name", ref.LAWS)
@pytest.mark.parametrize("vocab,L,K", [(3, 2, 2), (2, 3, 2), (3, 3, 1)])
def test_temperature_zero_is_exact_for_every_verifier(name, vocab, L, K):
    p, (_, q) = one_hot_target(vocab, seed=1), random_pair(vocab, seed=1)
    assert law_error(name, p, q, L, drafts_for(name, K)) < EXACT


# --- anchor values ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ANCHORS)
def test_anchor_values(name):
    p, q, L, K = anchor(name)
    for column, value in ANCHOR_MEAN_ACCEPTED[name].items():
        verifier, k = ("gbv", 1) if column == "gbv@1" else (column, drafts_for(column, K))
        assert expected_accepted(verifier, p, q, L, k) == pytest.approx(value, abs=1e-6), column
    assert (claimed_C(p, q, L, K), bound_sum(p, q, L, K)) == pytest.approx(ANCHOR_BOUNDS[name], abs=1e-6)


# --- identities ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("vocab,L", [(2, 3), (3, 2), (3, 3)])
def test_gbv_single_draft_attains_the_sum_of_overlaps(vocab, L):
    p, q = random_pair(vocab, seed=3)
    overlaps = sum(min(joint(p, s), joint(q, s))
                   for t in range(1, L + 1) for s in itertools.product(range(vocab), repeat=t))
    assert expected_accepted("gbv", p, q, L, 1) == pytest.approx(overlaps, abs=EXACT)
    assert claimed_C(p, q, L, 1) == pytest.approx(overlaps, abs=EXACT)


@pytest.mark.parametrize("K", [1, 2, 3])
def test_gbv_with_one_token_is_specinfer(K):
    p, q = random_pair(4, seed=K)
    assert expected_accepted("gbv", p, q, 1, K) == pytest.approx(expected_accepted("specinfer", p, q, 1, K), abs=EXACT)


@pytest.mark.parametrize("vocab,L", [(2, 3), (3, 2), (3, 3)])
def test_single_draft_orderings(vocab, L):
    p, q = random_pair(vocab, seed=4)
    token, bv = expected_accepted("token", p, q, L, 1), expected_accepted("bv", p, q, L, 1)
    assert expected_accepted("multipath", p, q, L, 1) == pytest.approx(bv, abs=EXACT)
    assert expected_accepted("traversal", p, q, L, 1) == pytest.approx(bv, abs=EXACT)  # on one chain it is bv
    assert token <= bv + EXACT


@pytest.mark.parametrize("name", ["token", "bv", "gbv"])
def test_block_acceptance_gives_the_accepted_length(name):
    p, q = random_pair(3, seed=5)
    L = 3
    drafts = [x for x in itertools.product(range(3), repeat=L) if joint(q, x) > 0]
    from_h = sum(joint(q, x) * np.dot(np.arange(L + 1), accepted_law(block_acceptance(name, p, q, x))) for x in drafts)
    assert from_h == pytest.approx(expected_accepted(name, p, q, L, 1), abs=EXACT)


def lp_alpha_star(p_vec, q_vec, K):
    """The OT problem itself: max P(Y in {X_1..X_K}) over couplings of q^K and p (variables pi(x, y))."""
    V = len(p_vec)
    tuples = list(itertools.product(range(V), repeat=K))
    gain = np.array([-float(y in x) for x in tuples for y in range(V)])
    rows = [np.kron(np.eye(len(tuples))[i], np.ones(V)) for i in range(len(tuples))]
    rows += [np.kron(np.ones(len(tuples)), np.eye(V)[y]) for y in range(V)]
    mass = [np.prod(q_vec[list(x)]) for x in tuples] + list(p_vec)
    return -linprog(gain, A_eq=np.array(rows), b_eq=mass, bounds=(0, None), method="highs").fun


@pytest.mark.parametrize("K", [1, 2, 3])
def test_alpha_star_three_ways(K):
    rng = np.random.default_rng(K)
    for _ in range(5):
        p_vec, q_vec = (np.where(rng.random(4) < 0.25, 0.0, rng.dirichlet(np.ones(4))) for _ in range(2))
        p_vec, q_vec = p_vec / p_vec.sum(), q_vec / q_vec.sum()
        brute = alpha_star_brute(p_vec, q_vec, K)
        assert alpha_star(p_vec, q_vec, K) == pytest.approx(brute, abs=EXACT)
        assert lp_alpha_star(p_vec, q_vec, K) == pytest.approx(brute, abs=1e-7)


@pytest.mark.parametrize("vocab,L,K", [(2, 2, 2), (3, 2, 2), (2, 3, 3), (3, 2, 3)])
def test_no_lossless_verifier_beats_the_bound(vocab, L, K):
    p, q = random_pair(vocab, seed=6)
    bound = bound_sum(p, q, L, K)
    assert claimed_C(p, q, L, K) <= bound + EXACT
    for name in verifier_names(lossless=True):
        assert expected_accepted(name, p, q, L, drafts_for(name, K)) <= bound + EXACT, name
    # with one draft the greedy rule reaches its bound in the first iteration (the audit's "of bound" = 100%)
    assert expected_accepted("gbv", p, q, L, 1) == pytest.approx(bound_sum(p, q, L, 1), abs=EXACT)


def test_single_draft_verifier_refuses_several_drafts():
    p, q = random_pair(2, seed=0)
    with pytest.raises(ValueError, match="single draft"):
        ref.outcomes("bv", p, q, [(0,), (1,)])


# --- ot: the optimal token-level coupling (docs/algorithms.md §15), an exact law of the reference only -------------
OT_ANCHOR_MEAN_ACCEPTED = {"A": 1.580247, "B": 1.501660, "C": 2.095275}


def random_node(rng, vocab):
    """One node's p and q with zeros in both (never all)."""
    def draw():
        vec = np.where(rng.random(vocab) < 0.25, 0.0, rng.dirichlet(np.full(vocab, 0.8)))
        vec[rng.integers(vocab)] += 0.0 if vec.sum() > 0 else 1.0
        return vec / vec.sum()
    return draw(), draw()


def node_outcome(node_law, p_vec, q_vec, k):
    """Enumerate the k i.i.d. children of one node: (law of the node's token, P(it is one of the children))."""
    law, accepted = np.zeros(len(p_vec)), 0.0
    for children in itertools.product(range(len(p_vec)), repeat=k):
        weight = np.prod(q_vec[list(children)])
        if weight > 0:
            out = node_law(p_vec, q_vec, list(children))
            law += weight * out
            accepted += weight * out[list(set(children))].sum()
    return law, accepted


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_ot_node_is_lossless_and_attains_alpha_star(k):
    rng, gains = np.random.default_rng(10 + k), []
    for vocab in (2, 3, 4, 5, 5):
        p_vec, q_vec = random_node(rng, vocab)
        law, accepted = node_outcome(ref._ot_node, p_vec, q_vec, k)
        assert np.abs(law - p_vec).max() < EXACT
        assert accepted == pytest.approx(alpha_star_brute(p_vec, q_vec, k), abs=EXACT)
        bound = optimal_acceptance(torch.from_numpy(p_vec), torch.from_numpy(q_vec), k).item()
        assert accepted == pytest.approx(bound, abs=EXACT)
        t = ref.ot_selection_law(p_vec, q_vec, k)  # the selection's law: below p, summing to alpha*
        assert (t <= p_vec + EXACT).all() and t.sum() == pytest.approx(bound, abs=EXACT)
        for other in (ref._kseq_node, ref._specinfer_node):
            gains.append(accepted - node_outcome(other, p_vec, q_vec, k)[1])
    assert min(gains) > -EXACT
    assert k == 1 or max(gains) > 1e-3  # with several drafts it beats them somewhere


def ot_accepting_every_selection(p, q, children):
    """Broken control: ot's selection accepted without its test min(1, p/t), p sampled when nothing is selected."""
    children = tuple(sorted(int(c) for c in children))
    chosen = ref._ot_highest(*ref._ot_ranks(p.tobytes(), q.tobytes(), len(children)), children, len(p))
    return chosen + (1 - chosen.sum()) * p


@pytest.mark.parametrize("vocab,L,K", SHAPES)
def test_ot_gives_the_target_law(monkeypatch, vocab, L, K):
    monkeypatch.setitem(ref.LAWS, "ot", ref.ot)
    for seed in range(2):
        p, q = random_pair(vocab, seed)
        assert law_error("ot", p, q, L, K) < EXACT
    p, (_, q) = one_hot_target(vocab, seed=1), random_pair(vocab, seed=1)  # temperature 0
    assert law_error("ot", p, q, L, K) < EXACT


@pytest.mark.parametrize("vocab,L,K", [(2, 2, 2), (3, 2, 2), (2, 3, 3)])
def test_ot_without_its_acceptance_test_is_caught(monkeypatch, vocab, L, K):
    monkeypatch.setitem(ref.LAWS, "ot_broken", ref._tree(ot_accepting_every_selection))
    p, q = random_pair(vocab, seed=2)
    assert law_error("ot_broken", p, q, L, K) > 1e-3


@pytest.mark.parametrize("name", ANCHORS)
def test_ot_anchor_values(monkeypatch, name):
    monkeypatch.setitem(ref.LAWS, "ot", ref.ot)
    p, q, L, K = anchor(name)
    assert expected_accepted("ot", p, q, L, K) == pytest.approx(OT_ANCHOR_MEAN_ACCEPTED[name], abs=1e-6)
    assert expected_accepted("ot", p, q, 1, K) == pytest.approx(alpha_star(p(()), q(()), K), abs=EXACT)  # L = 1
    assert OT_ANCHOR_MEAN_ACCEPTED[name] <= ANCHOR_BOUNDS[name][1]


def draft_by_draft_best(p_vec, q_vec, K):
    """Best acceptance of a rule that settles draft 1 before looking at the others: accept it with g/q (g <= p, q),
    else run the best (K-1)-draft rule on the rest, whose target norm(p - g) may as well not depend on the rejected
    token (alpha* is concave in the target). Its acceptance min_A [p(A) + 1 - g(A) - (1 - g(V)) q(A)^(K-1)], maximised
    over g by a linear program over all subsets A."""
    vocab, rows = len(p_vec), []
    for r in range(vocab + 1):
        for A in itertools.combinations(range(vocab), r):
            q_a = q_vec[list(A)].sum() ** (K - 1)
            rows.append((np.isin(np.arange(vocab), A) - q_a, p_vec[list(A)].sum() + 1 - q_a))
    gain = np.r_[np.zeros(vocab), -1.0]  # variables g, z: maximise z <= each subset's value
    A_ub = np.array([np.r_[row, 1.0] for row, _ in rows])
    bounds = [(0, cap) for cap in np.minimum(p_vec, q_vec)] + [(None, None)]
    return -linprog(gain, A_ub=A_ub, b_ub=[b for _, b in rows], bounds=bounds, method="highs").fun


def test_a_draft_by_draft_rule_falls_short_of_alpha_star():
    """Why ot looks at all the drafts at once (docs/algorithms.md §15.4): at anchor C's root with K = 2 the best rule
    that settles draft 1 first accepts 0.871429, against alpha* = 0.91 (and ot's 0.91)."""
    p, q, _, K = anchor("C")
    assert draft_by_draft_best(p(()), q(()), K) == pytest.approx(0.871429, abs=1e-6)
    assert alpha_star(p(()), q(()), K) == pytest.approx(0.91, abs=EXACT)
