"""The engine on tiny random models: warping, greedy identity with transformers, the exact sampling law of the
first tokens, KV caches that equal a fresh prefill, the per-sequence record, and outputs that depend neither on the
batch nor on when a prompt joins it (continuous batching)."""

import collections
import warnings
from contextlib import contextmanager

import pytest
import torch
import transformers
from scipy.stats import chisquare
from transformers import DynamicCache

from spectr_gbv.decoding import precision
from spectr_gbv.decoding.cache import COMMITTED, SlotCache, only_where, position_wise_modules
from spectr_gbv.decoding.engine import SpeculativeEngine, Stopped
from spectr_gbv.decoding.sampling import Sampling, warp
from spectr_gbv.decoding.tiny import tiny
from spectr_gbv.verifiers import VERIFIERS, Verifier, VerifierOutput, build_verifier, verifier_names
from spectr_gbv.verifiers.base import sample

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
    out = loaded.model.generate(torch.tensor([prompt], device=loaded.model.device), do_sample=False,
                                max_new_tokens=max_new_tokens)
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
    records = engine.generate_batch(prompts, MAX_NEW, generators(len(prompts)))
    assert [record.output_ids for record in records] == greedy_reference
    assert len(greedy_reference[EOS_PROMPT]) == EOS_STEP + 1  # the engineered EOS is reached
    assert any(len(out) == MAX_NEW for out in greedy_reference)  # and another is cut at max_new_tokens


GREEDY_CASES = [(name, K, L) for name in sorted(verifier_names(lossless=True)) for K in (1, 3) for L in (1, 4)
                if K == 1 or VERIFIERS[name].max_drafts is None]


@pytest.mark.parametrize("name, K, L", GREEDY_CASES)
def test_lossless_verifiers_emit_the_greedy_path(greedy_pair, greedy_reference, name, K, L):
    """All three prompts (lengths 11, 15 and 1) in one batch; one ends at EOS inside a block while the others go on."""
    target, drafter, prompts = greedy_pair
    sampling = Sampling(temperature=0.0, draft_temperature=1.0 if K > 1 else None)
    engine = SpeculativeEngine(target, drafter, name, num_drafts=K, block_length=L, sampling=sampling)
    records = engine.generate_batch(prompts, MAX_NEW, generators(len(prompts)))
    assert [record.output_ids for record in records] == greedy_reference
    for record in records:
        check_record(record, K, L, MAX_NEW)
    assert sum(sum(record.accepted_lengths) for record in records) > 0  # the perturbed drafter does get accepted


@pytest.mark.parametrize("name, K", [("token", 1), ("gbv", 3)])
@pytest.mark.parametrize("target_kernel, drafter_linear", [(None, dict(quantize="int8")),
                                                           ("onednn", dict(linear_kernel="onednn")),
                                                           ("onednn", dict(dtype="bfloat16", quantize="int8")),
                                                           ("onednn", dict(quantize="int8_dynamic"))])
def test_other_linear_layers_keep_the_target_greedy_path(name, K, target_kernel, drafter_linear):
    """An int8 drafter (bfloat16 activations beside a float32 target too, or int8 activations) is just another
    drafter; a target on oneDNN is the same float32 target, whose greedy path transformers' generate() gives on the
    same model."""
    target, drafter = tiny(seed=0, linear_kernel=target_kernel), tiny(seed=0, perturb=0.2, **drafter_linear)
    prompts = [target.encode_prompt(text) for text in PROMPTS]
    expected = [hf_greedy(target, prompt, MAX_NEW) for prompt in prompts]
    sampling = Sampling(temperature=0.0, draft_temperature=1.0 if K > 1 else None)
    engine = SpeculativeEngine(target, drafter, name, num_drafts=K, block_length=4, sampling=sampling)
    records = engine.generate_batch(prompts, MAX_NEW, generators(len(prompts)))
    assert [record.output_ids for record in records] == expected
    assert sum(sum(record.accepted_lengths) for record in records) > 0


