"""Verification of a draft by the target: which drafted tokens to keep, and the one token the target adds.

One verify pass runs the target over [last, d1..dk] and yields k+1 rows: row i is the target's distribution
for the position of d(i+1), row k the one after the whole draft. Walking the draft left to right:

- accepted tokens: the drafted tokens d1..dn that the rule keeps (n = 0..k);
- recovered token: at the first rejected position n+1, the token the target puts there instead
  (greedy: the target's argmax; sampled: a draw from the residual normalise(max(0, p - q)));
- bonus token: when all k are accepted, one more token drawn from row k, free from the same pass.

So every verify emits n + 1 tokens: n accepted plus one recovered or bonus token.

A side leaf (greedy only): the block may end with one more row, an alternative token for draft position i,
verified as if it stood at position i (a tree of one row: Transformer.forward's `tree`). It is taken when the
draft's chain breaks exactly at i and the target's token there is the leaf's: then it counts as accepted, and
the token after it (its row's argmax) is the bonus.

Greedy (temperature 0): accept while d_i equals the target's argmax; the output is the target's greedy output.
Sampled: speculative sampling (Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling"). Accept d_i with probability min(1, p(d_i) / q(d_i)); on rejection draw from
normalise(max(0, p - q)). Each emitted token is then distributed exactly as p, whatever q is, provided d_i was
drawn from q. A draft with no distribution (n-gram, or a draft model taking its argmax) is a point mass
q = onehot(d_i): accept with probability p(d_i), else draw from p with d_i removed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jllm.sampling import SamplingParams, argmax, draw, probs, sample


@dataclass
class Verdict:
    accepted: list[int]     # the drafted tokens kept, in order (a taken side leaf in place of the broken one)
    next: int               # the recovered or bonus token
    leaf_taken: bool = False
    rows: list[int] | None = None   # a tree or a taken leaf: the block rows of the accepted tokens (their path)


def verify_tree(drafts: list[int], parents: list[int], logits: torch.Tensor) -> Verdict:
    """Greedy verification of a tree of drafts. Block row 0 is the token before the drafts, row j + 1 holds
    drafts[j], whose parent is row parents[j] (< j + 1); logits: the target's rows for the block, each that of
    a decode step along its path (Transformer.forward's tree). From row 0, follow the child whose token is the
    target's argmax at the current row, while there is one (siblings differ, so there is at most one): the
    accepted path is the target's own greedy continuation, and the next token its argmax at the path's end."""
    if len(parents) != len(drafts) or any(not 0 <= p <= j for j, p in enumerate(parents)):
        raise ValueError(f"parents {parents} do not make a tree of {len(drafts)} drafts")
    target = argmax(logits)
    children: dict[int, dict[int, int]] = {}
    for j, p in enumerate(parents):
        children.setdefault(p, {}).setdefault(drafts[j], j + 1)
    row, path = 0, []
    while (nxt := children.get(row, {}).get(int(target[row]))) is not None:
        path.append(nxt)
        row = nxt
    return Verdict([drafts[r - 1] for r in path], int(target[row]), rows=path)


def verify_block(drafts: list[int], draft_probs: torch.Tensor | None, leaf: tuple[int, int] | None,
                 logits: torch.Tensor, params: SamplingParams, history: list[int],
                 gen: torch.Generator | None) -> Verdict:
    """One verify pass's decision. logits: the target's rows for [last, d1..dk] (plus the leaf's row when
    `leaf` = (i, token) is given) [k+1(+1), V]; history: the context before d1 (repeat penalty);
    draft_probs: [k, V'] what the drafts were drawn from (V' <= V: zeros beyond), or None for point masses."""
    k = len(drafts)
    if params.greedy:
        if params.repeat_penalty == 1.0:               # no history to apply: one call for all rows
            target = argmax(logits)
        else:
            target = [sample(logits[i], params, history + drafts[:i], gen) for i in range(k + 1)]
        n, nxt = verify_greedy(drafts, target[:k + 1])
        if leaf is not None and n == leaf[0] and target[n] == leaf[1]:
            return Verdict(drafts[:n] + [leaf[1]], target[-1], leaf_taken=True, rows=[*range(1, n + 1), k + 1])
        return Verdict(drafts[:n], nxt)
    n, nxt = verify_sampled_lazy(drafts, draft_probs,
                                 lambda i: probs(logits[i], params, history + drafts[:i]), gen)
    return Verdict(drafts[:n], nxt)


def verify_greedy(draft: list[int], target_argmax: list[int]) -> tuple[int, int]:
    """target_argmax: k+1 ids, the target's argmax after [last, d1..dk] -> (n accepted, next token)."""
    if len(target_argmax) != len(draft) + 1:
        raise ValueError(f"need len(draft) + 1 = {len(draft) + 1} target tokens, got {len(target_argmax)}")
    n = 0
    while n < len(draft) and draft[n] == target_argmax[n]:
        n += 1
    return n, int(target_argmax[n])


def recovery_probs(p: torch.Tensor, q: torch.Tensor | None, token: torch.Tensor) -> torch.Tensor:
    """p, q: [B, V] target and draft distributions at the rejected positions (q None: point masses at token);
    token: [B] the rejected tokens -> [B, V] unnormalised weights max(0, p - q) to draw recovered tokens from.

    A row whose residual has no mass (p == q up to rounding, so the rejection had probability ~0) falls back
    to p without the rejected token, and to p itself if that is empty too: never an all-zero row.
    """
    without = p.scatter(1, token[:, None], 0.0)            # p - onehot(token), clamped at 0
    r = without if q is None else (p - q).clamp_(min=0.0)
    r = torch.where(r.sum(1, keepdim=True) > 0, r, without)
    return torch.where(r.sum(1, keepdim=True) > 0, r, p)


def verify_sampled_batch(draft: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                         gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """B independent verifications at once. draft: [B, k] ids; draft_probs: [B, k, V] or None;
    target_probs: [B, k+1, V]; gen: a CPU generator -> (n accepted [B], recovered or bonus token [B]).

    Draws B*k uniforms, then one token per row, from gen, whatever the outcome.
    """
    B, k = draft.shape
    dev, rows = target_probs.device, torch.arange(B, device=target_probs.device)
    draft = draft.to(dev)
    if k == 0:
        return torch.zeros(B, dtype=torch.long), draw(target_probs[:, 0], gen)
    p_d = target_probs[:, :k].gather(2, draft[..., None])[..., 0].float().cpu()               # [B, k]
    q_d = (torch.ones(B, k) if draft_probs is None
           else draft_probs.gather(2, draft[..., None])[..., 0].float().cpu())               # [B, k]
    u = torch.rand(B, k, generator=gen)                                                   # [B, k] in [0, 1)
    accepted = u * q_d < p_d          # u < p/q without the division: q = 0 < p accepts, p = 0 always rejects
    n = accepted.long().cumprod(1).sum(1)                                                 # [B] leading run
    n_dev = n.to(dev)
    at = n_dev.clamp(max=k - 1)                                                           # [B] rejected slot
    p_n = target_probs[rows, n_dev].float()                                               # [B, V] row n
    q_n = None if draft_probs is None else draft_probs[rows, at].float()                  # [B, V]
    rejected = (n_dev < k)[:, None]
    weights = torch.where(rejected, recovery_probs(p_n, q_n, draft[rows, at]), p_n)       # [B, V]
    return n, draw(weights, gen)


def verify_sampled_lazy(draft: list[int], draft_probs: torch.Tensor | None, row, gen: torch.Generator
                        ) -> tuple[int, int]:
    """verify_sampled with the target's rows made only as the walk reaches them: row(i) -> [V] the target's
    sampling distribution at position i. A rejection at position n leaves rows n+1..k unmade (each costs a
    pass over the vocabulary, more with top-p). draft_probs: [k, V'] with V' <= V (zeros beyond), or None.

    The same uniforms in the same order and the same float32 comparisons as verify_sampled_batch, so the same
    outcome for the same generator state (tests/test_verify.py holds the two together).
    """
    k = len(draft)
    if k == 0:
        return 0, int(draw(row(0)[None], gen)[0])
    u = torch.rand(1, k, generator=gen)[0]
    for n in range(k):
        p = row(n)
        p_d = p[draft[n]].float()
        q_d = torch.ones(()) if draft_probs is None else draft_probs[n, draft[n]].float()
        if not bool(u[n] * q_d < p_d):
            q = None
            if draft_probs is not None:            # q over the whole vocabulary: zeros beyond its V'
                q = torch.zeros(1, p.shape[-1], dtype=torch.float32, device=p.device)
                q[0, :draft_probs.shape[-1]] = draft_probs[n].to(p.device)
            token = torch.tensor([draft[n]], device=p.device)
            return n, int(draw(recovery_probs(p[None].float(), q, token), gen)[0])
    return k, int(draw(row(k)[None].float(), gen)[0])


def verify_sampled(draft: list[int], draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                   gen: torch.Generator) -> tuple[int, int]:
    """draft: k ids; draft_probs: [k, V] the distributions they were drawn from, or None for point masses;
    target_probs: [k+1, V] the target's sampling distributions (after temperature / top-k / top-p, exactly as
    plain sampling uses them); gen: a CPU generator -> (n accepted, recovered or bonus token)."""
    k = len(draft)
    if target_probs.shape[0] != k + 1 or (draft_probs is not None and draft_probs.shape[0] != k):
        raise ValueError(f"draft of {k}: need target_probs [{k + 1}, V] and draft_probs [{k}, V] or None, "
                         f"got {tuple(target_probs.shape)} and "
                         f"{None if draft_probs is None else tuple(draft_probs.shape)}")
    n, tok = verify_sampled_batch(torch.tensor([draft], dtype=torch.long).view(1, k),
                                  None if draft_probs is None else draft_probs[None],
                                  target_probs[None], gen)
    return int(n[0]), int(tok[0])
