"""One table and a few plots from every job below a run or multirun folder:

    python -m spectr_gbv.tools.report outputs/multirun/2026-01-01/12-00-00
    python -m spectr_gbv.tools.report docs/study/main --page docs/results.md   # also refresh the page's tables

Reads each summary.json (one per job) and any real-distribution audit (`audit --real --json`) below the folder,
writes report.md and report.csv into the folder and prints the tables: by dataset in the paper's Table 1 shape when
jobs ran several, the paired differences of the paper's orderings, each verifier-arena job's comparison on identical
drafts (mode=arena, with its forest plot arena_differences.png), the speed against its cost-model limit when jobs
ran with baseline=true, agreement with `ar` at temperature 0, the audit, then all rows. It draws PNGs with
matplotlib, one line per verifier: block efficiency against num_drafts (a panel per block length), against
block_length (a panel per draft count) and against temperature, and, with baseline=true, the speedup over `ar`
against num_drafts and each speedup beside its limit. The summaries carry no optimal-transport bound (computing it
needs the models' distributions at every prefix), so the plots draw none; the audit has it on exact instances, an
arena job at the root of every context.
"""
import argparse
import csv
import json
import math
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from spectr_gbv.experiment.metrics import TIME_PARTS, TIMES, paired_difference  # noqa: E402
from spectr_gbv.experiment.records import read_records  # noqa: E402

COLUMNS = ("job", "dataset", "verifier", "num_drafts", "block_length", "temperature", "prompts", "new_tokens",
           "block_efficiency", "block_efficiency_se", "mean_accepted_length", "tokens_per_s", "speedup",
           "max_new_tokens", "model", "drafter")
# A job's speed against its cost-model limit (baseline=true), in the speed table only.
SPEED = ("machine", "ar_tokens_per_s", "trie_positions", "speed_limit", "speed_limit_share", *TIMES)
KNOBS_IN_LABEL = ("temperature", "model", "max_new_tokens")  # added to a line's label when they vary
# The paper's orderings, and gbv against traversal (the other sequence-level multi-draft rule), as (method, method it
# should beat): the paired table gives each difference first - second.
ORDERINGS = [(("gbv", 1), ("token", 1)), (("gbv", 1), ("bv", 1)), (("gbv", 3), ("spectr", 3)),
             (("gbv", 3), ("specinfer", 3)), (("gbv", 3), ("multipath", 3)), (("gbv", 3), ("spectr_gbv_paper", 3)),
             (("gbv", 3), ("gbv", 1)), (("gbv", 3), ("traversal", 3))]


def collect(folder: Path) -> list[dict]:
    """One row per job and dataset, then the job's "overall" row when it ran several datasets, in folder order."""
    rows = []
    for path in sorted(folder.rglob("summary.json"), key=job_order):
        summary = json.loads(path.read_text())
        per_dataset = summary["metrics"]
        if len(per_dataset) == 2:  # one dataset: "overall" repeats it
            per_dataset = {name: metrics for name, metrics in per_dataset.items() if name != "overall"}
        for dataset, metrics in per_dataset.items():
            row = {**summary, **metrics, "dataset": dataset, "job": str(path.parent.relative_to(folder))}
            rows.append({column: row.get(column) for column in COLUMNS + SPEED})
    return rows


