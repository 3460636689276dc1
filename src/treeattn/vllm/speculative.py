"""Tree speculative decoding inside vLLM 0.32: ``tree_speculative_config`` turns it on.

vLLM verifies drafts as chains. Here a draft is a tree, and four things change, each at one place:

1. **Proposal** (vLLM's public ``custom_class`` proposer): ``TreeProposer`` asks a treeattn
   ``Drafter`` (the n-gram tree drafter by default; ``auto`` adds the trained draft head) for a tree
   per request, within the node budget vLLM's scheduler reserved (``num_speculative_tokens`` =
   nodes - 1), giving it each request's final hidden state (the row that chose its last token: a
   draft head's input). The tree's nodes after the root become the request's draft tokens, parents
   before children, so any prefix vLLM's scheduler keeps is still a tree. A drafter that reads the
   target's embeddings and LM head is built in vLLM's worker, where ``load_model`` hands them over.
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
5. **Target features** for a drafter that reads them per position (``target_features``: a published
   EAGLE-3 head's aux layers, EAGLE-1/2's final hidden states): the model returns its aux hidden
   states (vLLM's EAGLE-3 interface, ``SupportsEagle3``; vLLM's aux layer ``i`` is the input of
   decoder layer ``i``, treeattn's boundary ``i``), and every computed position's features are kept
   per request (a prefill's rows, a tree's accepted path) in a ``FeatureHistory`` the drafter reads
   as ``TargetFeatures``. A prompt found in vLLM's prefix cache has no features for its cached
   tokens: the history starts after them, and the head attends to the positions it has.

**Configuration is plain data.** vLLM's ``--speculative-config`` names the proposer and the node
budget (``{"method": "custom_class", "model": "treeattn.vllm.speculative.TreeProposer",
"num_speculative_tokens": 15}``: 16 nodes). The drafter's options cannot go in that JSON: vLLM
0.32's ``SpeculativeConfig`` refuses unknown keys (pydantic ``extra="forbid"``), and its free-form
string fields mean something else (``model`` is the proposer's import path, ``quantization`` and
``revision`` describe a draft model's weights). So the options (``drafter``, ``heads``,
``draft_head``, ``adaptive``) travel as JSON in vLLM's own ``--additional-config '{"treeattn": {...}}'`` (command
line or ``--config`` file; vLLM hands it to the proposer inside ``VllmConfig``) or in
``TREEATTN_VLLM_TREES`` (what ``tree_speculative_config`` sets for ``vllm.LLM``). Without either:
the adaptive n-gram drafter. Only a drafter *object* (Python) travels pickled, in
``TREEATTN_VLLM_DRAFTER``. A bad value stops the engine at start, the error naming the field.

Requests whose sampling depends on the tokens before each position (penalties, bad words, logit
bias, allowed tokens, min tokens, min-p, structured output) get no drafts and are sampled by vLLM's
own sampler, so their output is unchanged. (vLLM refuses min-p and logit bias under any speculation,
as its rejection sampler cannot apply them; with trees they are accepted and served plainly.)

Points 2-5 have no extension point in vLLM 0.32: ``TreeProposer`` wraps five methods of vLLM's
``GPUModelRunner`` (which its CPU runner inherits), ``_prepare_inputs``, ``propose_draft_token_ids``,
``_sample``, ``sample_tokens`` (the drafts go back to the engine core with the step's output) and
``_setup_eagle3_aux_hidden_state_outputs``, when the first ``TreeProposer`` is built; the wrappers act
only for a runner whose drafter is a ``TreeProposer``. The engine core takes those drafts without
another call into the worker (``install_engine_hooks``: ``Scheduler.update_from_output`` and
``EngineCore.post_step``). All are pinned to vLLM ``0.32.0`` (``VLLM_VERSION``).
"""

from __future__ import annotations

import atexit
import base64
import functools
import json
import logging
import os
import pickle
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..speculative import Drafter, DraftTree, SamplingParams, verify_greedy, verify_sampling
from ..speculative.adaptive import AdaptiveDrafter, LearningDrafter, StepGate, make_adaptive
from ..speculative.choice import DRAFTERS, build_drafter, head_paths, load_for_target
from ..speculative.features import FINAL, FeatureHistory, check_feature_layers, wanted_features
from ..speculative.heads import VocabWeights
from . import ENV_VAR, enabled

