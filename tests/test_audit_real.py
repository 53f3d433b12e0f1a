"""The real-distribution audit (tools/audit.py --real), on tiny models: its instances are laws on the target's top
tokens, the lossless verifiers stay exact and below the bound on them, the published rule does not stay exact, and
--json writes the documented keys."""
import json

import numpy as np
import pytest

from spectr_gbv.decoding.tiny import tiny
from spectr_gbv.tools import audit
from spectr_gbv.tools.report import main as report_main
from spectr_gbv.verifiers import VERIFIERS

EXACT = 1e-12
SUPPORT, DEPTH, DRAFTS = 3, 2, (1, 2, 3)
TEXTS = ("The quick brown fox", "def fibonacci(n):", "Once upon a time")


@pytest.fixture(scope="module")
def built():
    target, drafter = tiny(seed=0), tiny(seed=0, perturb=0.5)
    prompts = [target.encode_prompt(text) for text in TEXTS]
    return prompts, audit.build_instances(target, drafter, prompts, support=SUPPORT, depth=DEPTH)


@pytest.fixture(scope="module")
def audits(built):
    return [audit.audit_instance(instance, DRAFTS) for instance in built[1]]


def test_instances_are_laws_on_the_targets_top_tokens(built):
    for instance in built[1]:
        nodes = sum(SUPPORT**d for d in range(DEPTH + 1))  # every prefix the enumeration asks for
        assert len(instance.p.table) == len(instance.q.table) == nodes
        for model in (instance.p, instance.q):
            for dist in model.table.values():
                assert dist.shape == (SUPPORT,) and (dist > 0).all() and abs(dist.sum() - 1) < EXACT
        # local token i is the target's i-th most likely: p is non-increasing on every support
        assert all((np.diff(dist) <= 0).all() for dist in instance.p.table.values())
        assert all(0 < mass <= 1 for mass in instance.mass.values())


def test_contexts_are_the_prompts_and_the_targets_greedy_tokens(built):
    for prompt, instance in zip(*built):
        assert instance.context[:len(prompt)] == prompt
        assert len(prompt) < len(instance.context) <= len(prompt) + audit.GREEDY_TOKENS


def test_lossless_verifiers_are_exact_and_below_the_bound(audits):
    for measured in audits:
        for (name, k), (accepted, law_error, bound) in measured.items():
            if VERIFIERS[name].lossless:
                assert law_error < EXACT, (name, k)
                assert accepted <= bound + EXACT, (name, k)


def test_the_published_rule_is_biased(audits):
    assert max(measured["spectr_gbv_paper", k][1] for measured in audits for k in DRAFTS) > 1e-6


def test_json_holds_the_documented_keys_and_the_report_prints_its_table(tmp_path, capsys):
    path = tmp_path / "real.json"
    audit.main(["--real", "--models", "tiny", "--support", "2", "--depth", "1", "--prompts", "1",
                "--json", str(path)])
    printed = capsys.readouterr().out
    report_main([str(tmp_path)])  # the report renders the same table from the JSON alone
    assert capsys.readouterr().out == printed
    assert "| verifier | K | lossless | E[tau] | of bound | law error | max law error |" in printed
    assert "| spectr_gbv_paper | 3 | NO | " in printed
    report = json.loads(path.read_text())
    settings = report["settings"]
    assert {"target", "drafter", "dtype", "temperature", "support", "depth", "drafts", "greedy_tokens",
            "prompts_per_dataset", "support_rule", "contexts"} <= set(settings)
    assert [(c["dataset"], c["prompt_index"]) for c in settings["contexts"]] == [(name, 0) for name in audit.DATASETS]
    assert all(set(c["support_mass"]) == {"p_root", "q_root", "p_mean", "q_mean"} for c in settings["contexts"])
    assert [(row["verifier"], row["K"]) for row in report["results"]] == audit.real_rows(settings["drafts"])
    for row in report["results"]:
        assert {"lossless", "mean_expected_accepted", "mean_share_of_bound", "mean_law_error",
                "max_law_error"} <= set(row)
        assert len(row["expected_accepted"]) == len(row["law_error"]) == len(row["bound"]) == len(audit.DATASETS)


def test_the_real_options_need_real(capsys):
    with pytest.raises(SystemExit) as exit_:
        audit.main(["--json", "real.json"])
    assert exit_.value.code == 2 and "only with --real" in capsys.readouterr().err
