"""The statistics: per-dataset sums of each prompt's counters, and every aggregate as a function of sums, so a sum
over ranks gives the one-process result; and the paired statistics of the report. Torch-free, so the report uses
it without loading the models' stack."""
import math

import numpy as np
from scipy.stats import t as student_t

# The time fields of decoding.engine.DecodeRecord, a record's "times": the parts of the iterations after the first,
# the total, and the first iteration's own. TIMES are summed per dataset; the prefill's time stays in the records.
TIME_PARTS = ("draft_time", "target_time", "verify_time")
TIMES = (*TIME_PARTS, "total_time")
RECORD_TIMES = (*TIMES, "prefill_time")
COUNTERS = ("prompts", "new_tokens", "target_calls", "new_tokens_sq", "target_calls_sq", "new_x_calls",
            "target_positions", *TIMES, "ar_new_tokens", "ar_time")


def counters(record: dict) -> list[float]:
    """One prompt's record as its values of COUNTERS."""
    new, calls = record["new_tokens"], record["target_calls"]
    baseline = record.get("baseline", {"new_tokens": 0, "total_time": 0.0})
    values = {"prompts": 1, "new_tokens": new, "target_calls": calls, "new_tokens_sq": new * new,
              "target_calls_sq": calls * calls, "new_x_calls": new * calls,
              "target_positions": record["target_positions"],
              **{key: record["times"][key] for key in TIMES},
              "ar_new_tokens": baseline["new_tokens"], "ar_time": baseline["total_time"]}
    return [float(values[key]) for key in COUNTERS]


def aggregate(counts: list[float], histogram: list[float]) -> dict:
    """Aggregates of one dataset (or all) from its summed counters and accepted-length histogram (index = length)."""
    c = dict(zip(COUNTERS, counts))
    n, new, calls = c["prompts"], c["new_tokens"], c["target_calls"]
    efficiency = new / calls if calls else float("nan")
    # Standard error of the ratio estimator new/calls over prompts (delta method), from sums only.
    squares = c["new_tokens_sq"] - 2 * efficiency * c["new_x_calls"] + efficiency**2 * c["target_calls_sq"]
    se = math.sqrt(max(squares, 0.0) / (n * (n - 1))) / (calls / n) if n > 1 else float("nan")
    iterations = sum(histogram)
    at_least = [sum(histogram[i:]) for i in range(len(histogram))]  # at_least[i]: iterations accepting >= i tokens
    tokens_per_s = new / c["total_time"] if c["total_time"] else float("nan")
    result = {
        "prompts": int(n), "new_tokens": int(new), "target_calls": int(calls),
        "block_efficiency": efficiency, "block_efficiency_se": se,
        "mean_accepted_length": (sum(i * h for i, h in enumerate(histogram)) / iterations if iterations
                                 else float("nan")),
        "acceptance_by_position": [count / iterations for count in at_least[1:]] if iterations else [],
        "accepted_length_histogram": [int(x) for x in histogram],
        # positions the target scored per iteration besides the prompt: 1 + the distinct nodes of the draft trie
        "trie_positions": c["target_positions"] / iterations if iterations else float("nan"),
        "tokens_per_s": tokens_per_s,
        **{key: c[key] for key in TIMES},
    }
    if c["ar_time"]:
        result["ar_tokens_per_s"] = c["ar_new_tokens"] / c["ar_time"]
        result["speedup"] = tokens_per_s / result["ar_tokens_per_s"]
    return result


def scalars(metrics: dict) -> dict[str, float]:
    """Flat scalar metrics for the loggers: `<dataset>/<name>`, acceptance by position as acceptance_at_<i>."""
    flat = {}
    for name, values in metrics.items():
        for key, value in values.items():
            if key == "acceptance_by_position":
                flat.update({f"{name}/acceptance_at_{i}": rate for i, rate in enumerate(value, start=1)})
            elif isinstance(value, (int, float)):
                flat[f"{name}/{key}"] = value
    return flat


Z95 = 1.959964  # the standard normal's 97.5% quantile


def paired_difference(a: dict, b: dict | None = None, paired: bool = True, resamples: int = 10_000,
                      seed: int = 0) -> dict[str, dict]:
    """The mean of a (minus the mean of b) with a 95% interval from a bootstrap that resamples prompts with
    replacement within each dataset (seeded, so a report is reproducible): the prompt is the sampling unit.

    a, b: keys (dataset, prompt_id, ...) -> a value: one per prompt (e.g. its block efficiency), or one per context
    (dataset, prompt_id, iteration) of the verifier arena. A resampled prompt keeps all its contexts, so the estimate
    is the mean over contexts (a ratio of sums over prompts) and the interval counts contexts of one prompt as the
    correlated draws they are. paired: only keys in both are kept (the same contexts); else every key of a prompt
    present in both (two decodes of the same prompts, each with contexts of its own). b None: a's mean alone.
    Returns, per dataset and "overall" (datasets resampled as strata, those of one prompt pooled): {"prompts",
    "contexts", "mean", "low", "high", "se", "design_effect"}: se is the bootstrap's standard deviation, the interval
    mean +- t se with Student's t at prompts - strata degrees of freedom (with 20 prompts a dataset a percentile
    interval covers a known truth in about 92% of simulated studies, this one in 94%: tests/test_statistics.py), and
    design_effect se^2 over the variance the same estimate would have if contexts were independent draws
    (docs/algorithms.md §16.2)."""
    if b is not None and paired:  # the same contexts: their differences are one side
        a, b = {key: a[key] - b[key] for key in a if key in b}, None
    sides = [prompt_sums(a)] + ([] if b is None else [prompt_sums(b)])
    prompts = sorted(set.intersection(*(set(side) for side in sides)))
    rng = np.random.default_rng(seed)
    datasets: dict[str, list] = {}
    for prompt in prompts:
        datasets.setdefault(prompt[0], []).append(prompt)
    result = {name: bootstrap([members], sides, rng, resamples) for name, members in datasets.items()}
    if prompts:
        result["overall"] = bootstrap(collapse_lone_prompts(list(datasets.values())), sides, rng, resamples)
    return result