__all__ = ["ADDITIONAL_CONFIG_KEY", "DRAFTER_ENV_VAR", "PROPOSER", "TREES_ENV_VAR", "VLLM_VERSION", "DrafterByName",
           "TreeOptions", "TreeProposer", "configured_drafter", "install_sampling_params_hook", "plain_decoding_reason",
           "step_trees", "tree_options", "tree_speculative_config"]

VLLM_VERSION = "0.32.0"
# The pickled drafter for vLLM's worker processes: base64 inline, or "file:PATH" for a large one (a
# local file: workers on other machines, e.g. a Ray cluster, cannot read it).
DRAFTER_ENV_VAR = "TREEATTN_VLLM_DRAFTER"
PROPOSER = f"{__name__}.TreeProposer"  # what --speculative-config's "model" names
# The drafter's options as JSON (``TreeOptions``' fields), for a server's environment or vllm.LLM.
TREES_ENV_VAR = "TREEATTN_VLLM_TREES"
# The same options under this key of vLLM's ``additional_config`` (``--additional-config``, config files).
ADDITIONAL_CONFIG_KEY = "treeattn"
_SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it is greedy
logger = logging.getLogger("vllm.treeattn")  # under vLLM's logger: its handlers print it


def tree_speculative_config(*, nodes: int = 16, drafter: Drafter | str = "ngram", heads: str | Path | None = None,
                            draft_head: str | Path | None = None, adaptive: bool = True) -> dict:
    """The ``speculative_config`` that makes ``vllm.LLM`` verify token trees (needs ``TREEATTN_VLLM=1``).

    ``nodes``: the most tree nodes per request and step, root included (vLLM reserves ``nodes - 1``
    draft slots per request). ``drafter``: a name, as ``treeattn demo --drafter`` takes it: ``ngram``
    (the default), ``suffix``, ``heads`` (treeattn's draft head: ``heads``, a head file or an EAGLE-3
    folder from ``treeattn train-heads``, else SmolLM2's default, ``find_heads()``; it reads the
    target's hidden states, or an EAGLE-3 head its aux-layer states, and its embeddings and LM head
    inside vLLM's worker, and is checked to fit their sizes and depth, not the model's name) or
    ``auto`` (suffix + head); ``draft_head``:
    a published EAGLE-3, EAGLE-1/2 or Medusa checkpoint (``load_draft_head``) that drafts for ``heads``
    or ``auto`` in place of treeattn's head, fed vLLM's hidden states of the layers it reads; or any
    treeattn ``Drafter`` object, which must pickle (it reaches vLLM's worker processes through
    ``TREEATTN_VLLM_DRAFTER``); an object with ``bind(weights) -> Drafter`` is bound there to the
    target's ``(embeddings, lm_head)`` weights first, and used as ``bind`` returns it (``adaptive``
    does not apply). A tree larger than ``nodes`` is cut to its first ``nodes``. Every drafter is
    given each request's final hidden state (the row that chose its last token). With ``adaptive``
    (the default) a drafter that scores its candidates (n-gram, suffix, head) is wrapped in an
    ``AdaptiveDrafter``: each step verifies only the nodes expected to pay for their verification time
    on the running engine (learnt from its step times and what it accepted), and a request whose
    draft would not pay decodes plainly. A ``LearningDrafter`` (an ``AdaptiveDrafter`` you built) is
    told every step's emitted tokens and time (None for a step that also prefilled other requests:
    the engine needs one step of decodes alone before a tree is verified).

    A drafter by name travels as JSON in ``TREEATTN_VLLM_TREES`` (set here); a server takes the same
    JSON there or in ``--additional-config '{"treeattn": {...}}'`` (see the module docstring).
    """
    if isinstance(nodes, bool) or not isinstance(nodes, (int, np.integer)) or nodes < 2:
        raise ValueError(f"nodes must be an integer >= 2 (the root and at least one draft), got {nodes!r}")
    if isinstance(drafter, str):
        options = tree_options({"drafter": drafter, "heads": None if heads is None else str(heads),
                                "draft_head": None if draft_head is None else str(draft_head), "adaptive": adaptive})
        options.drafter_for(int(nodes))  # a missing head file, or one that fails to load, fails here
        os.environ.pop(DRAFTER_ENV_VAR, None)
        os.environ[TREES_ENV_VAR] = json.dumps(options.__dict__)
    else:
        if heads is not None or draft_head is not None:
            raise ValueError(f"{'heads' if heads is not None else 'draft_head'} goes with drafter 'heads' or 'auto', "
                             f"not {drafter!r}")
        if callable(getattr(drafter, "bind", None)):
            pass  # bound to the target's weights in the worker, used as bind returns it
        elif not isinstance(drafter, Drafter):
            raise TypeError(f"drafter must be a drafter name ({', '.join(DRAFTERS)}), a treeattn Drafter (with "
                            f"propose(contexts, hidden=None)) or an object with bind(weights), got "
                            f"{type(drafter).__name__}")
        elif adaptive:
            drafter = make_adaptive(drafter, max_nodes=int(nodes))
        shared = _share(drafter)
        os.environ.pop(TREES_ENV_VAR, None)
        os.environ[DRAFTER_ENV_VAR] = shared
    return {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": int(nodes) - 1}


@dataclass(frozen=True)
class TreeOptions:
    """A drafter by name and its options: what ``--additional-config '{"treeattn": ...}'`` and
    ``TREEATTN_VLLM_TREES`` hold (the node budget is vLLM's ``num_speculative_tokens`` + 1)."""

    drafter: str = "ngram"
    heads: str | None = None
    draft_head: str | None = None  # a published checkpoint (folder or file) in place of treeattn's head
    adaptive: bool = True

    def drafter_for(self, nodes: int):
        """The drafter for trees of ``nodes`` nodes; one that reads the target's weights as a ``DrafterByName``."""
        if self.draft_head is not None:  # loaded where the target is (vLLM's worker), which it is checked against
            if not Path(self.draft_head).exists():
                raise ValueError(f"draft_head: no such checkpoint folder or file {self.draft_head}")
            return DrafterByName(self.drafter, nodes, draft_head=self.draft_head, full_trees=not self.adaptive)
        if self.drafter in ("heads", "auto"):  # built where the target's weights are: vLLM's worker
            head_paths(self.drafter, None if self.heads is None else Path(self.heads))  # none at all fails here
            return DrafterByName(self.drafter, nodes, self.heads, full_trees=not self.adaptive)
        return build_drafter(self.drafter, None, nodes, full_trees=not self.adaptive)[0]


def tree_options(value, where: str = "") -> TreeOptions:
    """``value`` (a dict, or its JSON) checked as ``TreeOptions``; ``ValueError`` names the field,
    prefixed by ``where`` (where the value came from)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc}): {value!r}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{where}: must be a JSON object with drafter, heads, draft_head, adaptive, got {value!r}")
    prefix = f"{where}." if where else ""
    unknown = sorted(set(value) - set(TreeOptions.__dataclass_fields__))
    if unknown:
        raise ValueError(f"{prefix}{unknown[0]}: unknown field; the fields are drafter, heads, draft_head, adaptive (the node "
                         "budget is the speculative config's num_speculative_tokens + 1)")
    options = TreeOptions(**value)
    if options.drafter not in DRAFTERS:
        raise ValueError(f"{prefix}drafter must be one of {', '.join(DRAFTERS)}, got {options.drafter!r}")
    if options.heads is not None and not isinstance(options.heads, str):
        raise ValueError(f"{prefix}heads must be a head file or EAGLE-3 folder path, or null, got {options.heads!r}")
    if options.draft_head is not None and not isinstance(options.draft_head, str):
        raise ValueError(f"{prefix}draft_head must be a checkpoint path or null, got {options.draft_head!r}")
    if not isinstance(options.adaptive, bool):
        raise ValueError(f"{prefix}adaptive must be true or false, got {options.adaptive!r}")
    for field in ("heads", "draft_head"):
        if getattr(options, field) is not None and options.drafter not in ("heads", "auto"):
            raise ValueError(f"{prefix}{field} goes with drafter 'heads' or 'auto', not {options.drafter!r}")
    if options.heads is not None and options.draft_head is not None:
        raise ValueError(f"{prefix}draft_head drafts in place of a treeattn heads file: give heads or draft_head")
    if options.drafter == "auto" and not options.adaptive:
        raise ValueError(f"{prefix}adaptive=False verifies one drafter's whole trees: pick drafter ngram, suffix or "
                         "heads, not auto")
    return options


def configured_drafter(additional_config, nodes: int):
    """The drafter a ``TreeProposer`` runs: a pickled object (``TREEATTN_VLLM_DRAFTER``), or by name from
    ``additional_config["treeattn"]`` or ``TREEATTN_VLLM_TREES``, else the adaptive n-gram drafter.
    Given twice is an error: which one was meant?"""
    given = {}
    if isinstance(additional_config, dict) and ADDITIONAL_CONFIG_KEY in additional_config:
        given[f"additional_config.{ADDITIONAL_CONFIG_KEY}"] = additional_config[ADDITIONAL_CONFIG_KEY]
    for var in (TREES_ENV_VAR, DRAFTER_ENV_VAR):
        if os.environ.get(var):
            given[var] = os.environ[var]
    if len(given) > 1:
        raise ValueError(f"tree speculation is configured twice ({' and '.join(given)}): give one")
    if DRAFTER_ENV_VAR in given:
        return _unshare(given[DRAFTER_ENV_VAR])
    where, value = next(iter(given.items()), ("", {}))
    return tree_options(value, where).drafter_for(nodes)


@dataclass(frozen=True)
class DrafterByName:
    """A drafter chosen by name, built in vLLM's worker once the target's weights are there."""

    kind: str
    nodes: int
    heads: str | None = None
    full_trees: bool = False
    draft_head: str | None = None

    def bind(self, weights: VocabWeights, *, num_layers: int | None = None) -> Drafter:
        """The drafter for a target with these ``(embeddings, lm_head)`` and ``num_layers`` decoder layers
        (what a published head is checked against: its aux layers must lie within them)."""
        published = None
        if self.draft_head is not None:
            if num_layers is None:
                raise ValueError("a published draft head is checked against its target: give num_layers")
            try:
                published = load_for_target(self.draft_head, weights, num_layers)
            except (OSError, ValueError) as exc:
                raise ValueError(f"draft_head {self.draft_head}: {exc}") from exc
        drafter, described = build_drafter(self.kind, None if published is not None else weights, self.nodes,
                                           full_trees=self.full_trees, draft_head=published,
                                           heads=None if self.heads is None else Path(self.heads), num_layers=num_layers)
        logger.info("treeattn tree speculation: %s", described)
        return drafter


def _vocab_weights(model, vllm_config) -> VocabWeights:
    """The target's ``(embeddings, lm_head)`` weights, ``[vocab, hidden]`` each, whole on every
    tensor-parallel rank (vLLM splits them by vocabulary rows: the ranks gather them once, at load)."""
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    weights = [getattr(embed, "weight", None), getattr(head, "weight", None)]
    if not all(isinstance(w, torch.Tensor) and w.dim() == 2 for w in weights):
        raise NotImplementedError(f"this drafter reads the target's embeddings and LM head, and {type(model).__name__} "
                                  "has no model.embed_tokens.weight and lm_head.weight")
    if vllm_config.parallel_config.tensor_parallel_size > 1:
        from vllm.distributed import tensor_model_parallel_all_gather

        tied = weights[0] is weights[1]
        weights = [tensor_model_parallel_all_gather(w.detach(), dim=0) for w in weights[: 2 - tied]]
        weights = weights * 2 if tied else weights
    vocab = vllm_config.model_config.get_vocab_size()  # vLLM pads the rows past it
    return weights[0].detach()[:vocab], weights[1].detach()[:vocab]


_ENV_LIMIT = 64 * 1024  # Linux refuses an environment string over 128 KiB when it starts vLLM's processes


def _share(drafter) -> str:
    """``drafter`` pickled for vLLM's workers: inline, or in a file (removed when this process exits)."""
    try:
        blob = pickle.dumps(drafter)
    except Exception as exc:  # pickling can fail in many ways; all mean the same to the caller
        raise TypeError(f"drafter {drafter!r} must pickle to reach vLLM's workers: {exc}") from exc
    if len(blob) <= _ENV_LIMIT:
        return base64.b64encode(blob).decode()
    fd, path = tempfile.mkstemp(prefix="treeattn-drafter-", suffix=".pkl")
    with os.fdopen(fd, "wb") as f:
        f.write(blob)
    atexit.register(lambda: Path(path).unlink(missing_ok=True))
    return "file:" + path


def _unshare(value: str):
    if value.startswith("file:"):
        return pickle.loads(Path(value[5:]).read_bytes())
    return pickle.loads(base64.b64decode(value))


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
        nodes = vllm_config.speculative_config.num_speculative_tokens + 1
        drafter = configured_drafter(vllm_config.additional_config, nodes)
        self._config = vllm_config
        # A drafter that reads the target's weights is bound to them in load_model.
        self._binding = drafter if callable(getattr(drafter, "bind", None)) else None
        self._setup(drafter, nodes)
        _install_runner_hooks()
        _install_logitsprocs_hook()

    def _setup(self, drafter: Drafter, nodes: int) -> None:
        if isinstance(drafter, AdaptiveDrafter) and drafter.gate is None:
            # An engine step is shared by the batch: whether drafting pays at all is measured per
            # batch size (at concurrency trees can cost more than they return; alone they win).
            drafter.gate = StepGate()
        self.drafter, self.nodes = drafter, nodes
        self._hidden_rows: np.ndarray | None = None  # per request, the step's row of its last token
        self._hidden: torch.Tensor | None = None  # the final hidden states at those rows
        self.trees: dict[str, DraftTree] = {}  # each request's last proposal, by request id
        self._rows: list[tuple[str, bool]] | None = None  # (request id, decodes plainly) of the batch
        # A learning drafter hears, at the next proposal, what its last one gave: the tokens each of
        # its requests emitted and the time of the engine step that verified it, from the runner's
        # start of that step (not from the proposal: the engine may have idled between requests).
        self._learner = drafter if isinstance(drafter, LearningDrafter) else None
        self._proposed: list[str] = []  # request ids of the last proposal, in the drafter's order
        self._drafting = 0.0  # seconds the last proposal took: part of what its step cost
        self._step_started: float | None = None  # None: the step also prefilled, its time says nothing of trees
        self._awaiting_proposal = False  # set by each step, cleared by propose: vLLM may skip proposing
        # A drafter that reads per-position target features (an EAGLE head) gets each request's history
        # of them: vLLM's aux hidden states of its layers (``FINAL``: the final hidden states), at the
        # rows of every computed position (all prefill rows; a tree's accepted path).
        layers = wanted_features(drafter)
        self.features = None if layers is None else FeatureHistory(layers)
        self._feature_rows: list[np.ndarray] | None = None  # per request, this step's rows that stay
        self._positions: np.ndarray | None = None  # per request, the position of its first row

    def load_model(self, target_model) -> None:
        """vLLM's runner hands every drafter the target model: a drafter that reads its weights binds here."""
        if self._binding is None:
            return
        weights = _vocab_weights(target_model, self._config)
        if isinstance(self._binding, DrafterByName):
            drafter = self._binding.bind(weights, num_layers=self._config.model_config.hf_text_config.num_hidden_layers)
        else:
            drafter = self._binding.bind(weights)
        if not isinstance(drafter, Drafter):
            raise TypeError(f"{self._binding!r}.bind returned {type(drafter).__name__}, not a treeattn Drafter")
        self._setup(drafter, self.nodes)

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray,
                slot_mappings=None) -> list[list[int]]:
        """Draft tokens per batch row (nodes after the root, parents first); remembers each tree."""
        if self._rows is None or len(self._rows) < len(sampled_token_ids):
            raise RuntimeError("TreeProposer.propose ran outside vLLM's runner hooks")
        if self._learner is not None and self._proposed:
            emitted = {self._rows[i][0]: list(sampled) for i, sampled in enumerate(sampled_token_ids)}
            seconds = None if self._step_started is None else time.perf_counter() - self._step_started + self._drafting
            self._learner.observe([emitted.get(r, []) for r in self._proposed], seconds)
        started = time.perf_counter()
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        rows = [i for i, sampled in enumerate(sampled_token_ids) if sampled and not self._rows[i][1]]
        if self.features is not None:  # a request whose history lacks a step (vLLM did not propose then) waits
            rows = [i for i in rows if self.features.end(self._rows[i][0]) == int(num_tokens_no_spec[i]) - 1]
        contexts = [token_ids_cpu[i, : int(num_tokens_no_spec[i])] for i in rows]
        if self.features is not None:
            hidden = self.features.features([self._rows[i][0] for i in rows])
        else:
            hidden = None if self._hidden is None else self._hidden[rows]
        for i, tree in zip(rows, self.drafter.propose(contexts, hidden=hidden) if rows else []):
            tree = _first_nodes(tree, self.nodes)
            self.trees[self._rows[i][0]] = tree
            drafts[i] = tree.tokens[1:].tolist()
        self._proposed, self._drafting = [self._rows[i][0] for i in rows], time.perf_counter() - started
        self._rows, self._hidden, self._step_started, self._awaiting_proposal = None, None, None, False
        return drafts

    def ask_target(self, runner) -> None:
        """Make vLLM's model return the hidden states of the feature layers the drafter reads (its aux
        hidden states, vLLM's EAGLE-3 interface, whose layer ``i`` is our boundary ``i``)."""
        if self.features is None:
            return
        from vllm.model_executor.models.interfaces import supports_eagle3

        model = runner.get_model()
        layers = check_feature_layers(self.features.layers, self._config.model_config.hf_text_config.num_hidden_layers)
        aux = tuple(sorted(layer for layer in layers if layer != FINAL))  # vLLM returns them in this order
        self._aux_index = {layer: aux.index(layer) for layer in aux}
        if not aux:
            return
        if not supports_eagle3(model):
            raise NotImplementedError(f"the drafter reads the target's hidden states at layers {list(aux)}, and vLLM's "
                                      f"{type(model).__name__} cannot return them (it does not implement SupportsEagle3)")
        model.set_aux_hidden_state_layers(aux)
        runner.use_aux_hidden_state_outputs = True

    def record_features(self, req_ids: list[str], hidden_states: torch.Tensor, aux_hidden_states) -> None:
        """Append this step's features to each request's history (before ``propose`` reads them)."""
        if self.features is None or self._feature_rows is None:
            return
        keep = [b for b, rows in enumerate(self._feature_rows) if rows.size and not self._rows[b][1]]
        if keep:
            index = torch.from_numpy(np.concatenate([self._feature_rows[b] for b in keep])).to(hidden_states.device)
            picked = torch.cat([hidden_states[index] if layer == FINAL else aux_hidden_states[self._aux_index[layer]][index]
                                for layer in self.features.layers], dim=-1)
            for b, rows in zip(keep, picked.split([self._feature_rows[b].size for b in keep])):
                self.features.write(req_ids[b], int(self._positions[b]), rows)
        self._feature_rows = self._positions = None

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


