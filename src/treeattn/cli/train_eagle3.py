"""``treeattn train-heads --arch eagle3``: self-distil an EAGLE-3 head (``speculative.eagle_train``) and
write it as a standard EAGLE-3 checkpoint folder, which ``treeattn demo --draft-head`` and EAGLE-3
loaders (vLLM, SGLang) read. The model's answers come from ``train-heads``' first stage (shared
checkpoint); this module runs the feature and training stages and reports held-out accuracy."""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich import box
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from ..speculative import eagle_train
from ..speculative.eagle import default_aux_layers
from ..speculative.heads import TrainState, shortlist


def aux_layers_arg(text: str) -> tuple[int, ...]:
    """``--aux-layers`` as three comma-separated boundary indices (argparse names the flag on error)."""
    try:
        layers = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected three comma-separated layer boundaries such as 2,15,27, "
                                         f"got {text!r}") from None
    if len(layers) != 3 or len(set(layers)) != 3:
        raise argparse.ArgumentTypeError(f"expected three distinct layer boundaries, got {text!r}")
    return tuple(sorted(layers))


def check_aux_layers(asked: tuple[int, ...] | None, num_layers: int) -> tuple[tuple[int, ...], str | None]:
    """``(aux layers, error naming the flag or None)`` for a target of ``num_layers`` decoder layers."""
    layers = default_aux_layers(num_layers) if asked is None else asked
    if all(0 <= a <= num_layers for a in layers) and len(set(layers)) == 3:
        return layers, None
    if asked is None:
        return layers, (f"the model has {num_layers} layers: EAGLE-3's default aux layers {layers} do not fit, "
                        "pass --aux-layers")
    return layers, f"--aux-layers must lie in [0, {num_layers}] (the model's layer boundaries), got {asked}"


Resume = Callable[[torch.nn.Module], tuple[TrainState, Callable[[TrainState], None]]]


FEATURES_FORMAT = 3  # what examples keeps (3: a folder of chunks; features in the dtype asked, final states float32)
FEATURES_CHUNK = 256  # answers per file of the features folder (about a minute of the stage on 2 cores)


def examples(model, model_name: str, train: tuple[list, list], held: tuple[list, list], aux: tuple[int, ...],
             dtype: torch.dtype, saved: Path, bar: Progress) -> tuple[eagle_train.Eagle3Data, eagle_train.Eagle3Data]:
    """The target's features along ``train`` and ``held`` (``eagle3_sequence`` per answer), kept in the
    folder ``saved`` in files of ``FEATURES_CHUNK`` answers, each written as soon as it is done: the
    stage (50 min for 7,000 answers on 2 cores) resumes from its last file after an interrupt, a
    resumed training run skips it, and the files are mapped rather than read into memory. A folder
    that holds another model's, answers', layers' or dtype's features is emptied first."""
    key = hashlib.sha256(json.dumps([FEATURES_FORMAT, model_name, train, held, list(aux), str(dtype)]).encode()).hexdigest()
    stamp = saved / "key"
    if saved.is_dir() and not (stamp.is_file() and stamp.read_text() == key):
        shutil.rmtree(saved)  # another run's features (and any file an interrupt left half written)
    saved.mkdir(parents=True, exist_ok=True)
    stamp.write_text(key)
    starts = range(0, len(train[0]), FEATURES_CHUNK)
    parts = [(f"train-{start:07d}", train[0][start:start + FEATURES_CHUNK], train[1][start:start + FEATURES_CHUNK])
             for start in starts] + [("held", *held)]
    todo = [part for part in parts if not (saved / f"{part[0]}.pt").is_file()]
    if len(todo) < len(parts):
        bar.console.print(f"target features from {saved}: {len(parts) - len(todo)} of {len(parts)} files")
    if todo:
        total = len(train[0]) + len(held[0])
        task = bar.add_task("target features", total=total, completed=total - sum(len(p[1]) for p in todo), info="")
        for name, prompts, answers in todo:
            rows = []
            for prompt, answer in zip(prompts, answers):
                rows.append(eagle_train.eagle3_sequence(model, prompt, answer, aux, dtype))
                bar.advance(task)
            kept = [r for r in rows if r is not None]
            fields = [list(column) for column in zip(*kept)] if kept else [[], [], [], []]
            tmp = saved / f"{name}.tmp"
            torch.save(dict(zip(("tokens", "features", "first", "final"), fields)), tmp)
            tmp.replace(saved / f"{name}.pt")  # atomic: an interrupt never leaves half a file
    data = [{"tokens": [], "features": [], "first": [], "final": []} for _ in range(2)]
    for name, _, _ in parts:
        blob = torch.load(saved / f"{name}.pt", map_location="cpu", weights_only=True, mmap=True)
        for field, values in blob.items():
            data[name == "held"][field] += values
    for part, what in zip(data, ("training", "held-out")):
        if not part["tokens"]:
            raise ValueError(f"no {what} answer has two tokens or more: nothing to learn from")
    return eagle_train.Eagle3Data(**data[0]), eagle_train.Eagle3Data(**data[1])


