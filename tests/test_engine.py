"""The engine on tiny random models: warping, greedy identity with transformers, the exact sampling law of the
first tokens, KV caches that equal a fresh prefill, and the per-sequence record."""

import collections

import pytest
import torch
from scipy.stats import chisquare
from transformers import DynamicCache

from spectr_gbv.engine import SpeculativeEngine
from spectr_gbv.models import tiny
from spectr_gbv.sampling import Sampling, warp
from spectr_gbv.verifiers import Verifier, VerifierOutput, build_verifier
from spectr_gbv.verifiers.reference import LOSSLESS, SINGLE_DRAFT

MAX_NEW = 16
PROMPTS = ["hello world", "The quick brown", "a"]
EOS_PROMPT, EOS_STEP = 1, 2  # greedy decoding of PROMPTS[1] is made to end with EOS as its third token
P_VALUE = 1e-6  # chi-square: an exact engine fails with probability 1e-6; the broken control lands far below


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models are all per-op overhead: a second thread only adds synchronisation (several times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- warp ------------------------------------------------------------------------------------------------------

def test_greedy_warp_is_exact_one_hot():
    logits = torch.tensor([[1e30, -3.0, 2.0], [0.0, 5.0, 5.0 - 1e-6]])
    assert torch.equal(warp(logits, 0.0), torch.tensor([[1.0, 0, 0], [0, 1.0, 0]]))


def test_top_k_and_top_p_keep_the_smallest_sufficient_set():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64).log()
    assert torch.allclose(warp(logits, 1.0, top_k=3), torch.tensor([0.5, 0.3, 0.15, 0]).double() / 0.95)
    # {0.5, 0.3} is the smallest set reaching 0.79; 0.81 needs the third token
    assert torch.allclose(warp(logits, 1.0, top_p=0.79), torch.tensor([0.625, 0.375, 0, 0]).double())
    assert torch.allclose(warp(logits, 1.0, top_p=0.81), torch.tensor([0.5, 0.3, 0.15, 0]).double() / 0.95)
    assert torch.allclose(warp(logits, 1.0, top_k=1, top_p=0.1), torch.tensor([1.0, 0, 0, 0]).double())
    assert torch.allclose(warp(logits, 2.0), (logits / 2).softmax(-1))


@pytest.mark.parametrize("dtype, expected", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                             (torch.float64, torch.float64)])
def test_warp_rows_are_distributions_in_float32_or_wider(dtype, expected):
    logits = torch.randn(3, 5, 50, generator=torch.Generator().manual_seed(0)).to(dtype)
    for temperature, top_k, top_p in [(0.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 10, 1.0), (1.3, 0, 0.9), (1.0, 5, 0.5)]:
        probs = warp(logits, temperature, top_k, top_p)
        assert probs.dtype == expected and probs.min() >= 0
        assert torch.allclose(probs.sum(-1), torch.ones((), dtype=expected))


@pytest.mark.parametrize("kwargs", [dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5),
                                    dict(draft_temperature=-0.5)])
def test_bad_sampling_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        Sampling(**kwargs)


# ---- greedy identity ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def greedy_pair():
    """float64 target and drafter; the target's EOS ids gain a token that greedy decoding of PROMPTS[EOS_PROMPT]
    emits at step EOS_STEP, so that prompt ends inside a block."""
    target = tiny(seed=0, dtype="float64")
    drafter = tiny(seed=0, perturb=0.2, dtype="float64")
    prompts = [target.tokenizer(text, add_special_tokens=False).input_ids for text in PROMPTS]
    first = hf_greedy(target, prompts[EOS_PROMPT], EOS_STEP + 1)
    assert first[EOS_STEP] not in first[:EOS_STEP], "pick another EOS_STEP: the token occurs earlier"
    target.model.generation_config.eos_token_id = [target.tokenizer.eos_token_id, first[EOS_STEP]]
    return target, drafter, prompts


def hf_greedy(loaded, prompt, max_new_tokens):
    out = loaded.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def greedy_reference(greedy_pair):
    target, _, prompts = greedy_pair
    return [hf_greedy(target, prompt, MAX_NEW) for prompt in prompts]


def test_ar_is_transformers_greedy(greedy_pair, greedy_reference):
    target, _, prompts = greedy_pair
    engine = SpeculativeEngine(target, None, "ar", sampling=Sampling(temperature=0.0))
    for prompt, expected in zip(prompts, greedy_reference):
        record = engine.generate(prompt, MAX_NEW, torch.Generator().manual_seed(0))
        assert record.output_ids == expected
        assert record.target_calls == record.new_tokens
    assert len(greedy_reference[EOS_PROMPT]) == EOS_STEP + 1  # the engineered EOS is reached
    assert any(len(out) == MAX_NEW for out in greedy_reference)  # and another is cut at max_new_tokens


