"""The arena's statistics (experiment/metrics.py): intervals that resample prompts, the sampling unit, and verdicts.
Plain numpy: a cluster bootstrap must cover a known truth, and must not be fooled by contexts that repeat."""
import numpy as np
import pytest

from spectr_gbv.experiment.metrics import paired_difference, verdict


def clustered_study(rng, datasets=5, prompts=20, prompt_sd=0.3, context_sd=0.5, truth=0.1):
    """Per-context differences in the study's design (20 prompts in each of 5 datasets): a prompt effect shared by
    its 3-30 contexts plus independent context noise."""
    values = {}
    for dataset in range(datasets):
        for prompt in range(prompts):
            effect = truth + prompt_sd * rng.standard_normal()
            for iteration in range(rng.integers(3, 31)):
                values[(f"d{dataset}", prompt, iteration)] = effect + context_sd * rng.standard_normal()
    return values


def context_level_interval(values: dict) -> tuple[float, float]:
    """What an estimator that takes contexts as independent draws reports: mean +- 1.96 s / sqrt(n)."""
    x = np.array(list(values.values()))
    half = 1.96 * x.std(ddof=1) / np.sqrt(len(x))
    return x.mean() - half, x.mean() + half


def test_repeating_every_context_leaves_the_prompt_level_interval_as_it_is():
    """Each context repeated m times within its prompt adds no information: the interval must not move, while an
    estimator over contexts narrows by about sqrt(m)."""
    rng, m = np.random.default_rng(0), 9
    values = clustered_study(rng, datasets=1, prompts=30)
    repeated = {(d, p, i * m + r): v for (d, p, i), v in values.items() for r in range(m)}
    once, again = paired_difference(values)["overall"], paired_difference(repeated)["overall"]
    assert again["contexts"] == m * once["contexts"] and again["prompts"] == once["prompts"]
    for key in ("mean", "low", "high", "se"):
        assert again[key] == pytest.approx(once[key], rel=1e-9)
    narrow, wide = np.diff(context_level_interval(repeated))[0], np.diff(context_level_interval(values))[0]
    assert wide / narrow == pytest.approx(np.sqrt(m), rel=0.05)
    assert again["design_effect"] == pytest.approx(m * once["design_effect"], rel=0.05)


def test_the_interval_covers_a_known_truth_in_95_percent_of_studies():
    """1,000 simulated studies with prompt effects and context noise: the 95% interval covers the truth in 93-97% of
    them (a context-level interval covers it far less often: the negative control)."""
    rng, truth, covered, naive = np.random.default_rng(1), 0.1, 0, 0
    for study in range(1000):
        values = clustered_study(rng, truth=truth)
        found = paired_difference(values, resamples=1000, seed=study)["overall"]
        covered += found["low"] <= truth <= found["high"]
        low, high = context_level_interval(values)
        naive += low <= truth <= high
    assert 930 <= covered <= 970
    assert naive < 800


def test_paired_differences_keep_the_contexts_both_sides_scored():
    a = {("d", p, i): 1.0 + p for p in range(4) for i in range(3)}
    b = {key: value - 0.5 for key, value in a.items()} | {("d", 9, 0): 100.0}  # a prompt a lacks: left out
    found = paired_difference(a, b)["overall"]
    assert (found["prompts"], found["contexts"]) == (4, 12)
    assert found["mean"] == found["low"] == found["high"] == pytest.approx(0.5)


def test_decodes_of_the_same_prompts_compare_their_own_contexts():
    """paired=False: each side keeps all contexts of the prompts both decoded; the estimate is a difference of
    means over contexts."""
    a = {("d", p, i): 2.0 for p in range(3) for i in range(4)}
    b = {("d", p, i): 1.0 for p in range(3) for i in range(2)} | {("e", 0, 0): 9.0}
    found = paired_difference(a, b, paired=False)
    assert set(found) == {"d", "overall"} and found["overall"]["mean"] == pytest.approx(1.0)


def test_strata_keep_their_prompts_and_the_estimate_is_the_mean_over_contexts():
    a = {("x", p, i): float(p) for p in range(5) for i in range(p + 1)} | {("y", 0, i): 10.0 for i in range(5)}
    found = paired_difference(a)
    contexts = list(a.values())
    assert found["overall"]["mean"] == pytest.approx(np.mean(contexts))
    assert found["y"]["low"] is None  # one prompt: nothing to resample
    assert found["x"]["prompts"] == 5 and found["overall"]["prompts"] == 6


@pytest.mark.parametrize("low, high, expected", [
    (0.001, 0.05, "above"), (-0.05, -0.001, "below"), (-0.015, 0.012, "equivalent"), (-0.03, 0.01, "open"),
    (-0.01, 0.04, "open"), (4e-10, 1.2e-9, "equivalent")])  # the last: one law, computed two ways
def test_a_verdict_says_what_the_interval_shows(low, high, expected):
    found = verdict({"mean": (low + high) / 2, "low": low, "high": high, "prompts": 100}, delta=0.02)
    assert found["verdict"] == expected
    assert (found["prompts_needed"] is None) == (expected != "open")


def test_prompts_needed_narrow_an_open_interval_until_it_resolves():
    """Mean 0, half-width 0.04 at 100 prompts: +-0.02 needs the half-width at 0.02, 4x the prompts; a mean of 0.03
    resolves once the half-width is below 0.03."""
    assert verdict({"mean": 0.0, "low": -0.04, "high": 0.04, "prompts": 100}, 0.02)["prompts_needed"] == 400
    assert verdict({"mean": 0.03, "low": -0.03, "high": 0.09, "prompts": 100}, 0.02)["prompts_needed"] == 400


def test_one_prompt_a_dataset_shows_no_spread_until_its_strata_are_pooled():
    """A dataset of one prompt has nothing to resample: its own interval is undefined (and open), while overall the
    lone prompts are pooled into one stratum, so five datasets of one prompt each still give an interval."""
    rng = np.random.default_rng(2)
    values = {(f"d{d}", 0, i): rng.standard_normal() + d for d in range(5) for i in range(10)}
    found = paired_difference(values)
    assert found["d0"]["low"] is None and found["d0"]["se"] is None
    assert verdict(found["d0"], 0.02) == {"verdict": "open", "prompts_needed": None}
    assert found["overall"]["low"] < found["overall"]["mean"] < found["overall"]["high"]
