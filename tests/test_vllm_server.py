"""Tree speculation served: vLLM's OpenAI-compatible server with treeattn's trees against the plain server.

Two servers on 127.0.0.1 for the whole module (SmolLM2 float32, as vLLM users run it): plain vLLM
and ``TREEATTN_VLLM=1`` with ``--speculative-config`` naming ``TreeProposer`` and the drafter by name
in ``--additional-config`` (``auto``: suffix + the shipped EAGLE-3 draft head). Greedy texts must be equal,
for completions and chat completions, streamed or not, alone or 16 at once with some clients gone
mid-stream; the tree server must free every KV block and keep serving. Two more starts check that a
bad configuration stops the server with the field named. Budget: ~5 min on 2 cores (four server
starts at ~35 s each are most of it); every request has a timeout and every loop a bound.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time

import pytest

from tests.vllm_server import ServerFailed, metric, metrics, served, tree_args

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed here: `make test-vllm` runs these in their own venv")]

ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
ARGS = ["--dtype", "float32", "--max-model-len", "1024", "--enforce-eager", "--seed", "0", "--max-num-seqs", "16"]
TREES = tree_args(16, drafter="auto")
TIMEOUT = 120  # seconds for any one request
PROMPTS = [  # two that repeat their input (drafts are accepted), one with nothing to look up
    "Repeat this list exactly, twice: apples, pears, plums, cherries, grapes, lemons.",
    "Rename x to total in this code and print the code:\ndef f(x):\n    x = x + 1\n    return x * x\n",
    "Write a short poem about the sea.",
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from treeattn.models.loader import ModelNotAvailable, save_smollm2

    try:
        return save_smollm2(tmp_path_factory.mktemp("smollm2"))
    except ModelNotAvailable as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def urls(model, tmp_path_factory):
    """``{"plain": URL, "trees": URL}``: both servers up for the module, stopped after it."""
    logs = tmp_path_factory.mktemp("server-logs")
    with (served(model, ARGS, {**ENV, "TREEATTN_VLLM": "0"}, logs / "plain.log") as plain,
          served(model, ARGS + TREES, {**ENV, "TREEATTN_VLLM": "1"}, logs / "trees.log") as trees):
        yield {"plain": plain, "trees": trees, "log": logs / "trees.log"}


def _client(url: str):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)


def _text(url: str, model, prompt: str, *, chat: bool, stream: bool, max_tokens: int = 32, **sampling) -> str:
    client, name = _client(url), str(model)
    args = {"model": name, "max_tokens": max_tokens, "temperature": 0.0, "stream": stream, **sampling}
    if chat:
        out = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **args)
        if not stream:
            return out.choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in out if c.choices)
    # A raw prompt to an instruct model often ends at once: keep going, past any end-of-text token.
    out = client.completions.create(prompt=prompt, extra_body={"ignore_eos": True}, **args)
    return out.choices[0].text if not stream else "".join(c.choices[0].text for c in out if c.choices)


def _drained(url: str, seconds: float = 30) -> dict[str, float]:
    """The server's metrics once no request runs or waits (within ``seconds``)."""
    deadline = time.monotonic() + seconds
    while True:
        values = metrics(url)
        idle = metric(values, "vllm:num_requests_running") == 0 and metric(values, "vllm:num_requests_waiting") == 0
        if idle or time.monotonic() > deadline:
            return values
        time.sleep(0.5)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_texts_equal_the_plain_server(urls, model, chat, stream):
    for prompt in PROMPTS:
        theirs = _text(urls["plain"], model, prompt, chat=chat, stream=stream)
        ours = _text(urls["trees"], model, prompt, chat=chat, stream=stream)
        assert ours == theirs and len(theirs) > 20


def test_trees_were_verified_and_accepted(urls, model):
    _text(urls["trees"], model, PROMPTS[0], chat=True, stream=False, max_tokens=64)
    values = _drained(urls["trees"])
    assert metric(values, "vllm:spec_decode_num_drafts_total") > 0
    assert metric(values, "vllm:spec_decode_num_accepted_tokens_total") > 0
    assert "SuffixDrafter + EagleDrafter, adaptive trees of up to 16 nodes" in urls["log"].read_text()


