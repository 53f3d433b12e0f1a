"""The decoding loop over a batch of prompts: a drafter proposes K i.i.d. blocks of L tokens per prompt, the target
scores every prompt's draft trie in one pass, a verifier keeps a prefix of one block plus one token per prompt, and
both KV caches keep exactly the committed paths.

Plain Python objects, no Hydra or Lightning:

    engine = SpeculativeEngine(target, drafter, "gbv", num_drafts=3, block_length=4, sampling=Sampling(1.0))
    records = engine.generate_batch(prompts, max_new_tokens=64, generators=[torch.Generator().manual_seed(s) ...])
    records = engine.generate_batch(prompts, 64, generators, slots=8)  # at most 8 rows, refilled as rows finish
    record = engine.generate(prompt_ids, max_new_tokens=64, generator=torch.Generator().manual_seed(0))

A batch holds at most `slots` rows (Decoder): a finished row leaves, and a waiting prompt takes its place at the
next iteration (continuous batching), so passes stay full instead of emptying as a fixed batch's rows finish. The
Lightning module keeps one Decoder across its steps. Each prompt draws all its randomness (drafts, verifier, `ar`)
from its own generator and joins with a fresh verifier state, so its tokens do not depend on which prompts share
its passes or when it joined (docs/algorithms.md §11, item 9). Verifier "ar" is plain autoregressive decoding of the
target with the same sampling: the speedup baseline.
"""
import dataclasses
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from spectr_gbv.decoding.cache import PAD_TOKEN, SlotCache
from spectr_gbv.decoding.draft_tree import node_labels, nodes_at, on_path, representatives
from spectr_gbv.decoding.models import LoadedModel, check_same_tokenizer
from spectr_gbv.decoding.precision import emulated_bfloat16
from spectr_gbv.decoding.sampling import Sampling, warp
from spectr_gbv.errors import ConfigError
from spectr_gbv.verifiers import VerifierOutput, build_verifier, verifier_class
from spectr_gbv.verifiers.base import sample

# on_iteration(prompt indices of the rows, tokens [B, K, L], q [B, K, L, V], p [B, K, L+1, V], the verifier's output,
# the state it was called with)
IterationHook = Callable[[list[int], Tensor, Tensor, Tensor, VerifierOutput, Any], None]


@dataclass
class DecodeRecord:
    """One sequence. Every iteration emits accepted_lengths[i] + 1 tokens except the last, which may be cut at EOS
    or max_new_tokens: sum(accepted_lengths) + target_calls >= new_tokens, equal unless the last block was cut
    (`ar` records no accepted lengths and one target call per token). Times are seconds (time.perf_counter); a
    pass over B rows charges each row 1/B of it, so the times of a batch's records add up to its wall time."""

    output_ids: list[int] = field(default_factory=list)  # new tokens only, EOS included when reached
    new_tokens: int = 0
    target_calls: int = 0  # target passes, each emits tokens: one per iteration (ar: per token)
    accepted_lengths: list[int] = field(default_factory=list)  # per iteration, as the verifier decided
    draft_indices: list[int] = field(default_factory=list)  # per iteration, the winning draft
    target_positions: int = 0  # positions the target scored besides the prompt: 1 + distinct trie nodes per iteration
    # total_time = prefill_time (the first iteration, whose passes read the prompt and which emits prefill_tokens;
    # ar: its first call) + draft_time + target_time + verify_time (the later iterations' parts) + bookkeeping
    prefill_time: float = 0.0
    draft_time: float = 0.0
    target_time: float = 0.0
    verify_time: float = 0.0
    total_time: float = 0.0

    @property
    def block_efficiency(self) -> float:
        return self.new_tokens / self.target_calls

    @property
    def prefill_tokens(self) -> int:
        """Tokens emitted by the first iteration, whose time is prefill_time."""
        return min(self.new_tokens, self.accepted_lengths[0] + 1 if self.accepted_lengths else 1)