def generators(n: int, seed: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


@contextmanager
def passes_of(**models):
    """Counts each model's forward passes within it, by name."""
    counts = dict.fromkeys(models, 0)
    hooks = [loaded.model.register_forward_hook(lambda *_, name=name: counts.update({name: counts[name] + 1}))
             for name, loaded in models.items()]
    try:
        yield counts
    finally:
        for hook in hooks:
            hook.remove()


def test_drafting_stops_at_eos_and_at_max_new_tokens(greedy_pair, greedy_reference):
    """With the target's twin as drafter the first block drafts the greedy path, EOS third: the fourth token is not
    drafted (PAD_TOKEN, rejected; its step runs no pass) and the block is cut at EOS. With 2 tokens left the
    iteration drafts one token: its first drafter pass only."""
    target, _, prompts = greedy_pair
    twin = tiny(seed=0, dtype="float64")
    engine = SpeculativeEngine(target, twin, "token", block_length=4, sampling=Sampling(temperature=0.0))
    with passes_of(drafter=twin) as passes:
        record = engine.generate(prompts[EOS_PROMPT], MAX_NEW, torch.Generator().manual_seed(0))
    assert record.accepted_lengths == [3] and record.output_ids == greedy_reference[EOS_PROMPT]
    assert record.new_tokens == EOS_STEP + 1 and record.output_ids[-1] in engine.eos_ids and passes["drafter"] == 3
    with passes_of(drafter=twin) as passes:
        record = engine.generate(prompts[0], 2, torch.Generator().manual_seed(0))
    assert record.output_ids == greedy_reference[0][:2] and record.accepted_lengths == [1] and passes["drafter"] == 1


def test_the_target_scores_each_distinct_trie_node_once(greedy_pair):
    """K = 3 greedy drafts are one path: each pass scores its root and L nodes, not K x (L + 1) positions."""
    target, drafter, prompts = greedy_pair
    with pytest.warns(UserWarning, match="draft_temperature"):
        engine = SpeculativeEngine(target, drafter, "gbv", num_drafts=3, block_length=4, sampling=Sampling(0.0))
    for record in engine.generate_batch(prompts, MAX_NEW, generators(len(prompts))):
        assert record.target_positions == record.target_calls * (1 + 4)


def test_the_prompt_costs_no_pass_of_its_own(greedy_pair):
    """The first iteration reads the prompt in its own passes: one target pass per iteration, L drafter steps (fewer
    only where fewer tokens can be kept: budget - 1 of them when max_new_tokens leaves budget <= L)."""
    target, drafter, prompts = greedy_pair
    L = 4
    engine = SpeculativeEngine(target, drafter, "token", num_drafts=1, block_length=L, sampling=Sampling(0.0))
    with passes_of(target=target, drafter=drafter) as passes:
        record = engine.generate(prompts[0], MAX_NEW, torch.Generator().manual_seed(0))
    budgets = [MAX_NEW - sum(record.accepted_lengths[:i]) - i for i in range(record.target_calls)]
    assert passes == {"target": record.target_calls, "drafter": sum(max(1, min(L, budget - 1)) for budget in budgets)}
    assert budgets[-1] <= L  # the last iteration drafted fewer
    assert record.prefill_tokens == record.accepted_lengths[0] + 1 and record.prefill_time > 0


def check_record(record, K, L, max_new_tokens):
    """Every iteration but the last emits accepted + 1 tokens; the last may be cut at EOS or max_new_tokens."""
    assert record.new_tokens == len(record.output_ids) <= max_new_tokens
    assert len(record.accepted_lengths) == len(record.draft_indices) == record.target_calls >= 1
    assert all(0 <= n <= L for n in record.accepted_lengths) and all(0 <= k < K for k in record.draft_indices)
    before_last = sum(record.accepted_lengths[:-1]) + record.target_calls - 1
    assert 1 <= record.new_tokens - before_last <= record.accepted_lengths[-1] + 1
    assert record.block_efficiency >= 1
    assert record.target_calls <= record.target_positions <= record.target_calls * (1 + K * L)  # the trie's size
    parts = record.prefill_time + record.draft_time + record.target_time + record.verify_time
    assert 0 < parts <= record.total_time


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


def chi_square_p_value(engine, law, samples, seed, batch_size):
    """Decodes the prompt `samples` times, batch_size copies per generate_batch call, each with its own generator."""
    counts = collections.Counter()
    for start in range(0, samples, batch_size):
        records = engine.generate_batch([SMALL_PROMPT] * batch_size, FIRST, generators(batch_size, seed + start))
        counts.update(tuple(record.output_ids) for record in records)
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
        resampled = sample(p[torch.arange(len(p)), 0, out.num_accepted], generator)
        return VerifierOutput(out.num_accepted, out.draft_index, torch.where(rejected, resampled, out.next_token))


@pytest.mark.parametrize("name, K, L, lossless, batch_size", [
    ("token", 1, 2, True, 1), ("gbv", 3, 2, True, 1), ("correction_from_target", 1, 2, False, 1),
    ("token", 1, 2, True, 50), ("gbv", 3, 2, True, 50), ("correction_from_target", 1, 2, False, 50),
    ("token", 1, 4, True, 1), ("gbv", 3, 4, True, 50)])
def test_first_tokens_follow_the_target_law(small_pair, name, K, L, lossless, batch_size):
    """The exact law of the first 3 tokens, one prompt at a time and 50 copies per batch (rows that end at EOS
    leave while the others go on). At L=4 the first block is longer than the 3 tokens asked for: its last two tokens
    are not drafted (PAD_TOKEN for sure), and neither are tokens after a drafted EOS."""
    target, drafter = small_pair
    verifier = "token" if name == "correction_from_target" else name
    sampling = Sampling(temperature=1.0, draft_temperature=0.5)
    engine = SpeculativeEngine(target, drafter, verifier, num_drafts=K, block_length=L, sampling=sampling)
    if not lossless:
        engine.verifier = CorrectionFromTarget()
    law = exact_law(target, SMALL_PROMPT, FIRST, engine.eos_ids)
    assert abs(sum(law.values()) - 1) < 1e-12
    p_value = chi_square_p_value(engine, law, SAMPLES, seed=0, batch_size=batch_size)
    assert (p_value > P_VALUE) == lossless, f"p-value {p_value:.2e}"


# ---- KV caches -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("K, L, batch, slots", [(1, 4, [0], None), (3, 4, [0], None), (3, 4, [0, 1, 2], None),
                                                (2, 3, [2, 0, 1], None), (3, 4, [2, 0, 1, 0], 2)])
