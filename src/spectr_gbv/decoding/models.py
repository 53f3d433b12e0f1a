"""Model loading: every model config instantiates to a LoadedModel (model + tokenizer + name).

pretrained()  any causal LM transformers loads: a local folder, a GGUF file, or a hub id (with network)
packaged()    the real models that ship as GGUF chunk packages on the package index (gguf_packages.py)
tiny()        random Llama-shaped models with a byte-level tokenizer, for tests (tiny.py)

A model's linear layers can run on other kernels (linear.py); check_same_tokenizer says whether a target and a drafter
mean the same thing by every token id.
"""
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import transformers

from spectr_gbv.decoding.linear import check_linear_layers, with_linear_layers
from spectr_gbv.decoding.precision import DTYPES, Precision, resolve_precision
from spectr_gbv.errors import ModelUnavailable

log = logging.getLogger(__name__)


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


def settled_precision(dtype: str, linear_kernel: str | None, quantize: str | None, device: str) -> Precision:
    """What a loader loads in: dtype auto made this machine's choice (precision.py), the linear layers' settings
    checked against it."""
    chosen = resolve_precision("", dtype, linear_kernel, quantize, device)
    check_linear_layers("", quantize, chosen.linear_kernel, chosen.dtype, device)
    if dtype == "auto":
        log.info("dtype %s, linear_kernel %s (%s)", chosen.dtype, chosen.linear_kernel, chosen.reason)
    return chosen


# --- any model transformers loads -------------------------------------------------------------------------------

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # "gpt2" or "org/name"


def is_hub_id(path: str) -> bool:
    """Whether pretrained() asks the hub for a path that is no local file or folder; the run's config check asks the
    same, so that what it lets through is what the loader takes."""
    return HUB_ID.match(path) is not None


def pretrained(path: str, dtype: str = "auto", device: str = "cpu", gguf_file: str | None = None,
               quantize: str | None = None, linear_kernel: str | None = None) -> LoadedModel:
    """Load a local folder (optionally with gguf_file inside it), a path to a .gguf file, or a hub id; quantize="int8"
    stores its linear layers' weights in int8 (see Int8Linear), "int8_dynamic" computes them in int8 (see
    DynamicInt8Linear), linear_kernel="onednn" computes them on oneDNN (see OneDNNLinear); dtype="auto" is this
    machine's choice (precision.py)."""
    chosen = settled_precision(dtype, linear_kernel, quantize, device)
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
            source, dtype=DTYPES[chosen.dtype], device_map=device, **kwargs)
    except OSError as error:
        if local.is_dir():  # a local folder: its own error says what is wrong with it
            raise
        raise ModelUnavailable(f"path={path}: not a local folder or .gguf file, and the hub could not give it "
                               f"({str(error).splitlines()[0]}); give a local model folder or .gguf file, or run "
                               "where the hub is reachable") from error
    tokenizer = transformers.AutoTokenizer.from_pretrained(source, gguf_file=gguf_file)
    name = Path(gguf_file).stem if gguf_file else Path(path).name
    model = with_linear_layers(model.eval(), quantize, chosen.linear_kernel)
    return LoadedModel(model=model, tokenizer=tokenizer, name=name)


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
