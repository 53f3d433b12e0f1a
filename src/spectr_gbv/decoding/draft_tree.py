"""The K drafts of a row as a token trie: drafts that share a prefix share its nodes, so each model feeds every
distinct node once (the target: distinct nodes + 1 positions instead of K x (L + 1)).

A node is named by the lowest-index draft through it: node (k, d) is draft k's token at depth d when no earlier
draft has the same first d + 1 tokens. `first[b, k, d]` is the draft that names draft k's node at depth d; cache
labels encode node (k, d) as k * L + d.
"""
import torch
from torch import Tensor

from spectr_gbv.decoding.cache import COMMITTED, HIDDEN
from spectr_gbv.verifiers.base import same_prefix


def representatives(tokens: Tensor, block_length: int) -> Tensor:
    """first [B, K, L] for drafts tokens [B, K, n], n <= L; depths not drafted yet name themselves."""
    B, K, n = tokens.shape
    first = same_prefix(tokens).long().argmax(2)  # lowest j sharing draft k's first d + 1 tokens (j = k always does)
    undrafted = torch.arange(K, device=tokens.device)[None, :, None].expand(B, K, block_length - n)
    return torch.cat([first, undrafted], -1)


def nodes_at(first: Tensor, depths: range) -> tuple[Tensor, Tensor, Tensor]:
    """The distinct nodes at the given depths, in (depth, draft) order so that parents come first, padded to the
    row with the most. Returns (draft [B, N], depth [B, N], real [B, N]) and, for every draft and depth in `depths`,
    the index of its node in that list, slot [B, K, len(depths)]."""
    B, K, L = first.shape
    d = torch.tensor(list(depths), device=first.device)
    named = first[:, :, d] == torch.arange(K, device=first.device)[None, :, None]  # [B, K, D]: node (k, d) exists
    flat = named.transpose(1, 2).flatten(1)  # index j * K + k for the j-th depth
    count = flat.sum(1)
    order = (~flat).long().argsort(dim=1, stable=True)[:, : int(count.max())]
    real = torch.arange(order.shape[1], device=first.device) < count[:, None]
    index_of = torch.zeros_like(flat, dtype=torch.long).scatter_(1, order, torch.arange(order.shape[1],
                                                                                       device=first.device).expand_as(order))
    wanted = torch.arange(len(d), device=first.device) * K + first[:, :, d]  # [B, K, D]: flat index of k's node
    slot = index_of.gather(1, wanted.flatten(1)).view(B, K, len(d))
    return order % K, d[order // K], real, slot


def node_labels(draft: Tensor, depth: Tensor, real: Tensor, block_length: int) -> Tensor:
    return torch.where(real, draft * block_length + depth, HIDDEN)


def on_path(label: Tensor, first: Tensor, draft: Tensor, depth_limit: Tensor) -> Tensor:
    """[B, S]: slots to keep after verification: committed ones and the nodes of draft `draft` [B] at depths
    below depth_limit [B]."""
    L = first.shape[-1]
    node = label.clamp_min(0)
    through = first[torch.arange(first.shape[0], device=first.device), draft]  # [B, L]
    on = (label >= 0) & (node % L < depth_limit[:, None]) & (through.gather(1, node % L) == node // L)
    return on | (label == COMMITTED)
