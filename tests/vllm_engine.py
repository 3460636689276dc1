"""Run one vLLM engine over a list of jobs and write what it generated as JSON (used by test_vllm).

Each engine runs in its own process, started by the test with or without ``TREEATTN_VLLM=1``: the
plugin decides at vLLM's start which class sits behind ``CPU_ATTN``, so the two backends cannot
share a process. Usage: ``python -m tests.vllm_engine SPEC.json RESULT.json``, where the spec holds
``model``, ``engine`` (keyword arguments of ``vllm.LLM``) and ``jobs`` (run in order):

- ``{"name", "prompts": [[token ids]...], "max_tokens"}``: one ``generate`` call over all prompts, greedy;
- ``{"name", "prompts", "max_tokens", "bad": [...]}``: the prompts as requests of one engine run, with
  invalid requests (``{"prompt": ..., "sampling": {...}}``) added between them; each bad one must be
  refused on its own while the good ones finish.

The result maps job names to generated token ids, ``errors`` to the refusals of each job, and
``counters`` to vLLM's counter metrics (speculative drafts, prefix-cache hits) after all jobs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _generate(llm, job) -> list[list[int]]:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _with_bad_requests(llm, job) -> tuple[list[list[int]], list[str]]:
    """Good requests interleaved with bad ones on one engine: the bad are refused, the good finish."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.exceptions import VLLMClientError

    engine, errors, good = llm.llm_engine, [], {}
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    for i, prompt in enumerate(job["prompts"]):
        engine.add_request(f"good-{i}", TokensPrompt(prompt_token_ids=prompt), params)
        good[f"good-{i}"] = None
        for j, bad in enumerate(job["bad"] if i == 0 else []):
            try:
                engine.add_request(f"bad-{j}", TokensPrompt(prompt_token_ids=bad["prompt"]),
                                   SamplingParams(**bad["sampling"]))
                errors.append("accepted")
            except (VLLMClientError, ValueError) as e:  # vLLM's refusal of a bad request
                errors.append(f"{type(e).__name__}: {e}")
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                good[out.request_id] = list(out.outputs[0].token_ids)
    return [good[k] for k in sorted(good, key=lambda k: int(k.split("-")[1]))], errors


def main(spec_path: str, result_path: str) -> None:
    from vllm import LLM

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(model=spec["model"], **spec["engine"])
    tokens, errors = {}, {}
    for job in spec["jobs"]:
        if "bad" in job:
            tokens[job["name"]], errors[job["name"]] = _with_bad_requests(llm, job)
        else:
            tokens[job["name"]] = _generate(llm, job)
    counters = {m.name: m.value for m in llm.get_metrics() if type(m).__name__ == "Counter"}
    with open(result_path, "w") as f:
        json.dump({"tokens": tokens, "errors": errors, "counters": counters}, f)


if __name__ == "__main__":  # vLLM starts its workers with spawn: they re-import this module
    main(*sys.argv[1:])
