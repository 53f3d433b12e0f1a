"""A researcher's own verifier (docs/custom_verifiers.md, examples/my_verifiers.py): its config checks, its exact
hook, and the audit's verdict on a correct rule and on a deliberately biased one. run.py end to end: tests/test_run.py
-k custom."""
import pytest

from conftest import ROOT
from spectr_gbv.errors import ConfigError
from spectr_gbv.experiment.config import validate
from spectr_gbv.tools import audit
from spectr_gbv.verifiers import reference

CORRECT, BIASED = "my_verifiers:SpeculativeSampling", "my_verifiers:BiasedSpeculativeSampling"
NOT_A_VERIFIER = "spectr_gbv.errors:ConfigError"  # a class, but without the contract
BAD_TARGETS = [
    ("no_such_module:Rule", "module no_such_module does not import (ModuleNotFoundError"),
    ("my_verifiers:NoSuchRule", "module my_verifiers has no attribute 'NoSuchRule'"),
    (NOT_A_VERIFIER, "ConfigError does not meet the verifier contract: it must be a subclass of "
                     "spectr_gbv.verifiers.Verifier that implements verify()"),
]


@pytest.fixture(autouse=True)
def examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))


def test_custom_target_becomes_the_verifier_name(make_cfg):
    cfg = make_cfg("verifier=custom", f"verifier.target={CORRECT}", "num_drafts=1")
    validate(cfg)
    assert cfg.verifier.name == cfg.module.verifier == CORRECT


@pytest.mark.parametrize("target, allowed", BAD_TARGETS + [(None, "required with verifier=custom")])
def test_a_bad_or_missing_target_names_verifier_target(make_cfg, target, allowed):
    cfg = make_cfg("verifier=custom", *([f"verifier.target={target}"] if target else []))
    with pytest.raises(ConfigError) as error:
        validate(cfg)
    assert (error.value.key, error.value.value) == ("verifier.target", target)
    assert error.value.allowed.startswith(allowed)


@pytest.mark.parametrize("name", list(reference.ANCHORS))
def test_the_examples_exact_hook_is_token_sd_and_the_biased_ones_is_not(name):
    p, q, L, _ = reference.anchor(name)
    assert reference.expected_accepted(CORRECT, p, q, L, 1) == pytest.approx(
        reference.expected_accepted("token", p, q, L, 1), abs=1e-12)
    assert reference.law_error(CORRECT, p, q, L, 1) < 1e-12
    assert reference.law_error(BIASED, p, q, L, 1) > 1e-3


def test_the_audit_passes_the_correct_rule_and_catches_the_biased_one(capsys):
    with pytest.raises(SystemExit) as exit_:  # the biased rule claims lossless and is not
        audit.main(["--verifier", CORRECT, "--verifier", BIASED])
    assert exit_.value.code == 1
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert f"verdict on {CORRECT}: lossless (min p = " in out
    assert f"verdict on {BIASED}: NOT lossless: p = " in out


def test_the_verdict_splits_its_false_alarm_rate_over_the_instances():
    checks = [audit.StreamCheck(title, 1, 2, 0.5, 1.0, 0.01, None, None) for title in audit.STREAM_INSTANCES]
    threshold = audit.FAMILY_ALPHA / len(checks)
    checks[1].p_value = 1.01 * threshold
    assert audit.verdict(checks, misses=0) == (True, f"lossless (min p = {checks[1].p_value:.3g} at instance "
                                                     f"{checks[1].title}; each test at {threshold:.1e} = 0.001 / 7)")
    checks[1].p_value = 0.99 * threshold
    assert audit.verdict(checks, misses=0)[1].startswith(f"NOT lossless: p = {checks[1].p_value:.2e}")
    checks[1].p_value = 0.5
    assert audit.verdict(checks, misses=3)[1].startswith(f"NOT lossless: p = 0 at instance {audit.GREEDY_TITLE}")
    checks[2].law_error = 1e-6
    assert audit.verdict(checks, misses=0)[1].startswith(f"NOT lossless: exact law error 1.0e-06 at instance "
                                                         f"{checks[2].title}")


@pytest.mark.parametrize("spec, allowed", BAD_TARGETS + [("gvb", "unknown verifier")])
def test_a_list_with_a_non_verifier_is_one_line_before_any_audit(spec, allowed, capsys):
    with pytest.raises(SystemExit) as exit_:
        audit.main(["--verifier", CORRECT, "--verifier", spec])
    assert exit_.value.code == f"error: --verifier={spec}: " + exit_.value.code.split(": ", 2)[2]
    assert exit_.value.code.split(": ", 2)[2].startswith(allowed)
    assert capsys.readouterr().out == ""  # nothing audited: the bad spec is found first


def test_verifier_is_not_for_real(capsys):
    with pytest.raises(SystemExit) as exit_:
        audit.main(["--real", "--verifier", CORRECT])
    assert exit_.value.code == 2 and "--verifier: not with --real" in capsys.readouterr().err
