"""One model's KV cache over B rows, with a label per slot saying which queries may attend to it.

Rows commit different numbers of tokens per iteration, so one physical cache length holds, per row, its committed
tokens, this iteration's draft-tree nodes, and slots no query sees (left padding, rejected nodes, rows that accepted
less than others). Positions are explicit per slot (RoPE is applied when a key is written, so a key may sit in any
slot), and every forward pass gets a 4D additive mask built from the labels:

  COMMITTED  a committed token of the row: every later query of that row sees it
  HIDDEN     padding or a dropped node: nobody sees it
  k*L + d    the draft-tree node at depth d of draft k, k the lowest-index draft through it: seen by the node itself
             and its descendants (see draft_tree.py)

Holes are removed by gathering the slots to keep into place (`keep`), once a whole region's worth piles up.

A pass over B rows is as wide as its widest row, so it feeds hidden slots too (left padding of the prompts, the trie
padding of rows with fewer distinct nodes). Nobody sees them, so the position-wise modules (every layer's MLP and the
output layer, most of a pass's work) skip them (`only_where`).
"""
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from spectr_gbv.decoding.models import LoadedModel

COMMITTED, HIDDEN = -1, -2
PAD_TOKEN = 0  # the input id of a padding slot: any valid id, its key is hidden


class SlotCache:
    def __init__(self, loaded: LoadedModel, batch_size: int):
        self.model = loaded.model
        self.cache = DynamicCache(config=loaded.model.config)
        sliding = {type(layer).__name__ for layer in self.cache.layers if type(layer) is not DynamicLayer}
        if sliding:  # a sliding window drops slots behind the labels' back
            raise ValueError(f"model {loaded.name!r} has {', '.join(sorted(sliding))} layers (sliding-window "
                             "attention), which the engine's slot cache does not support; use a model with full "
                             "attention in every layer")
        self.position_wise = position_wise_modules(self.model)
        device = self.model.device
        self.label = torch.empty(batch_size, 0, dtype=torch.long, device=device)
        self.position = torch.empty(batch_size, 0, dtype=torch.long, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)  # committed tokens per row

    @property
    def size(self) -> int:
        """Physical slots per row."""
        return self.label.shape[1]

    def forward(self, tokens: Tensor, label: Tensor, position: Tensor, first: Tensor | None = None,
                logits_to_keep: int = 0) -> Tensor:
        """Run the model on tokens [B, N] with their labels and positions, appending N slots to every row;
        `first` [B, K, L] (draft_tree.representatives) is needed when tree nodes are fed or seen. Returns logits."""
        mask = self.attention_mask(label, position, first)
        with only_where(label != HIDDEN, self.position_wise):
            logits = self.model(input_ids=tokens, attention_mask=mask, position_ids=position, cache=self.cache,
                                use_cache=True, logits_to_keep=logits_to_keep).logits
        self.label = torch.cat([self.label, label], 1)
        self.position = torch.cat([self.position, position], 1)
        self.lengths = self.lengths + (label == COMMITTED).sum(1)
        return logits

    def append(self, ids: list[list[int]]) -> Tensor:
        """Feed each row's committed tokens the cache lacks (ids: all of the row's committed tokens, at least one
        lacking); returns the logits at each row's last token [B, V]."""
        return self.forward(*self.committed_inputs(ids), logits_to_keep=1)[:, -1]

    def committed_inputs(self, ids: list[list[int]]) -> tuple[Tensor, Tensor, Tensor]:
        """Tokens, labels and positions [B, width] that feed each row's committed tokens the cache lacks (ids: all
        of the row's committed tokens), right-aligned behind hidden padding: each row's last token comes last, where
        the next inputs (draft nodes) can follow it."""
        token_lists = [row[n:] for row, n in zip(ids, self.lengths.tolist())]
        width = max(map(len, token_lists))
        device = self.model.device
        pads = torch.tensor([width - len(tokens) for tokens in token_lists], device=device)
        tokens = torch.tensor([[PAD_TOKEN] * (width - len(t)) + list(t) for t in token_lists], device=device)
        label = torch.where(torch.arange(width, device=device) < pads[:, None], HIDDEN, COMMITTED)
        position = (self.lengths[:, None] + torch.arange(width, device=device) - pads[:, None]).clamp_min(0)
        return tokens, label, position

    def attention_mask(self, label: Tensor, position: Tensor, first: Tensor | None) -> Tensor | None:
        """[B, 1, N, slots + N] of 0 (attend) and the dtype's minimum: transformers takes a 4D mask as given, and
        only an additive one means the same under eager and sdpa attention. None when the mask is plain causal
        over the slots (one row without holes, a chain of drafts): transformers then runs the same kernels as its
        own generate(), so `ar` and `token` match it token for token in bfloat16 too."""
        slot_label = torch.cat([self.label, label], 1)
        slot_position = torch.cat([self.position, position], 1)
        sees = slot_position[:, None, :] <= position[:, :, None]
        sees &= (slot_label[:, None, :] == COMMITTED) | descends_from(label, slot_label, first)
        n = label.shape[1]
        sees[:, :, -n:] |= torch.eye(n, dtype=torch.bool, device=sees.device)  # a padding query sees itself: no NaN
        slot = torch.arange(sees.shape[-1], device=sees.device)
        causal = slot <= slot[-n:, None]
        if bool((sees == causal).all() and (position == slot[-n:]).all()):
            return None
        dtype = self.model.dtype
        return torch.zeros(sees.shape, dtype=dtype, device=sees.device).masked_fill_(
            ~sees, torch.finfo(dtype).min)[:, None]

    def keep(self, start: int, keep: Tensor) -> None:
        """Of the slots from `start` on, keep those where keep [B, slots - start] holds, gathered in order to the
        front of that region, as committed; the region shrinks to the longest row's count, shorter rows end in
        hidden slots."""
        count = keep.sum(1)
        width = int(count.max())
        order = (~keep).long().argsort(dim=1, stable=True)[:, :width]  # kept slots first, in their order
        for layer in self.cache.layers:
            index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys = torch.cat([layer.keys[:, :, :start], layer.keys[:, :, start:].gather(2, index)], 2)
            layer.values = torch.cat([layer.values[:, :, :start], layer.values[:, :, start:].gather(2, index)], 2)
        filled = torch.arange(width, device=order.device) < count[:, None]
        self.label = torch.cat([self.label[:, :start], torch.where(filled, COMMITTED, HIDDEN)], 1)
        self.position = torch.cat([self.position[:, :start], self.position[:, start:].gather(1, order)], 1)
        self.lengths = (self.label == COMMITTED).sum(1)

    def compact(self) -> None:
        """Drop hidden slots once every row has piled up a quarter of the cache (and at least 16) of them: the
        gather costs one copy of the cache, attention over holes costs a little at every pass."""
        removable = self.size - int(self.lengths.max())
        if removable >= max(16, self.size // 4):
            self.keep(0, self.label == COMMITTED)

    def select_rows(self, rows: Tensor) -> None:
        """Keep only batch rows `rows` (finished rows leave the batch)."""
        self.cache.batch_select_indices(rows)
        self.label, self.position, self.lengths = self.label[rows], self.position[rows], self.lengths[rows]

    def add_rows(self, count: int) -> None:
        """Append `count` empty rows (prompts join the batch): every slot hidden, no committed token, keys and values
        zeros that nobody sees; the next pass feeds their prompts (committed_inputs)."""
        for layer in self.cache.layers:
            if layer.get_seq_length() > 0:  # else the first pass creates the layer with every row
                layer.keys = torch.cat([layer.keys, layer.keys.new_zeros(count, *layer.keys.shape[1:])])
                layer.values = torch.cat([layer.values, layer.values.new_zeros(count, *layer.values.shape[1:])])
        self.label = torch.cat([self.label, self.label.new_full((count, self.size), HIDDEN)])
        self.position = torch.cat([self.position, self.position.new_zeros(count, self.size)])
        self.lengths = torch.cat([self.lengths, self.lengths.new_zeros(count)])


def position_wise_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that map each position on its own: every decoder layer's MLP and the output layer (on the
    Qwen2.5-Coder pair ~90% of the weights a position is multiplied with)."""
    return [layer.mlp for layer in model.get_decoder().layers] + [model.get_output_embeddings()]


@contextmanager
def only_where(keep: Tensor, modules: list[torch.nn.Module]) -> Iterator[None]:
    """Within it, each position-wise module (inputs [B, N, H]) runs on the positions where keep [B, N] holds, packed
    into one row, and outputs zeros at the others; one that sees fewer positions (the output layer under
    logits_to_keep) sees the last ones. Exact at the kept positions: on a CPU a matmul costs about its rows, so a
    pass over B rows padded to the widest then costs about what its real positions cost, not what its padding does
    (docs/performance.md, "Padding skips the MLPs")."""
    if bool(keep.all()):
        yield
        return
    shapes = {}

    def pack(module, args):
        x = args[0]
        kept = keep[:, -x.shape[1]:]
        shapes[module] = (x.shape[:-1], kept)
        return (x[kept][None], *args[1:])

    def unpack(module, args, out):
        shape, kept = shapes.pop(module)
        full = out.new_zeros(shape + out.shape[-1:])
        full[kept] = out[0]
        return full

    handles = [hook for module in modules
               for hook in (module.register_forward_pre_hook(pack), module.register_forward_hook(unpack))]
    try:
        yield
    finally:
        for hook in handles:
            hook.remove()


def descends_from(query_label: Tensor, slot_label: Tensor, first: Tensor | None) -> Tensor:
    """[B, N, S]: query node (k2, d2) is slot node (k1, d1) or below it, i.e. d1 <= d2 and draft k2's node at depth
    d1 is k1's. Committed and hidden labels are nobody's descendants."""
    if first is None:
        return torch.zeros(query_label.shape + slot_label.shape[1:], dtype=torch.bool, device=query_label.device)
    L = first.shape[-1]
    q, s = query_label[:, :, None].clamp_min(0), slot_label[:, None, :].clamp_min(0)
    index = (q // L) * L + s % L  # first[b, k2, d1]
    through = first.flatten(1).gather(1, index.flatten(1)).view(index.shape)
    tree = (query_label[:, :, None] >= 0) & (slot_label[:, None, :] >= 0)
    return tree & (s % L <= q % L) & (through == s // L)
