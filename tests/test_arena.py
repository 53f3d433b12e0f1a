"""The verifier arena (mode=arena): exact accepted laws against the reference, identical drafts for every verifier,
the variance it removes, and run.py mode=arena end to end with a killed job resumed."""
import json
import signal

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

from conftest import TINY
from spectr_gbv.decoding.cache import PAD_TOKEN
from spectr_gbv.decoding.engine import SpeculativeEngine
from spectr_gbv.decoding.tiny import tiny
from spectr_gbv.decoding.sampling import Sampling
from spectr_gbv.errors import ConfigError
from spectr_gbv.experiment.arena import Arena, draft_digest, summarise
from spectr_gbv.experiment.config import arena_verifiers
from spectr_gbv.experiment.config import validate
from spectr_gbv.experiment.metrics import VERDICTS, paired_difference
from spectr_gbv.verifiers import build_verifier, reference, verifier_names
from spectr_gbv.verifiers.streams import law_p_value
from spectr_gbv.tools.bench import llm_like_call
from spectr_gbv.verifiers.tree import NaiveVerifier
from test_run import records, run_py, signal_after_records
from test_verifiers import instance, sample_path

# verifier: the draft counts where accepted_law() has a closed form
CLOSED_FORM = {"token": [1], "bv": [1], "gbv": [1], "multipath": [1, 2, 3], "nss": [1, 2, 3],
               "specinfer": [1, 2, 3], "spectr": [1, 2, 3], "traversal": [1, 2, 3, 4]}
# accept every token when the drafter is the target
FULL_ACCEPTANCE = ["token", "bv", "gbv", "specinfer", "spectr", "traversal"]


def stack(rows):
    return [torch.cat(parts) for parts in zip(*rows)]


@pytest.mark.parametrize("name", CLOSED_FORM)
def test_accepted_law_is_the_reference_law_given_the_drafts(name):
    """V = 3, so drafts often share prefixes: the tree rules' trie walk is tested on shared nodes too."""
    for K in CLOSED_FORM[name]:
        for seed in range(3):
            p_model = reference.RandModel(3, 11 + seed, zero_prob=0.2)
            q_model = reference.RandModel(3, 21 + seed, concentration=0.5)
            rng = np.random.default_rng(seed)
            drafts = tuple(sample_path(q_model, 3, rng) for _ in range(K))
            exact = np.zeros(4)
            for prob, emitted, _ in reference.outcomes(name, p_model, q_model, drafts):
                exact[len(emitted) - 1] += prob
            law = build_verifier(name).accepted_law(*instance(p_model, q_model, drafts, rows=1))
            # spectr: its kernel bisects rho* to within ~1e-12 (tree.RHO_BISECTION_STEPS), the reference to the bit
            np.testing.assert_allclose(law[0].numpy(), exact, atol=1e-11 if name == "spectr" else 1e-14)


def test_rules_without_a_closed_form_say_so():
    p_model, q_model = reference.RandModel(3, 1), reference.RandModel(3, 2)
    drafts = instance(p_model, q_model, [(0, 1), (2, 2)], rows=1)
    assert build_verifier("gbv").accepted_law(*drafts) is None  # RGBV's chain of levels
    assert build_verifier("spectr_gbv_paper").accepted_law(*drafts) is None


def test_token_scores_its_closed_form():
    """sum_i prod_{j<=i} min(1, p_j/q_j) per context, in float64, through the arena."""
    p_model, q_model, rng = reference.RandModel(4, 5), reference.RandModel(4, 6), np.random.default_rng(0)
    drafts = [sample_path(q_model, 3, rng) for _ in range(8)]
    tokens, q, p = stack([instance(p_model, q_model, [draft], rows=1) for draft in drafts])
    contexts = Arena(["token"], 1, replicas=1, seed=0).score(tokens, q, p, [str(i) for i in range(8)])
    for draft, context in zip(drafts, contexts):
        ratios = [min(1.0, p_model(draft[:i])[draft[i]] / q_model(draft[:i])[draft[i]]) for i in range(3)]
        closed_form = sum(np.prod(ratios[:i]) for i in range(1, 4))
        assert abs(context["verifiers"]["token@1"]["expected_accepted"] - closed_form) < 1e-12
        assert context["verifiers"]["token@1"]["se"] is None  # exact


