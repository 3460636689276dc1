"""``treeattn train-heads --arch eagle3``: an EAGLE-3 head self-distilled on a tiny random Llama (2 layers,
so aux boundaries 0, 1, 2), trained with the training-time test, saved as an EAGLE-3 checkpoint folder.

Budget: a few seconds each on 2 cores.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from tests.helpers import VOCAB, make_prompts, tiny_model
from tests.test_heads import CharTokenizer
from treeattn.speculative import EagleDrafter, generate, load_draft_head
from treeattn.speculative.eagle_train import (
    eagle3_accuracy,
    eagle3_examples,
    eagle3_loss,
    new_eagle3_head,
    save_eagle3,
    train_eagle3,
    ttt_forward,
)
from treeattn.speculative.heads import self_distill, shortlist

AUX = (0, 1, 2)
STEPS = 3


@pytest.fixture(scope="module")
def tiny(one_thread):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def answers(tiny):
    """The tiny model's own greedy answers: 16 prompts to train on, 4 held out."""
    prompts = make_prompts(seed=11, count=20)
    return prompts, self_distill(tiny, prompts, max_new_tokens=24)


@pytest.fixture(scope="module")
def data(tiny, answers):
    prompts, outputs = answers
    return eagle3_examples(tiny, prompts[:16], outputs[:16], AUX), eagle3_examples(tiny, prompts[16:], outputs[16:], AUX)


def fresh_head(tiny, answers, seed=0):
    return new_eagle3_head(tiny, shortlist(answers[1][:16], VOCAB, 48), AUX, seed=seed)


def periodic(phases, period=7):
    """Sequences that cycle through a fixed random permutation, from several phases: the next token is a
    function of the current one, so what a head learns on some phases holds on the others."""
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:period].tolist()
    prompts = [[perm[i % period], perm[(i + 1) % period]] for i in phases]
    return prompts, [[perm[(i + 2 + t) % period] for t in range(20)] for i in phases]


def test_training_lowers_the_held_out_loss(tiny):
    (prompts, outputs), (held_prompts, held_outputs) = periodic(range(8)), periodic(range(8, 11))
    train, held = eagle3_examples(tiny, prompts, outputs, AUX), eagle3_examples(tiny, held_prompts, held_outputs, AUX)
    head = new_eagle3_head(tiny, shortlist(outputs, VOCAB, 16), AUX)
    loss_before, acc_before = eagle3_loss(head, held, steps=STEPS), eagle3_accuracy(head, held, steps=STEPS)
    state = train_eagle3(head, train, steps=STEPS, epochs=10, batch_size=4, lr=3e-3)
    assert state.epoch == 10 and len(state.losses) == 10 * 2 and np.isfinite(state.losses).all()
    loss_after, acc_after = eagle3_loss(head, held, steps=STEPS), eagle3_accuracy(head, held, steps=STEPS)
    assert loss_after < 0.6 * loss_before, (loss_before, loss_after)
    assert len(acc_after) == STEPS and acc_after[0] > 0.8 and acc_after[1] > 0.8, (acc_before, acc_after)
    assert not head.embed_tokens.weight.requires_grad  # the target's embeddings stay frozen
    torch.testing.assert_close(head.embed_tokens.weight, tiny.vocab_weights()[0])


