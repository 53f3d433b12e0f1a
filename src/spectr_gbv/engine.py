"""The decoding loop: a drafter proposes K i.i.d. blocks of L tokens, the target scores them in one pass, a
verifier keeps a prefix of one block plus one token, and both KV caches keep exactly the committed path.

Plain Python objects, one sequence at a time (the K drafts are the batch):

    engine = SpeculativeEngine(target, drafter, "gbv", num_drafts=3, block_length=4, sampling=Sampling(1.0))
    record = engine.generate(prompt_ids, max_new_tokens=64, generator=torch.Generator().manual_seed(0))

Verifier "ar" is plain autoregressive decoding of the target with the same sampling: the speedup baseline.
"""
import time
import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import DynamicCache

from spectr_gbv.models import LoadedModel, check_same_tokenizer
from spectr_gbv.sampling import Sampling, warp
from spectr_gbv.verifiers import build_verifier
from spectr_gbv.verifiers.base import sample


@dataclass
class DecodeRecord:
    """One sequence. Every iteration emits accepted_lengths[i] + 1 tokens except the last, which may be cut at EOS
    or max_new_tokens: sum(accepted_lengths) + target_calls >= new_tokens, equal unless the last block was cut
    (`ar` records no accepted lengths and one target call per token)."""

    output_ids: list[int] = field(default_factory=list)  # new tokens only, EOS included when reached
    new_tokens: int = 0
    target_calls: int = 0  # target passes that emit tokens: one per iteration (ar: per token, prefill included)
    accepted_lengths: list[int] = field(default_factory=list)  # per iteration, as the verifier decided
    draft_indices: list[int] = field(default_factory=list)  # per iteration, the winning draft
    draft_time: float = 0.0  # seconds, time.perf_counter
    target_time: float = 0.0
    verify_time: float = 0.0
    total_time: float = 0.0

    @property
    def block_efficiency(self) -> float:
        return self.new_tokens / self.target_calls


