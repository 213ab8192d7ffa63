"""Shared prefixes forwarded once: the inputs of a micro-batch laid out as a prefix tree in one sequence.

Most of what the learner forwards is prompt, and prompts repeat: the G forks of a group carry the same
prompt token for token, the powers of one phase share the rules and the board (`diprl.policy.prompt`
orders the text from the most shared to the least), and forks often open their completions alike.
Causal attention makes the hidden state of a token a function of the tokens before it only, so every
distinct prefix needs forwarding once; what follows it attends to it.

Layout. A record's input is its prompt and its completion less the last token (whose state predicts
nothing). The inputs of a micro-batch, sorted, form a radix tree: a node holds the tokens that every
input below it shares at those positions. The nodes are laid end to end in depth-first order as one
sequence (batch 1, no padding); each token keeps the position it has in its own input, so positions
restart after a shared node in every branch. A token attends to the tokens of its node's ancestors
and, causally, to its own node's: that is the whole attention mask, and `diprl.learn.prefix_attention`
computes it block by block (a block is a set of nodes of similar sizes; each gathers its ancestors'
keys and values) instead of as one mask over unrelated records.

A node shorter than `min_tokens` is not shared (its tokens are repeated in each branch below it): it
would save little and cost an attention block. The token budget of a micro-batch counts the tokens of
its tree, what is forwarded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


def common_prefix(a: np.ndarray, b: np.ndarray, start: int = 0) -> int:
    """Length of the longest common prefix of `a` and `b`, both known to agree on `[0, start)`."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[start:n] != b[start:n])
    return start + int(diff[0]) if diff.size else n


@dataclass(frozen=True)
class Node:
    """Tokens `[start, end)` of every input below this node, at `flat` in the packed sequence."""

    start: int
    end: int
    source: int  # an input that holds the node's tokens
    parent: int  # index of the parent node, -1 for a root
    flat: int

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass
class PrefixTree:
    """The nodes of a micro-batch's inputs (every parent before its children) and where each input ends."""

    nodes: list[Node]
    leaf: list[int]  # per input: the node that holds its last token

    @property
    def num_tokens(self) -> int:
        return sum(n.length for n in self.nodes)

    def path(self, index: int) -> list[Node]:
        """The nodes of input `index`, root first; together they cover its positions `[0, len)`."""
        out: list[Node] = []
        node = self.leaf[index]
        while node >= 0:
            out.append(self.nodes[node])
            node = self.nodes[node].parent
        return out[::-1]

    def flat_positions(self, index: int, positions: Sequence[int]) -> list[int]:
        """Where positions of input `index` lie in the packed sequence."""
        path = self.path(index)
        out = []
        for v in positions:
            node = next(n for n in reversed(path) if n.start <= v)
            if v >= node.end:
                raise IndexError(f"position {v} is past the end of input {index} ({path[-1].end} tokens)")
            out.append(node.flat + v - node.start)
        return out


def build_tree(inputs: Sequence[np.ndarray], min_tokens: int) -> PrefixTree:
    """The radix tree of `inputs` (non-empty token arrays), nodes shorter than `min_tokens` not shared."""
    if min_tokens < 1:
        raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
    if any(len(x) == 0 for x in inputs):
        raise ValueError("every input needs at least one token")
    order = sorted(range(len(inputs)), key=lambda i: (inputs[i].tolist(), i))
    nodes: list[Node] = []
    leaf = [-1] * len(inputs)
    flat = 0

    def parts(indices: list[int], at: int) -> list[list[int]]:
        """Sorted `indices` split by their token at position `at` (inputs ending there form one part)."""
        out: list[list[int]] = []
        key: int | None = None
        for i in indices:
            k = int(inputs[i][at]) if len(inputs[i]) > at else -1
            if not out or k != key:
                out.append([])
                key = k
            out[-1].append(i)
        return out

    # An explicit stack (not recursion): a tree is as deep as its inputs branch. Each entry: sorted
    # indices sharing [0, start), all longer than start, and the parent node. Pushed in reverse so the
    # nodes come out depth-first in sorted order.
    stack: list[tuple[list[int], int, int]] = [(order, 0, -1)]
    while stack:
        indices, start, parent = stack.pop()
        first, last = inputs[indices[0]], inputs[indices[-1]]
        end = common_prefix(first, last, start)
        identical = len(first) == len(last) == end
        if len(indices) > 1 and not identical and end - start < min_tokens:
            # Too short to share: each branch starts its own node here.
            stack.extend((p, start, parent) for p in reversed(parts(indices, end)))
            continue
        nodes.append(Node(start, end, indices[0], parent, flat))
        flat += end - start
        here = len(nodes) - 1
        longer = []
        for i in indices:
            if len(inputs[i]) == end:
                leaf[i] = here
            else:
                longer.append(i)
        stack.extend((p, end, here) for p in reversed(parts(longer, end)))
    return PrefixTree(nodes, leaf)


def tree_cost_estimate(inputs: Sequence[np.ndarray], order: Sequence[int]) -> list[int]:
    """Tokens each input of sorted `order` adds to the tree of those before it (every common prefix shared)."""
    out = []
    for k, i in enumerate(order):
        shared = common_prefix(inputs[order[k - 1]], inputs[i]) if k else 0
        out.append(len(inputs[i]) - shared)
    return out