def test_bf16_autocast_trains_as_float32_does(tiny):
    """bfloat16 GEMMs (float32 weights, optimizer and loss) on features kept in bfloat16 (as train-heads
    --bf16 keeps them) reach float32's held-out loss and accuracy from the same start; a caller's own
    autocast context (whose weight-cast cache would freeze the first step's weights) and other dtypes
    are refused."""
    (prompts, outputs), (held_prompts, held_outputs) = periodic(range(8)), periodic(range(8, 11))
    train, held = eagle3_examples(tiny, prompts, outputs, AUX), eagle3_examples(tiny, held_prompts, held_outputs, AUX)
    train16 = eagle3_examples(tiny, prompts, outputs, AUX, dtype=torch.bfloat16)
    assert all(k.dtype == torch.bfloat16 and k.is_contiguous() and torch.equal(k, f.bfloat16())
               for k, f in zip(train16.features, train.features, strict=True))
    assert all(torch.equal(k, f) for k, f in zip(train16.final, train.final, strict=True))  # the teacher's: float32
    results = {}
    for autocast, data in ((None, train), (torch.bfloat16, train16)):
        head = new_eagle3_head(tiny, shortlist(outputs, VOCAB, 16), AUX)
        before = eagle3_loss(head, held, steps=STEPS)
        train_eagle3(head, data, steps=STEPS, epochs=10, batch_size=4, lr=3e-3, autocast=autocast)
        results[autocast] = eagle3_loss(head, held, steps=STEPS), eagle3_accuracy(head, held, steps=STEPS)
        assert all(p.dtype == torch.float32 for p in head.parameters())
    (loss32, acc32), (loss16, acc16) = results[None], results[torch.bfloat16]
    assert loss16 < 0.6 * before and abs(loss16 - loss32) < 0.2 * loss32, (before, loss32, loss16)
    assert acc16[0] > 0.8 and acc16[1] > 0.8, (acc32, acc16)
    with pytest.raises(ValueError, match="pass autocast=torch.bfloat16 instead"), torch.autocast("cpu", dtype=torch.bfloat16):
        train_eagle3(head, train, steps=STEPS, epochs=1)
    with pytest.raises(ValueError, match=r"autocast must be None \(float32\) or torch.bfloat16, got torch.float16"):
        train_eagle3(head, train, steps=STEPS, epochs=1, autocast=torch.float16)


def test_the_teacher_is_the_targets_distribution_at_the_state_that_chose_each_token(tiny, answers, data):
    """With the target's LM head as teacher, each trained row's distribution is the target's at the state
    that chose its target token: on greedy answers its argmax is that token. Training against it lowers the
    held-out loss."""
    from treeattn.speculative.eagle_train import STEP_WEIGHT, Eagle3Data, _batch_loss, _teacher_rows, _vocab_index

    train, held = data
    head = fresh_head(tiny, answers)
    lm_head = tiny.vocab_weights()[1]
    rows, vocab_index = _teacher_rows(head, lm_head, train), _vocab_index(head)
    feats, reads, targets, valid, chose = train.batch(list(range(len(train))), vocab_index, STEPS)
    for s in range(STEPS):
        ok = targets[s] >= 0
        assert ok.sum() > 20 and torch.equal((chose[ok] @ rows.T).argmax(-1), targets[s][ok]), s
        # the full vocabulary's argmax too: these are the target's own greedy tokens
        assert torch.equal(vocab_index[(chose[ok] @ lm_head.T).argmax(-1)], targets[s][ok]), s
    # the loss: each step's rows fit the teacher's distribution at their own target (computed once per
    # batch); random states, since a tiny model's greedy answers repeat themselves
    noisy = Eagle3Data(train.tokens, train.features, train.first, [torch.randn_like(f) for f in train.final])
    chose = noisy.batch(list(range(len(train))), vocab_index, STEPS)[4]
    finals = ttt_forward(head, feats, reads, STEPS)
    expected = sum(STEP_WEIGHT ** s * -(torch.softmax(chose[targets[s] >= 0] @ rows.T, -1)
                                         * torch.log_softmax(head.logits(final[targets[s] >= 0]), -1)).sum(-1).mean()
                   for s, final in enumerate(finals))
    torch.testing.assert_close(_batch_loss(head, noisy, list(range(len(train))), vocab_index, STEPS, rows), expected)
    before = eagle3_loss(head, held, steps=STEPS, teacher=lm_head)
    train_eagle3(head, train, steps=STEPS, epochs=3, batch_size=4, lr=3e-3, teacher=lm_head)
    assert eagle3_loss(head, held, steps=STEPS, teacher=lm_head) < before
    with pytest.raises(ValueError, match=r"teacher must be the target's LM head \[96, 64\], got \(96, 32\)"):
        train_eagle3(head, train, teacher=lm_head[:, :32])


