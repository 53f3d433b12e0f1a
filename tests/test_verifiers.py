"""The batched verifiers: their contract, their laws on whole generated streams (with negative controls that must
fail), temperature 0, the anchors of docs/algorithms.md §12, and parity with the exact float64 reference."""
import numpy as np
import pytest
import torch
from scipy import stats

from spectr_gbv.verifiers import ALIASES, VERIFIERS, build_verifier, optimal_acceptance, verifier_names
from spectr_gbv.verifiers import base, block, reference, traversal, tree
from spectr_gbv.verifiers.block import bv_acceptance
from spectr_gbv.verifiers.greedy import greedy_acceptance
from toy_streams import ToyModel, generate_streams, law_p_value

LOSSLESS = verifier_names(lossless=True)
MULTI_DRAFT = verifier_names(multi_draft=True)
P_MIN = 1e-6  # chi-square threshold: a correct verifier fails with probability below 1e-6


def drafts_for(name, k):
    return 1 if VERIFIERS[name].max_drafts == 1 else k


def random_call(B=4, K=2, L=3, V=5, dtype=torch.float64, seed=0, zero_below=0.0):
    """Random drafts and distributions; weights under zero_below are zeroed, as top-k / top-p do."""
    g = torch.Generator().manual_seed(seed)
    q = truncate(torch.rand(B, K, L, V, generator=g, dtype=dtype), zero_below)
    p = truncate(torch.rand(B, K, L + 1, V, generator=g, dtype=dtype), zero_below)
    q, p = q / q.sum(-1, keepdim=True), p / p.sum(-1, keepdim=True)
    x = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, K, L)
    return x, q, p


def truncate(weights, below):
    """Zero the weights under `below`, keeping each row's largest so that no row is all zero."""
    return weights * ((weights >= below) | (weights == weights.amax(-1, keepdim=True)))


# ---- contract ---------------------------------------------------------------------------------------------------

def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="verifier=gvb: unknown verifier; choose one of token, bv, gbv"):
        build_verifier("gvb")


def test_lossless_flags_and_alias():
    assert not VERIFIERS["spectr_gbv_paper"].lossless
    assert build_verifier("spectr_gbv").__class__ is VERIFIERS[ALIASES["spectr_gbv"]] is VERIFIERS["gbv"]
    assert set(LOSSLESS) == {"token", "bv", "gbv", "spectr", "specinfer", "nss", "multipath", "traversal"}
    assert set(reference.LAWS) == set(VERIFIERS)  # the exact reference covers every built-in


@pytest.mark.parametrize("name", verifier_names(multi_draft=False))
def test_single_draft_verifier_refuses_several_drafts(name):
    with pytest.raises(ValueError, match="at most 1 draft"):
        build_verifier(name)(*random_call(K=2))