def test_caches_hold_exactly_the_committed_path(greedy_pair, monkeypatch, K, L, batch, slots):
    """Before every draft and every target pass, each row's committed slots equal a fresh prefill of the committed
    tokens that cache covers: none in a row's first iteration (it reads the prompt, also when the row joins beside
    others: slots), then the drafter's lacks the last one or two, the target's exactly the last one."""
    target, drafter, prompts = greedy_pair
    engine = SpeculativeEngine(target, drafter, "gbv", num_drafts=K, block_length=L, sampling=Sampling(1.0))
    seen = {"draft": 0, "score": 0}
    draft, score = SpeculativeEngine._draft, SpeculativeEngine._score

    def checked_draft(self, cache, rows):
        for row, (ids, record) in enumerate(zip(rows.ids, rows.records)):
            length = int(cache.lengths[row])
            assert len(ids) - 2 <= length <= len(ids) - 1 if record.target_calls else length == 0
            assert_fresh(drafter, cache, row, ids[:length])
        seen["draft"] += 1
        return draft(self, cache, rows)

    def checked_score(self, cache, rows, tokens):
        for row, (ids, record) in enumerate(zip(rows.ids, rows.records)):
            assert_fresh(target, cache, row, ids[:-1] if record.target_calls else [])
        seen["score"] += 1
        return score(self, cache, rows, tokens)

    monkeypatch.setattr(SpeculativeEngine, "_draft", checked_draft)
    monkeypatch.setattr(SpeculativeEngine, "_score", checked_score)
    records = engine.generate_batch([prompts[i] for i in batch], 24, generators(len(batch)), slots=slots)
    for record in records:
        check_record(record, K, L, 24)
    assert seen["draft"] == seen["score"] > 3
    if slots is None:  # all rows start together: one iteration per iteration of the longest
        assert seen["score"] == max(record.target_calls for record in records)
    accepted = [n for record in records for n in record.accepted_lengths]
    assert len(set(accepted)) > 1  # varied paths
    if K > 1:
        assert len({k for record in records for k in record.draft_indices}) > 1