def test_sampled_answers_vary_and_resume_identically(tiny, answers):
    """Sampled answers differ from the greedy ones and from each other; an interrupted run that resumes
    from the batches it finished samples the same answers as an uninterrupted one (a seed per batch)."""
    from treeattn.speculative import SamplingParams

    prompts, greedy = answers[0][:6], answers[1][:6]
    hot = SamplingParams(1.5)
    full = self_distill(tiny, prompts * 2, max_new_tokens=12, batch_size=4, sampling=hot, seed=3)
    resumed = self_distill(tiny, prompts * 2, max_new_tokens=12, batch_size=4, sampling=hot, seed=3, done=full[:4])
    assert resumed == full
    assert full[:6] != full[6:] and full[:6] != [g[:12] for g in greedy]


@pytest.mark.parametrize("within_epoch", [False, True])
def test_resume_is_bit_identical(tiny, answers, data, within_epoch):
    """A run stopped at a checkpoint (after an epoch, or within one: ``checkpoint_s=0`` checkpoints
    after every batch) and resumed from it ends with the weights of an uninterrupted run."""
    train = data[0]
    full = fresh_head(tiny, answers)
    resumed = copy.deepcopy(full)
    train_eagle3(full, train, steps=2, epochs=3, batch_size=8)
    saved = []

    def interrupt(state):
        saved.append((copy.deepcopy(state), copy.deepcopy(resumed.state_dict())))
        if not within_epoch or len(saved) == 3:  # 16 sequences, 8 a batch: the 3rd checkpoint is within epoch 2
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_eagle3(resumed, train, steps=2, epochs=3, batch_size=8, on_checkpoint=interrupt,
                     checkpoint_s=0.0 if within_epoch else 600.0)
    state, weights = saved[-1]
    assert (state.epoch, state.batch) == ((1, 1) if within_epoch else (1, 0))
    restarted = fresh_head(tiny, answers, seed=5)  # another init: everything must come from the checkpoint
    restarted.load_state_dict(weights)
    train_eagle3(restarted, train, steps=2, epochs=3, batch_size=8, state=state)
    for (name, a), b in zip(full.state_dict().items(), restarted.state_dict().values()):
        assert torch.equal(a, b), name


def chain_outputs(head, features, tokens, c, steps):
    """Through ``Eagle3Head.forward`` and its KV cache: context rows ``0..c`` of one sequence, then a chain of
    ``steps - 1`` draft nodes reading the true tokens; the final states of row ``c`` and of each node."""
    cache = head.new_cache()
    cache.add_sequence(0)
    out = head(cache, [0], features[:c + 1], tokens[1:c + 2], [c + 1])
    finals, hidden = [out.final[-1]], out.hidden[-1:]
    for depth in range(steps - 1):
        out = head(cache, [0], hidden, tokens[c + 2 + depth:c + 3 + depth], [1], [[depth - 1]])
        finals.append(out.final[0])
        hidden = out.hidden
    return torch.stack(finals)


def test_saved_folder_loads_and_matches_the_training_forward(tiny, answers, data, tmp_path):
    train = data[0]
    head = fresh_head(tiny, answers)
    train_eagle3(head, train, steps=STEPS, epochs=1, batch_size=8)
    folder = save_eagle3(head, tmp_path / "e3", target_layers=2, dtype=torch.float32, note="test")
    config = json.loads((folder / "config.json").read_text())
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}  # not the defaults: spelled out
    assert config["draft_vocab_size"] == 48 and config["treeattn"] == {"note": "test"}
    loaded = load_draft_head(folder, target=tiny)
    assert loaded.config.aux_layers == AUX and loaded.to_target(torch.arange(48)).tolist() == sorted(
        shortlist(answers[1][:16], VOCAB, 48))
    for name, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    # The training forward on a batch of two sequences vs the head's own forward, context then a draft chain.
    feats, reads, _, _, _ = train.batch([0, 3], torch.zeros(VOCAB, dtype=torch.long), STEPS)
    with torch.no_grad():
        batched = ttt_forward(head, feats, reads, STEPS)
        for b, i in enumerate([0, 3]):
            for c in (0, 5, train.tokens[i].numel() - STEPS - 2):
                want = torch.stack([batched[s][b, c + s] for s in range(STEPS)])
                got = chain_outputs(loaded, train.features[i], train.tokens[i], c, STEPS)
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # Saved in bfloat16 by default, the engines' dtype.
    assert load_draft_head(save_eagle3(head, tmp_path / "bf16", target_layers=2), target=tiny).fc.weight.dtype == \
        torch.bfloat16