class Stopped(Exception):
    """A decode was asked to stop (should_stop() returned True); finished prompts were reported already."""


class Rows:
    """The prompts decoding now, in the order of the models' batch rows: each one's prompt index, committed ids (its
    prompt, then the tokens it emitted), generator and record."""

    def __init__(self, max_new_tokens: int, eos_ids: set[int], on_finish: Callable[[int, DecodeRecord], None] | None):
        self.indices: list[int] = []
        self.ids: list[list[int]] = []
        self.generators: list[torch.Generator] = []
        self.records: list[DecodeRecord] = []
        self.max_new_tokens, self.eos_ids, self.on_finish = max_new_tokens, eos_ids, on_finish

    def __len__(self) -> int:
        return len(self.indices)

    def add(self, index: int, prompt: list[int], generator: torch.Generator) -> None:
        self.indices.append(index)
        self.ids.append(list(prompt))
        self.generators.append(generator)
        self.records.append(DecodeRecord())

    def fresh(self) -> list[bool]:
        """Per row: in its first iteration, whose passes read its prompt (its time is the row's prefill_time)."""
        return [record.target_calls == 0 for record in self.records]

    def charge(self, key: str, seconds: float, where: list[bool] | None = None) -> None:
        """Each row (where `where` holds) gets its share of a pass over all rows, seconds / rows."""
        for row, record in enumerate(self.records):
            if where is None or where[row]:
                setattr(record, key, getattr(record, key) + seconds / len(self))

    def count_iteration(self, positions: list[int], accepted: list[int] | None = None,
                        drafts: list[int] | None = None) -> None:
        for row, record in enumerate(self.records):
            record.target_calls += 1
            record.target_positions += positions[row]
            if accepted is not None:
                record.accepted_lengths.append(accepted[row])
                record.draft_indices.append(drafts[row])

    def budgets(self) -> list[int]:
        """Tokens each row may still emit."""
        return [self.max_new_tokens - len(record.output_ids) for record in self.records]

    def emit(self, tokens: list[list[int]]) -> Tensor | None:
        """Append each row's new tokens up to the first EOS and up to max_new_tokens; finished rows leave. Returns
        the rows that go on (for the caches and the verifier state), None when every row does."""
        going = []
        for row, (index, record, new) in enumerate(zip(self.indices, self.records, tokens)):
            if self._extend(record, new):
                record.new_tokens = len(record.output_ids)
                if self.on_finish is not None:
                    self.on_finish(index, record)
            else:
                self.ids[row] += new
                going.append(row)
        if len(going) == len(self):
            return None
        for name in ("indices", "ids", "generators", "records"):
            setattr(self, name, [getattr(self, name)[row] for row in going])
        return torch.tensor(going, dtype=torch.long)

    def _extend(self, record: DecodeRecord, tokens: list[int]) -> bool:
        """True when the sequence is finished."""
        for token in tokens:
            record.output_ids.append(token)
            if token in self.eos_ids or len(record.output_ids) == self.max_new_tokens:
                return True
        return False


def check_settings(verifier: str, num_drafts: int, block_length: int, max_new_tokens: int = 1) -> None:
    """The one check of the engine's knobs, also run on the run's config before any model loads."""
    cls = None if verifier == "ar" else verifier_class(verifier)
    for key, value in [("num_drafts", num_drafts), ("block_length", block_length), ("max_new_tokens", max_new_tokens)]:
        if not (isinstance(value, int) and value >= 1):
            raise ConfigError(key, value, "must be >= 1")
    if cls is not None:
        cls.check_num_drafts(num_drafts)