def _commit(step: _Step, paths: list[list[int]], layers) -> None:
    """Copy each accepted path's K/V to the slots right after the prefix (node at depth d -> row d), in
    every attention layer's cache, by the layer's backend (which owns the cache's layout)."""
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
    for layer in layers:
        cache = getattr(layer, "kv_cache", None)
        if not isinstance(cache, torch.Tensor) or cache.numel() == 0 or cache.data_ptr() in seen:
            continue  # layers that share a cache appear more than once: move each cache once
        if not hasattr(getattr(layer, "impl", None), "move_tokens"):
            raise RuntimeError(f"layer {getattr(layer, 'layer_name', layer)} keeps a KV cache but its attention is "
                               f"{type(getattr(layer, 'impl', None)).__name__}, not treeattn's: its tree tokens cannot be committed")
        seen.add(cache.data_ptr())
        layer.impl.move_tokens(cache, src_slots.to(cache.device), dst_slots.to(cache.device))


# ---------------------------------------------------------------------------------------------- vLLM hooks


def _is_trees(speculative_config) -> bool:
    return getattr(speculative_config, "method", None) == "custom_class" and speculative_config.model == PROPOSER


def install_sampling_params_hook() -> None:
    """Let min_p and logit_bias through with tree speculation (the plugin runs this in every vLLM process).

    vLLM refuses them whenever speculation is on, since its rejection sampler cannot apply them.
    Trees never draft for such requests (``plain_decoding_reason``): vLLM's own sampler decodes them,
    with the processors ``_install_logitsprocs_hook`` builds."""
    from vllm.sampling_params import SamplingParams

    validate = SamplingParams._validate_spec_decode
    if getattr(validate, "_treeattn", False):
        return

    @functools.wraps(validate)
    def _validate_spec_decode(self, speculative_config):
        if not _is_trees(speculative_config):
            validate(self, speculative_config)

    _validate_spec_decode._treeattn = True
    SamplingParams._validate_spec_decode = _validate_spec_decode


