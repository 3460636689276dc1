"""Tree speculative decoding inside vLLM 0.32: ``tree_speculative_config`` turns it on.

vLLM verifies drafts as chains. Here a draft is a tree, and four things change, each at one place:

1. **Proposal** (vLLM's public ``custom_class`` proposer): ``TreeProposer`` asks a treeattn
   ``Drafter`` (the n-gram tree drafter by default) for a tree per request, within the node budget
   vLLM's scheduler reserved (``num_speculative_tokens`` = nodes - 1). The tree's nodes after the
   root become the request's draft tokens, parents before children, so any prefix vLLM's scheduler
   keeps is still a tree.
2. **Positions and attention**: the request's new tokens are the root (the last sampled token) and
   the draft nodes. Each token still gets its own KV slot (vLLM's linear slot mapping), but its
   RoPE position becomes its tree position ``seq_len + depth``, and treeattn's attention backend
   (``TREEATTN_VLLM=1``) lets it see the cached prefix plus its own ancestors (``batch.step_plan``).
3. **Verification**: greedy (the target's argmax down the tree: exactly vLLM's greedy output) or
   sampling (SpecInfer's lossless multi-draft rule, ``treeattn.speculative.verify``), per request.
4. **Commit**: the accepted path's K/V are copied into the slots that follow the prefix, so the
   next step sees a plain sequence; rejected nodes sit past the sequence's end, where vLLM writes
   next. vLLM's own bookkeeping then counts drafts and accepted tokens into its speculative
   metrics (``LLM.get_metrics()``).

Requests whose sampling depends on the tokens before each position (penalties, bad words, logit
bias, allowed tokens, min tokens, min-p, structured output) get no drafts and are sampled by vLLM's
own sampler, so their output is unchanged.

Points 2-4 have no extension point in vLLM 0.32: ``TreeProposer`` wraps three methods of vLLM's
``GPUModelRunner`` (which its CPU runner inherits), ``_prepare_inputs``, ``propose_draft_token_ids``
and ``_sample``, when the first ``TreeProposer`` is built; the wrappers act only for a runner whose
drafter is a ``TreeProposer``. They are pinned to vLLM ``0.32.0`` (``VLLM_VERSION``).
"""

from __future__ import annotations

import base64
import functools
import os
import pickle
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..speculative import Drafter, DraftTree, NGramDrafter, SamplingParams, verify_greedy, verify_sampling
from ..speculative.adaptive import LearningDrafter, make_adaptive
from . import ENV_VAR, enabled
from .batch import move_tokens

__all__ = ["DRAFTER_ENV_VAR", "VLLM_VERSION", "TreeProposer", "plain_decoding_reason", "step_trees",
           "tree_speculative_config"]

VLLM_VERSION = "0.32.0"
DRAFTER_ENV_VAR = "TREEATTN_VLLM_DRAFTER"  # the pickled drafter, for vLLM's worker processes
_SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it is greedy


def tree_speculative_config(*, nodes: int = 16, drafter: Drafter | None = None, adaptive: bool = True) -> dict:
    """The ``speculative_config`` that makes ``vllm.LLM`` verify token trees (needs ``TREEATTN_VLLM=1``).

    ``nodes``: the most tree nodes per request and step, root included (vLLM reserves ``nodes - 1``
    draft slots per request). ``drafter``: any treeattn ``Drafter`` (default ``NGramDrafter(nodes)``);
    it must pickle, since it reaches vLLM's worker processes through the environment
    (``TREEATTN_VLLM_DRAFTER``), and a tree larger than ``nodes`` is cut to its first ``nodes``.
    With ``adaptive`` (the default) a drafter that scores its candidates (n-gram, suffix, heads) is
    wrapped in an ``AdaptiveDrafter``: each step verifies only the nodes expected to pay for their
    verification time on the running engine (learnt from its step times and what it accepted), and
    a request whose draft would not pay decodes plainly. A ``LearningDrafter`` (an
    ``AdaptiveDrafter`` you built) is told every step's emitted tokens and time.
    """
    if isinstance(nodes, bool) or not isinstance(nodes, (int, np.integer)) or nodes < 2:
        raise ValueError(f"nodes must be an integer >= 2 (the root and at least one draft), got {nodes!r}")
    drafter = NGramDrafter(int(nodes)) if drafter is None else drafter
    if not isinstance(drafter, Drafter):
        raise TypeError(f"drafter must be a treeattn Drafter (with propose(contexts)), got {type(drafter).__name__}")
    if adaptive:
        drafter = make_adaptive(drafter, max_nodes=int(nodes))
    try:
        os.environ[DRAFTER_ENV_VAR] = base64.b64encode(pickle.dumps(drafter)).decode()
    except Exception as exc:  # pickling can fail in many ways; all mean the same to the caller
        raise TypeError(f"drafter {drafter!r} must pickle to reach vLLM's workers: {exc}") from exc
    return {"method": "custom_class", "model": f"{__name__}.TreeProposer", "num_speculative_tokens": int(nodes) - 1}


