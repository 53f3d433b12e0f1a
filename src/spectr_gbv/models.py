"""Model loading: every model config instantiates to a LoadedModel (model + tokenizer + name).

tiny()       random Qwen2-shaped models with a byte-level tokenizer, for tests (no files, no network)
"""

import math
from dataclasses import dataclass

import torch
import transformers

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass
class LoadedModel:
    model: transformers.PreTrainedModel  # eval mode, on its device, in its dtype
    tokenizer: transformers.PreTrainedTokenizerBase
    name: str


def torch_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not allowed; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def tiny(seed: int = 0, vocab_size: int | None = None, num_layers: int = 2, hidden_size: int = 64,
         perturb: float = 0.0, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
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
    config = transformers.Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,  # grouped-query, as Qwen
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
    model = model.to(device=device, dtype=torch_dtype(dtype)).eval()
    name = f"tiny(seed={seed}, vocab={vocab_size}, perturb={perturb})"
    return LoadedModel(model=model, tokenizer=tokenizer, name=name)


@torch.no_grad()
def add_relative_noise(model: torch.nn.Module, scale: float, seed: int) -> None:
    """Add Gaussian noise of std scale * rms(w) to every weight w, from a generator of its own (seeded)."""
    generator = torch.Generator().manual_seed(seed + 1_000_003)  # a stream apart from the init's
    for weight in model.parameters():
        rms = weight.pow(2).mean().sqrt()
        weight.add_(scale * rms * torch.randn(weight.shape, generator=generator))