def assert_fresh(loaded, cache, row, ids):
    """Row `row` of a SlotCache, its committed slots in position order, against a fresh one-row prefill."""
    committed = (cache.label[row] == COMMITTED).nonzero()[:, 0]
    order = committed[cache.position[row, committed].argsort()]
    assert cache.position[row, order].tolist() == list(range(len(ids)))
    if not ids:
        return
    fresh = DynamicCache(config=loaded.model.config)
    with torch.no_grad():
        loaded.model(torch.tensor([ids]), cache=fresh, use_cache=True)
    for layer, fresh_layer in zip(cache.cache.layers, fresh.layers):
        for kept, expected in ((layer.keys, fresh_layer.keys), (layer.values, fresh_layer.values)):
            assert torch.allclose(kept[row][:, order], expected[0], atol=1e-10, rtol=0)


def test_padded_positions_skip_the_position_wise_modules(greedy_pair):
    """A pass with hidden positions: the MLPs and the output layer see the kept positions only, the logits there are
    the unpacked pass's, and no hook is left behind."""
    target, _, prompts = greedy_pair
    model, modules = target.model, position_wise_modules(target.model)
    assert len(modules) == model.config.num_hidden_layers + 1
    cache = SlotCache(target, len(prompts))
    ids, label, position = cache.committed_inputs(prompts)  # left-padded to the longest prompt
    mask, keep = cache.attention_mask(label, position, None), label == COMMITTED
    seen = []
    counter = modules[0].register_forward_hook(lambda module, args, out: seen.append(args[0].shape[:-1].numel()))
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, position_ids=position).logits
        with only_where(keep, modules):
            packed = model(input_ids=ids, attention_mask=mask, position_ids=position).logits
    counter.remove()
    assert seen == [ids.numel(), int(keep.sum())]
    assert torch.allclose(packed[keep], full[keep], atol=1e-12, rtol=0)
    assert (packed[~keep] == 0).all()
    assert not any(module._forward_hooks or module._forward_pre_hooks for module in modules)


# ---- batch invariance, attention implementations, devices ----------------------------------------------------

INVARIANCE_CASES = [("ar", 1, 1, 0.0), ("ar", 1, 1, 1.0), ("token", 1, 4, 0.0), ("gbv", 3, 4, 0.0),
                    ("gbv", 3, 4, 1.0), ("spectr", 2, 3, 1.0), ("multipath", 3, 2, 1.0),
                    ("spectr_gbv_paper", 3, 4, 1.0)]


def decode_in_batches(engine, prompts, batch_size, max_new_tokens=MAX_NEW):
    """Every prompt with generator seeded i (its index), batch_size prompts per generate_batch call."""
    out = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        out += [record.output_ids for record in engine.generate_batch(
            chunk, max_new_tokens, generators(len(chunk), seed=start))]
    return out


@pytest.mark.parametrize("name, K, L, temperature", INVARIANCE_CASES)
def test_outputs_do_not_depend_on_the_batch(greedy_pair, name, K, L, temperature):
    """A prompt's tokens are the same alone, in a batch of 4, and beside other prompts (float64)."""
    target, drafter, prompts = greedy_pair
    sampling = Sampling(temperature, draft_temperature=1.0 if K > 1 else None)
    engine = SpeculativeEngine(target, None if name == "ar" else drafter, name, K, L, sampling)
    prompts = prompts + [prompts[0][:4], prompts[1][3:]]
    alone = decode_in_batches(engine, prompts, 1)
    assert decode_in_batches(engine, prompts, 4) == alone
    assert decode_in_batches(engine, prompts, len(prompts)) == alone
    assert len({tuple(ids) for ids in alone}) > 1