class SpeculativeEngine:
    def __init__(self, target: LoadedModel, drafter: LoadedModel | None, verifier: str, num_drafts: int = 1,
                 block_length: int = 4, sampling: Sampling = Sampling()):
        check_settings(verifier, num_drafts, block_length)
        self.verifier_name = verifier
        self.verifier = None if verifier == "ar" else build_verifier(verifier)
        if self.verifier is not None and drafter is None:
            raise ValueError(f"verifier={verifier!r} needs a drafter; only 'ar' runs without one")
        if self.verifier is not None:
            check_same_tokenizer(target, drafter)
        if self.verifier is not None and num_drafts > 1 and sampling.drafter_temperature == 0:
            warnings.warn(f"num_drafts={num_drafts} with a greedy drafter makes all drafts identical; "
                          "set sampling.draft_temperature > 0")
        for role, key, loaded in (("target", "model", target), ("drafter", "drafter", drafter)):  # key: run.py's
            if loaded is not None and emulated_bfloat16(loaded.model):
                warnings.warn(f"the {role} runs in bfloat16 on a CPU without AMX-BF16 or AVX512-BF16, where "
                              "bfloat16 matmuls are emulated: a pass over n positions or rows costs about n passes "
                              "over one, so drafts and batches pay little; float32 on oneDNN can be faster "
                              f"({key}.dtype=auto, the default, picks it there; docs/performance.md)")
        self.target, self.drafter, self.sampling = target, drafter, sampling
        self.num_drafts, self.block_length = num_drafts, block_length
        self.eos_ids = eos_ids(target)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, generator: torch.Generator) -> DecodeRecord:
        return self.generate_batch([prompt_ids], max_new_tokens, [generator])[0]

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int, generators: list[torch.Generator],
                       on_finish: Callable[[int, DecodeRecord], None] | None = None,
                       should_stop: Callable[[], bool] | None = None,
                       on_iteration: IterationHook | None = None, slots: int | None = None) -> list[DecodeRecord]:
        """Decode the prompts, prompt i with generators[i], at most `slots` at once (None: all together): a prompt
        left waiting takes the row of one that finished at the next iteration (Decoder). on_finish(i, record) is
        called as soon as prompt i is done (records are final then). When should_stop() turns True, raises Stopped
        before the next iteration. on_iteration sees every verification: the rows' prompt indices, the drafts,
        their laws, the verifier's decision and the state it was called with (the verifier arena scores other verifiers
        on them, and a stateful one with that state); its time is
        charged to no record."""
        if not prompts:
            raise ValueError("prompts must be a non-empty list of non-empty token id lists")
        if len(generators) != len(prompts):
            raise ValueError(f"got {len(generators)} generators for {len(prompts)} prompts: give one per prompt")
        records: list[DecodeRecord | None] = [None] * len(prompts)

        def finish(index: int, record: DecodeRecord) -> None:
            records[index] = record
            if on_finish is not None:
                on_finish(index, record)

        decoder = self.decoder(slots or len(prompts), max_new_tokens, finish, should_stop, on_iteration)
        for prompt, generator in zip(prompts, generators):
            decoder.add(prompt, generator)
        decoder.run()
        return records

    def decoder(self, slots: int, max_new_tokens: int, on_finish: Callable[[int, DecodeRecord], None] | None = None,
                should_stop: Callable[[], bool] | None = None,
                on_iteration: IterationHook | None = None) -> "Decoder":
        """A decode that prompts join as others finish, at most `slots` at a time (Decoder)."""
        return Decoder(self, slots, max_new_tokens, on_finish, should_stop, on_iteration)

    def _draft(self, cache: SlotCache, rows: Rows) -> tuple[Tensor, Tensor]:
        """K i.i.d. blocks of L tokens per row [B, K, L] and the warped q each token was sampled from [B, K, L, V].
        The first token's law depends on committed tokens only: one query per row gives it to all K drafts; from
        then on each step feeds the distinct nodes of the depth drafted last. Drafting stops where transformers'
        assisted generation stops: a row keeps at most budget - 1 drafted tokens (its iteration emits at most
        budget tokens), and a draft ends at an EOS. Past that, the token is PAD_TOKEN for sure, and a step no draft
        needs runs no pass. That is still a drafter law, decided by the row's own tokens and budget, so every
        verifier stays lossless and rows stay batch invariant (docs/algorithms.md §11, item 7)."""
        B, K, L = len(rows), self.num_drafts, self.block_length
        budget = torch.tensor(rows.budgets(), device=cache.lengths.device)[:, None]
        eos = torch.tensor(sorted(self.eos_ids), device=cache.lengths.device)
        drafting = (budget > 1).expand(B, K)
        q = padded(self._draft_warp(cache.append(rows.ids))[:, None].expand(B, K, -1), drafting)
        drafted, probs = [sample(q, rows.generators)], [q]
        batch = torch.arange(B, device=q.device)[:, None]
        for depth in range(1, L):
            drafting = drafting & (budget > depth + 1) & ~torch.isin(drafted[-1], eos)
            q = probs[0]  # a stand-in when no draft needs this step: padded() turns all of it into PAD_TOKEN
            if drafting.any():
                tokens = torch.stack(drafted, -1)
                first = representatives(tokens, L)
                draft, node_depth, real, slot = nodes_at(first, range(depth - 1, depth))
                position = cache.lengths[:, None] + node_depth  # the committed length is the first draft position
                logits = cache.forward(tokens[batch, draft, node_depth], node_labels(draft, node_depth, real, L),
                                       position, first)
                q = self._draft_warp(logits)[batch, slot[..., 0]]
            q = padded(q, drafting)
            drafted.append(sample(q, rows.generators))
            probs.append(q)
        return torch.stack(drafted, -1), torch.stack(probs, 2)

    def _score(self, cache: SlotCache, rows: Rows, tokens: Tensor) -> tuple[Tensor, Tensor, list[int]]:
        """Warped target p [B, K, L+1, V] at every prefix of every draft (the last is the bonus distribution), from
        one pass over each row's committed tokens the cache lacks (the last of them is the trie's root; the whole
        prompt at the first iteration) and the distinct nodes of its trie; the trie's `first` [B, K, L]; and each
        row's number of positions scored after the prompt (the root and the nodes)."""
        B, K, L = tokens.shape
        first = representatives(tokens, L)
        draft, depth, real, slot = nodes_at(first, range(L))
        batch = torch.arange(B, device=tokens.device)[:, None]
        committed, committed_label, committed_position = cache.committed_inputs(rows.ids)
        inputs = torch.cat([committed, tokens[batch, draft, depth]], 1)
        label = torch.cat([committed_label, node_labels(draft, depth, real, L)], 1)
        position = torch.cat([committed_position, committed_position[:, -1:] + 1 + depth], 1)
        logits = cache.forward(inputs, label, position, first, logits_to_keep=1 + depth.shape[1])
        probs = self._target_warp(logits)  # [B, 1 + nodes, V]: the root, then the nodes
        slots = torch.cat([torch.zeros_like(slot[..., :1]), 1 + slot], -1)  # the root, then k's node at each depth
        return probs[batch[..., None], slots], first, (1 + real.sum(1)).tolist()

    def _target_warp(self, logits: Tensor) -> Tensor:
        return warp(logits, self.sampling.temperature, self.sampling.top_k, self.sampling.top_p)

    def _draft_warp(self, logits: Tensor) -> Tensor:
        return warp(logits, self.sampling.drafter_temperature, self.sampling.top_k, self.sampling.top_p)