GREEDY_CASES = [(name, K, L) for name in sorted(LOSSLESS) for K in (1, 3) for L in (1, 4)
                if not (K > 1 and name in SINGLE_DRAFT)]


@pytest.mark.parametrize("name, K, L", GREEDY_CASES)
def test_lossless_verifiers_emit_the_greedy_path(greedy_pair, greedy_reference, name, K, L):
    target, drafter, prompts = greedy_pair
    sampling = Sampling(temperature=0.0, draft_temperature=1.0 if K > 1 else None)
    engine = SpeculativeEngine(target, drafter, name, num_drafts=K, block_length=L, sampling=sampling)
    accepted = 0
    for seed, (prompt, expected) in enumerate(zip(prompts, greedy_reference)):
        record = engine.generate(prompt, MAX_NEW, torch.Generator().manual_seed(seed))
        assert record.output_ids == expected
        check_record(record, K, L, MAX_NEW)
        accepted += sum(record.accepted_lengths)
    assert accepted > 0  # the perturbed drafter's tokens do get accepted


def test_a_block_is_cut_at_eos(greedy_pair, greedy_reference):
    """With the target as its own drafter the first block emits L + 1 = 5 tokens; EOS is the third."""
    target, _, prompts = greedy_pair
    engine = SpeculativeEngine(target, target, "token", block_length=4, sampling=Sampling(temperature=0.0))
    record = engine.generate(prompts[EOS_PROMPT], MAX_NEW, torch.Generator().manual_seed(0))
    assert record.accepted_lengths == [4] and record.output_ids == greedy_reference[EOS_PROMPT]
    assert record.new_tokens == EOS_STEP + 1 and record.output_ids[-1] in engine.eos_ids


def check_record(record, K, L, max_new_tokens):
    """Every iteration but the last emits accepted + 1 tokens; the last may be cut at EOS or max_new_tokens."""
    assert record.new_tokens == len(record.output_ids) <= max_new_tokens
    assert len(record.accepted_lengths) == len(record.draft_indices) == record.target_calls >= 1
    assert all(0 <= n <= L for n in record.accepted_lengths) and all(0 <= k < K for k in record.draft_indices)
    before_last = sum(record.accepted_lengths[:-1]) + record.target_calls - 1
    assert 1 <= record.new_tokens - before_last <= record.accepted_lengths[-1] + 1
    assert record.block_efficiency >= 1
    assert 0 <= record.draft_time + record.target_time + record.verify_time <= record.total_time


# ---- sampling identity -----------------------------------------------------------------------------------------

# A 4-token vocabulary (EOS = 1 among them) keeps the law of the first 3 tokens to 40 cells. The sharper drafter
# (draft temperature 0.5) is rejected often, so corrections matter and the broken control is far off.
SMALL = dict(vocab_size=4, num_layers=1, hidden_size=16, dtype="float64")
SMALL_PROMPT, FIRST, SAMPLES = [2, 2], 3, 600


@pytest.fixture(scope="module")
def small_pair():
    return tiny(seed=1, **SMALL), tiny(seed=2, **SMALL)


def exact_law(loaded, prompt, n, eos_ids):
    """Law of the first n generated tokens (shorter when EOS comes first), from the model's own probabilities."""
    law, open_prefixes = {}, [()]
    for _ in range(n):
        with torch.no_grad():
            logits = loaded.model(torch.tensor([prompt + list(s) for s in open_prefixes])).logits[:, -1]
        mass = {s: law.pop(s, 1.0) for s in open_prefixes}
        for s, probs in zip(open_prefixes, warp(logits, 1.0).tolist()):
            law.update({s + (token,): mass[s] * p for token, p in enumerate(probs)})
        open_prefixes = [s for s in law if len(s) == len(open_prefixes[0]) + 1 and s[-1] not in eos_ids]
    return law


def chi_square_p_value(engine, law, samples, seed):
    generator = torch.Generator().manual_seed(seed)
    counts = collections.Counter(tuple(engine.generate(SMALL_PROMPT, FIRST, generator).output_ids)
                                 for _ in range(samples))
    assert set(counts) <= set(law), "an impossible sequence was generated"
    # pool the rare cells so every expected count is >= 5 (chi-square approximation)
    cells = sorted(law, key=law.get)
    rare = [s for s in cells if law[s] * samples < 5]
    common = [s for s in cells if law[s] * samples >= 5]
    observed = [counts[s] for s in common] + [sum(counts[s] for s in rare)]
    expected = [law[s] * samples for s in common] + [sum(law[s] for s in rare) * samples]
    return chisquare(observed, expected).pvalue


