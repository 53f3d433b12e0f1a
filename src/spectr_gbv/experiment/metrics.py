"""The statistics: per-dataset sums of each prompt's counters, and every aggregate as a function of sums, so a sum
over ranks gives the one-process result; and the paired statistics of the report. Torch-free, so the report uses
it without loading the models' stack."""
import math

import numpy as np

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


def paired_difference(a: dict, b: dict, resamples: int = 10_000, seed: int = 0) -> dict[str, dict]:
    """Mean per-prompt difference a - b of two jobs that decoded the same prompts, with a 95% percentile bootstrap
    interval (resampling prompts with replacement within each dataset; seeded, so the report is reproducible).

    a, b: (dataset, prompt_id) -> a per-prompt value (e.g. block efficiency); only prompts in both are paired.
    Returns, per dataset and "overall" (the mean over all paired prompts, datasets resampled as strata):
    {"prompts", "mean", "low", "high"}."""
    keys = sorted(set(a) & set(b))
    strata: dict[str, list[float]] = {}
    for key in keys:
        strata.setdefault(key[0], []).append(a[key] - b[key])
    rng = np.random.default_rng(seed)
    result, overall_sums = {}, np.zeros(resamples)
    for name, values in strata.items():
        values = np.asarray(values)
        draws = values[rng.integers(0, len(values), size=(resamples, len(values)))].sum(1)
        overall_sums += draws
        result[name] = interval(values.mean(), draws / len(values), len(values))
    if keys:
        result["overall"] = interval(float(np.mean([a[k] - b[k] for k in keys])), overall_sums / len(keys), len(keys))
    return result


def interval(mean: float, bootstrap_means: np.ndarray, prompts: int) -> dict:
    low, high = np.quantile(bootstrap_means, [0.025, 0.975])
    return {"prompts": prompts, "mean": float(mean), "low": float(low), "high": float(high)}