def test_a_client_gone_mid_stream_is_aborted_and_later_requests_are_unaffected(urls, model):
    generated = metric(_drained(urls["trees"]), "vllm:generation_tokens_total")
    stream = _client(urls["trees"]).completions.create(model=str(model), prompt=PROMPTS[0], max_tokens=400,
                                                       temperature=0.0, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 4:
            break
    stream.close()  # the client disconnects: the server aborts the request
    values = _drained(urls["trees"])
    assert metric(values, "vllm:num_requests_running") == 0
    # it would have run to its 400 tokens (no end-of-text stop); it stopped soon after the 5th chunk
    assert metric(values, "vllm:generation_tokens_total") - generated < 200
    assert metric(values, "vllm:kv_cache_usage_perc") == 0
    assert (_text(urls["trees"], model, PROMPTS[1], chat=True, stream=True)
            == _text(urls["plain"], model, PROMPTS[1], chat=True, stream=True))


async def _concurrent(url: str, model, prompts: list[str], cancel: set[int]) -> list[str | None]:
    """Each prompt as a streamed chat completion, all at once; those in ``cancel`` disconnect after a
    few chunks (None in the result)."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=TIMEOUT, max_retries=0)

    async def one(i: int, prompt: str) -> str | None:
        stream = await client.chat.completions.create(model=str(model), messages=[{"role": "user", "content": prompt}],
                                                      max_tokens=40, temperature=0.0, stream=True)
        parts = []
        async for chunk in stream:
            parts.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
            if i in cancel and len(parts) == 3:
                await stream.close()
                return None
        return "".join(parts)

    try:
        return await asyncio.wait_for(asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))), 4 * TIMEOUT)
    finally:
        await client.close()


def test_sixteen_clients_some_gone_finish_as_plain_and_free_every_block(urls, model):
    prompts = [f"{PROMPTS[i % 3]} ({i})" for i in range(16)]  # distinct requests, three kinds
    cancel = {2, 7, 11, 14}
    ours = asyncio.run(_concurrent(urls["trees"], model, prompts, cancel))
    theirs = asyncio.run(_concurrent(urls["plain"], model, prompts, set()))
    assert [t is None for t in ours] == [i in cancel for i in range(16)]
    assert [t for t in ours if t is not None] == [t for i, t in enumerate(theirs) if i not in cancel]
    values = _drained(urls["trees"])
    assert metric(values, "vllm:num_requests_running") == 0 and metric(values, "vllm:kv_cache_usage_perc") == 0


def _plainly(urls, model, prompt: str, **sampling) -> str:
    """The tree server's text for these settings, checked to be the plain server's and drafted for by nothing."""
    drafts = metric(_drained(urls["trees"]), "vllm:spec_decode_num_drafts_total")
    ours = _text(urls["trees"], model, prompt, chat=True, stream=False, **sampling)
    assert metric(_drained(urls["trees"]), "vllm:spec_decode_num_drafts_total") == drafts  # no drafts for it
    assert ours == _text(urls["plain"], model, prompt, chat=True, stream=False, **sampling)
    return ours


@pytest.mark.parametrize("sampling", [{"presence_penalty": 0.5}, {"frequency_penalty": 0.3},
                                      {"extra_body": {"repetition_penalty": 1.2}}],
                         ids=["presence", "frequency", "repetition"])
def test_penalties_decode_plainly(urls, model, sampling):
    _plainly(urls, model, PROMPTS[0], **sampling)


def test_logit_bias_and_min_p_are_served_plainly(urls, model):
    # vLLM refuses both under its own speculation (its rejection sampler cannot apply them); with trees
    # they are accepted and reach vLLM's sampler: forbidding the answer's first token changes the answer.
    first = _client(urls["plain"]).chat.completions.create(
        model=str(model), messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=1, temperature=0.0,
        logprobs=True, extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs.content[0].token
    biased = _plainly(urls, model, PROMPTS[0], logit_bias={first.split(":")[1]: -100.0})
    assert biased != _text(urls["plain"], model, PROMPTS[0], chat=True, stream=False)
    _plainly(urls, model, PROMPTS[2], temperature=0.8, seed=7, extra_body={"min_p": 0.2})


@pytest.mark.parametrize("args, field", [
    (["--speculative-config", json.dumps({**json.loads(TREES[1]), "drafter": "auto"})],
     "validation error for SpeculativeConfig\ndrafter\n  Unexpected keyword argument"),
    (tree_args(16, drafter="medusa"), "additional_config.treeattn.drafter must be one of ngram, suffix, heads, auto"),
], ids=["speculative-config", "additional-config"])
def test_a_bad_configuration_stops_the_server_naming_the_field(model, tmp_path, args, field):
    with pytest.raises(ServerFailed) as failed, served(model, ARGS + args, {**ENV, "TREEATTN_VLLM": "1"},
                                                      tmp_path / "bad.log", start_timeout=300):
        pass
    assert field in failed.value.log
