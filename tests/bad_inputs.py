"""Mutation fuzzing of the public functions: every malformed input must get a clear error.

``python -m tests.bad_inputs`` runs every case in this one process and prints one JSON line per
case (the case's name before it runs, so a crash names its case). ``tests/test_bad_inputs.py``
runs it in a subprocess and checks each outcome: a ``ValueError``/``TypeError`` whose message
names the mutated argument (or an argument it is checked against), or a documented-valid result.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

import treeattn
from treeattn.testing import MIXED, make_batch

# Arguments whose checks name a partner: a mutation of the key may be reported under any of these.
PARTNERS = {
    "q": {"q", "k", "v", "kv_pages", "k_pages", "out"},
    "k": {"k", "v", "q"},
    "v": {"v", "k", "q"},
    "q_indptr": {"q_indptr", "kv_indptr", "tree_indptr", "page_indptr", "last_page_len", "q", "request"},
    "kv_indptr": {"kv_indptr", "q_indptr", "k", "request"},
    "tree_indptr": {"tree_indptr", "q_indptr", "tree_order", "request"},
    "tree_order": {"tree_order", "tree_indptr", "request"},
    "page_indptr": {"page_indptr", "q_indptr", "page_indices", "last_page_len", "request"},
    "page_indices": {"page_indices", "page_indptr", "kv_pages"},
    "last_page_len": {"last_page_len", "page_indptr", "request"},
    "kv_pages": {"kv_pages", "k_pages", "v_pages", "q"},
    "sm_scale": {"sm_scale"},
    "out": {"out"},
    "lse": {"lse"},
    "out_a": {"out_a", "out_b"},
    "out_b": {"out_b", "out_a"},
    "lse_a": {"lse_a"},
    "lse_b": {"lse_b"},
    "parents": {"parents", "trees"},
    "trees": {"trees"},
    "choices": {"choices"},
}


@dataclass
class Case:
    name: str
    argument: str
    call: Callable[[], object]
    valid: bool = False  # the mutation is documented-valid input: it must succeed


def _float_mutations(x: torch.Tensor) -> Iterator[tuple[str, object, bool]]:
    yield "float64", x.double(), False
    yield "int32", x.to(torch.int32), False
    yield "extra dim", x[None], False
    yield "missing dim", x[0] if x.dim() > 1 else x[:, None], False
    yield "strided last dim", x.repeat_interleave(2, dim=-1)[..., ::2], False
    yield "list", x.tolist(), False
    yield "numpy", x.numpy(), False
    yield "meta", x.to("meta"), False
    yield "None", None, False


def _index_mutations(x: torch.Tensor) -> Iterator[tuple[str, object, bool]]:
    yield "float", x.float(), False
    yield "bool", x.bool(), False
    yield "2-D", x[None], False
    yield "list", x.tolist(), True
    yield "numpy int64", x.numpy().astype(np.int64), True
    yield "int64 tensor", x.long(), True
    yield "numpy float", x.numpy().astype(np.float64), False
    yield "plus one", x + 1, False
    yield "minus one", x - 1, False
    yield "shorter", x[:-1], False
    yield "longer", torch.cat([x, x[-1:] + 1]), False
    yield "reversed", x.flip(0), False
    yield "huge", x.long() + 2**40, False
    yield "string", "0,1,2", False
    yield "None", None, False


def _scale_mutations() -> Iterator[tuple[str, object, bool]]:
    for value, valid in ((-1.0, False), (0.0, False), (float("nan"), False), (float("inf"), False), ("0.1", False),
                         (True, False), (np.float32(0.1), True), (np.int64(1), True), (torch.tensor(0.1), False)):
        yield repr(value), value, valid


def ragged_cases() -> Iterator[Case]:
    batch = make_batch(MIXED, h_q=4, h_kv=2, d=16, seed=0)
    base = dict(zip(("q", "q_indptr", "k", "v", "kv_indptr", "tree_indptr", "tree_order"), batch.ragged_args()))

    def call(**changes):
        args = {**base, **changes}
        extra = {k: args.pop(k) for k in list(args) if k in ("sm_scale", "out", "lse")}
        return lambda: treeattn.tree_attention(*args.values(), **extra)

    for arg in ("q", "k", "v"):
        for what, value, valid in _float_mutations(base[arg]):
            yield Case(f"tree_attention {arg} {what}", arg, call(**{arg: value}), valid)
    for arg in ("q_indptr", "kv_indptr", "tree_indptr", "tree_order"):
        mutations = _index_mutations(base[arg]) if arg != "tree_order" else _order_mutations(base[arg])
        for what, value, valid in mutations:
            yield Case(f"tree_attention {arg} {what}", arg, call(**{arg: value}), valid)
    for what, value, valid in _scale_mutations():
        yield Case(f"tree_attention sm_scale {what}", "sm_scale", call(sm_scale=value), valid)
    q = base["q"]
    for what, value in (("wrong shape", torch.empty(q.shape[0] + 1, *q.shape[1:])), ("float64", q.double()),
                        ("strided", torch.empty(q.shape[0], q.shape[1], 2 * q.shape[2])[..., ::2])):
        yield Case(f"tree_attention out {what}", "out", call(out=value))
    for what, value in (("float16", torch.empty(q.shape[:2], dtype=torch.float16)), ("short", torch.empty(1, 4))):
        yield Case(f"tree_attention lse {what}", "lse", call(lse=value))


def _order_mutations(order: torch.Tensor) -> Iterator[tuple[str, object, bool]]:
    yield "float", order.float(), False
    yield "one column", order[:, :1], False
    yield "swapped columns", order.flip(1), False
    yield "plus one", order + 1, False
    yield "negative", order - 100, False
    yield "all zero", torch.zeros_like(order), False
    yield "shorter", order[:-1], False
    yield "list", order.tolist(), True
    yield "None", None, False


def paged_cases() -> Iterator[Case]:
    batch = make_batch(MIXED, h_q=4, h_kv=2, d=16, seed=1, page_size=4)
    names = ("q", "q_indptr", "kv_pages", "page_indptr", "page_indices", "last_page_len", "tree_indptr", "tree_order")
    base = dict(zip(names, batch.paged_args()))

    def call(**changes):
        args = {**base, **changes}
        return lambda: treeattn.paged_tree_attention(*args.values())

    for what, value, valid in _float_mutations(base["kv_pages"]):
        yield Case(f"paged kv_pages {what}", "kv_pages", call(kv_pages=value), valid)
    pages = base["kv_pages"]
    yield Case("paged kv_pages one half", "kv_pages", call(kv_pages=pages[:, :1]))
    yield Case("paged kv_pages zero pages", "kv_pages", call(kv_pages=pages[:0]))
    yield Case("paged kv_pages every other page", "page_indices", call(kv_pages=pages[::2]))
    yield Case("paged kv_pages pair of one", "kv_pages", call(kv_pages=(pages[:, 0],)))
    yield Case("paged kv_pages NHD pair", "kv_pages",
               call(kv_pages=(pages[:, 0].transpose(1, 2), pages[:, 1].transpose(1, 2))), True)
    for arg in ("page_indptr", "page_indices", "last_page_len", "q_indptr", "tree_indptr"):
        for what, value, valid in _index_mutations(base[arg]):
            valid = valid or (arg, what) == ("page_indices", "reversed")  # other pages, still in range: valid
            yield Case(f"paged {arg} {what}", arg, call(**{arg: value}), valid)


def merge_cases() -> Iterator[Case]:
    gen = torch.Generator().manual_seed(2)
    out_a, out_b = torch.randn(3, 2, 8, generator=gen), torch.randn(3, 2, 8, generator=gen)
    lse_a, lse_b = torch.randn(3, 2, generator=gen), torch.randn(3, 2, generator=gen)
    base = dict(out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b)

    def call(**changes):
        args = {**base, **changes}
        return lambda: treeattn.merge_state(*args.values())

    for arg in ("out_a", "out_b"):
        for what, value, valid in _float_mutations(base[arg]):
            yield Case(f"merge_state {arg} {what}", arg, call(**{arg: value}), valid)
    for arg in ("lse_a", "lse_b"):
        for what, value in (("float64", base[arg].double()), ("short", base[arg][:1]), ("list", base[arg].tolist()),
                            ("meta", base[arg].to("meta"))):
            yield Case(f"merge_state {arg} {what}", arg, call(**{arg: value}))
    yield Case("merge_state empty batch", "out_a", call(out_a=out_a[:0], out_b=out_b[:0], lse_a=lse_a[:0],
                                                         lse_b=lse_b[:0]), True)


def tree_cases() -> Iterator[Case]:
    bad_parents = {"self parent": [0], "forward parent": [-1, 2, 0], "below -1": [-1, -2], "floats": [-1.0, 0.0],
                   "nested": [[-1], [0]], "ragged nested": [[-1], [0, 1]], "string": "abc", "bools": [True, False],
                   "uint64 wrap": np.array([2**64 - 1], dtype=np.uint64), "None": None}
    for what, parents in bad_parents.items():
        yield Case(f"tree_order {what}", "parents", lambda p=parents: treeattn.tree_order(p))
        yield Case(f"TokenTree {what}", "parents", lambda p=parents: treeattn.TokenTree(p))
    yield Case("pack_trees not a list", "trees", lambda: treeattn.pack_trees(torch.tensor([-1, 0])))
    yield Case("pack_trees empty", "trees", lambda: treeattn.pack_trees([]), True)
    yield Case("pack_trees numpy trees", "trees", lambda: treeattn.pack_trees([np.array([-1, 0])]), True)
    for what, choices in {"float rank": [(0,), (1.5,)], "negative rank": [(0,), (-1,)], "bool rank": [(True,)],
                          "missing parent": [(0, 0)], "duplicate": [(0,), (0,)], "empty path": [()]}.items():
        yield Case(f"from_choices {what}", "choices", lambda c=choices: treeattn.TokenTree.from_choices(c))


def all_cases() -> list[Case]:
    return [*ragged_cases(), *paged_cases(), *merge_cases(), *tree_cases()]


def main() -> None:
    torch.set_num_threads(1)
    for case in all_cases():
        print(json.dumps({"case": case.name, "start": True}), flush=True)
        try:
            case.call()
            outcome = {"result": "ok"}
        except (ValueError, TypeError) as exc:
            outcome = {"result": type(exc).__name__, "message": str(exc)}
        except Exception as exc:
            outcome = {"result": "other", "type": type(exc).__name__, "message": str(exc)[:300]}
        print(json.dumps({"case": case.name, "argument": case.argument, "valid": case.valid, **outcome}), flush=True)
    print(json.dumps({"done": True}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