def test_drafting_with_the_trained_head_is_greedy(tiny, answers, data, tmp_path):
    head = fresh_head(tiny, answers)
    train_eagle3(head, data[0], steps=STEPS, epochs=4, batch_size=4, lr=3e-3)
    loaded = load_draft_head(save_eagle3(head, tmp_path / "e3", target_layers=2), target=tiny, dtype=torch.float32)
    prompts = answers[0][:4]  # answers it was trained on: drafts get accepted
    plain = generate(tiny, prompts, max_new_tokens=16)
    spec = generate(tiny, prompts, max_new_tokens=16, drafter=EagleDrafter(loaded, budget=10), adaptive=False)
    assert spec.tokens == plain.tokens
    assert spec.mean_tree_size > 2 and spec.forward_passes < plain.forward_passes  # a trained head gets tokens accepted


def test_train_heads_command_writes_an_eagle3_folder(tiny, tmp_path, monkeypatch, capsys):
    from treeattn.cli import build_parser
    from treeattn.cli import train_heads as cli

    loaded = []  # the dtypes the command loads the model in

    def load(dtype=torch.float32):
        loaded.append(dtype)
        return (tiny if dtype == torch.float32 else tiny_model("llama", dtype=dtype)), CharTokenizer()

    monkeypatch.setattr(cli, "load_smollm2", load)
    (tmp_path / "prompts.txt").write_text("abcabcabc\nhello hello\nxyzxyz\nthe cat sat\n")
    argv = ["train-heads", "--arch", "eagle3", "--prompts", str(tmp_path / "prompts.txt"), "--out",
            str(tmp_path / "e3"), "--max-tokens", "6", "--epochs", "2", "--batch", "2", "--threads", "1",
            "--depth", "2", "--vocab", "20"]
    args = build_parser().parse_args([*argv, "--aux-layers", "2,0,1"])
    assert args.run(args) == 0
    head = load_draft_head(tmp_path / "e3", target=tiny)
    assert head.config.aux_layers == AUX and head.config.vocab_size_draft == 20
    meta = json.loads((tmp_path / "e3" / "config.json").read_text())["treeattn"]
    assert len(meta["top1"]) == 2 and meta["prompts"] == 4 and meta["epochs"] == 2
    assert torch.load(tmp_path / "e3.ckpt", weights_only=True)["heads"] is None  # training done: the answers stay
    assert "draft step" in capsys.readouterr().out
    # --samples 3: two sampled answers more per training prompt (3 of the 4 prompts; the 4th is held out)
    # --bf16: the sampled answers are written by the model in bfloat16, the greedy ones (read from the
    # checkpoint here) by the float32 model
    args = build_parser().parse_args([*argv, "--aux-layers", "2,0,1", "--samples", "3", "--out", str(tmp_path / "s3"),
                                      "--bf16"])
    loaded.clear()
    assert args.run(args) == 0
    assert loaded == [torch.float32, torch.bfloat16]
    sampled = torch.load(tmp_path / "s3.ckpt", weights_only=True)["sampled"]
    assert len(sampled) == 6 and all(0 < len(answer) <= 6 for answer in sampled)
    loaded.clear()
    assert args.run(args) == 0 and loaded == [torch.float32]  # every answer is written: no bfloat16 copy
    meta = json.loads((tmp_path / "s3" / "config.json").read_text())["treeattn"]
    assert meta["prompts"] == 4 and meta["held_out"] == 1 and meta["samples"] == 3 and meta["bf16"] is True
    assert "trained on 9 answers" in capsys.readouterr().out
    for bad_args, flag in ((argv[1:], "--aux-layers"),  # a 2-layer target: EAGLE-3's defaults do not fit
                           ([*argv[1:], "--aux-layers", "0,1,3"], "--aux-layers"),
                           (["--aux-layers", "0,1,2"], "--aux-layers"),  # without --arch eagle3
                           (["--bf16"], "--bf16"),
                           ([*argv[1:], "--aux-layers", "0,1,2", "--depth", "0"], "--depth"),
                           ([*argv[1:], "--aux-layers", "0,1,2", "--samples", "0"], "--samples"),
                           ([*argv[1:], "--aux-layers", "0,1,2", "--samples", "2", "--temperature", "0"], "--temperature")):
        bad = build_parser().parse_args(argv[:1] + bad_args)
        assert bad.run(bad) == 2
        assert flag in capsys.readouterr().err
    for bad_args in (["--arch", "eagle"], ["--arch", "eagle3", "--aux-layers", "1,2"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv[:1] + bad_args)
        assert bad_args[-2] in capsys.readouterr().err


def test_train_heads_eagle3_resumes_without_recomputing_the_features(tiny, tmp_path, monkeypatch):
    """The target's features are kept beside the checkpoint, a file per chunk of answers: a run stopped
    in the feature stage resumes after its last chunk, one stopped in training resumes from them
    (mapped, not recomputed), and either writes the head an uninterrupted run writes; features kept in
    another dtype are computed again; a finished run removes the folder and keeps the checkpoint."""
    from treeattn.cli import build_parser
    from treeattn.cli import train_eagle3 as stage
    from treeattn.cli import train_heads as cli

    monkeypatch.setattr(cli, "load_smollm2", lambda: (tiny, CharTokenizer()))
    monkeypatch.setattr(stage, "FEATURES_CHUNK", 2)
    computed = []  # the answers whose features were computed, in order
    real_sequence, real_train = stage.eagle_train.eagle3_sequence, stage.eagle_train.train_eagle3
    budget = [None]  # answers the feature stage computes before it is interrupted (None: all)

    def counting(model, prompt, answer, *args, **kwargs):
        if budget[0] is not None and len(computed) == budget[0]:
            raise KeyboardInterrupt
        computed.append(len(prompt))
        return real_sequence(model, prompt, answer, *args, **kwargs)

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(stage.eagle_train, "eagle3_sequence", counting)
    (tmp_path / "prompts.txt").write_text("abcabcabc\nhello hello\nxyzxyz\nthe cat sat\n")
    argv = ["train-heads", "--arch", "eagle3", "--prompts", str(tmp_path / "prompts.txt"), "--max-tokens", "6",
            "--epochs", "2", "--batch", "2", "--threads", "1", "--depth", "2", "--vocab", "20", "--aux-layers", "0,1,2"]

    def run(out: str, *extra: str, interrupt: bool = False, after: int | None = None) -> int:
        computed.clear()
        budget[0] = after
        monkeypatch.setattr(stage.eagle_train, "train_eagle3", stop if interrupt else real_train)
        args = build_parser().parse_args([*argv, "--out", str(tmp_path / out), *extra])
        if interrupt or after is not None:
            with pytest.raises(KeyboardInterrupt):
                args.run(args)
        else:
            assert args.run(args) == 0
        return len(computed)

    assert run("fresh", "--bf16") == 4  # 3 training prompts, 1 held out
    assert run("e3", "--bf16", after=2) == 2  # chunks of 2 answers: the first is written, then the stop
    assert sorted(p.name for p in (tmp_path / "e3.features").glob("*.pt")) == ["train-0000000.pt"]
    assert run("e3", "--bf16", interrupt=True) == 2  # the second chunk (1 answer) and the held-out one
    assert run("e3", "--bf16") == 0
    assert not (tmp_path / "e3.features").exists() and (tmp_path / "e3.ckpt").exists()
    assert (tmp_path / "e3" / "model.safetensors").read_bytes() == (tmp_path / "fresh" / "model.safetensors").read_bytes()
    assert run("other", "--bf16", interrupt=True) == 4
    assert run("other", "--bf16", "--aux-layers", "2,1,0", interrupt=True) == 0  # the same boundaries
    assert run("other", interrupt=True) == 4  # float32 features