def decode_with_arena(arena: Arena, perturb: float, K: int, L: int, max_new_tokens: int = 8, slots: int | None = None):
    """A float64 tiny pair decoded with gbv (at most `slots` prompts at once), the arena watching; also returns each
    row's drafts per iteration."""
    target = tiny(0, dtype="float64")
    drafter = tiny(0, perturb=perturb, dtype="float64")
    engine = SpeculativeEngine(target, drafter, "gbv", K, L, Sampling(1.0))
    prompts = [{"dataset": "tiny", "prompt_id": i, "prompt": text} for i, text in enumerate(["Hello", "Once"])]
    seen = {0: [], 1: []}
    watch = arena.watch(prompts)

    def on_iteration(indices, tokens, q, p, out, state):
        for row, index in enumerate(indices):
            seen[index].append(tokens[row].clone())
        watch(indices, tokens, q, p, out, state)

    engine.generate_batch([target.encode_prompt(prompt["prompt"]) for prompt in prompts], max_new_tokens,
                          [torch.Generator().manual_seed(i) for i in range(2)], on_iteration=on_iteration,
                          slots=slots)
    return [(arena.finished(prompt), seen[i]) for i, prompt in enumerate(prompts)]


def test_a_drafter_equal_to_the_target_has_every_token_accepted():
    L = 3
    arena = Arena(arena_verifiers(FULL_ACCEPTANCE, "gbv"), 2, replicas=2, seed=0)
    checked = 0
    for contexts, drafts in decode_with_arena(arena, 0.0, K=2, L=L):
        for context, tokens in zip(contexts, drafts):
            if (tokens == PAD_TOKEN).any():  # drafting stopped at an EOS or the budget: not the target's law there
                continue
            checked += 1
            for name, values in context["verifiers"].items():
                assert values["expected_accepted"] == pytest.approx(L, abs=1e-9), name
                assert values["first_token_acceptance"] == pytest.approx(1, abs=1e-9), name
    assert checked >= 2


def test_contexts_do_not_depend_on_when_a_prompt_joins():
    """One slot: the second prompt joins when the first has finished, and gets the contexts it gets beside it: the
    same drafts, and the same scores up to the rounding of laws computed in passes of another width."""
    def contexts(slots):
        decoded = decode_with_arena(Arena(["token", "gbv"], 2, replicas=2, seed=0), 0.5, K=2, L=2, slots=slots)
        return [context for prompt_contexts, _ in decoded for context in prompt_contexts]

    together, one_by_one = contexts(None), contexts(1)
    assert [(c["iteration"], c["drafts"]) for c in one_by_one] == [(c["iteration"], c["drafts"]) for c in together]
    for joined, beside in zip(one_by_one, together):
        assert joined["alpha_star"] == pytest.approx(beside["alpha_star"], abs=1e-12)
        for name, values in beside["verifiers"].items():
            assert joined["verifiers"][name]["expected_accepted"] == pytest.approx(values["expected_accepted"],
                                                                                   abs=1e-12)


class SeenA(NaiveVerifier):
    """nss that keeps the drafts of every law it is asked for (the arena asks once per context and k)."""

    name = "seen_a"
    calls: list[torch.Tensor] = []

    def accepted_law(self, draft_tokens, draft_probs, target_probs):
        self.calls.append(draft_tokens.clone())
        return super().accepted_law(draft_tokens, draft_probs, target_probs)


class SeenB(SeenA):
    name = "seen_b"
    calls: list[torch.Tensor] = []