def plain_decoding_reason(params) -> str | None:
    """Why a request with these vLLM ``SamplingParams`` must decode plainly, or None if trees can serve it.

    Tree verification compares each node with the target's choice *given that node's ancestors*;
    settings that make the choice depend on the emitted tokens before it would need the logits
    recomputed per path, so those requests get no drafts (vLLM samples them itself)."""
    checks = (("presence_penalty", params.presence_penalty != 0), ("frequency_penalty", params.frequency_penalty != 0),
              ("repetition_penalty", params.repetition_penalty != 1), ("bad_words", bool(params.bad_words)),
              ("logit_bias", bool(params.logit_bias)), ("allowed_token_ids", params.allowed_token_ids is not None),
              ("min_tokens", params.min_tokens > 0), ("min_p", params.min_p > 0),
              ("structured_outputs", params.structured_outputs is not None))
    reasons = [name for name, used in checks if used]
    return ", ".join(reasons) if reasons else None


# ---------------------------------------------------------------------------------------------- one step


@dataclass
class _Step:
    """What one verification step knows: the requests' trees in batch order and their rows."""

    trees: list[DraftTree | None]  # None: no drafts (prefill, decode, or plain decoding)
    query_start: np.ndarray  # int64 [B+1]: request b's rows are query_start[b]:query_start[b+1]
    slots: torch.Tensor  # vLLM's slot mapping of this step's rows

    def position_shift(self, total: int) -> np.ndarray:
        """Per row, linear position minus tree position (``index - depth``), 0 outside trees."""
        shift = np.zeros(total, dtype=np.int64)
        for b, tree in enumerate(self.trees):
            if tree is not None:
                shift[self.query_start[b]:self.query_start[b + 1]] = np.arange(tree.size) - tree.depth.numpy()
        return shift


_current: _Step | None = None


def step_trees(num_reqs: int) -> list[np.ndarray | None] | None:
    """The parent arrays of the running step's requests (for the attention builder), or None."""
    if _current is None:
        return None
    if len(_current.trees) != num_reqs:
        raise RuntimeError(f"the tree step has {len(_current.trees)} requests, the attention metadata {num_reqs}")
    return [None if t is None else t.parents for t in _current.trees]


