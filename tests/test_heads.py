"""The EAGLE-style draft head: data, training, saving, drafting (tiny random Llama, CPU).

Budget: ~15 s on 2 cores.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tests.helpers import VOCAB, tiny_hf, tiny_model
from treeattn.speculative.heads import (
    DraftHeads,
    HeadDrafter,
    causal_hidden_states,
    head_accuracy,
    head_examples,
    load_heads,
    save_heads,
    shortlist,
    train_heads,
)


@pytest.fixture(scope="module")
def tiny(one_thread):
    return tiny_model("llama")


def random_head(depth: int = 3, vocab=range(VOCAB), seed: int = 0) -> DraftHeads:
    torch.manual_seed(seed)
    heads = DraftHeads(64, vocab, depth=depth)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.2)
    return heads.eval()


def test_causal_hidden_states_match_the_model_logits(tiny):
    hf = tiny_hf("llama")
    tokens = [3, 17, 5, 60, 2, 9]
    hidden = causal_hidden_states(tiny, tokens)
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(tiny.logits(hidden), expected, atol=2e-5, rtol=1e-4)


def test_vocab_weights_are_the_models_embeddings_and_lm_head(tiny):
    embed, lm = tiny.vocab_weights()
    hidden = torch.randn(3, 64)
    torch.testing.assert_close(hidden @ lm.t(), tiny.logits(hidden))
    assert embed.shape == (VOCAB, 64) and torch.equal(embed, tiny.model.get_input_embeddings().weight)


def test_examples_lay_out_each_answer_and_unroll_within_it(tiny):
    data = head_examples(tiny, [[1, 2], [7]], [[3, 4, 5, 6], [8, 9, 10]])
    # answer 1: positions 1..4 of [1, 2, 3, 4, 5, 6]; answer 2: positions 0..2 of [7, 8, 9, 10]
    assert data.next_token.tolist() == [3, 4, 5, 6, 8, 9, 10]
    assert data.end.tolist() == [4, 4, 4, 4, 7, 7, 7]
    torch.testing.assert_close(data.hidden[:4], causal_hidden_states(tiny, [1, 2, 3, 4, 5])[1:])
    torch.testing.assert_close(data.hidden[4:], causal_hidden_states(tiny, [7, 8, 9]))
    feed, states, targets = data.unroll(torch.tensor([0, 2, 3, 4]), depth=2)
    assert feed[:, 0].tolist() == [3, 5, 6, 8]  # step 0 feeds the token after the state...
    assert targets.tolist() == [[4, 5], [6, -100], [-100, -100], [9, 10]]  # ...and guesses the one after that
    torch.testing.assert_close(states[0], data.hidden[[1, 2]])
    with pytest.raises(ValueError, match="nothing to train on"):
        head_examples(tiny, [[1]], [[2]])
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        head_examples(tiny, [[1, 2], []], [[3, 4], [5, 6]])
    with pytest.raises(ValueError, match="pair up"):
        head_examples(tiny, [[1, 2]], [[3, 4], [5, 6]])


def test_shortlist_ranks_by_count_then_fills_with_the_lowest_ids():
    assert shortlist([[5, 9, 9], [9, 5, 7]], vocab_size=12, size=6) == [9, 5, 7, 0, 1, 2]
    assert shortlist([[5, 5, 3]], vocab_size=4, size=10) == [3, 0, 1, 2]  # the vocabulary bounds it
    with pytest.raises(ValueError, match="size"):
        shortlist([[1]], vocab_size=4, size=1)


def test_head_arguments_are_checked(tiny):
    for kwargs, match in ((dict(hidden_size=0, vocab=[1, 2]), "hidden_size"), (dict(hidden_size=64, vocab=[1, 1]),
                          "distinct"), (dict(hidden_size=64, vocab=[-1, 2]), "distinct"),
                          (dict(hidden_size=64, vocab=[1, 2], depth=0), "depth")):
        with pytest.raises(ValueError, match=match):
            DraftHeads(**kwargs)
    heads = random_head()
    assert heads(torch.randn(5, 64), torch.randn(5, 64)).shape == (5, 64)
    with pytest.raises(ValueError, match="budget"):
        HeadDrafter(heads, tiny.vocab_weights(), budget=0)
    with pytest.raises(TypeError, match="DraftHeads"):
        HeadDrafter(object(), tiny.vocab_weights())


def periodic_data(tiny, period: int = 7, n: int = 6):
    """Answers that cycle through a fixed random permutation: the next token is a function of the
    current one, so a head can learn every draft step."""
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:period].tolist()
    prompts = [[perm[i % period]] + [perm[(i + 1) % period]] for i in range(n)]
    outputs = [[perm[(i + 2 + t) % period] for t in range(20)] for i in range(n)]
    return perm, prompts, outputs, head_examples(tiny, prompts, outputs)


def test_training_lowers_the_loss_and_raises_accuracy_at_every_step(tiny):
    perm, _, outputs, data = periodic_data(tiny)
    torch.manual_seed(0)
    heads = DraftHeads(64, shortlist(outputs, VOCAB, 16), depth=3)
    weights = tiny.vocab_weights()
    before = head_accuracy(heads, weights, data)
    state = train_heads(heads, weights, data, epochs=30, batch_rows=64, lr=1e-2)
    assert np.mean(state.losses[-3:]) < 0.6 * np.mean(state.losses[:3])
    after = head_accuracy(heads, weights, data)
    assert all(a > 0.95 and a > b + 0.5 for a, b in zip(after, before)), (before, after)
    assert head_accuracy(heads, weights, data, top_k=999) == [1.0, 1.0, 1.0]  # top_k beyond the shortlist: all of it
    # Off the shortlist a token is a miss: a head over other tokens never scores.
    blind = DraftHeads(64, [t for t in range(VOCAB) if t not in perm][:16], depth=3)
    assert head_accuracy(blind, weights, data, top_k=16) == [0.0, 0.0, 0.0]


def test_trained_drafter_proposes_the_continuation(tiny):
    _, prompts, outputs, data = periodic_data(tiny)
    torch.manual_seed(0)
    heads = DraftHeads(64, shortlist(outputs, VOCAB, 16), depth=3)
    train_heads(heads, tiny.vocab_weights(), data, epochs=30, batch_rows=64, lr=1e-2)
    drafter = HeadDrafter(heads, tiny.vocab_weights(), budget=4, top_k=2, width=1)
    context = prompts[0] + outputs[0][:5]  # data row 4 holds the state that predicted the context's last token
    tree = drafter.propose([np.array(context)], data.hidden[[4]])[0]
    assert tree.tokens.tolist() == [context[-1]] + outputs[0][5:8] and tree.parents.tolist() == [-1, 0, 1, 2]


def test_drafter_tree_is_the_heads_best_nodes(tiny):
    """Rebuilt by hand: every node's children are the head's top-k after its path, each depth expands
    the ``width`` best nodes, and the tree keeps the ``budget`` best by path probability."""
    heads = random_head(depth=3, vocab=list(range(40, VOCAB)) + list(range(40)))
    weights = tiny.vocab_weights()
    embed, lm = weights
    out = lm[heads.vocab]
    top_k, width, budget = 3, 2, 9
    drafter = HeadDrafter(heads, weights, budget=budget, top_k=top_k, width=width, min_score=0.0)
    hidden = torch.randn(2, 64)
    contexts = [np.array([4]), np.array([5, 6])]
    cands = drafter.candidates(contexts, hidden)
    for b, c in enumerate(cands):
        with torch.no_grad():
            all_nodes = []  # (path score, path tokens, edge probability)
            frontier = [(1.0, [int(contexts[b][-1])], hidden[b])]
            for _ in range(3):
                children = []
                for score, path, h in frontier:
                    state = heads(h[None], embed[[path[-1]]])[0]
                    p = torch.softmax(state @ out.t(), -1)
                    top = torch.topk(p, top_k)
                    for q, i in zip(top.values.tolist(), top.indices.tolist()):
                        children.append((score * q, path + [int(heads.vocab[i])], state, q))
                all_nodes += [(s, path, q) for s, path, _, q in children]
                frontier = [(s, path, h) for s, path, h, _ in sorted(children, key=lambda x: -x[0])[:width]]
        want = sorted(all_nodes, key=lambda x: -x[0])[:budget - 1]
        tree = c.tree
        paths = [[int(tree.tokens[0])]]
        for i in range(1, tree.size):
            paths.append(paths[tree.parents[i]] + [int(tree.tokens[i])])
        assert tree.size == budget and tree.tokens[0] == contexts[b][-1]
        assert sorted(map(tuple, paths[1:])) == sorted(tuple(p) for _, p, _ in want)
        by_path = {tuple(p): q for _, p, q in want}
        np.testing.assert_allclose([by_path[tuple(p)] for p in paths[1:]], c.prior[1:], rtol=1e-5)
        depths = [len(p) - 1 for p in paths[1:]]
        assert all((c.keys[1:] // 100) == np.array(depths) - 1)
    # A batch drafts exactly what each context drafts alone.
    for b in range(2):
        alone = drafter.candidates([contexts[b]], hidden[[b]])[0]
        assert alone.tree.tokens.tolist() == cands[b].tree.tokens.tolist()
        assert alone.tree.parents.tolist() == cands[b].tree.parents.tolist()
    with pytest.raises(ValueError, match="hidden"):
        drafter.candidates([np.array([4])])
    assert drafter.propose([], torch.zeros(0, 64)) == []


def test_drafting_stops_where_no_path_reaches_min_score(tiny):
    heads = random_head(depth=3)
    hidden = torch.randn(1, 64)
    deep = HeadDrafter(heads, tiny.vocab_weights(), budget=40, top_k=3, width=2, min_score=0.0)
    shallow = HeadDrafter(heads, tiny.vocab_weights(), budget=40, top_k=3, width=2, min_score=0.99)
    full, cut = deep.propose([np.array([4])], hidden)[0], shallow.propose([np.array([4])], hidden)[0]
    assert full.size == 1 + 3 + 6 + 6 and cut.size == 1 + 3  # random heads: no path is 99% likely
    assert (cut.parents[1:] == 0).all() and sorted(cut.tokens[1:]) == sorted(full.tokens[full.parents == 0])
    with pytest.raises(ValueError, match="min_score"):
        HeadDrafter(heads, tiny.vocab_weights(), min_score=1.0)
    floored = deep.candidates([np.array([4])], hidden, floor=0.99)[0].tree  # the caller's floor stops it alike
    assert floored.tokens.tolist() == cut.tokens.tolist() and floored.parents.tolist() == cut.parents.tolist()


def test_drafting_dtype_is_the_heads_own_or_the_faster_of_it_and_bfloat16(tiny, monkeypatch):
    heads = random_head(depth=3)
    weights, hidden, context = tiny.vocab_weights(), torch.randn(1, 64), [np.array([4])]
    own = HeadDrafter(heads, weights, budget=8)
    assert own.embed.dtype == torch.float32 and "dtype=torch.float32" in repr(own)
    half = HeadDrafter(heads, weights, budget=8, dtype=torch.bfloat16, min_score=0.0)
    assert half.embed.dtype == half.heads.fuse.weight.dtype == half.project[0].weight.dtype == torch.bfloat16
    assert heads.fuse.weight.dtype == torch.float32  # the caller's head is left as it was
    tree = half.propose(context, hidden)[0]
    assert tree.size == 8 and tree.tokens[0] == 4  # drafts from a float32 hidden state
    torch.manual_seed(3)
    HeadDrafter(heads, weights, dtype="fastest")  # times both dtypes on random states of its own
    drawn = torch.rand(4)
    torch.manual_seed(3)
    assert torch.equal(drawn, torch.rand(4))  # the caller's random stream untouched
    timings = iter([2.0, 1.0])  # float32 timed first, then bfloat16: bfloat16 faster
    monkeypatch.setattr(HeadDrafter, "_depth_seconds", lambda self: next(timings))
    assert HeadDrafter(heads, weights, dtype="fastest").embed.dtype == torch.bfloat16
    timings = iter([1.0, 2.0])
    assert HeadDrafter(heads, weights, dtype="fastest").embed.dtype == torch.float32
    with pytest.raises(ValueError, match="dtype"):
        HeadDrafter(heads, weights, dtype="half")


def test_training_resumes_where_it_stopped(tiny):
    _, _, outputs, data = periodic_data(tiny)
    weights = tiny.vocab_weights()
    torch.manual_seed(1)
    full = DraftHeads(64, shortlist(outputs, VOCAB, 16), depth=2)
    resumed = copy.deepcopy(full)
    train_heads(full, weights, data, epochs=3, batch_rows=32)
    saved = []

    def interrupt(state):
        saved.append(copy.deepcopy(state))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_heads(resumed, weights, data, epochs=3, batch_rows=32, on_checkpoint=interrupt)
    assert saved[-1].epoch == 1
    train_heads(resumed, weights, data, epochs=3, batch_rows=32, state=saved[-1])
    for a, b in zip(full.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b)


def test_save_load_round_trip(tmp_path):
    heads = random_head(depth=2, vocab=[7, 3, 5])
    save_heads(heads, tmp_path / "h.pt", note="test")
    loaded, meta = load_heads(tmp_path / "h.pt")
    assert meta == {"note": "test"} and loaded.depth == 2 and loaded.vocab.tolist() == [7, 3, 5]
    for a, b in zip(heads.parameters(), loaded.parameters()):
        torch.testing.assert_close(a.to(torch.float16).float(), b)  # saved in float16
    torch.save({"x": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a treeattn draft-head file"):
        load_heads(tmp_path / "other.pt")
    torch.save({"format": "treeattn-draft-heads-1"}, tmp_path / "medusa.pt")
    with pytest.raises(ValueError, match="older treeattn .*rerun `treeattn train-heads`"):
        load_heads(tmp_path / "medusa.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "h.pt").read_bytes()[:100])
    with pytest.raises(ValueError, match="not a readable treeattn draft-head file"):
        load_heads(tmp_path / "cut.pt")
    blob = torch.load(tmp_path / "h.pt", weights_only=True)
    del blob["depth"]
    torch.save(blob, tmp_path / "damaged.pt")
    with pytest.raises(ValueError, match="damaged treeattn draft-head file"):
        load_heads(tmp_path / "damaged.pt")


def test_find_heads_passes_over_an_unusable_user_file(tmp_path, monkeypatch):
    from treeattn.speculative import heads as module

    user, shipped = tmp_path / "user.pt", tmp_path / "shipped.pt"
    save_heads(random_head(depth=1), shipped)
    monkeypatch.setattr(module, "DEFAULT_HEADS", user)
    monkeypatch.setattr(module, "PACKAGED_HEADS", shipped)
    for name in ("DEFAULT_EAGLE3", "PACKAGED_EAGLE3"):
        monkeypatch.setattr(module, name, tmp_path / name)
    assert module.find_heads() == shipped
    torch.save({"format": "treeattn-draft-heads-1"}, user)  # an older treeattn's Medusa heads
    assert module.find_heads() == shipped
    save_heads(random_head(depth=2), user)
    assert module.find_heads() == user


def test_find_heads_prefers_eagle3_folders_and_the_users_heads(tmp_path, monkeypatch):
    from treeattn.speculative import heads as module

    paths = {name: tmp_path / name for name in ("DEFAULT_EAGLE3", "DEFAULT_HEADS", "PACKAGED_EAGLE3", "PACKAGED_HEADS")}
    for name, path in paths.items():
        monkeypatch.setattr(module, name, path)
    save_heads(random_head(depth=1), paths["PACKAGED_HEADS"])
    paths["PACKAGED_EAGLE3"].mkdir()
    (paths["PACKAGED_EAGLE3"] / "config.json").write_text("{}")
    assert module.find_heads() == paths["PACKAGED_HEADS"]  # a folder without weights is no checkpoint
    (paths["PACKAGED_EAGLE3"] / "model.safetensors").write_bytes(b"")
    assert module.find_heads() == paths["PACKAGED_EAGLE3"]
    assert module.find_heads(eagle3=False) == paths["PACKAGED_HEADS"]
    save_heads(random_head(depth=1), paths["DEFAULT_HEADS"])  # the user's own head wins over the shipped ones
    assert module.find_heads() == paths["DEFAULT_HEADS"]
    paths["DEFAULT_EAGLE3"].mkdir()
    for name in ("config.json", "model.safetensors"):
        (paths["DEFAULT_EAGLE3"] / name).write_text("{}")
    assert module.find_heads() == paths["DEFAULT_EAGLE3"]
    assert module.find_heads(eagle3=False) == paths["DEFAULT_HEADS"]


def test_a_head_trains_in_another_dtype_than_the_models(tiny):
    _, _, outputs, data = periodic_data(tiny)
    heads = DraftHeads(64, shortlist(outputs, VOCAB, 16), depth=2).double()  # the model's states are float32
    state = train_heads(heads, tiny.vocab_weights(), data, epochs=1, batch_rows=64)
    assert np.isfinite(state.losses).all() and len(head_accuracy(heads, tiny.vocab_weights(), data)) == 2


def test_optimizer_checkpoint_loads_weights_only(tiny, tmp_path):
    _, _, outputs, data = periodic_data(tiny)
    state = train_heads(DraftHeads(64, shortlist(outputs, VOCAB, 16), depth=2), tiny.vocab_weights(), data,
                        epochs=1, batch_rows=64)
    torch.save({"optimizer": state.optimizer, "losses": state.losses}, tmp_path / "ckpt")
    assert torch.load(tmp_path / "ckpt", weights_only=True)["losses"] == state.losses


class CharTokenizer:
    eos_token_id = 0

    def apply_chat_template(self, messages, **kwargs):
        return [1 + ord(ch) % (VOCAB - 1) for ch in messages[0]["content"][:10]]


def test_train_heads_command_writes_a_head(tiny, tmp_path, monkeypatch, capsys):
    from treeattn.cli import build_parser
    from treeattn.cli import train_heads as cli

    monkeypatch.setattr(cli, "load_smollm2", lambda: (tiny, CharTokenizer()))
    (tmp_path / "prompts.txt").write_text("abcabcabc\nhello hello\nxyzxyz\nthe cat sat\n")
    argv = ["train-heads", "--prompts", str(tmp_path / "prompts.txt"), "--out", str(tmp_path / "h.pt"),
            "--max-tokens", "6", "--epochs", "2", "--batch", "2", "--threads", "1", "--depth", "2", "--vocab", "20"]
    args = build_parser().parse_args(argv)
    assert args.run(args) == 0
    heads, meta = load_heads(tmp_path / "h.pt")
    assert heads.depth == 2 and heads.vocab.numel() == 20 and len(meta["top1"]) == 2 and meta["prompts"] == 4
    assert all(0 <= a <= b <= 1 for a, b in zip(meta["top1"], meta["top4"]))
    kept = torch.load(tmp_path / "h.ckpt", weights_only=True)  # training done: only the answers stay
    assert kept["heads"] is None and kept["train"] is None and len(kept["outputs"]) == 4
    assert "draft step" in capsys.readouterr().out
    for bad_args, flag in ((["--prompts", str(tmp_path / "missing.txt")], "--prompts"), (["--vocab", "1"], "--vocab"),
                           (["--depth", "0"], "--depth"), (["--max-tokens", "1"], "--max-tokens")):
        bad = build_parser().parse_args(argv[:1] + bad_args)
        assert bad.run(bad) == 2
        assert flag in capsys.readouterr().err


def test_train_heads_keeps_the_answers_written_across_samples(tiny, tmp_path, monkeypatch):
    """The answers stage resumes from its checkpoint, also after a finished run: another --samples writes
    only the rounds it lacks and keeps the ones written (the same answers); another --temperature samples
    again."""
    from treeattn.cli import build_parser
    from treeattn.cli import train_heads as cli

    monkeypatch.setattr(cli, "load_smollm2", lambda: (tiny, CharTokenizer()))
    written = []
    real = cli.self_distill

    def counting(model, prompts, *, done=(), **kwargs):
        written.append(len(prompts) - len(done))
        return real(model, prompts, done=done, **kwargs)

    def stop(*args, **kwargs):
        raise KeyboardInterrupt  # the answers are checkpointed; stop before the hidden states

    real_examples = cli.head_examples
    monkeypatch.setattr(cli, "self_distill", counting)
    monkeypatch.setattr(cli, "head_examples", stop)
    (tmp_path / "prompts.txt").write_text("abcabcabc\nhello hello\nxyzxyz\nthe cat sat\n")
    ckpt = tmp_path / "run.ckpt"
    argv = ["train-heads", "--prompts", str(tmp_path / "prompts.txt"), "--out", str(tmp_path / "h.pt"),
            "--checkpoint", str(ckpt), "--max-tokens", "6", "--batch", "2", "--threads", "1", "--vocab", "20"]

    def run(*extra: str) -> list[int]:
        written.clear()
        args = build_parser().parse_args([*argv, *extra])
        with pytest.raises(KeyboardInterrupt):
            args.run(args)
        return list(written)

    assert run("--samples", "3") == [4, 6]  # 4 greedy answers; 3 training prompts x 2 sampled rounds
    first = torch.load(ckpt, weights_only=True)["sampled"]
    assert len(first) == 6
    assert run("--samples", "2") == [0, 0]
    assert run() == [0]  # --samples 1 reads no sampled answers and drops none
    assert run("--samples", "4") == [0, 3]  # one round more
    kept = torch.load(ckpt, weights_only=True)["sampled"]
    assert kept[:6] == first and len(kept) == 9
    assert run("--samples", "2", "--temperature", "0.5") == [0, 3]
    monkeypatch.setattr(cli, "head_examples", real_examples)  # a run to the end keeps the answers for the next
    written.clear()
    args = build_parser().parse_args([*argv, "--samples", "2", "--temperature", "0.5", "--epochs", "1"])
    assert args.run(args) == 0 and written == [0, 0]
    monkeypatch.setattr(cli, "head_examples", stop)
    assert run("--samples", "3", "--temperature", "0.5") == [0, 3]
