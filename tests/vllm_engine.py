"""Run one vLLM engine over a list of jobs and write what it generated as JSON (used by test_vllm).

Each engine runs in its own process, started by the test with or without ``TREEATTN_VLLM=1``: the
plugin decides at vLLM's start which class sits behind ``CPU_ATTN``, so the two backends cannot
share a process. Usage: ``python -m tests.vllm_engine SPEC.json RESULT.json``, where the spec holds
``model``, ``engine`` (keyword arguments of ``vllm.LLM``) and ``jobs`` (run in order):

- ``{"name", "prompts": [[token ids]...], "max_tokens"}``: one ``generate`` call over all prompts
  (``max_tokens`` one for all or one per prompt), greedy, or with ``"sampling"`` (keyword arguments
  of ``SamplingParams``; then every sample of each prompt is kept, with the logprob of each of its
  tokens when ``logprobs`` is set);
- ``{"name", "prompts", "max_tokens", "bad": [...]}``: the prompts as requests of one engine run, with
  invalid requests (``{"prompt": ..., "sampling": {...}}``) added between them; each bad one must be
  refused on its own while the good ones finish.

With ``"tree": {"nodes", "drafter": {"class": "module.Name", "kwargs": {...}} | "name"}`` in the spec,
the engine verifies token trees (``treeattn.vllm.speculative.tree_speculative_config``).

The result maps job names to generated token ids, ``errors`` to the refusals of each job,
``counters`` to vLLM's counter metrics (speculative drafts, prefix-cache hits) after all jobs, and
``draft_fetches`` to how many times the engine core called into its workers for a step's drafts
(``take_draft_token_ids``; the engine core runs in this process).
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path


def _generate(llm, job) -> list[list[int]] | list[list[list[int]]]:
    from vllm import SamplingParams, TokensPrompt

    sampling, lengths = job.get("sampling"), job["max_tokens"]
    lengths = lengths if isinstance(lengths, list) else [lengths] * len(job["prompts"])  # per prompt: finish apart
    params = [SamplingParams(**{"temperature": 0.0, **(sampling or {}), "max_tokens": n, "ignore_eos": True})
              for n in lengths]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False)
    if sampling is not None and sampling.get("logprobs") is not None:  # with each chosen token's logprob
        return [[[list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]] for c in o.outputs]
                for o in outputs]
    if sampling is not None:
        return [[list(c.token_ids) for c in o.outputs] for o in outputs]
    return [list(o.outputs[0].token_ids) for o in outputs]


def _speculative_config(tree: dict) -> dict:
    from treeattn.vllm.speculative import tree_speculative_config

    drafter = tree.get("drafter", "ngram")
    if isinstance(drafter, dict):
        module, name = drafter["class"].rsplit(".", 1)
        drafter = getattr(importlib.import_module(module), name)(**drafter.get("kwargs", {}))
    options = {k: tree[k] for k in ("heads", "draft_head", "adaptive") if k in tree}
    return tree_speculative_config(nodes=tree["nodes"], drafter=drafter, **options)


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
    engine = dict(spec["engine"])
    if spec.get("tree") is not None:
        engine["speculative_config"] = _speculative_config(spec["tree"])
    llm = LLM(model=spec["model"], **engine)
    executor, fetches = llm.llm_engine.engine_core.engine_core.model_executor, []
    take = executor.take_draft_token_ids
    executor.take_draft_token_ids = lambda: fetches.append(1) or take()
    tokens, errors = {}, {}
    for job in spec["jobs"]:
        if "bad" in job:
            tokens[job["name"]], errors[job["name"]] = _with_bad_requests(llm, job)
        else:
            tokens[job["name"]] = _generate(llm, job)
    counters = {m.name: m.value for m in llm.get_metrics() if type(m).__name__ == "Counter"}
    with open(result_path, "w") as f:
        json.dump({"tokens": tokens, "errors": errors, "counters": counters, "draft_fetches": len(fetches)}, f)


if __name__ == "__main__":  # vLLM starts its workers with spawn: they re-import this module
    main(*sys.argv[1:])