# ---- continuous batching -----------------------------------------------------------------------------------------

REFILL_CASES = ([("ar", 1, 1, 1.0), ("ar", 1, 1, 0.0), ("token", 1, 4, 0.0), ("gbv", 3, 4, 0.0)]
                + [(name, VERIFIERS[name].max_drafts or 3, 3, 1.0) for name in sorted(VERIFIERS)])


def six_prompts(prompts):
    """PROMPTS (lengths 11, 15, 1; greedy decoding of the second ends at EOS) and three more of other lengths."""
    return prompts + [prompts[0][:4], prompts[1][3:], prompts[2] * 6]


def decode_alone(engine, prompts, max_new_tokens=MAX_NEW):
    return [engine.generate(prompt, max_new_tokens, torch.Generator().manual_seed(i))
            for i, prompt in enumerate(prompts)]


def decisions(record):
    return record.output_ids, record.accepted_lengths, record.draft_indices


@pytest.mark.parametrize("name, K, L, temperature", REFILL_CASES)
def test_refill_gives_each_prompt_its_decode_alone(greedy_pair, name, K, L, temperature):
    """Six prompts through two slots: each prompt joins as another finishes (at EOS or at max_new_tokens), beside
    rows in the middle of their decode, and gets exactly the tokens, accepted lengths and draft indices it gets
    alone (float64). Every row's first iteration is its own prefill."""
    target, drafter, prompts = greedy_pair
    sampling = Sampling(temperature, draft_temperature=1.0)  # sampled drafts at T = 0 too: varied decisions
    engine = SpeculativeEngine(target, None if name == "ar" else drafter, name, K, L, sampling)
    prompts = six_prompts(prompts)
    alone = decode_alone(engine, prompts)
    joined = []  # per iteration: did a row join while the verifier had a state for the others?
    if engine.verifier is not None:
        verifier, first_seen = engine.verifier, set()

        def watched(tokens, q, p, generator, state):
            joined.append(state is not None)
            return verifier(tokens, q, p, generator=generator, state=state)

        def on_iteration(indices, *_):
            joined[-1] &= not first_seen.issuperset(indices)
            first_seen.update(indices)

        engine.verifier = watched
    refill = engine.generate_batch(prompts, MAX_NEW, generators(len(prompts)), slots=2,
                                   on_iteration=None if engine.verifier is None else on_iteration)
    assert [decisions(record) for record in refill] == [decisions(record) for record in alone]
    for record in refill:
        assert record.prefill_time > 0 and record.prefill_tokens >= 1
        if name != "ar":
            check_record(record, K, L, MAX_NEW)
    if temperature == 0:  # the engineered EOS, and cuts at max_new_tokens
        assert len(refill[EOS_PROMPT].output_ids) == EOS_STEP + 1
        assert any(len(record.output_ids) == MAX_NEW for record in refill)
    if name == "gbv" and temperature > 0:  # a fresh row beside rows with pending levels
        assert any(joined)


def rows_per_target_pass(target):
    """Collects the rows of every target pass within it."""
    rows = []
    hook = target.model.register_forward_hook(lambda module, args, kwargs, out: rows.append(
        kwargs["input_ids"].shape[0]), with_kwargs=True)
    return rows, hook