def test_every_verifier_at_a_context_sees_the_same_drafts():
    SeenA.calls.clear()
    SeenB.calls.clear()
    K = 3
    arena = Arena(arena_verifiers(["test_arena:SeenA", "test_arena:SeenB"], "gbv"), K, replicas=2, seed=0,
                  reference="gbv")
    decoded = decode_with_arena(arena, 0.5, K=K, L=2)
    assert len(SeenA.calls) == len(SeenB.calls) > 0
    for a, b in zip(SeenA.calls, SeenB.calls):
        assert torch.equal(a, b)
    # per iteration one call per k = 1..K, each on the first k of the drafts the reference decoded with
    for iteration in range(len(SeenA.calls) // K):
        calls = SeenA.calls[iteration * K:(iteration + 1) * K]
        for k, call in enumerate(calls, start=1):
            assert torch.equal(call, calls[-1][:, :k])
    for contexts, drafts in decoded:
        for context, tokens in zip(contexts, drafts):
            assert context["drafts"] == draft_digest(tokens)  # once per context, of the drafts every verifier saw
            assert all("drafts" not in values for values in context["verifiers"].values())
            assert set(context["verifiers"]) == {"gbv@3", "gbv@3 fresh"} | {
                f"{name}@{k}" for name in ("test_arena:SeenA", "test_arena:SeenB") for k in (1, 2, 3)}
    assert len({context["drafts"] for contexts, _ in decoded for context in contexts}) > 1


def test_identical_drafts_remove_the_variance_of_a_comparison():
    """bv - token per context on the same drafts (uniforms integrated out) against bv - token of two separate
    decodes, each with its own drafts and uniforms: the same mean, a fraction of the variance."""
    p_model, q_model, rng, n = reference.RandModel(4, 7), reference.RandModel(4, 8), np.random.default_rng(1), 400
    shared = stack([instance(p_model, q_model, [sample_path(q_model, 3, rng)], rows=1) for _ in range(n)])
    contexts = Arena(["token", "bv"], 1, replicas=1, seed=0).score(*shared, [str(i) for i in range(n)])
    arena = np.array([c["verifiers"]["bv@1"]["expected_accepted"] - c["verifiers"]["token@1"]["expected_accepted"]
                      for c in contexts])
    generator = torch.Generator().manual_seed(0)
    taus = {}
    for name in ("token", "bv"):  # end to end: each verifier on drafts of its own
        own = stack([instance(p_model, q_model, [sample_path(q_model, 3, rng)], rows=1) for _ in range(n)])
        taus[name] = build_verifier(name)(*own, generator=generator).num_accepted.double().numpy()
    end_to_end = taus["bv"] - taus["token"]
    assert abs(arena.mean() - end_to_end.mean()) < 4 * np.sqrt(arena.var() / n + end_to_end.var() / n)
    assert arena.var() < end_to_end.var() / 4


def test_arena_knobs_are_checked_before_any_model_loads(make_cfg):
    with pytest.raises(ConfigError) as error:
        validate(make_cfg(*TINY, "mode=arena", "verifiers=[token,nope]"))
    assert str(error.value).startswith("verifiers=nope: unknown verifier; choose one of")
    with pytest.raises(ConfigError, match="replicas=0: must be >= 1"):
        validate(make_cfg(*TINY, "mode=arena", "replicas=0"))
    with pytest.raises(ConfigError, match=r"verifiers=\[\]: names no verifier to score"):
        validate(make_cfg(*TINY, "mode=arena", "verifiers=[]"))
    with pytest.raises(ConfigError, match="delta=0.0: must be > 0"):
        validate(make_cfg(*TINY, "mode=arena", "delta=0"))
    for decoder in ("ar", "spectr_gbv_paper"):
        with pytest.raises(ConfigError, match=f"verifier={decoder}: the arena needs a lossless speculative"):
            validate(make_cfg(*TINY, "mode=arena", f"verifier={decoder}", "num_drafts=1"))
    with pytest.raises(ConfigError, match="verifiers=.*only with mode=arena"):
        validate(make_cfg(*TINY, "verifiers=[token]"))
    default = make_cfg(*TINY)  # python run.py alone: the evaluation as before
    assert default.module._target_ == "spectr_gbv.experiment.module.SpeculativeEvaluation"
    assert "verifiers" not in default.module and default.verifiers is None
    assert arena_verifiers(None, "spectr_gbv") == verifier_names()  # every built-in; the alias is gbv


def test_run_py_arena_end_to_end_resumes_after_a_kill(tmp_path):
    from spectr_gbv.tools.report import report

    job = ["mode=arena", "verifiers=[token,spectr_gbv_paper]", "num_drafts=2", "block_length=2", "replicas=2",
           "limit=3", "max_new_tokens=6", f"hydra.run.dir={tmp_path}"]
    process = run_py(*job, background=True)
    predictions = tmp_path / "predictions.jsonl"
    signal_after_records(process, predictions, 1, signal.SIGKILL)
    process.wait()
    kept = predictions.read_text()
    assert 1 <= kept.count("\n") < 3 and not (tmp_path / "summary.json").exists()

    done = run_py(*job, "logger=wandb", env={"WANDB_DIR": str(tmp_path), "WANDB_MODE": "offline"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert predictions.read_text().startswith(kept)  # nothing recorded is lost or decoded again
    found = records(tmp_path)
    assert sorted(found) == [("tiny", i) for i in range(3)]
    for record in found.values():
        assert [c["iteration"] for c in record["arena"]] == list(range(record["target_calls"]))
        assert set(record["arena"][0]["verifiers"]) == {"gbv@2", "gbv@2 fresh", "token@1", "spectr_gbv_paper@1",
                                                       "spectr_gbv_paper@2"}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["verifiers"] == ["gbv", "token", "spectr_gbv_paper"] and summary["replicas"] == 2
    arena = summary["arena"]
    overall = arena["datasets"]["overall"]
    assert overall["decode"]["iterations"] == sum(r["target_calls"] for r in found.values())
    assert overall["decode"]["scoring_ms_per_context"] > 0
    rows = overall["verifiers"]
    assert rows["token@1"]["exact"] and not rows["gbv@2"]["exact"]
    assert (rows["gbv@2"]["state"], rows["gbv@2 fresh"]["state"], rows["token@1"]["state"]) == (
        "carried", "fresh", "none")
    assert rows["gbv@2"]["difference"] is None and rows["gbv@2 fresh"]["verdict"] is None
    assert rows["spectr_gbv_paper@2"]["verdict"] in VERDICTS and rows["spectr_gbv_paper@2"]["prompts"] == 3
    contexts = [c for r in found.values() for c in r["arena"]]
    assert rows["token@1"]["expected_accepted"] == pytest.approx(
        np.mean([c["verifiers"]["token@1"]["expected_accepted"] for c in contexts]))
    assert rows["spectr_gbv_paper@2"]["alpha_star"] >= rows["token@1"]["alpha_star"]  # alpha* grows with k
    assert {(pair["a"], pair["b"]) for pair in arena["pairs"]} == {("token@1", "spectr_gbv_paper@1"),
                                                                   ("gbv@2", "spectr_gbv_paper@2")}
    assert set(arena["state_cost"]) == {"gbv@2"} and arena["consistency"]["verifier"] == "gbv@2"
    [run] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    assert list(run.parent.glob("files/media/table/arena_*.table.json"))

    markdown = report(tmp_path)
    assert "| verifier@k | setting | state | prompts | contexts | E[tau] [95%] |" in markdown
    assert "| spectr_gbv_paper@2 ~ |" in markdown and "verdicts at k=2" in markdown
    assert (tmp_path / "arena_differences.png").exists()


PROMPTS = ["Hello", "Once", "The", "A cat", "In", "We", "It was", "So"] * 2


def tiny_arena(reference: str, K: int, names: list[str], L: int = 4, max_new_tokens: int = 96) -> tuple[dict, dict]:
    """A float64 tiny pair at T = 1 decoded by `reference` over 16 prompts, the arena scoring `names` (4 replicas):
    its records (as summarise() takes them) and their summary."""
    target, drafter = tiny(0, dtype="float64"), tiny(0, perturb=0.5, dtype="float64")
    engine = SpeculativeEngine(target, drafter, reference, K, L, Sampling(1.0))
    prompts = [{"dataset": "tiny", "prompt_id": i, "prompt": text} for i, text in enumerate(PROMPTS)]
    arena = Arena(arena_verifiers(names, reference), K, replicas=4, seed=0, reference=reference)
    decoded = engine.generate_batch([target.encode_prompt(prompt["prompt"]) for prompt in prompts], max_new_tokens,
                                    [torch.Generator().manual_seed(i) for i in range(len(prompts))],
                                    on_iteration=arena.watch(prompts))
    recorded = {("tiny", i): {"arena": arena.finished(prompt), "target_calls": out.target_calls,
                              "new_tokens": out.new_tokens,
                              "times": {"total_time": out.total_time, "verify_time": out.verify_time}}
                for i, (prompt, out) in enumerate(zip(prompts, decoded))}
    return recorded, summarise(recorded, reference, list(arena.verifiers), ["tiny"], delta=0.02)


@pytest.mark.parametrize("reference, K", [("gbv", 1), ("gbv", 2), ("bv", 1)])
def test_the_reference_scored_with_its_state_matches_its_own_decode(reference, K):
    """On the reference's decode its realised tau and its scored E[tau] (carried state; replicas at K = 2) agree
    within the prompt-level interval. The negative control: gbv scored from a fresh state does not."""
    recorded, summary = tiny_arena(reference, K, ["bv", "gbv"] if K == 1 else ["gbv"])
    found = summary["consistency"]
    assert found["verifier"] == f"{reference}@{K}" and found["holds"], found["datasets"]["overall"]
    if reference == "gbv":
        contexts = {("tiny", prompt, c["iteration"]): c for (_, prompt), r in recorded.items() for c in r["arena"]}
        fresh = paired_difference({key: c["accepted"] for key, c in contexts.items()},
                                  {key: c["verifiers"][f"gbv@{K} fresh"]["expected_accepted"]
                                   for key, c in contexts.items()})["overall"]
        assert fresh["high"] < 0  # a fresh state overstates what gbv accepts on its own decode
        assert summary["state_cost"][f"gbv@{K}"]["overall"]["high"] < 0
        assert summary["datasets"]["overall"]["verifiers"][f"gbv@{K} fresh"]["verdict"] is None


def test_bv_on_gbvs_contexts_scores_as_bvs_own_decode():
    """The contexts a decode passes through do not favour one rule: bv's arena mean on gbv's contexts and bv's own
    decode of the same prompts agree within the prompt-level interval (each side keeps its own contexts)."""
    on_gbv, _ = tiny_arena("gbv", 1, ["bv"])
    own, _ = tiny_arena("bv", 1, ["bv"])
    values = lambda recorded, of: {("tiny", prompt, c["iteration"]): of(c)  # noqa: E731
                                   for (_, prompt), r in recorded.items() for c in r["arena"]}
    difference = paired_difference(values(on_gbv, lambda c: c["verifiers"]["bv@1"]["expected_accepted"]),
                                   values(own, lambda c: c["accepted"]), paired=False)["overall"]
    assert difference["prompts"] == len(PROMPTS) and difference["low"] <= 0 <= difference["high"]


def test_gbvs_law_with_a_carried_state_is_the_law_of_its_calls():
    """gbv at K = 1 given pending levels: accepted_law(state=) against 20,000 calls with the states a first call left
    (chi-square); the law from a fresh state must fail on the same calls."""
    rows, gbv = 20_000, build_verifier("gbv")
    p_model, q_model = reference.RandModel(4, 7, zero_prob=0.1), reference.RandModel(4, 8)
    rng, generator = np.random.default_rng(0), torch.Generator().manual_seed(0)
    first = gbv(*instance(p_model, q_model, [sample_path(q_model, 3, rng)], rows), generator=generator)
    assert first.state is not None  # levels pending in the rows that rejected early
    second = instance(p_model, q_model, [sample_path(q_model, 3, rng)], rows)
    taus = gbv(*second, generator=generator, state=first.state).num_accepted[:, None]
    for state, fits in ((first.state, True), (None, False)):
        law = gbv.accepted_law(*second, state=state).mean(0)
        p_value = law_p_value(taus, {(i,): float(mass) for i, mass in enumerate(law)})
        assert (p_value > 1e-3) if fits else (p_value < 1e-6), (state is not None, p_value)


@pytest.mark.parametrize("name", ["gbv", "spectr_gbv_paper"])
def test_replicas_with_shared_work_follow_the_law_of_calls(name):
    """replicate_accepted (the work of a row's replicas shared) against as many separate calls, K = 3 at V = 4 (drafts
    share prefixes), gbv with the states a first call left: a two-sample chi-square on the counts of tau. Its power:
    gbv's replicas from a fresh state must fail against the calls with the state."""
    rows, replicas, verifier = 400, 50, build_verifier(name)
    p_model, q_model = reference.RandModel(4, 7, zero_prob=0.1), reference.RandModel(4, 8)
    rng, generator = np.random.default_rng(0), torch.Generator().manual_seed(0)
    first = verifier(*stack([instance(p_model, q_model, [sample_path(q_model, 3, rng) for _ in range(3)], 1)
                             for _ in range(rows)]), generator=generator)
    second = instance(p_model, q_model, [sample_path(q_model, 3, rng) for _ in range(3)], rows)
    calls = torch.cat([verifier(*second, generator=generator, state=first.state).num_accepted
                       for _ in range(replicas)])
    for state, fits in ((first.state, True), (None, first.state is None)):
        shared = verifier.replicate_accepted(*second, generator, replicas, state=state).flatten()
        table = np.array([np.bincount(taus.numpy(), minlength=4) for taus in (calls, shared)])
        p_value = chi2_contingency(table[:, table.sum(0) > 0]).pvalue
        assert (p_value > 1e-3) if fits else (p_value < 1e-6), (state is not None, p_value)


def test_the_report_checks_a_rules_scores_on_another_decode_against_its_own(tmp_path):
    """bv scored on gbv's decode against bv's own decode of the same prompts, in the report of both jobs."""
    from spectr_gbv.tools.report import arena_tables

    for job in ("gbv", "bv"):
        recorded, arena = tiny_arena(job, 1, ["bv"], max_new_tokens=32)
        folder = tmp_path / job
        folder.mkdir()
        (folder / "predictions.jsonl").write_text("".join(
            json.dumps({"dataset": dataset, "prompt_id": prompt, **record}) + "\n"
            for (dataset, prompt), record in recorded.items()))
        (folder / "summary.json").write_text(json.dumps(
            {"num_drafts": 1, "block_length": 4, "temperature": 1.0, "model": "tiny", "drafter": "tiny'",
             "arena": arena}))
    markdown, _ = arena_tables(tmp_path)
    [line] = [line for line in markdown.splitlines() if line.startswith("Contexts check")]
    assert line.startswith(f"Contexts check (L=4 T=1.0): bv@1's E[tau] on the gbv@1 decode minus its own decode's "
                           f"realised tau, {len(PROMPTS)} prompts: ")


# E[tau] per context of every closed-form law (rows: the three contexts at V = 6, then the three at V = 64), pinned
# when the arena's scoring was made cheaper: a faster kernel must keep the law it scores, not only its mean.
PINNED_LAWS = {
    "token@1": [2.405797370261, 3.799861031715, 3.878467504815, 1.012879603326, 2.065625712833, 2.033976200777],
    "bv@1": [2.320208057395, 4.0, 4.0, 2.215540892253, 2.656905660769, 1.987326712655],
    "spectr@1": [2.405797370261, 3.799861031715, 3.878467504815, 1.012879603326, 2.065625712833, 2.033976200777],
    "spectr@2": [2.772247741786, 3.44007466425, 3.889380405017, 3.35963046318, 1.575294337403, 2.634168136107],
    "spectr@3": [3.107432342212, 3.802176011564, 3.9123816472, 2.793340173678, 1.668712437057, 2.650237369687],
    "spectr@4": [3.395026563366, 3.792418711066, 3.9123816472, 3.003131221227, 1.853810775788, 2.480574671631],
    "specinfer@1": [2.405797370261, 3.799861031715, 3.878467504815, 1.012879603326, 2.065625712833, 2.033976200777],
    "specinfer@2": [2.405797370261, 3.799861031715, 3.878467504815, 3.563838429741, 2.065625712833, 2.584500200763],
    "specinfer@3": [2.405797370261, 3.799861031715, 3.878467504815, 3.563838429741, 2.065625712833, 2.584500200763],
    "specinfer@4": [2.684327742338, 3.799861031715, 3.878467504815, 3.563838429741, 2.065625712833, 2.584500200763],
    "nss@1": [0.592042072014, 1.356427811443, 3.011918003795, 0.125944671589, 0.024884797559, 0.600528762694],
    "nss@2": [0.592042072014, 2.116189412881, 3.061549567684, 0.977926675685, 0.071708771207, 0.912199556575],
    "nss@3": [0.592042072014, 2.168059580083, 3.419382729666, 0.984600261334, 0.094853329102, 1.000050483681],
    "nss@4": [0.730399833319, 2.238299198264, 3.599650144215, 1.023076646828, 0.114263796686, 1.014651387583],
    "multipath@1": [2.320208057395, 4.0, 4.0, 2.215540892253, 2.656905660769, 1.987326712655],
    "multipath@2": [1.887155208864, 3.473986703943, 4.0, 3.592228762874, 1.782761587454, 2.217350464703],
    "multipath@3": [1.376600053334, 2.817600878023, 4.0, 3.589740124777, 1.645327294885, 1.472321114131],
    "multipath@4": [1.757326610132, 2.253471337633, 4.0, 2.644131133333, 1.749572272209, 1.115904710267],
    "traversal@1": [2.320208057395, 4.0, 4.0, 2.215540892253, 2.656905660769, 1.987326712655],
    "traversal@2": [2.320208057395, 4.0, 4.0, 3.558286788359, 2.656905660769, 2.590851217481],
    "traversal@3": [2.320208057395, 4.0, 4.0, 3.558286788359, 2.656905660769, 2.686616871024],
    "traversal@4": [2.320208057395, 4.0, 4.0, 3.558286788359, 2.656905660769, 2.738790311682],
    "gbv@1": [3.02669925304, 3.721201952197, 4.0],
}


def pinned_contexts(V: int, seed: int, K: int):
    """Three contexts of bench.llm_like_call (drafts share nodes at V = 6) in float64, rows renormalised."""
    x, q, p = llm_like_call(3, K, 4, V, seed=seed)
    return x, *(probs.double() / probs.double().sum(-1, keepdim=True) for probs in (q, p))


def test_closed_form_laws_are_pinned_to_1e_9():
    scored = {}
    for K, names in ((4, sorted({name.partition("@")[0] for name in PINNED_LAWS} - {"gbv"})), (1, ["gbv"])):
        for V, seed in ((6, 0), (64, 1)) if K == 4 else ((6, 0),):
            arena = Arena(names, K, replicas=1, seed=0, reference="gbv")
            for context in arena.score(*pinned_contexts(V, seed, K), ["a", "b", "c"]):
                for name, values in context["verifiers"].items():
                    if values["se"] is None and not name.endswith("fresh"):
                        scored.setdefault(name, []).append(values["expected_accepted"])
    assert scored.keys() == PINNED_LAWS.keys()
    for name, values in PINNED_LAWS.items():
        np.testing.assert_allclose(scored[name], values, atol=1e-9, rtol=0, err_msg=name)