def job_order(path: Path) -> list:
    """Multirun job folders are numbers: 2 before 10, and before named folders beside them (arena/0 before arena/k1)."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in path.parts]


def write_tables(rows: list[dict], folder: Path) -> str:
    """report.csv, one row per job and dataset; returns the same as a Markdown table."""
    with (folder / "report.csv").open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=COLUMNS + SPEED)
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(row[column]) for column in COLUMNS) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def dataset_table(rows: list[dict]) -> str:
    """The paper's Table 1 shape: a row per method, block efficiency (standard error) and speedup per dataset, and
    their average over datasets. Empty when the jobs ran a single dataset."""
    datasets = list(dict.fromkeys(row["dataset"] for row in rows if row["dataset"] != "overall"))
    if len(datasets) < 2:
        return ""
    methods: dict[str, dict[str, dict]] = {}
    varying = varying_knobs(rows)
    for row in rows:
        methods.setdefault(method_label(row, varying), {})[row["dataset"]] = row
    header = ["method"] + [f"{name} BE" for name in datasets] + ["mean BE"] + [f"{name} speedup" for name in datasets]
    header += ["mean speedup"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method, by_dataset in methods.items():
        found = [by_dataset[name] for name in datasets if name in by_dataset]
        efficiency = [f"{r['block_efficiency']:.2f} ({r['block_efficiency_se']:.2f})" for r in found]
        speedups = [r["speedup"] for r in found]
        mean_speedup = sum(speedups) / len(speedups) if None not in speedups else None
        lines.append("| " + " | ".join([method, *efficiency, mean_with_error(found), *map(cell, speedups),
                                        cell(mean_speedup)]) + " |")
    return "\n".join(lines) + "\n"


def speed_table(rows: list[dict]) -> tuple[str, list[dict]]:
    """Each job's speedup over `ar` beside its cost-model limit (decoding/costs.py) and the share reached, with the
    time split, for the jobs run with baseline=true; returns the Markdown table and its rows (for the bars)."""
    overall = {row["job"]: row for row in rows}.values()  # each job's last row
    jobs = [row for row in overall if row["speed_limit"] is not None]
    if not jobs:
        return "", []
    header = ["method", "prompts", "tokens/s", "ar tokens/s", "speedup", "block eff.", "trie positions", "limit",
              "share", *[f"{key.removesuffix('_time')} %" for key in TIME_PARTS]]
    machines = ", and ".join(dict.fromkeys(str(row["machine"]) for row in jobs))
    lines = [f"Measured on {machines}:", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    varying = varying_knobs(jobs)
    for row in jobs:
        split = [f"{100 * row[key] / row['total_time']:.0f}" for key in TIME_PARTS]
        lines.append("| " + " | ".join([method_label(row, varying), str(row["prompts"]), f"{row['tokens_per_s']:.2f}",
                                        f"{row['ar_tokens_per_s']:.2f}", f"{row['speedup']:.2f}x",
                                        f"{row['block_efficiency']:.2f}", f"{row['trie_positions']:.1f}",
                                        f"{row['speed_limit']:.2f}x", f"{row['speed_limit_share']:.0%}",
                                        *split]) + " |")
    return "\n".join(lines) + "\n", jobs


def speed_bars(jobs: list[dict], path: Path) -> None:
    """Each method's speedup beside its limit, one pair of bars per method, 1x (as fast as `ar`) marked."""
    figure, axis = plt.subplots(figsize=(0.9 * len(jobs) + 2.5, 4))
    xs = range(len(jobs))
    axis.bar([x - 0.2 for x in xs], [row["speedup"] for row in jobs], 0.4, label="speedup over ar")
    axis.bar([x + 0.2 for x in xs], [row["speed_limit"] for row in jobs], 0.4, label="cost-model limit", alpha=0.5)
    axis.axhline(1, color="gray", linestyle="--")
    varying = varying_knobs(jobs)
    axis.set_xticks(list(xs), [method_label(row, varying) for row in jobs], rotation=30, ha="right")
    axis.set_ylabel("x ar's tokens/s")
    axis.legend(fontsize="small")
    axis.grid(alpha=0.3, axis="y")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def real_audits(folder: Path) -> list[dict]:
    """The JSON files of `python -m spectr_gbv.tools.audit --real --json PATH` below the folder."""
    found = [json.loads(path.read_text()) for path in sorted(folder.rglob("*.json"))]
    return [data for data in found if isinstance(data, dict) and data.keys() == {"settings", "results"}]