def pack_shared(inputs: Sequence[np.ndarray], budget: int, min_batches: int, min_tokens: int) -> list[list[int]]:
    """Indices of `inputs` grouped into micro-batches whose prefix trees hold at most `budget` tokens.

    Inputs are sorted, so neighbours share the most, and cut into consecutive runs: a run is filled
    while its tree (estimated with every common prefix shared, then built exactly) fits the budget.
    An input longer than the budget gets a micro-batch of its own. With fewer runs than
    `min_batches`, the largest runs are halved (by tokens) while they hold two inputs or more.
    """
    order = sorted(range(len(inputs)), key=lambda i: (inputs[i].tolist(), i))
    added = dict(zip(order, tree_cost_estimate(inputs, order), strict=True))
    runs: list[list[int]] = []
    cost = 0
    for i in order:
        step = added[i] if runs and runs[-1] else len(inputs[i])
        if runs and cost + step <= budget:
            runs[-1].append(i)
            cost += step
        else:
            runs.append([i])
            cost = len(inputs[i])

    def exact(run: list[int]) -> int:
        return build_tree([inputs[i] for i in run], min_tokens).num_tokens

    def estimate(run: list[int]) -> int:
        return len(inputs[run[0]]) + sum(added[i] for i in run[1:])

    def halve(run: list[int]) -> tuple[list[int], list[int]]:
        half, acc = estimate(run) / 2, len(inputs[run[0]])
        cut = 1
        while cut < len(run) - 1 and acc + added[run[cut]] <= half:
            acc += added[run[cut]]
            cut += 1
        return run[:cut], run[cut:]

    fitted: list[list[int]] = []
    pending = runs[::-1]
    while pending:
        run = pending.pop()
        if len(run) > 1 and exact(run) > budget:  # the unshared short nodes made it longer than estimated
            a, b = halve(run)
            pending.extend([b, a])
        else:
            fitted.append(run)
    target = min(min_batches, len(order))
    while len(fitted) < target:
        k = max((j for j in range(len(fitted)) if len(fitted[j]) > 1), key=lambda j: estimate(fitted[j]))
        fitted[k : k + 1] = list(halve(fitted[k]))
    return fitted


@dataclass
class AttentionBlock:
    """Nodes attended together: their own tokens as queries, their ancestors' and own tokens as keys.

    `query_index` [n, S] and `key_index` [n, A + S] are positions in the packed sequence (padding points
    at any real token and is masked); `mask` [n, 1, S, A + S] is True where a query may attend: the
    node's ancestors (the first `start` of the A slots) and its own tokens up to itself. Roots (A = 0)
    need no mask: plain causal attention over their own tokens.
    """

    query_index: torch.Tensor
    key_index: torch.Tensor
    mask: torch.Tensor | None

    def to(self, device: torch.device | str) -> AttentionBlock:
        return AttentionBlock(
            self.query_index.to(device),
            self.key_index.to(device),
            self.mask.to(device) if self.mask is not None else None,
        )


@dataclass
class PrefixLayout:
    """What the model needs to forward a packed prefix tree: positions, attention blocks, and the way back.

    `gather_back` [N] takes the concatenated block outputs (each block's [n * S] rows in turn) back to
    the packed sequence's order.
    """

    position_ids: torch.Tensor  # [1, N]
    blocks: list[AttentionBlock]
    gather_back: torch.Tensor  # [N]

    def to(self, device: torch.device | str) -> PrefixLayout:
        return PrefixLayout(
            self.position_ids.to(device), [b.to(device) for b in self.blocks], self.gather_back.to(device)
        )


def _size_class(n: int) -> int:
    """Sizes within a factor of two share a class: a block pads its nodes to its largest, at most twice."""
    return int(n).bit_length()


def packed_layout(tree: PrefixTree, inputs: Sequence[np.ndarray]) -> tuple[torch.Tensor, PrefixLayout]:
    """(input ids [1, N], layout) of `tree` over `inputs`."""
    nodes = tree.nodes
    ids = np.concatenate([inputs[n.source][n.start : n.end] for n in nodes]).astype(np.int64)
    positions = np.concatenate([np.arange(n.start, n.end) for n in nodes]).astype(np.int64)
    # Flat positions of each node's ancestors, in order: the positions [0, start) of every input below it.
    ancestry: list[np.ndarray] = []
    for n in nodes:
        if n.parent < 0:
            ancestry.append(np.zeros(0, dtype=np.int64))
        else:
            p = nodes[n.parent]
            ancestry.append(np.concatenate([ancestry[n.parent], np.arange(p.flat, p.flat + p.length)]))
    classes: dict[tuple[int, int], list[int]] = {}
    for k, n in enumerate(nodes):
        classes.setdefault((_size_class(n.start), _size_class(n.length)), []).append(k)
    blocks: list[AttentionBlock] = []
    gather_back = np.zeros(len(ids), dtype=np.int64)
    offset = 0
    for key in sorted(classes):
        members = classes[key]
        a = max(nodes[k].start for k in members)
        s = max(nodes[k].length for k in members)
        query = np.zeros((len(members), s), dtype=np.int64)
        keys = np.zeros((len(members), a + s), dtype=np.int64)
        for row, k in enumerate(members):
            n = nodes[k]
            own = np.arange(n.flat, n.flat + n.length)
            query[row, : n.length] = own
            keys[row, : n.start] = ancestry[k]
            keys[row, a : a + n.length] = own
            gather_back[own] = offset + row * s + np.arange(n.length)
        offset += len(members) * s
        mask = None
        if a:
            starts = torch.tensor([nodes[k].start for k in members])
            slot = torch.arange(a + s)
            q = torch.arange(s)
            ancestor = (slot[None, None, :] < starts[:, None, None]) & (slot < a)[None, None, :]
            own_causal = (slot[None, :] >= a) & (slot[None, :] - a <= q[:, None])
            mask = (ancestor | own_causal[None]).unsqueeze(1)
        blocks.append(AttentionBlock(torch.from_numpy(query), torch.from_numpy(keys), mask))
    layout = PrefixLayout(torch.from_numpy(positions)[None], blocks, torch.from_numpy(gather_back))
    return torch.from_numpy(ids)[None], layout