@pytest.mark.parametrize("name", VERIFIERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_output_shapes_and_ranges(name, dtype):
    x, q, p = random_call(B=6, K=drafts_for(name, 3), L=4, dtype=dtype)
    out = build_verifier(name)(x, q, p, generator=torch.Generator().manual_seed(1))
    for t in (out.num_accepted, out.draft_index, out.next_token):
        assert t.shape == (6,) and t.dtype == torch.int64
    assert ((0 <= out.num_accepted) & (out.num_accepted <= 4)).all()
    assert ((0 <= out.draft_index) & (out.draft_index < x.shape[1])).all()


@pytest.mark.parametrize("corrupt, message", [
    (lambda x, q, p: (x, q.masked_fill(q == q.max(), float("nan")), p), "draft_probs contains NaN"),
    (lambda x, q, p: (x, q, p.masked_fill(p == p.max(), float("inf"))), "target_probs contains NaN or inf"),
    (lambda x, q, p: (x, q, p - 0.5 * (p == p.max())), "target_probs contains negative|target_probs rows"),
    (lambda x, q, p: (x, q * 1.01, p), "draft_probs rows must sum to 1"),
    (lambda x, q, p: (x, q, p[:, :, :-1]), "target_probs must have shape"),
    (lambda x, q, p: (x, q.half(), p), "draft_probs must have shape|float32 or float64"),
    (lambda x, q, p: (x.int(), q, p), "draft_tokens must be int64"),
])
def test_bad_inputs_name_the_tensor(corrupt, message):
    with pytest.raises(ValueError, match=message):
        build_verifier("gbv")(*corrupt(*random_call()))


# ---- randomness: a generator per row, and uniforms that are exactly 0 -----------------------------------------

ROW_SEEDS = [11, 12, 13, 14]


def generators(seeds):
    return [torch.Generator().manual_seed(seed) for seed in seeds]


def outcome(out, rows=slice(None)):
    return [t[rows].tolist() for t in (out.num_accepted, out.draft_index, out.next_token)]


@pytest.mark.parametrize("name", VERIFIERS)
def test_a_generator_per_row_makes_each_row_independent_of_the_batch(name):
    """Row b of a batch with generators[b] gives exactly what row b alone gives with a generator seeded alike, over
    three calls that thread the state (gbv's pending levels) on both sides."""
    verifier, B = build_verifier(name), len(ROW_SEEDS)
    batch_generators, alone_generators = generators(ROW_SEEDS), generators(ROW_SEEDS)
    batch_state, alone_states = None, [None] * B
    for seed in range(3):
        x, q, p = random_call(B=B, K=drafts_for(name, 3), L=3, V=6, seed=seed, zero_below=0.2)
        out = verifier(x, q, p, generator=batch_generators, state=batch_state)
        batch_state = out.state
        for b in range(B):
            alone = verifier(x[b:b + 1], q[b:b + 1], p[b:b + 1], generator=alone_generators[b], state=alone_states[b])
            alone_states[b] = alone.state
            assert outcome(alone) == outcome(out, slice(b, b + 1)), f"row {b}, call {seed}"


@pytest.mark.parametrize("shape", [(4, 3, 6), (4, 6)])
def test_sample_takes_row_draws_from_its_own_generator(shape):
    probs = truncate(torch.rand(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64), 0.3)
    batch = base.sample(probs, generators(ROW_SEEDS))
    alone = [base.sample(probs[b:b + 1], generator).tolist() for b, generator in enumerate(generators(ROW_SEEDS))]
    assert [batch[b:b + 1].tolist() for b in range(len(ROW_SEEDS))] == alone


def sample_reference(probs, generator):
    """sample()'s reference: one float64 CDF over the whole row, inverted (the first token whose cdf exceeds u)."""
    flat = probs.reshape(-1, probs.shape[-1]).double()
    cdf = flat.cumsum(-1)
    u = base.uniforms(probs.shape[:-1], cdf, generator).reshape(-1, 1) * cdf[:, -1:]
    return base.invert_cdf(cdf, flat, u).reshape(probs.shape[:-1])


def sparse_rows(rows=64, V=1000, seed=0):
    """Unnormalised float32 rows with runs of zeros longer than a block, and mass in the last, partial block."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(rows, V, generator=g) ** 4
    runs = torch.rand(rows, V // 100, generator=g) < 0.5  # zero whole stretches of 100 tokens
    weights = weights * ~runs.repeat_interleave(100, 1) * (torch.rand(rows, V, generator=g) > 0.3)
    weights[:, -1] = torch.rand(rows, generator=g)
    return weights


@pytest.mark.parametrize("block_size", [1, 7, 64, 1000, 4096])
def test_sample_draws_what_one_whole_cdf_draws(block_size):
    """The two-level inverse CDF picks the token one CDF over the whole row picks, from the same uniforms."""
    probs = sparse_rows()
    for seed in range(20):
        fast = base.sample(probs, torch.Generator().manual_seed(seed), block=block_size)
        assert fast.tolist() == sample_reference(probs, torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("u", [0.0, 1.0])
def test_sample_at_the_ends_of_the_unit_interval_draws_the_first_and_last_positive_token(u, monkeypatch):
    """u = 0, and u * total rounded up to the total (u = 1 here), must still land on tokens of positive weight."""
    probs = sparse_rows()
    probs[:, :150] = 0
    probs[:, -3:] = 0
    rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: rand(*args, **kwargs).fill_(u))
    positive = (probs > 0).nonzero()
    token = base.sample(probs, None, block=64)
    assert (probs.gather(1, token[:, None]) > 0).all()
    ends = [row[:, 1].min() if u == 0 else row[:, 1].max() for row in positive.split(
        torch.bincount(positive[:, 0]).tolist())]
    assert token.tolist() == [int(end) for end in ends]


@pytest.mark.parametrize("name", VERIFIERS)
def test_a_single_generator_still_works_and_a_wrong_count_is_refused(name):
    x, q, p = random_call(B=4, K=drafts_for(name, 3), V=6)
    single = build_verifier(name)(x, q, p, generator=torch.Generator().manual_seed(0))
    assert outcome(single) == outcome(build_verifier(name)(x, q, p, generator=torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match="one per row"):
        build_verifier(name)(x, q, p, generator=generators(ROW_SEEDS[:3]))


def truncated_instances(K, L, count=8, vocab=4):
    """`count` trie-consistent instances, one per row, with zeros (top-k / top-p) in the target's and the drafter's
    laws."""
    rows = []
    for seed in range(count):
        p_model = reference.RandModel(vocab, seed, zero_prob=0.4)
        q_model = reference.RandModel(vocab, seed + 50, zero_prob=0.2)
        rng = np.random.default_rng(seed)
        rows.append(instance(p_model, q_model, [sample_path(q_model, L, rng) for _ in range(K)], rows=1))
    return [torch.cat(parts) for parts in zip(*rows)]


@pytest.mark.parametrize("name", VERIFIERS)
def test_zero_uniforms_never_emit_a_token_the_target_excludes(name, monkeypatch):
    """Zeros in p and q (top-k / top-p) are legal inputs, and torch.rand returns exactly 0 about once in 2^24 float32
    draws: with u <= h instead of u < h, that accepts a drafted token of target probability 0. Every uniform is made 0
    here."""
    L = 3
    x, q, p = truncated_instances(drafts_for(name, 3), L)
    assert (p[:, :, :L].gather(-1, x[..., None]) == 0).any(), "no drafted token has target probability 0"
    assert (q == 0).any() and (p == 0).any()
    rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: rand(*args, **kwargs).zero_())
    out = build_verifier(name)(x, q, p, generator=torch.Generator().manual_seed(0))
    rows = torch.arange(len(x))
    path, path_p = x[rows, out.draft_index], p[rows, out.draft_index]  # [B, L], [B, L+1, V]
    accepted = torch.arange(L) < out.num_accepted[:, None]
    assert (path_p[:, :L].gather(-1, path[..., None]).squeeze(-1)[accepted] > 0).all(), "accepted a p = 0 token"
    assert (path_p[rows, out.num_accepted, out.next_token] > 0).all(), "next_token has p = 0"


# ---- laws of whole streams --------------------------------------------------------------------------------------

STREAM_CASES = [  # (vocab, seed of the pair, K, L): context-dependent models with zeros in p and q
    (3, 1, 3, 3),
    (3, 7, 2, 2),
    (4, 3, 3, 2),
]


def toy_pair(vocab, seed, one_hot=False):
    return (ToyModel(vocab, seed, zero_prob=0.2, one_hot=one_hot), ToyModel(vocab, seed + 100, zero_prob=0.15))


@pytest.mark.parametrize("vocab, seed, K, L", STREAM_CASES)
@pytest.mark.parametrize("name", LOSSLESS)
def test_lossless_verifiers_give_the_target_law_of_whole_streams(name, vocab, seed, K, L):
    target, drafter = toy_pair(vocab, seed)
    samples, _ = generate_streams(build_verifier(name), target, drafter, rows=10_000,
                                  num_drafts=drafts_for(name, K), block_length=L, num_tokens=3, seed=seed)
    assert law_p_value(samples, target.law(3)) > P_MIN


@pytest.mark.parametrize("K", [1, 3])
def test_gbv_without_its_target_modification_fails(K):
    target, drafter = toy_pair(3, 1)
    samples, _ = generate_streams(build_verifier("gbv"), target, drafter, rows=10_000, num_drafts=K,
                                  block_length=3, num_tokens=3, seed=1, keep_state=False)
    assert law_p_value(samples, target.law(3)) < P_MIN


@pytest.mark.parametrize("name, module", [("token", block), ("bv", block), ("specinfer", tree),
                                          ("traversal", traversal)])
def test_residual_p_instead_of_normalised_excess_fails(name, module, monkeypatch):
    monkeypatch.setattr(module, "normalise", lambda residual, fallback: fallback)  # residual := p
    target, drafter = toy_pair(3, 1)
    samples, _ = generate_streams(build_verifier(name), target, drafter, rows=10_000,
                                  num_drafts=drafts_for(name, 3), block_length=3, num_tokens=3, seed=1)
    assert law_p_value(samples, target.law(3)) < P_MIN


def test_published_rule_is_biased_at_positive_temperature():
    target, drafter = toy_pair(3, 1)
    samples, _ = generate_streams(build_verifier("spectr_gbv_paper"), target, drafter, rows=10_000, num_drafts=3,
                                  block_length=3, num_tokens=3, seed=1)
    assert law_p_value(samples, target.law(3)) < P_MIN


@pytest.mark.parametrize("name", VERIFIERS)
@pytest.mark.parametrize("K, L", [(1, 1), (3, 4)])
def test_temperature_zero_emits_the_greedy_path(name, K, L):
    """One-hot targets: every lossless verifier, and the published rule too, emits exactly the greedy tokens."""
    target, drafter = toy_pair(4, 5, one_hot=True)
    samples, _ = generate_streams(build_verifier(name), target, drafter, rows=2_000,
                                  num_drafts=drafts_for(name, K), block_length=L, num_tokens=5, seed=2)
    (greedy, prob), = [(seq, pr) for seq, pr in target.law(5).items() if pr > 0]
    assert prob == 1.0 and (samples == torch.tensor(greedy)).all()


# ---- the anchors (docs/algorithms.md §12): mean accepted count of the first iteration ------------------------

# every verifier once, and gbv with one draft as well; single-draft verifiers run at K = 1
ANCHOR_COLUMNS = list(VERIFIERS) + ["gbv@1"]


@pytest.mark.parametrize("anchor", reference.ANCHORS)
@pytest.mark.parametrize("column", ANCHOR_COLUMNS)
def test_anchor_mean_accepted_length(anchor, column):
    """Monte Carlo against the exact reference value (which tests/test_reference.py pins to docs/algorithms.md §12)."""
    p, q, L, K = reference.ANCHORS[anchor]
    name = column.split("@")[0]
    K = 1 if column.endswith("@1") else drafts_for(name, K)
    exact = reference.expected_accepted(name, reference.ConstModel(p), reference.ConstModel(q), L, K)
    target, drafter = ToyModel(len(p), 0, const=p), ToyModel(len(q), 0, const=q)
    rows = 40_000
    _, accepted = generate_streams(build_verifier(name), target, drafter, rows=rows, num_drafts=K,
                                   block_length=L, num_tokens=1, seed=3)
    standard_error = accepted.std().item() / rows ** 0.5
    assert abs(accepted.mean().item() - exact) < 5 * standard_error


# ---- parity with the exact reference ----------------------------------------------------------------------------

def instance(p_model, q_model, drafts, rows):
    """Batched tensors of one instance (block-relative reference models, fixed drafts), repeated over rows."""
    q = [[q_model(d[:i]) for i in range(len(d))] for d in drafts]
    p = [[p_model(d[:i]) for i in range(len(d) + 1)] for d in drafts]
    expand = lambda a: torch.tensor(np.array(a))[None].expand(rows, *np.array(a).shape).contiguous()  # noqa: E731
    return expand(drafts).long(), expand(q), expand(p)


def sample_path(q_model, length, rng):
    path = ()
    for _ in range(length):
        path += (int(rng.choice(len(q_model(path)), p=q_model(path))),)
    return path


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("name", ["bv", "gbv"])
def test_block_posteriors_match_reference(name, seed):
    """Same inputs, same h: then the same uniforms give the same tau."""
    p_model, q_model = reference.RandModel(4, seed, zero_prob=0.2), reference.RandModel(4, seed + 50, zero_prob=0.2)
    draft = sample_path(q_model, 4, np.random.default_rng(seed))
    x, q, p = instance(p_model, q_model, [draft], rows=1)
    if name == "bv":
        h, _ = bv_acceptance(x[:, 0], q[:, 0], p[:, 0])
    else:
        log_s = torch.cat([torch.zeros(1, 1, dtype=q.dtype),
                           q[:, 0].gather(-1, x[:, 0, :, None]).squeeze(-1).log().cumsum(-1)], -1)
        h = greedy_acceptance(p[:, 0, :4], q[:, 0], x[:, 0], log_s, 4)
    np.testing.assert_allclose(h[0].numpy(), reference.block_acceptance(name, p_model, q_model, draft), atol=1e-12)


@pytest.mark.parametrize("name", VERIFIERS)
@pytest.mark.parametrize("seed", [0, 1])
def test_outcome_law_given_the_drafts_matches_reference(name, seed):
    """Conditional on fixed drafts, the batched verifier's (accepted prefix, extra token) law equals the exact one."""
    L, K, rows = 2, drafts_for(name, 3), 20_000
    p_model, q_model = reference.RandModel(3, 11 + seed, zero_prob=0.2), reference.RandModel(3, 21 + seed)
    rng = np.random.default_rng(seed)
    drafts = tuple(sample_path(q_model, L, rng) for _ in range(K))
    exact = {}
    for prob, emitted, _ in reference.outcomes(name, p_model, q_model, drafts):
        exact[emitted] = exact.get(emitted, 0.0) + prob
    x, q, p = instance(p_model, q_model, drafts, rows)
    out = build_verifier(name)(x, q, p, generator=torch.Generator().manual_seed(4))
    emitted = [drafts[k][:n] + (y,) for k, n, y in
               zip(out.draft_index.tolist(), out.num_accepted.tolist(), out.next_token.tolist())]
    support = sorted(exact)
    observed = np.array([emitted.count(e) for e in support])
    assert observed.sum() == rows, "an outcome outside the exact law's support"
    expected = np.array([exact[e] for e in support]) * rows
    assert stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue > P_MIN


@pytest.mark.parametrize("anchor", reference.ANCHORS)
@pytest.mark.parametrize("K", [1, 2])
def test_traversal_anchor_mean_is_the_kernels_own_mean_over_all_drafts(anchor, K):
    """docs/algorithms.md §12 from the kernel alone: its closed-form law of tau given the drafts (accepted_law, checked
    draft tuple by draft tuple in test_arena.py) averaged over every draft tuple, one per row, weighted by its
    probability under q."""
    p, q, L, _ = reference.ANCHORS[anchor]
    p_model, q_model = reference.ConstModel(p), reference.ConstModel(q)
    tuples = list(reference._draft_tuples(q_model, L, K))
    x, q_rows, p_rows = (torch.cat(parts) for parts in zip(*(instance(p_model, q_model, drafts, rows=1)
                                                                for drafts, _ in tuples)))
    means = build_verifier("traversal").accepted_law(x, q_rows, p_rows) @ torch.arange(L + 1, dtype=torch.float64)
    weights = torch.tensor([w for _, w in tuples], dtype=torch.float64)
    exact = reference.expected_accepted("traversal", p_model, q_model, L, K)
    assert (weights * means).sum().item() == pytest.approx(exact, abs=1e-12)


def test_optimal_acceptance_matches_brute_force():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(5), size=20)
    q = rng.dirichlet(np.ones(5), size=20)
    p[::3, 0] = 0
    p /= p.sum(-1, keepdims=True)
    for K in (1, 2, 4):
        fast = optimal_acceptance(torch.tensor(p), torch.tensor(q), K).numpy()
        brute = [reference.alpha_star_brute(pi, qi, K) for pi, qi in zip(p, q)]
        np.testing.assert_allclose(fast, brute, atol=1e-12)
    one_draft = optimal_acceptance(torch.tensor(p), torch.tensor(q), 1).numpy()
    np.testing.assert_allclose(one_draft, np.minimum(p, q).sum(-1), atol=1e-12)  # K = 1: 1 - TV