class Decoder:
    """Continuous batching: prompts wait in a queue and at most `slots` of them decode at once, as the rows of one
    batch; at the start of every iteration waiting prompts take the rows of those that finished, and that
    iteration's passes read their prompts, as the first iteration reads every prompt of a batch that starts
    together. A prompt's tokens do not depend on when it joined or beside whom it decoded (docs/algorithms.md §11,
    item 9). Prompts are indexed 0, 1, ... in the order they are added; on_finish(index, record) as each one ends,
    on_iteration and should_stop as in generate_batch. Rows outlive run(): a caller may add prompts and run in turns,
    as the Lightning module does, step by step."""

    def __init__(self, engine: SpeculativeEngine, slots: int, max_new_tokens: int,
                 on_finish: Callable[[int, DecodeRecord], None] | None = None,
                 should_stop: Callable[[], bool] | None = None, on_iteration: IterationHook | None = None):
        check_settings(engine.verifier_name, engine.num_drafts, engine.block_length, max_new_tokens)
        if not (isinstance(slots, int) and slots >= 1):
            raise ValueError(f"slots={slots!r}: must be an int >= 1")
        self.engine, self.slots = engine, slots
        self.should_stop, self.on_iteration = should_stop, on_iteration
        self.rows = Rows(max_new_tokens, engine.eos_ids, on_finish)
        self.waiting: deque[tuple[int, list[int], torch.Generator]] = deque()
        self.added = 0
        self._start_empty()

    def add(self, prompt_ids: list[int], generator: torch.Generator) -> int:
        """Queue a prompt (it decodes with `generator` alone); returns its index."""
        if len(prompt_ids) == 0:
            raise ValueError("prompts must be non-empty token id lists")
        self.waiting.append((self.added, list(prompt_ids), generator))
        self.added += 1
        return self.added - 1

    @torch.inference_mode()
    def run(self, until_admitted: bool = False) -> None:
        """Iterate until every prompt added has finished, or with until_admitted until none is waiting for a row
        (rows still decoding go on at the next run). Raises Stopped before an iteration when should_stop() holds:
        the prompts finished so far were reported."""
        while self.waiting or (self.rows and not until_admitted):
            if self.should_stop is not None and self.should_stop():
                raise Stopped(f"stopped with {len(self.rows) + len(self.waiting)} prompts unfinished")
            self._admit()
            if self.engine.verifier is None:
                self._autoregressive()
            else:
                self._speculative()

    def _start_empty(self) -> None:
        """Empty caches and no verifier state: no row left, or none yet."""
        self.target = SlotCache(self.engine.target, 0)
        self.drafter = None if self.engine.verifier is None else SlotCache(self.engine.drafter, 0)
        self.state = None

    def _caches(self) -> list[SlotCache]:
        return [cache for cache in (self.target, self.drafter) if cache is not None]

    def _admit(self) -> None:
        """Waiting prompts take the free rows: empty rows in both caches (the next pass reads their prompts) and
        fresh rows of the verifier's state."""
        count = min(self.slots - len(self.rows), len(self.waiting))
        for _ in range(count):
            self.rows.add(*self.waiting.popleft())
        if count:
            for cache in self._caches():
                cache.add_rows(count)
            self.state = add_state_rows(self.state, count)

    def _leave(self, going: Tensor | None) -> None:
        """After emit: the caches and the state keep the rows that go on (going; None: all of them)."""
        if not self.rows:
            self._start_empty()
            return
        for cache in self._caches():
            if going is not None:
                cache.select_rows(going.to(cache.lengths.device))
            cache.compact()
        if going is not None:
            self.state = select_state_rows(self.state, going)

    def _autoregressive(self) -> None:
        rows = self.rows
        started = time.perf_counter()
        fresh = rows.fresh()  # their call reads the prompt: the prefill
        tokens = sample(self.engine._target_warp(self.target.append(rows.ids)), rows.generators).tolist()
        seconds = time.perf_counter() - started
        rows.charge("prefill_time", seconds, fresh)
        rows.charge("target_time", seconds, [not first for first in fresh])
        rows.charge("total_time", seconds)
        rows.count_iteration([0 if first else 1 for first in fresh])
        self._leave(rows.emit([[token] for token in tokens]))

    def _speculative(self) -> None:
        # Invariant between iterations: each cache holds a prefix of every row's committed ids, and the tokens past
        # it are fed at the next pass, the last of them as the root of the draft trie (its pass returns p at the
        # block start). A row joins with no slot of its own: its first iteration reads its prompt in that
        # iteration's passes, as transformers' assisted generation does, not in passes of its own. Then the
        # target's cache lacks exactly the last committed token, the drafter's the last one or two (it never feeds
        # the last token it drafts).
        engine, rows, target, drafter = self.engine, self.rows, self.target, self.drafter
        started = time.perf_counter()
        fresh = rows.fresh()  # their iteration reads the prompt: the prefill
        target_start, drafter_start = target.size, drafter.size
        tokens, q = engine._draft(drafter, rows)
        after_draft = time.perf_counter()
        p, first, positions = engine._score(target, rows, tokens)
        after_score = time.perf_counter()
        dtype = torch.promote_types(p.dtype, q.dtype)
        q, p = q.to(dtype), p.to(dtype)
        out = engine.verifier(tokens, q, p, generator=rows.generators, state=self.state)
        accepted, winner = out.num_accepted.to(tokens.device), out.draft_index.to(tokens.device)
        # each row emits its winning draft's accepted tokens, then the recovered or bonus token
        emitted = [path[:n] + [token] for path, n, token in zip(
            tokens[torch.arange(len(rows)), winner].tolist(), accepted.tolist(), out.next_token.tolist())]
        later = [not first_iteration for first_iteration in fresh]
        rows.charge("prefill_time", time.perf_counter() - started, fresh)
        rows.charge("verify_time", time.perf_counter() - after_score, later)
        rows.charge("draft_time", after_draft - started, later)
        rows.charge("target_time", after_score - after_draft, later)
        # Keep the winning path: the target has seen the root and every node, the drafter the pending tokens
        # and the nodes above the last depth. The new token (and, after a full acceptance, the last draft token
        # for the drafter) is fed next time.
        target.keep(target_start, on_path(target.label[:, target_start:], first, winner, accepted))
        drafter.keep(drafter_start, on_path(drafter.label[:, drafter_start:], first, winner,
                                            accepted.clamp(max=engine.block_length - 1)))
        rows.charge("total_time", time.perf_counter() - started)
        rows.count_iteration(positions, accepted.tolist(), winner.tolist())
        if self.on_iteration is not None:
            self.on_iteration(list(rows.indices), tokens, q, p, out, self.state)
        self.state = out.state
        self._leave(rows.emit(emitted))


