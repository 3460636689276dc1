"""Draft heads on the model's own LM head: training, saving, drafting (tiny random Llama, CPU).

Budget: ~10 s on 2 cores.
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
    train_heads,
)


@pytest.fixture(scope="module")
def tiny(one_thread):
    return tiny_model("llama")


def test_causal_hidden_states_match_the_model_logits(tiny):
    hf = tiny_hf("llama")
    tokens = [3, 17, 5, 60, 2, 9]
    hidden = causal_hidden_states(tiny, tokens)
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(tiny.logits(hidden), expected, atol=2e-5, rtol=1e-4)


def test_untrained_heads_repeat_the_models_next_token_guess(tiny):
    heads = DraftHeads(64, num_heads=2)
    hidden = torch.randn(5, 64)
    logits = heads(hidden, tiny.logits)
    assert logits.shape == (2, 5, VOCAB)
    torch.testing.assert_close(logits[1], tiny.logits(hidden))


def periodic_data(tiny, period: int = 7, n: int = 6):
    """Sequences that cycle through a fixed random permutation: the token k steps ahead is a function
    of the current one, so a head can learn it."""
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:period].tolist()
    prompts = [[perm[i % period]] + [perm[(i + 1) % period]] for i in range(n)]
    outputs = [[perm[(i + 2 + t) % period] for t in range(20)] for i in range(n)]
    return head_examples(tiny, prompts, outputs, num_heads=2)


def test_examples_target_the_tokens_two_and_three_ahead(tiny):
    x, y = head_examples(tiny, [[1, 2]], [[3, 4, 5, 6]], num_heads=2)
    # positions 1, 2, 3, 4 of [1, 2, 3, 4, 5, 6] predict 3..6; head 0 the token after that, head 1 two after
    assert y.tolist() == [[4, 5], [5, 6], [6, -100], [-100, -100]]
    torch.testing.assert_close(x, causal_hidden_states(tiny, [1, 2, 3, 4, 5])[1:])


def test_training_lowers_the_loss_and_raises_accuracy(tiny):
    x, y = periodic_data(tiny)
    torch.manual_seed(0)
    heads = DraftHeads(64, num_heads=2)
    before = head_accuracy(heads, tiny.logits, x, y)
    state = train_heads(heads, tiny.logits, x, y, epochs=30, batch_rows=64, lr=3e-2)
    assert np.mean(state.losses[-3:]) < 0.5 * np.mean(state.losses[:3])
    after = head_accuracy(heads, tiny.logits, x, y)
    assert all(a > b + 0.3 for a, b in zip(after, before)), (before, after)


def test_training_resumes_where_it_stopped(tiny):
    x, y = periodic_data(tiny)
    full = DraftHeads(64, num_heads=2)
    train_heads(full, tiny.logits, x, y, epochs=3, batch_rows=32)
    resumed = DraftHeads(64, num_heads=2)
    saved = []

    def interrupt(state):
        saved.append(copy.deepcopy(state))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_heads(resumed, tiny.logits, x, y, epochs=3, batch_rows=32, on_epoch=interrupt)
    assert saved[-1].epoch == 1
    train_heads(resumed, tiny.logits, x, y, epochs=3, batch_rows=32, state=saved[-1])
    for a, b in zip(full.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b)


def test_save_load_round_trip(tmp_path):
    heads = DraftHeads(64, num_heads=3)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_()
    save_heads(heads, tmp_path / "h.pt", note="test")
    loaded, meta = load_heads(tmp_path / "h.pt")
    assert meta == {"note": "test"} and loaded.num_heads == 3
    for a, b in zip(heads.parameters(), loaded.parameters()):
        torch.testing.assert_close(a.to(torch.float16).float(), b)  # saved in float16
    torch.save({"x": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a treeattn draft-heads file"):
        load_heads(tmp_path / "other.pt")


def test_head_drafter_trees_follow_the_heads(tiny):
    heads = DraftHeads(64, num_heads=2)
    drafter = HeadDrafter(heads, tiny.logits, budget=7, top_k=3)
    hidden = torch.randn(2, 64)
    cands = drafter.candidates([np.array([4]), np.array([5, 6])], hidden)
    top = torch.topk(heads(hidden, tiny.logits), 3, dim=-1).indices
    for b, c in enumerate(cands):
        tree = c.tree
        assert tree.size == 7 and tree.tokens[0] == [4, 6][b]
        depth = np.zeros(tree.size, int)
        for i in range(1, tree.size):
            depth[i] = depth[tree.parents[i]] + 1
            assert tree.tokens[i] in top[depth[i] - 1, b].tolist()
        assert depth.max() <= 2
    with pytest.raises(ValueError, match="hidden"):
        drafter.candidates([np.array([4])])


def test_optimizer_checkpoint_loads_weights_only(tiny, tmp_path):
    x, y = periodic_data(tiny)
    state = train_heads(DraftHeads(64, num_heads=2), tiny.logits, x, y, epochs=1, batch_rows=64)
    torch.save({"optimizer": state.optimizer, "losses": state.losses}, tmp_path / "ckpt")
    assert torch.load(tmp_path / "ckpt", weights_only=True)["losses"] == state.losses


class CharTokenizer:
    eos_token_id = 0

    def apply_chat_template(self, messages, **kwargs):
        return [1 + ord(ch) % (VOCAB - 1) for ch in messages[0]["content"][:10]]


def test_train_heads_command_writes_heads(tiny, tmp_path, monkeypatch, capsys):
    from treeattn.cli import build_parser
    from treeattn.cli import train_heads as cli

    monkeypatch.setattr(cli, "load_smollm2", lambda: (tiny, CharTokenizer()))
    (tmp_path / "prompts.txt").write_text("abcabcabc\nhello hello\nxyzxyz\nthe cat sat\n")
    argv = ["train-heads", "--prompts", str(tmp_path / "prompts.txt"), "--out", str(tmp_path / "h.pt"),
            "--max-tokens", "6", "--epochs", "2", "--batch", "2", "--threads", "1", "--num-heads", "2"]
    args = build_parser().parse_args(argv)
    assert args.run(args) == 0
    heads, meta = load_heads(tmp_path / "h.pt")
    assert heads.num_heads == 2 and len(meta["top1"]) == 2 and meta["prompts"] == 4
    assert not (tmp_path / "h.ckpt").exists()  # removed once training ended
    bad = build_parser().parse_args(argv[:1] + ["--prompts", str(tmp_path / "missing.txt")])
    assert bad.run(bad) == 2
    assert "--prompts" in capsys.readouterr().err
