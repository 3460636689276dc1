"""Tree verification: greedy acceptance, and lossless speculative sampling (statistical tests).

Budget: ~20 s on 2 cores.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treeattn.speculative.verify import (
    DraftTree,
    SamplingParams,
    VerifyResult,
    sample_rows,
    target_probs,
    verify,
    verify_greedy,
    verify_sampling,
)


def chi2_sf(stat: float, dof: int) -> float:
    """Survival function of the chi-square distribution (no scipy here)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def chi2_stat(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson statistic with cells of expected count < 5 pooled into one."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return float(((obs - exp) ** 2 / exp).sum()), int(keep.sum() - 1)


# ---------------------------------------------------------------------------------------------- greedy


def greedy_reference(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """The documented rule in plain Python: accepted = every edge carries the parent's argmax;
    the result is the deepest accepted node, the lowest index among equally deep ones."""
    pred = logits.argmax(-1).tolist()
    accepted, depth = [True], [0]
    for i in range(1, tree.size):
        p = int(tree.parents[i])
        accepted.append(accepted[p] and int(tree.tokens[i]) == pred[p])
        depth.append(depth[p] + 1)
    leaf = min((i for i in range(tree.size) if accepted[i]), key=lambda i: (-depth[i], i))
    path = tree.path(leaf)
    return path, [int(tree.tokens[i]) for i in path[1:]] + [pred[leaf]]


def test_greedy_known_tree():
    # root(5) -> a(1) -> c(3); root -> b(2) -> d(4); target argmax: root->2, b->4, d->0
    tree = DraftTree(np.array([5, 1, 2, 3, 4]), np.array([-1, 0, 0, 1, 2]))
    logits = torch.full((5, 8), -1.0)
    for node, best in ((0, 2), (1, 3), (2, 4), (3, 1), (4, 0)):
        logits[node, best] = 1.0
    res = verify_greedy([tree], logits)
    assert res.paths == [[0, 2, 4]]
    assert res.tokens == [[2, 4, 0]]
    assert res.leaf_indices == [4] and res.num_accepted_drafts == [2]


def test_greedy_rejects_everything_emits_bonus():
    tree = DraftTree(np.array([5, 1, 2]), np.array([-1, 0, 0]))
    logits = torch.randn(3, 8)
    logits[0] = -5.0
    logits[0, 7] = 5.0
    res = verify_greedy([tree], logits)
    assert res.paths == [[0]] and res.tokens == [[7]]


def test_greedy_duplicate_siblings_lowest_index_wins():
    # Nodes 1 and 2 both carry 3 (the root's argmax); their children 4 and 3 both carry 1 (their argmax):
    # two accepted paths of depth 2, and the one ending at the lower index (node 3) wins.
    tree = DraftTree(np.array([0, 3, 3, 1, 1]), np.array([-1, 0, 0, 2, 1]))
    logits = torch.zeros(5, 4)
    logits[:, 3] = 1.0
    logits[[1, 2], 1] = 2.0
    res = verify_greedy([tree], logits)
    assert res.paths == [[0, 2, 3]]
    assert res.tokens == [[3, 1, 3]]


@st.composite
def random_trees(draw):
    n = draw(st.integers(1, 24))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = [draw(st.integers(0, 3)) for _ in range(n)]
    return DraftTree(np.array(tokens), np.array(parents))


@settings(max_examples=60, deadline=None)
@given(st.lists(random_trees(), min_size=1, max_size=5), st.integers(0, 2**31 - 1))
def test_greedy_matches_reference(trees, seed):
    g = torch.Generator().manual_seed(seed)
    total = sum(t.size for t in trees)
    logits = torch.randn(total, 4, generator=g)  # vocab 4: many drafts match
    res = verify_greedy(trees, logits)
    start = 0
    for b, tree in enumerate(trees):
        path, tokens = greedy_reference(tree, logits[start:start + tree.size])
        assert res.paths[b] == path and res.tokens[b] == tokens
        start += tree.size


def test_verify_dispatch_and_validation():
    tree = DraftTree.root_only(3)
    logits = torch.randn(1, 6)
    assert verify([tree], logits).tokens == [[int(logits.argmax())]]
    assert verify([tree], logits, SamplingParams(temperature=0.0)).tokens == [[int(logits.argmax())]]
    with pytest.raises(ValueError, match="one row per tree node"):
        verify_greedy([tree], torch.randn(2, 6))
    with pytest.raises(ValueError, match="rooted at node 0"):
        DraftTree(np.array([1, 2]), np.array([-1, -1]))
    with pytest.raises(ValueError, match="same"):
        DraftTree(np.array([1, 2, 3]), np.array([-1, 0]))
    with pytest.raises(TypeError, match="DraftTree"):
        verify_greedy([[1, 2]], logits)
    with pytest.raises(ValueError, match="draft_probs"):
        DraftTree(np.array([1, 2]), np.array([-1, 0]), draft_probs=torch.ones(3, 5))


def test_target_probs_filters():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    full = torch.softmax(logits, -1)
    torch.testing.assert_close(target_probs(logits, SamplingParams()), full)
    torch.testing.assert_close(target_probs(logits, SamplingParams(temperature=2.0)), torch.softmax(logits / 2, -1))
    top2 = target_probs(logits, SamplingParams(top_k=2))
    torch.testing.assert_close(top2[0, :2], full[0, :2] / full[0, :2].sum())
    assert (top2[0, 2:] == 0).all()
    # top-p keeps the smallest prefix reaching the mass: p = [.57, .21, .13, ...] -> 0.7 keeps two tokens
    topp = target_probs(logits, SamplingParams(top_p=0.7))
    assert (topp[0, :2] > 0).all() and (topp[0, 2:] == 0).all()
    assert (target_probs(logits, SamplingParams(top_p=0.01))[0, 1:] == 0).all()


# -------------------------------------------------------------------------------------------- sampling

VOCAB = 5
HORIZON = 3  # compare the joint law of the first three emitted tokens: 125 cells
OFFSET = np.array([sum(VOCAB ** k for k in range(n)) for n in range(HORIZON + 1)])
# Tree shape: the root has 3 children; the first has 2 children, one of which has a child.
SHAPE = np.array([-1, 0, 0, 0, 1, 1, 4])


class TableModel:
    """A target 'model' over a 5-token vocabulary: logits are a fixed random function of the first
    HORIZON tokens of the context (a context is coded as OFFSET[len] + its base-5 value)."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(int(OFFSET[-1]) + VOCAB ** HORIZON, VOCAB, generator=g) * 0.8

    def joint(self, params: SamplingParams) -> np.ndarray:
        """Exact law of the first HORIZON tokens, cells in base-5 order."""
        probs = target_probs(self.table, params).numpy().astype(np.float64)
        out = np.ones(VOCAB ** HORIZON)
        for cell in range(VOCAB ** HORIZON):
            digits = [(cell // VOCAB ** (HORIZON - 1 - i)) % VOCAB for i in range(HORIZON)]
            value = 0
            for i, t in enumerate(digits):
                out[cell] *= probs[OFFSET[i] + value, t]
                value = value * VOCAB + t
        return out


def extend(length: torch.Tensor, value: torch.Tensor, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Append a token to coded contexts; beyond HORIZON tokens the code stops changing."""
    grow = length < HORIZON
    return torch.where(grow, length + 1, length), torch.where(grow, value * VOCAB + token, value)


def draft_batch(length, value, roots, g, q_table, mode):
    """Sample one tree per sequence: siblings i.i.d. from q ("iid"), without replacement
    ("distinct", q renormalised over the untaken tokens) or fixed distinct tokens ("point")."""
    batch, n = roots.shape[0], SHAPE.size
    tokens = torch.zeros(batch, n, dtype=torch.int64)
    tokens[:, 0] = roots
    q_rows = torch.zeros(batch, n, VOCAB)
    offset = torch.from_numpy(OFFSET)
    lens, vals = [length] + [None] * (n - 1), [value] + [None] * (n - 1)  # coded context of each node
    for parent in range(n):
        kids = np.nonzero(parent == SHAPE)[0].tolist()
        q = q_table[(offset[lens[parent]] + vals[parent]) % q_table.shape[0]]  # the draft depends on context
        taken = torch.zeros(batch, VOCAB, dtype=torch.bool)
        for rank, kid in enumerate(kids):
            if mode == "point":
                tok = torch.full((batch,), (3 * parent + rank) % VOCAB)
                row = torch.nn.functional.one_hot(tok, VOCAB).float()
            else:
                row = q.masked_fill(taken, 0.0) if mode == "distinct" else q
                row = row / row.sum(1, keepdim=True)
                tok = torch.multinomial(row, 1, generator=g).squeeze(1)
            taken[torch.arange(batch), tok] = True
            tokens[:, kid], q_rows[:, kid] = tok, row
            lens[kid], vals[kid] = extend(lens[parent], vals[parent], tok)
    codes = torch.stack([offset[lens[i]] + vals[i] for i in range(n)], dim=1)
    trees = [DraftTree(tokens[b].numpy(), SHAPE, None if mode == "point" else q_rows[b]) for b in range(batch)]
    return trees, codes


def sample_prefixes(model: TableModel, params: SamplingParams, mode: str, n: int, seed: int,
                    verifier=verify_sampling) -> np.ndarray:
    """Speculative sampling for n independent sequences, one batch per step, until each has emitted
    HORIZON tokens; returns the counts of the HORIZON-token prefixes."""
    g = torch.Generator().manual_seed(seed)
    q_table = torch.softmax(torch.randn(31, VOCAB, generator=g) * 1.5, -1)  # drafts far from the target
    length, value = [0] * n, [0] * n  # coded context of each sequence (it starts empty)
    roots = [0] * n  # the last prompt token
    while True:
        live = [b for b in range(n) if length[b] < HORIZON]
        if not live:
            return np.bincount(value, minlength=VOCAB ** HORIZON)
        trees, codes = draft_batch(torch.tensor([length[b] for b in live]), torch.tensor([value[b] for b in live]),
                                   torch.tensor([roots[b] for b in live]), g, q_table, mode)
        res = verifier(trees, model.table[codes.reshape(-1)], params, g)
        for b, new in zip(live, res.tokens):
            for t in new[: HORIZON - length[b]]:
                length[b], value[b] = length[b] + 1, value[b] * VOCAB + t
            roots[b] = new[-1]


N_SAMPLES = 30000


@pytest.mark.parametrize("mode,params", [
    ("iid", SamplingParams()),
    ("distinct", SamplingParams()),
    ("point", SamplingParams()),
    ("iid", SamplingParams(temperature=0.8, top_k=4, top_p=0.9)),
])
def test_sampling_is_lossless(mode, params):
    model = TableModel(seed=1)
    counts = sample_prefixes(model, params, mode, N_SAMPLES, seed=2)
    joint = model.joint(params)
    stat, dof = chi2_stat(counts, joint)
    assert chi2_sf(stat, dof) > 1e-3, f"emitted law differs from the target: chi2={stat:.1f}, dof={dof}"
    first, marginal = counts.reshape(VOCAB, -1).sum(1), joint.reshape(VOCAB, -1).sum(1)
    assert chi2_sf(*chi2_stat(first, marginal)) > 1e-3
    # Power: the same samples reject a law that moves 2% of the first token's mass between two tokens.
    hi, lo = np.argsort(marginal)[-1], np.argsort(marginal)[-2]
    shifted = marginal.copy()
    shifted[hi] -= 0.02
    shifted[lo] += 0.02
    assert chi2_sf(*chi2_stat(first, shifted)) < 1e-3


def sequential_reference(trees, logits, params, generator, *, residual=True) -> VerifyResult:
    """SpecInfer's rule one tree at a time, in plain Python; ``residual=False`` is the classic bug of
    drawing from p (minus the rejected token) instead of norm(max(p - q, 0)) after a rejection."""
    probs = target_probs(logits, params)
    paths, tokens, start = [], [], 0
    for tree in trees:
        node, p, path, out = 0, probs[start].clone(), [0], []
        while True:
            for kid in np.nonzero(tree.parents == node)[0].tolist():
                x = int(tree.tokens[kid])
                q = tree.draft_probs[kid]
                if float(torch.rand(1, generator=generator)) * float(q[x]) < float(p[x]):
                    node, p = kid, probs[start + kid].clone()
                    path.append(kid)
                    out.append(x)
                    break
                p = (p - q).clamp(min=0) if residual else p.index_fill(0, torch.tensor([x]), 0.0)
                p = p / p.sum()
            else:
                out.append(int(torch.multinomial(p, 1, generator=generator)))
                break
        paths.append(path)
        tokens.append(out)
        start += tree.size
    return VerifyResult(paths, tokens)


def test_a_biased_verifier_is_caught():
    model, params = TableModel(seed=1), SamplingParams()
    counts = sample_prefixes(model, params, "iid", 6000, seed=3,
                             verifier=lambda *a: sequential_reference(*a, residual=False))
    stat, dof = chi2_stat(counts, model.joint(params))
    assert chi2_sf(stat, dof) < 1e-6


def test_sampling_reproducible_with_generator():
    g = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(4, 7, generator=g), -1)
    trees = [DraftTree(np.array([1, 2, 3, 4]), np.array([-1, 0, 0, 2]), draft_probs=q) for _ in range(16)]
    logits = torch.randn(64, 7, generator=g)
    a = verify_sampling(trees, logits, SamplingParams(), torch.Generator().manual_seed(5))
    b = verify_sampling(trees, logits, SamplingParams(), torch.Generator().manual_seed(5))
    assert a == b
    assert len({tuple(t) for t in a.tokens}) > 1  # 16 draws are not all the same


def test_point_mass_acceptance_probability_is_exact():
    """Point-mass drafts: the first child is accepted with probability p(x), the second with
    p(y) / (1 - p(x)) given the first was rejected; check the empirical first-token law closely."""
    logits = torch.tensor([[1.0, 0.2, -0.5, 0.7], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    tree = DraftTree(np.array([0, 3, 1]), np.array([-1, 0, 0]))
    n = 40000
    res = verify_sampling([tree] * n, logits.repeat(n, 1), SamplingParams(), torch.Generator().manual_seed(7))
    first = np.bincount([t[0] for t in res.tokens], minlength=4)
    p = torch.softmax(logits[0], -1).numpy()
    stat, dof = chi2_stat(first, p)
    assert chi2_sf(stat, dof) > 1e-3
    accepted = np.array([len(path) > 1 for path in res.paths])
    assert abs(accepted.mean() - (p[3] + p[1])) < 0.01  # P(some child accepted) = p(3) + p(1)


# ------------------------------------------------------------------ one tree type, bad input (issue 15 defect 7)


def test_a_draft_tree_is_a_token_tree():
    import treeattn

    tree = DraftTree([7, 1, 2, 3, 4], [-1, 0, 0, 1, 1])
    plain = treeattn.TokenTree([-1, 0, 0, 1, 1])
    assert isinstance(tree, treeattn.TokenTree)
    assert torch.equal(tree.order, plain.order) and torch.equal(tree.depth, plain.depth)
    assert tree.path(4) == [0, 1, 4] and tree.tokens.tolist() == [7, 1, 2, 3, 4]
    assert repr(tree).startswith("DraftTree(size=5")
    with pytest.raises(ValueError):
        tree.tokens[0] = 1  # read-only, as the parents
    root = DraftTree.root_only(np.int64(9))
    assert root.tokens.tolist() == [9] and root.parents.tolist() == [-1] and root.draft_probs is None
    with pytest.raises(TypeError, match="token must be an int"):
        DraftTree.root_only(9.0)


def test_deep_draft_trees_verify_without_a_loop_per_level():
    n = 4096  # a 4096-token chain that the target accepts to the end
    tokens = np.arange(n) % 50
    logits = torch.full((n, 50), -1.0)
    logits[torch.arange(n), torch.from_numpy((tokens + 1) % 50)] = 1.0
    res = verify_greedy([DraftTree(tokens, np.arange(-1, n - 1))], logits)
    assert res.paths == [list(range(n))] and res.tokens == [tokens[1:].tolist() + [int(tokens[-1] + 1) % 50]]


@pytest.mark.parametrize("poison", ["all nan", "one nan", "+inf", "all -inf"])
@pytest.mark.parametrize("how", ["greedy", "sampling", "target_probs"])
def test_logits_without_a_defined_target_are_refused(poison, how):
    """Issue 15 defect 7: all-NaN logits made greedy verification return token 0."""
    tree = DraftTree([1, 2, 3], [-1, 0, 0])
    logits = torch.randn(3, 6)
    row = logits[1]
    if poison == "all nan":
        row.fill_(float("nan"))
    elif poison == "one nan":
        row[4] = float("nan")
    elif poison == "+inf":
        row[0] = float("inf")
    else:
        row.fill_(float("-inf"))
    with pytest.raises(ValueError, match="logits row 1 has a NaN, a \\+inf or no finite entry"):
        if how == "greedy":
            verify_greedy([tree], logits)
        elif how == "sampling":
            verify_sampling([tree], logits, SamplingParams())
        else:
            target_probs(logits, SamplingParams())


def test_masked_vocabulary_is_fine():
    logits = torch.tensor([[float("-inf"), 0.5, float("-inf"), 2.0]] * 2)
    tree = DraftTree([1, 3], [-1, 0])
    assert verify_greedy([tree], logits).tokens == [[3, 3]]
    assert set(verify_sampling([tree] * 50, logits.repeat(50, 1), SamplingParams(),
                               torch.Generator().manual_seed(0)).tokens[0]) <= {1, 3}


@pytest.mark.parametrize("how", ["greedy", "sampling"])
def test_draft_tokens_outside_the_vocabulary_are_refused(how):
    """Issue 15 defect 7: greedy silently rejected them, sampling raised a raw IndexError."""
    trees = [DraftTree([1, 2], [-1, 0]), DraftTree([1, 2, 6], [-1, 0, 1])]
    with pytest.raises(ValueError, match=r"trees\[1\]\.tokens\[2\] = 6 is outside the logits' vocabulary of 6"):
        verify([*trees], torch.randn(5, 6), None if how == "greedy" else SamplingParams())


def _probs(*rows):
    return torch.tensor(rows, dtype=torch.float32)


@pytest.mark.parametrize("draft_probs,message", [
    (_probs([0, 0, 0], [float("nan")] * 3), r"draft_probs\[1\] has a NaN, infinite or negative entry"),
    (_probs([0, 0, 0], [1.2, -0.2, 0.0]), r"draft_probs\[1\] has a NaN, infinite or negative entry"),
    (_probs([0, 0, 0], [0.5, 0.4, 0.3]), r"draft_probs\[1\] sums to 1\.2, expected 1"),
    (_probs([0, 0, 0], [2.0, 3.0, 5.0]), r"draft_probs\[1\] sums to 10"),
    (_probs([0, 0, 0], [0.5, 0.0, 0.5]), r"draft_probs\[1, tokens\[1\]\] = 0"),
    (_probs([0, 0]), r"draft_probs must have shape \[2, vocab\] \(one row per node\), got \(1, 2\)"),
    (_probs([1.0], [1.0]), r"tokens\[1\] = 1 is outside draft_probs' vocabulary of 1"),
])
def test_draft_probs_must_be_distributions_that_can_draw_the_token(draft_probs, message):
    """Issue 15 defect 7: NaN, negative, unnormalised rows or a zero at the drafted token voided
    the lossless guarantee without a word."""
    with pytest.raises(ValueError, match=message):
        DraftTree([0, 1], [-1, 0], draft_probs=draft_probs)


@pytest.mark.parametrize("draft_probs", [torch.tensor([[0, 0, 0], [0, 1, 0]]), [[0.0, 0.0, 0.0], [0.0, 1.0, 0.0]]])
def test_draft_probs_must_be_a_float_tensor(draft_probs):
    with pytest.raises(TypeError, match=r"draft_probs must be a float tensor \[2, vocab\]"):
        DraftTree([0, 1], [-1, 0], draft_probs=draft_probs)


def test_draft_probs_tolerances():
    ok = torch.tensor([[0.0, 0.0, 0.0], [0.3, 0.3, 0.4 + 5e-4]])  # row 0 is ignored, fp32 round-off allowed
    DraftTree([0, 1], [-1, 0], draft_probs=ok)
    DraftTree([0, 1], [-1, 0], draft_probs=torch.tensor([[9.0, 9.0, 9.0], [0.3, 0.3, 0.41]]).bfloat16())
    with pytest.raises(ValueError, match="sums to"):
        DraftTree([0, 1], [-1, 0], draft_probs=torch.tensor([[0.0, 0.0, 0.0], [0.3, 0.3, 0.41]]))
    with pytest.raises(ValueError, match=r"draft_probs\[2, tokens\[2\]\] = 0: node 2"):  # the first bad row is named
        DraftTree([0, 1, 2], [-1, 0, 0], draft_probs=torch.tensor([[0.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.0]]))


@pytest.mark.parametrize("kwargs,error,message", [
    ({"top_k": 2.5}, TypeError, "top_k must be an int, got float"),
    ({"top_k": True}, TypeError, "top_k must be an int, got a bool"),
    ({"top_k": None}, TypeError, "top_k must be an int, got NoneType"),
    ({"top_k": -1}, ValueError, "top_k must be >= 0"),
    ({"temperature": True}, TypeError, "temperature must be a real number"),
    ({"temperature": "1"}, TypeError, "temperature must be a real number"),
    ({"temperature": None}, TypeError, "temperature must be a real number"),
    ({"temperature": float("nan")}, ValueError, "temperature must be finite and >= 0"),
    ({"temperature": -0.5}, ValueError, "temperature must be finite and >= 0"),
    ({"top_p": 0.0}, ValueError, "top_p must be in"),
    ({"top_p": "0.9"}, TypeError, "top_p must be a real number"),
])
def test_sampling_params_are_taken_exactly(kwargs, error, message):
    """Issue 15 defect 7: top_k=2.5 / True and temperature=True were accepted; top_k=None and
    temperature="1" gave raw errors."""
    with pytest.raises(error, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_accept_numpy_scalars():
    params = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), top_p=np.float64(0.9))
    assert (type(params.temperature), type(params.top_k), type(params.top_p)) == (float, int, float)
    assert params == SamplingParams(0.5, 3, 0.9)


@pytest.mark.parametrize("temperature", [1e-39, 1e-45, 1e-30, 1e-6])
def test_tiny_temperatures_sample_the_argmax(temperature):
    """Issue 15 defect 7: temperature 1e-39 failed inside multinomial (logits / t overflowed to inf).
    Documented: any t > 0 samples; as t -> 0 the law tends to the argmax."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.999], [5.0, 0.0, 0.0, -1.0]])
    probs = target_probs(logits, SamplingParams(temperature=temperature))
    assert torch.isfinite(probs).all() and probs.argmax(-1).tolist() == [1, 0]
    assert probs.max(-1).values.tolist() == pytest.approx([1.0, 1.0], abs=1e-6)
    res = verify_sampling([DraftTree([0, 2], [-1, 0])], logits, SamplingParams(temperature=temperature),
                          torch.Generator().manual_seed(0))
    assert res.tokens == [[1]]  # the draft (2) is rejected, the argmax (1) emitted


def test_tiny_temperature_ties_are_uniform():
    probs = target_probs(torch.tensor([[1.0, 1.0, 0.0]]), SamplingParams(temperature=1e-39))
    assert probs.tolist() == [[0.5, 0.5, 0.0]]


def test_verify_checks_its_arguments():
    """Issue 15 defect 7: verify(params=dict) and a bare DraftTree gave raw errors."""
    import treeattn

    tree = DraftTree([1, 2], [-1, 0])
    logits = torch.randn(2, 4)
    with pytest.raises(TypeError, match="params must be a SamplingParams.*got dict"):
        verify([tree], logits, params={"temperature": 0.7})
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        verify_sampling([tree], logits, {"temperature": 0.7})
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        target_probs(logits, 0.7)
    with pytest.raises(TypeError, match="trees must be a list of DraftTree.*wrap a single tree in a list"):
        verify(tree, logits)
    with pytest.raises(TypeError, match=r"trees\[0\] must be a DraftTree, got TokenTree"):
        verify([treeattn.TokenTree([-1, 0])], logits)
    with pytest.raises(TypeError, match="trees must be a list of DraftTree"):
        verify(np.array([1, 2]), logits)
    with pytest.raises(ValueError, match="trees is empty"):
        verify([], logits)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        verify([tree], logits, SamplingParams(), generator=0)
    with pytest.raises(TypeError, match="logits must be a float tensor"):
        verify([tree], logits.long())
    with pytest.raises(TypeError, match="logits must be a float tensor"):
        verify([tree], logits.tolist())
    with pytest.raises(ValueError, match=r"tokens\[1\] = -2: tokens must be non-negative"):
        DraftTree([1, -2], [-1, 0])
    with pytest.raises(TypeError, match="tokens must hold integers"):
        DraftTree([1.0, 2.0], [-1, 0])
    with pytest.raises(TypeError, match=r"tokens\[1\] must be an int, got a bool"):
        DraftTree([1, True], [-1, 0])


def test_sample_rows_follows_each_row_and_never_draws_zero_mass():
    """sample_rows (the bonus-token draw) against each row's law: unnormalised rows, zeros inside and
    at the end of a row, a row of one token."""
    rows = torch.tensor([[0.5, 0.0, 1.5, 2.0, 0.0, 0.0],
                         [1e-3, 3.0, 0.0, 0.2, 0.7, 0.0],
                         [0.0, 0.0, 0.0, 0.0, 0.0, 4.0]])
    n = 20000
    drawn = sample_rows(rows.repeat(n, 1), torch.Generator().manual_seed(11)).view(n, 3)
    for r in range(3):
        counts = np.bincount(drawn[:, r].numpy(), minlength=6)
        assert counts[(rows[r] == 0).numpy()].sum() == 0
        law = (rows[r] / rows[r].sum()).double().numpy()
        keep = law > 0
        if keep.sum() > 1:
            stat, dof = chi2_stat(counts[keep], law[keep])
            assert chi2_sf(stat, dof) > 1e-3
        else:
            assert (counts[keep] == n).all()


def test_sample_rows_uniform_at_the_top_of_its_range(monkeypatch):
    """A uniform whose product with the row's mass rounds up to the mass itself still lands on the last
    token with mass, not past it on a zero-probability one."""
    rows = torch.tensor([[0.1, 0.7, 0.0, 0.0], [0.3, 0.0, 0.0, 0.0]], dtype=torch.float64)
    before = rows.clone()
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.ones(shape, dtype=torch.float64))
    assert sample_rows(rows).tolist() == [1, 0]
    assert torch.equal(rows, before)  # float64 rows are read, not summed in place
    monkeypatch.undo()
    for bad, what in (([[0.5, 0.5], [0.0, 0.0]], "sum 0.0"), ([[float("nan"), 1.0]], "sum nan")):
        with pytest.raises(ValueError, match=rf"probs\[{len(bad) - 1}\] must be non-negative with a positive, finite sum, got {what}"):
            sample_rows(torch.tensor(bad))