def test_refill_keeps_the_passes_full(greedy_pair):
    """Six prompts, two slots, a greedy target (two prompts end at EOS after one iteration): in chunks of two the
    other prompt of such a pair decodes alone for a dozen passes; refilled, every pass holds two rows until one
    prompt is left, and the same tokens take fewer passes."""
    target, drafter, prompts = greedy_pair
    engine = SpeculativeEngine(target, drafter, "gbv", 3, 4, Sampling(0.0, draft_temperature=1.0))
    prompts = six_prompts(prompts)
    chunks, hook = rows_per_target_pass(target)
    in_chunks = [record for start in range(0, len(prompts), 2) for record in engine.generate_batch(
        prompts[start:start + 2], MAX_NEW, generators(2, seed=start))]
    hook.remove()
    refilled, hook = rows_per_target_pass(target)
    refill = engine.generate_batch(prompts, MAX_NEW, generators(len(prompts)), slots=2)
    hook.remove()
    assert [decisions(record) for record in refill] == [decisions(record) for record in in_chunks]
    assert refilled == sorted(refilled, reverse=True)  # two rows per pass, then the last prompt alone
    assert sum(refilled) == sum(chunks)  # one row per iteration of each prompt, either way
    assert len(refilled) < len(chunks) and sum(refilled) / len(refilled) > sum(chunks) / len(chunks)


def test_a_decoder_takes_prompts_step_by_step_and_stops_keeping_the_finished(greedy_pair):
    """The Lightning module's way: two prompts per step, each step decodes until both hold a row while the rows of
    earlier steps go on; prompt indices count the prompts added, the same in every iteration hook; the last run
    drains. A stop keeps every record reported before it."""
    target, drafter, prompts = greedy_pair
    engine = SpeculativeEngine(target, drafter, "gbv", 3, 4, Sampling(1.0))
    prompts = six_prompts(prompts)
    alone = decode_alone(engine, prompts)
    finished, hooked = {}, {}
    decoder = engine.decoder(2, MAX_NEW, on_finish=finished.__setitem__,
                             on_iteration=lambda indices, tokens, *_: hooked.update(
                                 {index: hooked.get(index, 0) + 1 for index in indices}))
    for step in range(3):
        assert [decoder.add(prompts[i], torch.Generator().manual_seed(i)) for i in (2 * step, 2 * step + 1)] == [
            2 * step, 2 * step + 1]
        decoder.run(until_admitted=True)
        assert not decoder.waiting and 1 <= len(decoder.rows) <= 2
    assert len(finished) < len(prompts)  # some rows outlive the last step
    decoder.run()
    assert not decoder.rows and sorted(finished) == list(range(len(prompts)))
    assert [decisions(finished[i]) for i in range(len(prompts))] == [decisions(record) for record in alone]
    assert hooked == {i: finished[i].target_calls for i in range(len(prompts))}

    reported = {}
    stopping = engine.decoder(2, MAX_NEW, on_finish=reported.__setitem__, should_stop=lambda: len(reported) >= 2)
    for i, prompt in enumerate(prompts):
        stopping.add(prompt, torch.Generator().manual_seed(i))
    with pytest.raises(Stopped, match="prompts unfinished"):
        stopping.run()
    assert 2 <= len(reported) < len(prompts)
    assert all(decisions(record) == decisions(alone[i]) for i, record in reported.items())


def with_attention(loaded, implementation):
    loaded.model.set_attn_implementation(implementation)
    return loaded


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_tree_masks_mean_the_same_under_eager_and_sdpa(architecture):
    """The 4D additive mask (tree nodes, holes, padding) gives the same logits under both attention kernels, and
    the same outputs; Qwen2 is the real pair's architecture."""
    make = tiny if architecture == "llama" else tiny_qwen2
    outputs = {}
    for implementation in ("eager", "sdpa"):
        target = with_attention(make(seed=0, dtype="float64"), implementation)
        drafter = with_attention(make(seed=0, perturb=0.2, dtype="float64"), implementation)
        prompts = [target.tokenizer(text, add_special_tokens=False).input_ids for text in PROMPTS]
        engine = SpeculativeEngine(target, drafter, "gbv", 3, 4, Sampling(1.0))
        outputs[implementation] = decode_in_batches(engine, prompts, len(prompts))
    assert outputs["eager"] == outputs["sdpa"]


