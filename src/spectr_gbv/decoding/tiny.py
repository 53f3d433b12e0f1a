"""Tiny random causal LMs for tests: Llama-shaped, with a byte-level tokenizer, built in memory (no files, no network).
tiny(seed=s) is a target; tiny(seed=s, perturb=x) is it with seeded noise on its weights, a drafter."""
import math

import torch
import transformers

from spectr_gbv.decoding.linear import with_linear_layers
from spectr_gbv.decoding.models import LoadedModel, settled_precision
from spectr_gbv.decoding.precision import DTYPES


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
    chosen = settled_precision(dtype, linear_kernel, quantize, device)
    # Llama, not Qwen2: for model_type qwen2 AutoTokenizer ignores the saved tokenizer class, so a saved tiny
    # model would reload with a Qwen2 tokenizer that maps bytes to nothing.
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, max_position_embeddings=4096, tie_word_embeddings=False,
        num_attention_heads=4, num_key_value_heads=2,  # grouped-query attention, as Qwen's
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
    model = model.to(device=device, dtype=DTYPES[chosen.dtype]).eval()
    model = with_linear_layers(model, quantize, chosen.linear_kernel)
    name = f"tiny(seed={seed}, vocab={vocab_size}, perturb={perturb})"
    return LoadedModel(model=model, tokenizer=tokenizer, name=name)


@torch.no_grad()
def add_relative_noise(model: torch.nn.Module, scale: float, seed: int) -> None:
    """Add Gaussian noise of std scale * rms(w) to every weight w, from a generator of its own (seeded)."""
    generator = torch.Generator().manual_seed(seed + 1_000_003)  # a stream apart from the init's
    for weight in model.parameters():
        rms = weight.pow(2).mean().sqrt()
        weight.add_(scale * rms * torch.randn(weight.shape, generator=generator))