def audit_table(audit: dict) -> str:
    """The real-distribution audit: per verifier and K, the means over the contexts of E[tau] (accepted draft tokens
    of one iteration), its share of the optimal-transport bound, and the law error (mean and max)."""
    settings, contexts = audit["settings"], audit["settings"]["contexts"]
    lines = [f"Real pair {settings['target']} / {settings['drafter']} ({settings['dtype']}, temperature "
             f"{settings['temperature']}): top-{settings['support']} tree, L={settings['depth']}, means over "
             f"{len(contexts)} contexts:", "",
             "| verifier | K | lossless | E[tau] | of bound | law error | max law error |", "|" + "---|" * 7]
    for row in audit["results"]:
        lines.append(f"| {row['verifier']} | {row['K']} | {'yes' if row['lossless'] else 'NO'} | "
                     f"{row['mean_expected_accepted']:.4f} | {row['mean_share_of_bound']:.1%} | "
                     f"{row['mean_law_error']:.1e} | {row['max_law_error']:.1e} |")
    mass = {key: sum(context["support_mass"][key] for context in contexts) / len(contexts)
            for key in ("p_root", "q_root", "p_mean", "q_mean")}
    lines += ["", f"Untruncated mass of the supports, means over the contexts: at the root p {mass['p_root']:.3f}, "
                  f"q {mass['q_root']:.3f}; over all nodes p {mass['p_mean']:.3f}, q {mass['q_mean']:.3f}."]
    return "\n".join(lines) + "\n"


def method_label(row: dict, varying: list[str]) -> str:
    """A job's name in tables and legends: verifier, K, L, and the knobs that vary between the jobs shown (e.g. the
    temperature), so that no two jobs share a row or a bar."""
    return " ".join([f"{row['verifier']} K={row['num_drafts']} L={row['block_length']}"]
                    + [f"{knob}={row[knob]}" for knob in varying])


def varying_knobs(rows: list[dict]) -> list[str]:
    return [knob for knob in KNOBS_IN_LABEL if len({row[knob] for row in rows}) > 1]


def greedy_agreement(rows: list[dict], folder: Path) -> str:
    """At temperature 0 every lossless verifier must emit the target's greedy tokens: for each temperature-0 job,
    how many of its prompts have exactly the output tokens of the `ar` job below the same folder."""
    greedy = {row["job"]: row for row in rows if row["temperature"] == 0}  # one entry per job, in folder order
    reference = next((job for job, row in greedy.items() if row["verifier"] == "ar"), None)
    if reference is None:
        return ""
    expected = {key: record["output_ids"] for key, record in read_records(folder / reference).items()}
    lines = ["| method (temperature 0) | prompts with ar's exact tokens |", "|---|---|"]
    for job, row in greedy.items():
        if job != reference:
            records = read_records(folder / job)
            same = sum(record["output_ids"] == expected.get(key) for key, record in records.items())
            lines.append(f"| {row['verifier']} K={row['num_drafts']} | {same} / {len(records)} |")
    return "\n".join(lines) + "\n"