def run_eagle3(args: argparse.Namespace, model, train: tuple[list, list], held: tuple[list, list], aux: tuple[int, ...],
               resume: Resume, bar: Progress, started: float, model_name: str, features: Path) -> int:
    """Train and write the head from the model's answers ``train`` (``(prompts, answers)``) and report its
    accuracy on ``held`` (held-out prompts and greedy answers); ``resume(head)`` loads a checkpoint into
    the head and gives its ``TrainState`` and its checkpointer; ``features``: the folder that
    keeps the target's features for a resumed run."""
    console, err = bar.console, Console(stderr=True)
    held_out = len(held[0])
    kept = torch.bfloat16 if args.bf16 else torch.float32  # --bf16 GEMMs round the features to bfloat16 anyway
    try:
        data, held = examples(model, model_name, train, held, aux, kept, features, bar)
    except ValueError as exc:  # e.g. every answer ended at once (EOS)
        err.print(f"[red]treeattn train-heads: the answers cannot train a head: {exc}[/red]")
        return 2
    vocab = shortlist(train[1], model.config.vocab_size, args.vocab)
    head = eagle_train.new_eagle3_head(model, vocab, aux)
    teacher = model.vocab_weights()[1]  # EAGLE-3's loss: the target's distributions, not only its tokens
    state, on_checkpoint = resume(head)
    task = bar.add_task("training", total=None, info="")
    eagle_train.train_eagle3(head, data, steps=args.depth, epochs=args.epochs, lr=args.lr, state=state,
                             on_checkpoint=on_checkpoint, teacher=teacher, autocast=torch.bfloat16 if args.bf16 else None,
                             progress=lambda d, t, info: bar.update(task, completed=d, total=t, info=info))
    top1 = eagle_train.eagle3_accuracy(head, held, steps=args.depth)
    loss = eagle_train.eagle3_loss(head, held, steps=args.depth, teacher=teacher)
    minutes = (time.perf_counter() - started) / 60
    eagle_train.save_eagle3(head, args.out, target_layers=model.config.num_hidden_layers, model=model_name,
                            prompts=len(train[0]) // args.samples + held_out, held_out=held_out, samples=args.samples,
                            max_tokens=args.max_tokens, epochs=args.epochs, lr=args.lr, top1=top1, held_out_loss=loss,
                            bf16=args.bf16, minutes=round(minutes, 1))
    table = Table(title=f"held-out accuracy ({held_out} prompts, loss {loss:.3f})", box=box.SIMPLE_HEAD)
    for col in ("draft step", "guesses", "top-1"):
        table.add_column(col, justify="right")
    for j, a1 in enumerate(top1):
        table.add_row(str(j + 1), f"token t+{j + 2}", f"{a1:.1%}")
    console.print(table)
    console.print(f"wrote the EAGLE-3 head {args.out} (aux layers {list(aux)}, {len(vocab)}-token draft vocabulary) "
                  f"in {minutes:.1f} min; trained on {len(data)} answers")
    return 0