# The attribute of a step's ModelRunnerOutput that carries the drafts proposed after it (install_engine_hooks).
_DRAFTS = "_treeattn_drafts"
_UNSENT = object()


def install_engine_hooks() -> None:
    """Spare vLLM's engine core a round trip to its worker per step (the plugin runs this in every vLLM process).

    After each step the engine core asks the worker for the drafts proposed in it (``post_step``:
    ``take_draft_token_ids``), a second call into the worker process after the one that returned the
    step's output. On a 2-core CPU it took about 2 ms of a 30 ms decoding step, every step, drafting or
    not (the worker process has to be scheduled again). A worker with a ``TreeProposer`` sends the drafts
    with the step's output instead (``_install_runner_hooks``: ``sample_tokens``; an attribute, which
    pickling keeps where the worker is another process), and the engine core gives them to its scheduler
    as ``post_step`` would have. An output without them (another proposer, an empty step) leaves
    ``post_step`` as it is. Only a process that has loaded vLLM's engine core is hooked (vLLM's engine-core
    process and ``vllm.LLM``'s have, before they run the plugins; importing it would cost the others, the
    workers and vLLM's model inspection, seconds); an engine core not hooked fetches the drafts by the call."""
    core = sys.modules.get("vllm.v1.engine.core")
    if core is None:
        return
    from vllm.v1.core.sched.scheduler import Scheduler

    engine_core = core.EngineCore
    update, post_step = Scheduler.update_from_output, engine_core.post_step
    if getattr(post_step, "_treeattn", False):
        return

    @functools.wraps(update)
    def update_from_output(self, scheduler_output, model_runner_output):
        self._treeattn_drafts = getattr(model_runner_output, _DRAFTS, _UNSENT)
        return update(self, scheduler_output, model_runner_output)

    @functools.wraps(post_step)
    def _post_step(self, model_executed: bool) -> None:
        drafts = self.scheduler.__dict__.pop("_treeattn_drafts", _UNSENT)  # this step's: set by its update
        if drafts is _UNSENT or not (self.check_for_draft_tokens and not self.async_scheduling and model_executed):
            return post_step(self, model_executed)
        if drafts is not None:
            self.scheduler.update_draft_token_ids(drafts)

    _post_step._treeattn = True
    Scheduler.update_from_output = update_from_output
    engine_core.post_step = _post_step


