"""proposers.draft_tree, the tree drafting loop, on a fake proposer whose logits follow its last token: the
first chain comes first and every parent precedes its child, width 1 is draft_chain's chain, no batched step
is spent on nodes that cannot get children, k_min holds, and the cost rule prunes unlikely branches."""

import torch

from jllm.sampling import SamplingParams
from jllm.spec.proposers import Chooser, Limits, draft_chain, draft_tree

V = 12


def logits_after(token: int) -> torch.Tensor:
    """The fake proposer: next (token + 1) % V is likeliest, then (token + 2) % V, then the rest."""
    out = torch.zeros(V)
    out[(token + 1) % V] = 3.0
    out[(token + 2) % V] = 2.0
    return out


class Expand:
    def __init__(self):
        self.calls, self.rows = 0, 0

    def __call__(self, nodes, states, paths):
        self.calls += 1
        self.rows += len(nodes)
        assert all(len(p) == nodes[0].depth - 1 for p in paths)       # each path holds the node's ancestors
        out = torch.stack([logits_after(n.token) for n in nodes])
        return out, torch.zeros(len(nodes), 1), [(n.token, None) for n in nodes]


def tree(k, width, branches, nodes, p_node=0.0, **kw):
    lim = Limits(SamplingParams(), tree=(width, branches, nodes, p_node), **kw)
    ex = Expand()
    return draft_tree(logits_after(0), torch.zeros(1), ex, k, lim, lambda i: i), ex


def test_width_one_is_the_chain():
    t, ex = tree(5, 1, 1, 8)
    step = lambda tok: logits_after(tok)                                  # noqa: E731
    chain = draft_chain(logits_after(0), step, 5, Limits(SamplingParams()), [], Chooser())
    assert t.tokens == chain.tokens == [1, 2, 3, 4, 5] and t.tree is None
    assert ex.calls == 4 == chain.forwards                               # one step a depth after the first


def test_first_chain_first_and_parents_before_children():
    t, ex = tree(3, 2, 2, 8)
    assert t.tokens[:3] == [1, 2, 3]                                     # the likeliest path
    assert t.tree[:3] == [0, 1, 2] and all(0 <= p <= j for j, p in enumerate(t.tree))
    for j, p in enumerate(t.tree):                                       # each token follows its parent
        parent_token = 0 if p == 0 else t.tokens[p - 1]
        assert t.tokens[j] in ((parent_token + 1) % V, (parent_token + 2) % V)
    assert len(t.tokens) == 8 and ex.calls == 2                          # depths 2 and 3 expanded once each


def test_no_step_for_nodes_that_cannot_have_children():
    _, ex = tree(6, 3, 2, 3)                  # the root's 3 children fill the 3 nodes: nothing to expand
    assert ex.calls == 0
    t, ex = tree(6, 2, 2, 4)                  # depth 1: 2 nodes, depth 2: 2 more fill it, no third step
    assert len(t.tokens) == 4 and ex.calls == 1


def test_k_min_and_the_cost_rule():
    never = lambda n, p, free=False: False                               # noqa: E731
    t, ex = tree(6, 2, 1, 8, extend=never, k_min=3)
    assert t.tokens == [1, 2, 3] and ex.calls == 2                       # k_min deep, nothing else pays
    # rows and steps pay only for paths at least 0.15 likely: the chain 1 2 3 (0.54, 0.29, 0.15) and the
    # root's second choice 2 (0.20) join, nothing under them
    rare = lambda n, p, free=False: p >= 0.15                            # noqa: E731
    t, ex = tree(4, 2, 2, 8, extend=rare)
    assert t.tokens == [1, 2, 3, 2] and t.tree == [0, 1, 2, 0] and ex.calls == 3
    t0, _ = tree(4, 2, 2, 8, p_node=0.9)                                 # a floor above every path: one node
    assert t0.tokens == [1]