class TreeProposer:
    """vLLM's ``custom_class`` proposer: a treeattn ``Drafter`` behind vLLM's ``propose`` contract."""

    def __init__(self, vllm_config) -> None:
        import vllm

        if vllm.__version__ != VLLM_VERSION:
            raise RuntimeError(f"treeattn's tree speculation hooks are written for vLLM {VLLM_VERSION}, "
                               f"this is {vllm.__version__}")
        if not enabled():
            raise RuntimeError(f"tree speculation needs treeattn's attention (tree masks): set {ENV_VAR}=1")
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise NotImplementedError("tree speculation does not support pipeline parallelism")
        encoded = os.environ.get(DRAFTER_ENV_VAR)
        if not encoded:
            raise RuntimeError(f"{DRAFTER_ENV_VAR} is not set: build the speculative_config with "
                               "treeattn.vllm.speculative.tree_speculative_config(...)")
        self._setup(pickle.loads(base64.b64decode(encoded)), vllm_config.speculative_config.num_speculative_tokens + 1)
        _install_runner_hooks()

    def _setup(self, drafter: Drafter, nodes: int) -> None:
        self.drafter, self.nodes = drafter, nodes
        self.trees: dict[str, DraftTree] = {}  # each request's last proposal, by request id
        self._rows: list[tuple[str, bool]] | None = None  # (request id, decodes plainly) of the batch
        # A learning drafter hears, at the next proposal, what its last one gave: the tokens each of
        # its requests emitted and the time since (the engine step that verified it).
        self._learner = drafter if isinstance(drafter, LearningDrafter) else None
        self._proposed: list[str] = []  # request ids of the last proposal, in the drafter's order
        self._proposed_at = 0.0

    def load_model(self, target_model) -> None:
        """vLLM's CPU runner hands every drafter the target model; treeattn's drafters need none."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray,
                slot_mappings=None) -> list[list[int]]:
        """Draft tokens per batch row (nodes after the root, parents first); remembers each tree."""
        if self._rows is None or len(self._rows) < len(sampled_token_ids):
            raise RuntimeError("TreeProposer.propose ran outside vLLM's runner hooks")
        if self._learner is not None and self._proposed:
            emitted = {self._rows[i][0]: list(sampled) for i, sampled in enumerate(sampled_token_ids)}
            self._learner.observe([emitted.get(r, []) for r in self._proposed], time.perf_counter() - self._proposed_at)
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        rows = [i for i, sampled in enumerate(sampled_token_ids) if sampled and not self._rows[i][1]]
        contexts = [token_ids_cpu[i, : int(num_tokens_no_spec[i])] for i in rows]
        for i, tree in zip(rows, self.drafter.propose(contexts) if rows else []):
            tree = _first_nodes(tree, self.nodes)
            self.trees[self._rows[i][0]] = tree
            drafts[i] = tree.tokens[1:].tolist()
        self._proposed, self._proposed_at = [self._rows[i][0] for i in rows], time.perf_counter()
        self._rows = None
        return drafts

    def begin_step(self, req_ids: list[str], scheduled_drafts: dict[str, list[int]], num_scheduled: np.ndarray,
                   slots: torch.Tensor) -> _Step | None:
        """The trees of this step's requests: what was proposed, cut to what vLLM scheduled."""
        trees: list[DraftTree | None] = []
        for b, req_id in enumerate(req_ids):
            drafts = scheduled_drafts.get(req_id, [])
            tree = self.trees.pop(req_id, None)
            if not drafts:
                trees.append(None)
                continue
            if num_scheduled[b] != len(drafts) + 1:
                raise RuntimeError(f"request {req_id}: {num_scheduled[b]} tokens scheduled with {len(drafts)} drafts; "
                                   "tree speculation expects the root and its drafts")
            if tree is not None and tree.tokens[1:len(drafts) + 1].tolist() == drafts:
                trees.append(_first_nodes(tree, len(drafts) + 1))
            else:  # drafts not from this proposer (vLLM replaced them): verify them as the chain they are
                trees.append(DraftTree([0, *drafts], np.arange(-1, len(drafts))))
        if all(t is None for t in trees):
            return None
        query_start = np.concatenate([[0], np.cumsum(num_scheduled[: len(req_ids)])]).astype(np.int64)
        return _Step(trees, query_start, slots)


def _first_nodes(tree: DraftTree, n: int) -> DraftTree:
    """The tree's first ``n`` nodes (a tree, since parents come first)."""
    return tree if tree.size <= n else DraftTree(tree.tokens[:n], tree.parents[:n])


# ---------------------------------------------------------------------------------------------- verification


def _verify(step: _Step, runner, logits: torch.Tensor, metadata):
    """Tree verification of one step into vLLM's ``SamplerOutput`` layout; returns it and each request's path."""
    from vllm.v1.outputs import SamplerOutput
    from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID

    batch = runner.input_batch
    sampling = batch.sampling_metadata
    starts = (metadata.cu_num_sampled_tokens.cpu().numpy() - np.asarray(metadata.num_draft_tokens) - 1).tolist()
    trees = [t if t is not None else DraftTree([0], [-1]) for t in step.trees]
    params = [runner.requests[r].sampling_params for r in batch.req_ids[: len(trees)]]

    paths: list[list[int]] = [[0]] * len(trees)
    tokens: list[list[int] | None] = [None] * len(trees)
    trees_serve = [plain_decoding_reason(p) is None for p in params]
    greedy = [b for b, p in enumerate(params) if p.temperature < _SAMPLING_EPS and trees_serve[b]]
    if greedy:
        rows = torch.cat([torch.arange(starts[b], starts[b] + trees[b].size) for b in greedy]).to(logits.device)
        result = verify_greedy([trees[b] for b in greedy], logits[rows].float())
        for b, path, emitted in zip(greedy, result.paths, result.tokens):
            paths[b], tokens[b] = path, emitted
    for b, p in enumerate(params):
        if tokens[b] is None and trees_serve[b]:
            top_k = p.top_k if p.top_k > 0 else 0
            result = verify_sampling([trees[b]], logits[starts[b]:starts[b] + trees[b].size].float(),
                                     SamplingParams(p.temperature, top_k, p.top_p), sampling.generators.get(b))
            paths[b], tokens[b] = result.paths[0], result.tokens[0]
    plain = [b for b, t in enumerate(tokens) if t is None]
    if plain:  # vLLM's own sampler, one row per request (the root: these requests have no drafts)
        rows = torch.tensor([starts[b] for b in range(len(trees))], device=logits.device)
        sampled = runner.sampler(logits=logits[rows], sampling_metadata=sampling, predict_bonus_token=True)
        for b in plain:
            tokens[b] = [int(sampled.sampled_token_ids[b, 0])]

    width = metadata.max_spec_len + 1
    out = torch.full((len(trees), width), PLACEHOLDER_TOKEN_ID, dtype=torch.int32)
    for b, emitted in enumerate(tokens):
        out[b, : len(emitted)] = torch.tensor(emitted, dtype=torch.int32)
    out = out.to(logits.device)
    logprobs = None
    if sampling.max_num_logprobs is not None:  # raw logprobs of each emitted token, at the row that chose it
        rows = torch.tensor([starts[b] + (paths[b][d] if d < len(paths[b]) else paths[b][-1])
                             for b in range(len(trees)) for d in range(width)], device=logits.device)
        emitted = out.flatten().long().clamp(min=0)
        logprobs = runner.sampler.gather_logprobs(runner.sampler.compute_logprobs(logits[rows].float()),
                                                  sampling.max_num_logprobs, emitted)
    return SamplerOutput(sampled_token_ids=out, logprobs_tensors=logprobs), paths