def collapse_lone_prompts(strata: list[list]) -> list[list]:
    """Strata of one prompt pooled (with each other, or else into the first stratum): within a stratum of one prompt
    there is nothing to resample, and keeping it would leave its share of the variance out of the interval."""
    kept, lone = [list(s) for s in strata if len(s) > 1], [s[0] for s in strata if len(s) == 1]
    if len(lone) > 1 or not kept:
        return kept + ([lone] if lone else [])
    return [kept[0] + lone, *kept[1:]]


def bootstrap(strata: list[list], sides: list[dict], rng, resamples: int) -> dict:
    """The estimate and its interval over these strata of prompts. Rao and Wu's bootstrap: each resample draws n - 1
    of a stratum's n prompts, each counted n / (n - 1) times, so the bootstrap variance is not the plain bootstrap's,
    too small by (n - 1) / n with the 20 prompts of a dataset."""
    drawn = [np.zeros((2, resamples)) for _ in sides]
    for members in strata:
        per_resample = max(len(members) - 1, 1)
        draws = rng.integers(0, len(members), size=(resamples, per_resample))
        for total, side in zip(drawn, sides):
            sums = np.array([side[prompt] for prompt in members]).T  # [3, prompts]: sum, count, sum of squares
            total += sums[:2, draws].sum(-1) * (len(members) / per_resample)
    every = [np.array([side[prompt] for members in strata for prompt in members]).T for side in sides]
    return estimate_interval(every, drawn, [len(members) for members in strata])


def prompt_sums(values: dict) -> dict[tuple, tuple[float, int, float]]:
    """(dataset, prompt_id) -> the sum, the count and the sum of squares of its values."""
    sums: dict[tuple, list] = {}
    for key, value in values.items():
        found = sums.setdefault(tuple(key[:2]), [0.0, 0, 0.0])
        found[0] += value
        found[1] += 1
        found[2] += value * value
    return {prompt: tuple(found) for prompt, found in sums.items()}


def estimate_interval(sums: list[np.ndarray], drawn: list[np.ndarray], widths: list[int]) -> dict:
    """The estimate (a's mean over contexts, minus b's) and its interval from the sides' per-prompt sums [3, prompts]
    (stratum after stratum, of widths prompts each) and their resampled sums [2, resamples]. With no more prompts than
    strata the spread is not estimable: se, low and high are None."""
    sign = [1.0, -1.0]
    mean = float(sum(sg * s[0].sum() / s[1].sum() for sg, s in zip(sign, sums)))
    found = {"prompts": int(sums[0].shape[1]), "contexts": int(sums[0][1].sum()), "mean": mean, "low": None,
             "high": None, "se": None, "design_effect": None}
    freedom = sums[0].shape[1] - len(widths)
    if freedom < 1:
        return found
    se = float(sum(sg * d[0] / d[1] for sg, d in zip(sign, drawn)).std(ddof=1))
    half = se * float(student_t.ppf(0.975, freedom))
    independent = context_level_variance(sums, widths)
    return {**found, "low": mean - half, "high": mean + half, "se": se,
            "design_effect": float(se**2 / independent) if independent > 0 else None}


def context_level_variance(sums: list[np.ndarray], widths: list[int]) -> float:
    """The variance of the estimate if its contexts were independent draws within each stratum: for a side of N
    contexts in strata of N_d with variance s_d^2, sum_d (N_d / N)^2 s_d^2 / N_d; the sides' variances add. A paired
    difference is one side (its values are the differences)."""
    bounds = np.cumsum([0, *widths])
    variance = 0.0
    for s in sums:
        total = s[1].sum()
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            value, count, square = (s[i, lo:hi].sum() for i in range(3))
            if count > 1:
                s2 = (square - value * value / count) / (count - 1)
                variance += (count / total) ** 2 * s2 / count
    return variance


VERDICTS = ("above", "below", "equivalent", "open")
ROUNDING = 1e-6  # tokens per call: equal laws computed two ways (spectr bisects rho* to ~1e-9 a context), not an order


def verdict(difference: dict, delta: float) -> dict:
    """What a difference's 95% interval shows: `above` or `below` zero when it excludes 0, `equivalent` when it lies
    inside +-delta, else `open`, with `prompts_needed`: the prompts at which the interval, narrowing as
    1/sqrt(prompts) about the same mean, would either exclude 0 or fit inside +-delta."""
    low, high, mean = difference["low"], difference["high"], difference["mean"]
    needed = None
    if low is None:  # one prompt a stratum: nothing shows the spread
        return {"verdict": "open", "prompts_needed": None}
    if max(-low, high) < ROUNDING:  # the same law computed in another order: not an ordering
        found = "equivalent"
    elif low > 0:
        found = "above"
    elif high < 0:
        found = "below"
    elif -delta < low and high < delta:
        found = "equivalent"
    else:
        found = "open"
        half, target = (high - low) / 2, max(abs(mean), delta - abs(mean))
        needed = math.ceil(difference["prompts"] * (half / target) ** 2) if target > 0 else None
    return {"verdict": found, "prompts_needed": needed}