def _install_logitsprocs_hook() -> None:
    """vLLM builds no min_p and logit_bias processors when speculation is on; with trees its sampler
    runs the requests that use them (plainly), so the runner gets the processors it has without speculation."""
    from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, LogitsProcessors
    from vllm.v1.worker import gpu_model_runner

    build = gpu_model_runner.build_logitsprocs
    if getattr(build, "_treeattn", False):
        return

    @functools.wraps(build)
    def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs=()):
        if is_pooling_model or custom_logitsprocs or not _is_trees(vllm_config.speculative_config):
            return build(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs)
        return LogitsProcessors(ctor(vllm_config, device, is_pin_memory) for ctor in BUILTIN_LOGITS_PROCESSORS)

    build_logitsprocs._treeattn = True
    gpu_model_runner.build_logitsprocs = build_logitsprocs


def _install_runner_hooks() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner, "_treeattn_hooks", False):
        return
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    prepare, propose, sample = (GPUModelRunner._prepare_inputs, GPUModelRunner.propose_draft_token_ids,
                                GPUModelRunner._sample)
    sample_tokens = GPUModelRunner.sample_tokens
    setup_aux = GPUModelRunner._setup_eagle3_aux_hidden_state_outputs

    @functools.wraps(prepare)
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        global _current
        started = time.perf_counter()
        result = prepare(self, scheduler_output, num_scheduled_tokens)
        _current = None
        if isinstance(getattr(self, "drafter", None), TreeProposer):
            if len(self.input_batch.block_table.block_tables) != 1:
                raise NotImplementedError("tree speculation supports models with one KV cache group")
            # What belongs to finished requests goes (vLLM has dropped them from self.requests by now;
            # a step that schedules nothing prepares nothing, so its finished requests go at the next).
            for r in [r for r in self.drafter.trees if r not in self.requests]:
                del self.drafter.trees[r]
            if self.drafter.features is not None:
                self.drafter.features.keep_only(self.requests)
            total = scheduler_output.total_num_scheduled_tokens
            slots = self.input_batch.block_table.block_tables[0].slot_mapping.gpu[:total].clone()
            num_reqs = self.input_batch.num_reqs
            # Each request's last row holds its final hidden state, unless tree verification says otherwise.
            scheduled = np.asarray(num_scheduled_tokens)[:num_reqs]
            self.drafter._hidden_rows = np.cumsum(scheduled) - 1
            if self.drafter.features is not None:  # every row's features stay, unless tree verification says otherwise
                ends = self.drafter._hidden_rows + 1
                self.drafter._feature_rows = [np.arange(end - n, end) for end, n in zip(ends, scheduled)]
                self.drafter._positions = self.input_batch.num_computed_tokens_cpu[:num_reqs].copy()
            drafts = scheduler_output.scheduled_spec_decode_tokens
            decode_only = all(n == 1 + len(drafts.get(r, ())) for r, n in zip(self.input_batch.req_ids, scheduled))
            self.drafter._step_started = started if decode_only else None
            if self.drafter._awaiting_proposal:  # the last step proposed nothing: this one verifies no proposal
                self.drafter._proposed = []
            self.drafter._awaiting_proposal = True
            _current = self.drafter.begin_step(self.input_batch.req_ids[:num_reqs],
                                               scheduler_output.scheduled_spec_decode_tokens,
                                               np.asarray(num_scheduled_tokens), slots)
            if _current is not None:  # RoPE at tree positions; slots (already mapped) stay linear
                shift = torch.from_numpy(_current.position_shift(total))
                self.positions[:total] -= shift.to(self.positions.device, self.positions.dtype)
        return result

    @functools.wraps(propose)
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, *args, **kwargs):
        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, TreeProposer):
            req_ids = self.input_batch.req_ids
            drafter._rows = [(r, plain_decoding_reason(self.requests[r].sampling_params) is not None)
                             for r in req_ids]
            drafter.record_features(req_ids, hidden_states, aux_hidden_states)
            if drafter._hidden_rows is not None:  # the state that chose each request's last token
                drafter._hidden = hidden_states[torch.from_numpy(drafter._hidden_rows).to(hidden_states.device)]
                drafter._hidden_rows = None
        return propose(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states, sample_hidden_states,
                       aux_hidden_states, *args, **kwargs)

    @functools.wraps(sample)
    def _sample(self, logits, spec_decode_metadata):
        global _current
        step, _current = _current, None
        if spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0:
            # No request drafted (a step the gate kept plain): vLLM would still run its rejection
            # sampler, ~1 ms of a 65 ms step here; its plain sampler gives the same tokens and shapes.
            spec_decode_metadata = None
        if step is None or spec_decode_metadata is None or not isinstance(getattr(self, "drafter", None), TreeProposer):
            return sample(self, logits, spec_decode_metadata)
        self.input_batch.update_async_output_token_ids()
        output, paths = _verify(step, self, logits, spec_decode_metadata)
        _commit(step, paths, self.compilation_config.static_forward_context.values())
        rows = self.drafter._hidden_rows  # the last accepted node's row chose the bonus token
        for b, (tree, path) in enumerate(zip(step.trees, paths)):
            if tree is not None:
                rows[b] = step.query_start[b] + path[-1]
                if self.drafter._feature_rows is not None:  # the accepted path's rows, root first
                    self.drafter._feature_rows[b] = step.query_start[b] + np.asarray(path)
        return output

    @functools.wraps(sample_tokens)
    def _sample_tokens(self, grammar_output):
        output = sample_tokens(self, grammar_output)
        if (isinstance(getattr(self, "drafter", None), TreeProposer) and isinstance(output, ModelRunnerOutput)
                and output is not EMPTY_MODEL_RUNNER_OUTPUT):  # (a shared instance: nothing may stick to it)
            setattr(output, _DRAFTS, self.take_draft_token_ids())  # see install_engine_hooks
        return output

    @functools.wraps(setup_aux)
    def _setup_eagle3_aux_hidden_state_outputs(self):
        if isinstance(getattr(self, "drafter", None), TreeProposer):
            self.drafter.ask_target(self)  # vLLM's own would pick an EAGLE-3 draft model's layers
        else:
            setup_aux(self)

    GPUModelRunner._prepare_inputs = _prepare_inputs
    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    GPUModelRunner._sample = _sample
    GPUModelRunner.sample_tokens = _sample_tokens
    GPUModelRunner._setup_eagle3_aux_hidden_state_outputs = _setup_eagle3_aux_hidden_state_outputs
    GPUModelRunner._treeattn_hooks = True