def _commit(step: _Step, paths: list[list[int]], kv_caches: list[torch.Tensor]) -> None:
    """Copy each accepted path's K/V to the slots right after the prefix (node at depth d -> row d)."""
    src, dst = [], []
    for b, path in enumerate(paths):
        for depth, node in enumerate(path):
            if node != depth:
                src.append(step.query_start[b] + node)
                dst.append(step.query_start[b] + depth)
    if not src:
        return
    src_slots, dst_slots = step.slots[torch.tensor(src)], step.slots[torch.tensor(dst)]
    seen = set()
    for cache in kv_caches:  # layers that share a cache appear more than once: move each cache once
        if cache.data_ptr() not in seen:
            seen.add(cache.data_ptr())
            move_tokens(cache, src_slots.to(cache.device), dst_slots.to(cache.device))


# ---------------------------------------------------------------------------------------------- vLLM hooks


def _install_runner_hooks() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, "_treeattn_hooks", False):
        return
    prepare, propose, sample = (GPUModelRunner._prepare_inputs, GPUModelRunner.propose_draft_token_ids,
                                GPUModelRunner._sample)

    @functools.wraps(prepare)
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        global _current
        result = prepare(self, scheduler_output, num_scheduled_tokens)
        _current = None
        if isinstance(getattr(self, "drafter", None), TreeProposer):
            if len(self.input_batch.block_table.block_tables) != 1:
                raise NotImplementedError("tree speculation supports models with one KV cache group")
            total = scheduler_output.total_num_scheduled_tokens
            slots = self.input_batch.block_table.block_tables[0].slot_mapping.gpu[:total].clone()
            num_reqs = self.input_batch.num_reqs
            _current = self.drafter.begin_step(self.input_batch.req_ids[:num_reqs],
                                               scheduler_output.scheduled_spec_decode_tokens,
                                               np.asarray(num_scheduled_tokens), slots)
            if _current is not None:  # RoPE at tree positions; slots (already mapped) stay linear
                shift = torch.from_numpy(_current.position_shift(total))
                self.positions[:total] -= shift.to(self.positions.device, self.positions.dtype)
        return result

    @functools.wraps(propose)
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        if isinstance(getattr(self, "drafter", None), TreeProposer):
            req_ids = self.input_batch.req_ids
            self.drafter._rows = [(r, plain_decoding_reason(self.requests[r].sampling_params) is not None)
                                  for r in req_ids]
            for r in scheduler_output.finished_req_ids:
                self.drafter.trees.pop(r, None)
        return propose(self, scheduler_output, sampled_token_ids, *args, **kwargs)

    @functools.wraps(sample)
    def _sample(self, logits, spec_decode_metadata):
        global _current
        step, _current = _current, None
        if step is None or spec_decode_metadata is None or not isinstance(getattr(self, "drafter", None), TreeProposer):
            return sample(self, logits, spec_decode_metadata)
        self.input_batch.update_async_output_token_ids()
        output, paths = _verify(step, self, logits, spec_decode_metadata)
        _commit(step, paths, self.kv_caches)
        return output

    GPUModelRunner._prepare_inputs = _prepare_inputs
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    GPUModelRunner._sample = _sample
    GPUModelRunner._treeattn_hooks = True