class CorrectionFromTarget(Verifier):
    """The classic bug, as a negative control: after a rejection the correction is drawn from p, not
    norm((p - q)+). Accepted tokens are then over-represented."""

    name, max_drafts, lossless = "correction_from_target", 1, False

    def verify(self, tokens, q, p, generator, state):
        out = build_verifier("token").verify(tokens, q, p, generator, state)
        rejected = out.num_accepted < tokens.shape[-1]
        resampled = torch.multinomial(p[0, 0, out.num_accepted], 1, generator=generator)[:, 0]
        return VerifierOutput(out.num_accepted, out.draft_index, torch.where(rejected, resampled, out.next_token))


@pytest.mark.parametrize("name, K, L, lossless", [("token", 1, 2, True), ("gbv", 3, 2, True),
                                                  ("correction_from_target", 1, 2, False)])
def test_first_tokens_follow_the_target_law(small_pair, name, K, L, lossless):
    target, drafter = small_pair
    verifier = "token" if name == "correction_from_target" else name
    sampling = Sampling(temperature=1.0, draft_temperature=0.5)
    engine = SpeculativeEngine(target, drafter, verifier, num_drafts=K, block_length=L, sampling=sampling)
    if not lossless:
        engine.verifier = CorrectionFromTarget()
    law = exact_law(target, SMALL_PROMPT, FIRST, engine.eos_ids)
    assert abs(sum(law.values()) - 1) < 1e-12
    p_value = chi_square_p_value(engine, law, SAMPLES, seed=0)
    assert (p_value > P_VALUE) == lossless, f"p-value {p_value:.2e}"


# ---- KV caches -------------------------------------------------------------------------------------------------

def test_caches_hold_exactly_the_committed_path(greedy_pair, monkeypatch):
    """At the start of every iteration both caches equal a fresh prefill of the committed tokens they cover."""
    target, drafter, prompts = greedy_pair
    engine = SpeculativeEngine(target, drafter, "gbv", num_drafts=3, block_length=4, sampling=Sampling(1.0))
    seen = {"draft": 0, "score": 0}
    draft, score = SpeculativeEngine._draft, SpeculativeEngine._score

    def checked_draft(self, cache, ids, generator):
        assert len(ids) - 2 <= cache.get_seq_length() <= len(ids) - 1  # at most the last two tokens pending
        assert_fresh(drafter, cache, ids[:cache.get_seq_length()])
        seen.update(draft=seen["draft"] + 1, ids=list(ids))
        return draft(self, cache, ids, generator)

    def checked_score(self, cache, last_token, tokens):
        assert_fresh(target, cache, seen["ids"][:-1])  # the target lacks exactly the last committed token
        seen["score"] += 1
        return score(self, cache, last_token, tokens)

    monkeypatch.setattr(SpeculativeEngine, "_draft", checked_draft)
    monkeypatch.setattr(SpeculativeEngine, "_score", checked_score)
    record = engine.generate(prompts[0], 24, torch.Generator().manual_seed(0))
    check_record(record, 3, 4, 24)
    assert seen["draft"] == seen["score"] == record.target_calls > 3
    assert len(set(record.accepted_lengths)) > 1 and len(set(record.draft_indices)) > 1  # varied paths


def assert_fresh(loaded, cache, ids):
    fresh = DynamicCache(config=loaded.model.config)
    with torch.no_grad():
        loaded.model(torch.tensor([ids]), cache=fresh, use_cache=True)
    for layer, fresh_layer in zip(cache.layers, fresh.layers):
        assert layer.keys.shape == fresh_layer.keys.shape
        assert torch.allclose(layer.keys, fresh_layer.keys, atol=1e-10)
        assert torch.allclose(layer.values, fresh_layer.values, atol=1e-10)


# ---- bad input ---------------------------------------------------------------------------------------------------

def test_bad_engine_arguments_are_refused(greedy_pair):
    target, drafter, prompts = greedy_pair
    with pytest.raises(ValueError, match="unknown verifier"):
        SpeculativeEngine(target, drafter, "nope")
    with pytest.raises(ValueError, match="needs a drafter"):
        SpeculativeEngine(target, None, "gbv")
    with pytest.raises(ValueError, match="num_drafts"):
        SpeculativeEngine(target, drafter, "gbv", num_drafts=0)
    with pytest.raises(ValueError, match="do not share a tokenizer"):
        SpeculativeEngine(target, tiny(vocab_size=8), "gbv")
    with pytest.raises(ValueError, match="at most 1 draft"):  # the verifier's own check
        SpeculativeEngine(target, drafter, "token", num_drafts=2).generate(prompts[0], 4, torch.Generator())
    with pytest.raises(ValueError, match="max_new_tokens"):
        SpeculativeEngine(target, None, "ar").generate(prompts[0], 0, torch.Generator())
    with pytest.warns(UserWarning, match="draft_temperature"):  # K greedy drafts would all be the same
        SpeculativeEngine(target, drafter, "gbv", num_drafts=2, sampling=Sampling(temperature=0.0))