def tiny_qwen2(seed=0, perturb=0.0, dtype="float64"):
    """tiny() with Qwen2's architecture (q/k/v biases, its own attention module), same tokenizer and scale."""
    llama = tiny(seed=seed, perturb=perturb, dtype=dtype)
    config = transformers.Qwen2Config(**{key: getattr(llama.model.config, key) for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "eos_token_id")})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen2ForCausalLM(config).to(llama.model.dtype)
    model.load_state_dict(llama.model.state_dict(), strict=False)  # Qwen2's q/k/v biases keep their random init
    model.generation_config = llama.model.generation_config
    return type(llama)(model=model.eval(), tokenizer=llama.tokenizer, name=f"qwen2 {llama.name}")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("name, K, L", [("token", 1, 4), ("gbv", 3, 4), ("spectr", 3, 2)])
def test_greedy_identity_and_batch_invariance_on_cuda(name, K, L):
    """float32 on cuda, every mask, position and generator on the device: greedy outputs equal transformers'
    generate() there, and sampled outputs do not depend on the batch, nor on when a prompt joins it."""
    target, drafter = tiny(seed=0, device="cuda"), tiny(seed=0, perturb=0.2, device="cuda")
    prompts = [target.tokenizer(text, add_special_tokens=False).input_ids for text in PROMPTS]
    greedy = SpeculativeEngine(target, drafter, name, K, L, Sampling(0.0, draft_temperature=1.0 if K > 1 else None))
    records = greedy.generate_batch(prompts, MAX_NEW, cuda_generators(len(prompts)))
    assert [record.output_ids for record in records] == [hf_greedy(target, prompt, MAX_NEW) for prompt in prompts]
    sampled = SpeculativeEngine(target, drafter, name, K, L, Sampling(1.0))
    alone = [sampled.generate(prompt, MAX_NEW, cuda_generators(i + 1)[i]).output_ids
             for i, prompt in enumerate(prompts)]
    together = sampled.generate_batch(prompts, MAX_NEW, cuda_generators(len(prompts)))
    assert [record.output_ids for record in together] == alone
    refilled = sampled.generate_batch(prompts, MAX_NEW, cuda_generators(len(prompts)), slots=2)
    assert [record.output_ids for record in refilled] == alone


def cuda_generators(n):
    return [torch.Generator(device="cuda").manual_seed(i) for i in range(n)]


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
    gemma_like = transformers.Gemma3TextConfig(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                                               vocab_size=384, hidden_size=32, intermediate_size=64,
                                               num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    sliding = type(target)(transformers.AutoModelForCausalLM.from_config(gemma_like).eval(), target.tokenizer, "gemma")
    with pytest.raises(ValueError, match="sliding-window"):
        SpeculativeEngine(sliding, None, "ar").generate(prompts[0], 2, torch.Generator())
    with pytest.warns(UserWarning, match="draft_temperature"):  # K greedy drafts would all be the same
        SpeculativeEngine(target, drafter, "gbv", num_drafts=2, sampling=Sampling(temperature=0.0))


@pytest.mark.parametrize("flags, warned", [(set(), True), ({"avx512_bf16"}, False), ({"amx_tile", "amx_bf16"}, False),
                                           (None, False)])
def test_bfloat16_without_the_cpus_bfloat16_units_is_flagged(monkeypatch, flags, warned):
    """Only where the CPU is known to lack AMX-BF16 and AVX512-BF16 (None: no /proc/cpuinfo), and only for bfloat16
    linear weights: int8 weights with bfloat16 activations run on their own kernel."""
    monkeypatch.setattr(precision, "cpu_flags", lambda: flags)
    for settings, expected in [(dict(dtype="bfloat16"), warned), (dict(dtype="float32"), False),
                               (dict(dtype="bfloat16", quantize="int8"), False)]:
        model = tiny(seed=0, **settings)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            SpeculativeEngine(model, model, "token", sampling=Sampling(temperature=0.0))
        assert any("float32 on oneDNN can be faster" in str(warning.message) for warning in caught) == expected