def padded(q: Tensor, drafting: Tensor) -> Tensor:
    """q [B, K, V] where drafting [B, K] holds, elsewhere the one-hot of PAD_TOKEN."""
    if bool(drafting.all()):
        return q
    pad = torch.zeros_like(q)
    pad[..., PAD_TOKEN] = 1
    return torch.where(drafting[..., None], q, pad)


def select_state_rows(state, rows: Tensor):
    """A verifier's state (a dataclass of per-row tensors, or None) for the rows that go on."""
    if state is None:
        return None
    return dataclasses.replace(state, **{f.name: getattr(state, f.name)[rows.to(getattr(state, f.name).device)]
                                         for f in dataclasses.fields(state)})


def add_state_rows(state, count: int):
    """A verifier's state (a dataclass of per-row tensors, or None) with `count` fresh rows after its rows: rows of
    zeros, a fresh row's state by the verifiers' contract (docs/custom_verifiers.md, State; `gbv`: levels that
    have expired). None stays None: then no row has any state."""
    if state is None:
        return None
    return dataclasses.replace(state, **{f.name: torch.cat([value, value.new_zeros(count, *value.shape[1:])])
                                         for f in dataclasses.fields(state)
                                         for value in [getattr(state, f.name)]})


def eos_ids(loaded: LoadedModel) -> set[int]:
    """Every id that ends a sequence: the tokenizer's EOS and the generation config's (an int or a list)."""
    found = set()
    for ids in (loaded.tokenizer.eos_token_id, loaded.model.generation_config.eos_token_id):
        if ids is not None:
            found.update([ids] if isinstance(ids, int) else ids)
    return found