def paired_table(rows: list[dict], folder: Path) -> tuple[str, list[dict]]:
    """The paper's orderings as paired differences: every method decoded the same prompts with the same seeds, so for
    each ordering present in the folder (same block length and temperature), the mean per-prompt difference in block
    efficiency with its 95% bootstrap interval (stratified by dataset, seeded), per dataset and overall, and whether
    the interval resolves the ordering. Returns the Markdown table and its entries (for the forest plot)."""
    jobs = {(row["verifier"], row["num_drafts"], row["block_length"], row["temperature"]): row["job"] for row in rows}
    entries = []
    for (better, worse) in ORDERINGS:
        for (verifier, k, block_length, temperature), job in jobs.items():
            other = jobs.get((*worse, block_length, temperature))
            if (verifier, k) != better or other is None:
                continue
            intervals = paired_difference(per_prompt_efficiency(folder / job), per_prompt_efficiency(folder / other))
            if not intervals:  # no records (summaries only): nothing to pair
                continue
            entries.append({"first": f"{better[0]} K={better[1]}", "second": f"{worse[0]} K={worse[1]}",
                            "label": f"{better[0]} K={better[1]} - {worse[0]} K={worse[1]}",
                            "setting": f"L={block_length} T={temperature}",
                            "intervals": intervals})
    if not entries:
        return "", []
    datasets = [row["dataset"] for row in rows if row["dataset"] != "overall"]
    names = [name for name in dict.fromkeys(datasets) if any(name in entry["intervals"] for entry in entries)]
    names.append("overall")
    header = ["paired difference in block efficiency", "setting", *names, "overall verdict"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for entry in entries:
        found = entry["intervals"]
        cells = [with_interval(found[n], "+.2f") if n in found else ""
                 for n in names]
        lines.append("| " + " | ".join([entry["label"], entry["setting"], *cells, verdict(entry)]) + " |")
    return "\n".join(lines) + "\n", entries


def per_prompt_efficiency(job: Path) -> dict[tuple[str, int], float]:
    return {key: r["new_tokens"] / r["target_calls"] for key, r in read_records(job).items()}


def verdict(entry: dict) -> str:
    """In words: an ordering is resolved when the 95% interval of the overall difference excludes zero."""
    overall = entry["intervals"]["overall"]
    if overall["low"] is None:
        return f"unresolved, one prompt a dataset shows no spread ({overall['prompts']} prompts)"
    if overall["low"] > 0:
        return f"{entry['first']} higher: resolved ({overall['prompts']} prompts)"
    if overall["high"] < 0:
        return f"{entry['second']} higher: resolved ({overall['prompts']} prompts)"
    return f"unresolved, the interval holds 0 ({overall['prompts']} prompts)"


def forest_plot(entries: list[dict], path: Path,
                xlabel: str = "difference in block efficiency per prompt:\nmean and 95% interval") -> None:
    """The paired differences as 95% intervals, one row per ordering (overall), zero marked."""
    figure, axis = plt.subplots(figsize=(7, 0.45 * len(entries) + 1.2))
    entries = [entry for entry in entries if entry["intervals"]["overall"]["low"] is not None]
    for row, entry in enumerate(entries):
        overall = entry["intervals"]["overall"]
        below, above = overall["mean"] - overall["low"], overall["high"] - overall["mean"]
        axis.errorbar(overall["mean"], row, xerr=[[below], [above]], fmt="o", capsize=4, color="black")
    axis.axvline(0, color="gray", linestyle="--")
    axis.set_yticks(range(len(entries)), [f"{entry['label']} ({entry['setting']})" for entry in entries])
    axis.invert_yaxis()
    axis.set_xlabel(xlabel)
    axis.grid(alpha=0.3, axis="x")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def arena_tables(folder: Path) -> tuple[str, list[dict]]:
    """Each verifier-arena job (mode=arena) below the folder, every interval over prompts (the sampling unit): per
    verifier@k (its setting beside it, so that a results page's rows name their job) its state, E[tau] given the
    drafts with its 95% interval and design effect, the difference against the reference at the same k with its
    verdict and the prompts an open one would need, the first-token acceptance beside the optimal-transport bound
    alpha* and the ms per context; the reference decode's cost and the scoring's above it. Then per k the verdict
    matrix of every pair, E[tau] per dataset with the orderings that flip between datasets, a stateful rule's
    state cost and the consistency check of the decode. Returns the Markdown and the intervals (forest plot)."""
    text, entries, jobs = [], [], []
    for path in sorted(folder.rglob("summary.json"), key=job_order):
        summary = json.loads(path.read_text())
        if "arena" not in summary or "overall" not in summary["arena"]["datasets"]:
            continue
        jobs.append((path.parent, summary))
        arena = summary["arena"]
        setting = f"L={summary['block_length']} T={summary['temperature']}"
        text += arena_verifier_table(arena, summary, setting, path.parent.relative_to(folder))
        text += verdict_matrices(arena, setting) + dataset_table_of_arena(arena, setting) + state_lines(arena)
        reference = arena["reference"]
        for name, row in arena["datasets"]["overall"]["verifiers"].items():
            if row["difference"] is not None:
                entries.append({"label": f"{name} - {reference}@{name.rpartition('@')[2]}", "setting": setting,
                                "intervals": {"overall": row["difference"]}})
    return "\n".join(text + cross_decode_lines(jobs)), entries


def cross_decode_lines(jobs: list[tuple[Path, dict]]) -> list[str]:
    """Whether a decode's path favours a rule: a rule's E[tau] over another reference's decode against the rule's
    own decode of the same prompts in the same setting (realised tau), each side over its own contexts."""
    lines = []
    for own_folder, own in jobs:
        rule = f"{own['arena']['reference']}@{own['num_drafts']}"
        for other_folder, other in jobs:
            same = all(own[key] == other[key] for key in ("block_length", "temperature", "model", "drafter"))
            if other is own or not same or rule not in other["arena"]["datasets"]["overall"]["verifiers"]:
                continue
            scored = arena_values(other_folder, lambda c: c["verifiers"][rule]["expected_accepted"])
            realised = arena_values(own_folder, lambda c: c["accepted"])
            found = paired_difference(scored, realised, paired=False)
            if found:
                lines.append(f"Contexts check (L={own['block_length']} T={own['temperature']}): {rule}'s E[tau] on "
                             f"the {other['arena']['reference']}@{other['num_drafts']} decode minus its own decode's "
                             f"realised tau, {found['overall']['prompts']} prompts: {interval_text(found)}.")
    return lines + ([""] if lines else [])


def arena_values(job: Path, value) -> dict:
    """value(context) per arena context of a job's records, keyed (dataset, prompt_id, iteration)."""
    return {(dataset, prompt_id, context["iteration"]): value(context)
            for (dataset, prompt_id), record in read_records(job).items() for context in record.get("arena", [])
            if "accepted" in context}


def arena_verifier_table(arena: dict, summary: dict, setting: str, job: Path) -> list[str]:
    reference, overall = arena["reference"], arena["datasets"]["overall"]
    decode = overall["decode"]
    verify = decode["verify_ms_per_iteration"]
    scoring = decode.get("scoring_ms_per_context")
    cost = "" if scoring is None else f"; scoring took {scoring:.0f} ms per context ({decode['scoring_share']:.0%})"
    verify = "-" if verify is None else f"{verify:.1f}"
    lines = [f"Verifier arena ({job}): {summary['model']} <- {summary['drafter']}, {setting}, drafts of {reference} "
             f"K={summary['num_drafts']} over {decode['prompts']} prompts ({decode['iterations']} contexts); that "
             f"decode took {decode['ms_per_iteration']:.1f} ms per iteration ({verify} ms in its verifier){cost}, "
             f"block efficiency {decode['block_efficiency']:.2f}. E[tau] given the drafts (exact, or a mean of "
             f"replicas where marked ~), 95% intervals over prompts; verdicts within ±{arena['delta']}:", "",
             "| verifier@k | setting | state | prompts | contexts | E[tau] [95%] | design effect "
             "| vs reference@k [95%] | verdict | prompts needed | first-token acceptance | alpha* | ms/context |",
             "|" + "---|" * 13]
    for name, row in overall["verifiers"].items():
        found = row["difference"]
        difference = "" if found is None else with_interval(found, "+.3f")
        mean = {"mean": row["expected_accepted"], "low": row["expected_accepted_low"],
                "high": row["expected_accepted_high"]}
        lines.append(f"| {name}{'' if row['exact'] else ' ~'} | {setting} | {row['state']} | {row['prompts']} | "
                     f"{row['contexts']} | {with_interval(mean, '.3f')} | {design_cell(row['design_effect'])} | "
                     f"{difference} | "
                     f"{row['verdict'] or ''} | {needed_cell(row['prompts_needed'])} | "
                     f"{row['first_token_acceptance']:.3f} | {row['alpha_star']:.3f} | {row['ms_per_context']:.1f} |")
    return lines + [""]


def design_cell(effect: float | None) -> str:
    return "" if effect is None else f"{effect:.1f}"


def needed_cell(prompts: int | None) -> str:
    return "" if prompts is None else f"{prompts:,}"


def verdict_matrices(arena: dict, setting: str) -> list[str]:
    """Per k, every pair's overall verdict, row minus column (`open (N)`: N prompts would settle it)."""
    lines = []
    for k in sorted({pair["k"] for pair in arena["pairs"]}):
        at_k = [pair for pair in arena["pairs"] if pair["k"] == k]
        names = list(dict.fromkeys([pair["a"] for pair in at_k] + [pair["b"] for pair in at_k]))
        cells = {(pair["a"], pair["b"]): pair["datasets"]["overall"] for pair in at_k}
        lines += [f"Arena verdicts at k={k} ({setting}), row minus column over prompts, ±{arena['delta']}:", "",
                  "| verdicts at k=" + str(k) + f" {setting} | " + " | ".join(names[1:]) + " |",
                  "|" + "---|" * len(names)]
        for a in names[:-1]:
            row = [verdict_cell(cells[a, b]) if (a, b) in cells else "" for b in names[1:]]
            lines.append(f"| {a} | " + " | ".join(row) + " |")
        lines.append("")
    return lines


def verdict_cell(difference: dict) -> str:
    found = f"{difference['verdict']} {difference['mean']:+.3f}"
    return found + (f" ({difference['prompts_needed']:,})" if difference["prompts_needed"] else "")


def dataset_table_of_arena(arena: dict, setting: str) -> list[str]:
    """E[tau] per dataset for each verifier@k, and the pairs resolved in opposite directions in two datasets."""
    datasets = [name for name in arena["datasets"] if name != "overall"]
    if len(datasets) < 2:
        return []
    lines = [f"Arena E[tau] by dataset ({setting}):", "", f"| E[tau] by dataset {setting} | " + " | ".join(datasets)
             + " |", "|" + "---|" * (len(datasets) + 1)]
    for name in arena["datasets"]["overall"]["verifiers"]:
        values = [arena["datasets"][d]["verifiers"].get(name) for d in datasets]
        lines.append(f"| {name} | " + " | ".join("" if v is None else f"{v['expected_accepted']:.3f}"
                                                 for v in values) + " |")
    flips = [f"{pair['a']} - {pair['b']}" for pair in arena["pairs"]
             if {"above", "below"} <= {pair["datasets"][d]["verdict"] for d in datasets if d in pair["datasets"]}]
    return lines + ["", f"Orderings resolved in opposite directions in two datasets ({setting}): "
                    f"{', '.join(flips) if flips else 'none'}.", ""]


def state_lines(arena: dict) -> list[str]:
    """A stateful rule's state cost, and whether the decode's realised tau matches the reference's E[tau]."""
    lines = [f"State cost of {name} ({d['overall']['prompts']} prompts): carried minus fresh {interval_text(d)}."
             for name, d in arena["state_cost"].items()]
    found = arena["consistency"]
    if found is not None:
        lines.append(f"Consistency: the decode's realised tau minus {found['verifier']}'s E[tau] "
                     f"{interval_text(found['datasets'])}: {'holds' if found['holds'] else 'FAILS'}.")
    return lines + ([""] if lines else [])


def interval_text(differences: dict) -> str:
    return with_interval(differences["overall"], "+.3f")


def with_interval(found: dict, spec: str) -> str:
    """mean [low, high]; [n/a] where one prompt a stratum left the spread unknown."""
    if found["low"] is None:
        return f"{found['mean']:{spec}} [n/a]"
    return f"{found['mean']:{spec}} [{found['low']:{spec}}, {found['high']:{spec}}]"


def dataset_bars(rows: list[dict], path: Path) -> bool:
    """The main table at a glance: block efficiency per dataset as grouped bars, one bar per method, with standard
    error bars. Only when the jobs ran several datasets."""
    datasets = list(dict.fromkeys(row["dataset"] for row in rows if row["dataset"] != "overall"))
    if len(datasets) < 2:
        return False
    methods: dict[str, dict[str, dict]] = {}
    varying = varying_knobs(rows)
    for row in rows:
        methods.setdefault(method_label(row, varying), {})[row["dataset"]] = row
    width = 0.8 / len(methods)
    figure, axis = plt.subplots(figsize=(1.6 * len(datasets) + 3, 4))
    for i, (method, by_dataset) in enumerate(methods.items()):
        xs = [d + (i - (len(methods) - 1) / 2) * width for d, name in enumerate(datasets) if name in by_dataset]
        found = [by_dataset[name] for name in datasets if name in by_dataset]
        axis.bar(xs, [r["block_efficiency"] for r in found], width, yerr=[r["block_efficiency_se"] for r in found],
                 capsize=2, label=method)
    axis.set_xticks(range(len(datasets)), datasets)
    axis.set_ylabel("block efficiency (tokens per target call)")
    axis.legend(fontsize="small", bbox_to_anchor=(1.01, 1), loc="upper left")  # beside the bars, not over them
    axis.grid(alpha=0.3, axis="y")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def mean_with_error(rows: list[dict]) -> str:
    """The average block efficiency over datasets and its standard error: the datasets' prompts are independent,
    so the variances of the per-dataset estimates add."""
    average = sum(row["block_efficiency"] for row in rows) / len(rows)
    error = math.sqrt(sum(row["block_efficiency_se"] ** 2 for row in rows)) / len(rows)
    return f"{average:.2f} ({error:.2f})"


def cell(value) -> str:
    if value is None:
        return ""
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def plot(rows: list[dict], x: str, y: str, panel: str, path: Path) -> bool:
    """Lines of y against x, one per verifier (and varying knob), one panel per value of `panel`."""
    by_job = {row["job"]: row for row in rows}  # each job's last row: its overall result
    rows = [row for row in by_job.values() if row[y] is not None]
    if len({row[x] for row in rows}) < 2:
        return False  # a single x value is a point, not a curve
    varying = [knob for knob in KNOBS_IN_LABEL if knob != x and len({row[knob] for row in rows}) > 1]
    panels = sorted({row[panel] for row in rows})
    figure, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), sharey=True, squeeze=False)
    for axis, value in zip(axes[0], panels):
        lines: dict[str, list[dict]] = {}
        for row in rows:
            if row[panel] == value:
                label = " ".join([row["verifier"]] + [f"{knob}={row[knob]}" for knob in varying])
                lines.setdefault(label, []).append(row)
        xs = sorted({row[x] for row in rows})
        shift = 0.15 * min(b - a for a, b in zip(xs, xs[1:])) / max(len(lines), 1)  # side by side, bars apart
        for i, (label, points) in enumerate(sorted(lines.items())):
            points.sort(key=lambda row: row[x])
            errors = [row["block_efficiency_se"] for row in points] if y == "block_efficiency" else None
            offset = (i - (len(lines) - 1) / 2) * shift
            axis.errorbar([row[x] + offset for row in points], [row[y] for row in points], yerr=errors, marker="o",
                          capsize=3, label=label)
        axis.set_title(f"{panel} = {value}")
        axis.set_xlabel(x)
        axis.set_xticks(sorted({row[x] for row in rows}))
        axis.grid(alpha=0.3)
    axes[0][0].set_ylabel(y)
    axes[0][-1].legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def report(folder: Path) -> str:
    rows, audits = collect(folder), real_audits(folder)
    if not rows and not audits:
        raise SystemExit(f"error: folder={folder}: no summary.json or real audit below it; give a run or multirun "
                         "folder")
    paired, entries = paired_table(rows, folder)
    speed, speed_jobs = speed_table(rows)
    arena, arena_entries = arena_tables(folder)
    tables = (dataset_table(rows), paired, arena, speed, greedy_agreement(rows, folder),
              *[audit_table(audit) for audit in audits], write_tables(rows, folder) if rows else "")
    markdown = "\n".join(table for table in tables if table)
    (folder / "report.md").write_text(markdown)
    if entries:
        forest_plot(entries, folder / "paired_differences.png")
    if arena_entries:
        forest_plot(arena_entries, folder / "arena_differences.png",
                    xlabel="difference in E[tau] per context, same drafts:\nmean and 95% interval")
    if speed_jobs:
        speed_bars(speed_jobs, folder / "speedup_vs_limit.png")
    dataset_bars(rows, folder / "block_efficiency_by_dataset.png")
    plots = [("num_drafts", "block_efficiency", "block_length"), ("block_length", "block_efficiency", "num_drafts"),
             ("num_drafts", "speedup", "block_length"), ("temperature", "block_efficiency", "num_drafts")]
    for x, y, panel in plots:
        plot(rows, x, y, panel, folder / f"{y}_vs_{x}.png")
    return markdown