class SpeculativeEngine:
    def __init__(self, target: LoadedModel, drafter: LoadedModel | None, verifier: str, num_drafts: int = 1,
                 block_length: int = 4, sampling: Sampling = Sampling()):
        for key, value in [("num_drafts", num_drafts), ("block_length", block_length)]:
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{key}={value!r} is not allowed: must be an integer >= 1")
        self.verifier = None if verifier == "ar" else build_verifier(verifier)
        if self.verifier is not None and drafter is None:
            raise ValueError(f"verifier={verifier!r} needs a drafter; only 'ar' runs without one")
        if self.verifier is not None:
            check_same_tokenizer(target, drafter)
        if self.verifier is not None and num_drafts > 1 and sampling.drafter_temperature == 0:
            warnings.warn(f"num_drafts={num_drafts} with a greedy drafter makes all drafts identical; "
                          "set sampling.draft_temperature > 0")
        self.target, self.drafter, self.sampling = target, drafter, sampling
        self.num_drafts, self.block_length = num_drafts, block_length
        self.eos_ids = eos_ids(target)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, generator: torch.Generator) -> DecodeRecord:
        if len(prompt_ids) == 0:
            raise ValueError("prompt_ids is empty: the prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} is not allowed: must be >= 1")
        start = time.perf_counter()
        record = DecodeRecord()
        decode = self._autoregressive if self.verifier is None else self._speculative
        decode(list(prompt_ids), max_new_tokens, generator, record)
        record.new_tokens = len(record.output_ids)
        record.total_time = time.perf_counter() - start
        return record

    def _autoregressive(self, ids, max_new_tokens, generator, record):
        cache = DynamicCache(config=self.target.model.config)
        pending = ids  # tokens the target has not seen yet: the prompt, then each sampled token
        while True:
            tick = time.perf_counter()
            logits = self._forward(self.target, cache, torch.tensor([pending]), logits_to_keep=1)[0, -1]
            token = sample(self._target_warp(logits), generator).item()
            record.target_time += time.perf_counter() - tick
            record.target_calls += 1
            if self._emit(record, [token], max_new_tokens):
                return
            pending = [token]

    def _speculative(self, ids, max_new_tokens, generator, record):
        # Invariant between iterations: `ids` = prompt + emitted tokens; each cache holds a prefix of `ids` with
        # one batch row, and the tokens past it are fed at the next forward. The target's cache always lacks
        # exactly the last token of `ids`: feeding it with the drafts makes the pass return p at the block start.
        target_cache = DynamicCache(config=self.target.model.config)
        draft_cache = DynamicCache(config=self.drafter.model.config)
        if len(ids) > 1:  # prefill, timed as each model's share
            tick = time.perf_counter()
            self._forward(self.target, target_cache, torch.tensor([ids[:-1]]), logits_to_keep=1)
            tock = time.perf_counter()
            self._forward(self.drafter, draft_cache, torch.tensor([ids[:-1]]), logits_to_keep=1)
            record.target_time += tock - tick
            record.draft_time += time.perf_counter() - tock
        state = None
        while True:
            tick = time.perf_counter()
            tokens, q = self._draft(draft_cache, ids, generator)
            tock = time.perf_counter()
            p = self._score(target_cache, ids[-1], tokens)
            tack = time.perf_counter()
            dtype = torch.promote_types(p.dtype, q.dtype)
            out = self.verifier(tokens[None], q[None].to(dtype), p[None].to(dtype), generator=generator, state=state)
            accepted, row, token = out.num_accepted.item(), out.draft_index.item(), out.next_token.item()
            record.draft_time += tock - tick
            record.target_time += tack - tock
            record.verify_time += time.perf_counter() - tack
            record.target_calls += 1
            record.accepted_lengths.append(accepted)
            record.draft_indices.append(row)
            state = out.state
            # The target has seen ids + all L drafted tokens of every row; the drafter ids + the first L-1 (it
            # never feeds the last token it samples). Keep the winning row, cut back to what is committed.
            # The new token (and, after a full acceptance, the last draft token for the drafter) is fed next time.
            keep_committed_path(target_cache, row, len(ids) + accepted, self.num_drafts)
            keep_committed_path(draft_cache, row, len(ids) + min(accepted, self.block_length - 1), self.num_drafts)
            emitted = tokens[row, :accepted].tolist() + [token]
            ids += emitted
            if self._emit(record, emitted, max_new_tokens):
                return

    def _draft(self, cache, ids, generator) -> tuple[Tensor, Tensor]:
        """K i.i.d. blocks of L tokens [K, L] and the warped q each token was sampled from [K, L, V]."""
        pending = torch.tensor([ids[cache.get_seq_length():]])  # the 1 or 2 committed tokens not yet seen
        tokens, probs = [], []
        for step in range(self.block_length):
            logits = self._forward(self.drafter, cache, pending, logits_to_keep=1)[:, -1]
            q = warp(logits, self.sampling.drafter_temperature, self.sampling.top_k, self.sampling.top_p)
            if step == 0 and self.num_drafts > 1:
                # The first token's law depends on committed tokens only: one row gives it to all K drafts, which
                # part ways from here on, each row with its own copy of the committed prefix's cache.
                q = q.expand(self.num_drafts, -1)
                cache.batch_repeat_interleave(self.num_drafts)
            pending = sample(q, generator)[:, None]
            tokens.append(pending)
            probs.append(q)
        return torch.cat(tokens, 1), torch.stack(probs, 1)

    def _score(self, cache, last_token: int, tokens: Tensor) -> Tensor:
        """Warped target p [K, L+1, V] at every prefix of every draft (the last is the bonus distribution)."""
        inputs = torch.cat([torch.full_like(tokens[:, :1], last_token), tokens], 1)
        if self.num_drafts > 1:
            cache.batch_repeat_interleave(self.num_drafts)
        return self._target_warp(self._forward(self.target, cache, inputs))

    def _target_warp(self, logits: Tensor) -> Tensor:
        return warp(logits, self.sampling.temperature, self.sampling.top_k, self.sampling.top_p)

    @staticmethod
    def _forward(loaded: LoadedModel, cache: DynamicCache, input_ids: Tensor, logits_to_keep: int = 0) -> Tensor:
        device = loaded.model.device
        return loaded.model(input_ids=input_ids.to(device), cache=cache, use_cache=True,
                            logits_to_keep=logits_to_keep).logits

    def _emit(self, record: DecodeRecord, tokens: list[int], max_new_tokens: int) -> bool:
        """Append tokens up to the first EOS and up to max_new_tokens; True when the sequence is finished."""
        for token in tokens:
            record.output_ids.append(token)
            if token in self.eos_ids or len(record.output_ids) == max_new_tokens:
                return True
        return False


def keep_committed_path(cache: DynamicCache, row: int, length: int, rows: int) -> None:
    """Cut the cache to its first `length` positions and keep batch row `row` (of `rows`)."""
    cache.crop(length - cache.get_seq_length())  # crop takes minus the number of positions to drop
    if rows > 1:
        cache.batch_select_indices(torch.tensor([row]))


def eos_ids(loaded: LoadedModel) -> set[int]:
    """Every id that ends a sequence: the tokenizer's EOS and the generation config's (an int or a list)."""
    found = set()
    for ids in (loaded.tokenizer.eos_token_id, loaded.model.generation_config.eos_token_id):
        if ids is not None:
            found.update([ids] if isinstance(ids, int) else ids)
    return found