def markdown_tables(lines: list[str]) -> list[tuple[int, int]]:
    """(first, end) line spans of the Markdown tables in lines."""
    spans, first = [], None
    for index, line in enumerate([*lines, ""]):
        if line.startswith("|") and first is None:
            first = index
        elif not line.startswith("|") and first is not None:
            spans.append((first, index))
            first = None
    return spans


def key_width(header: str, rows: list[str]) -> int:
    """Cells that name a row across runs: the first, or the first two where the second is a setting (a paired
    difference is the same only at the same block length and temperature) or the first repeats (an audit's
    verifier at several K)."""
    firsts = [row.split(" | ")[0] for row in rows]
    return 2 if header.split(" | ")[1] == "setting" or len(set(firsts)) < len(firsts) else 1


def row_key(row: str, width: int) -> tuple[str, ...]:
    return tuple(row.split(" | ")[:width])


PART_MARK = re.compile(r"<!-- report: (\S+) -->")


def refresh_page(page: Path, markdown: str, part: str | None = None) -> int:
    """Replace in a results page every table row that this report prints anew: a page's table is refreshed when
    the report prints a table with the same header holding every row the page quotes (the page may quote a subset,
    in its own order). Two parts can print the same rows of other runs (the main table's and the speed part's
    "gbv K=3 L=8"), so a table on the line below `<!-- report: NAME -->` is refreshed only by the report of the part
    folder NAME. Returns the rows replaced; prose is left as it is."""
    printed = markdown.splitlines()
    lines = page.read_text().splitlines()
    replaced = 0
    for first, end in markdown_tables(lines):
        source = PART_MARK.fullmatch(lines[first - 1]) if first else None
        if source and source.group(1) != part:
            continue
        quoted = lines[first + 2:end]  # below the header and its separator
        for start, stop in markdown_tables(printed):
            rows = printed[start + 2:stop]
            width = key_width(printed[start], rows)
            by_key = {row_key(row, width): row for row in rows}
            keys = [row_key(row, width) for row in quoted]
            if printed[start] == lines[first] and all(key in by_key for key in keys):
                lines[first + 2:end] = [by_key[key] for key in keys]
                replaced += sum(old != new for old, new in zip(quoted, lines[first + 2:end]))
                break
    page.write_text("\n".join(lines) + "\n")
    return replaced


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m spectr_gbv.tools.report", description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a run or multirun folder (searched recursively)")
    parser.add_argument("--page", type=Path, help="a results page (docs/results.md) whose tables quote this report: "
                                                  "refresh their rows from it")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        sys.exit(f"error: folder={args.folder}: not a directory; give a run or multirun folder")
    if args.page is not None and not args.page.is_file():
        sys.exit(f"error: page={args.page}: no such file; give a Markdown page that quotes this report")
    markdown = report(args.folder)
    print(markdown, end="")
    if args.page is not None:
        refreshed = refresh_page(args.page, markdown, args.folder.resolve().name)
        print(f"{args.page}: {refreshed} table rows refreshed", file=sys.stderr)


if __name__ == "__main__":
    main()
