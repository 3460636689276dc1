"""``treeattn train-heads``: self-distil an EAGLE-style draft head for SmolLM2-135M on the CPU (HF
transformers' LlamaForCausalLM with treeattn's attention, ``treeattn.models.load_smollm2``).

Three stages, each checkpointed so that an interrupted run resumes where it stopped (rerun the same
command; a rerun with other settings or more ``--samples`` keeps the answers already written, even
after a finished run): the model writes
greedy answers to the shipped prompts (``speculative/data/prompts.txt``) and, with ``--samples N``,
``N - 1`` sampled answers more to each training prompt; its hidden states along those answers become
the training data, then the head is trained (checkpointed after each epoch and every 10 minutes).
The last tenth of the prompts is held out (their greedy answers) to report the accuracy of each
draft step. ``--arch eagle3`` trains an EAGLE-3 head instead (``train_eagle3``), written as an EAGLE-3
checkpoint folder.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich import box
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from ..models.loader import ModelNotAvailable, load_smollm2
from ..speculative import SamplingParams
from ..speculative.heads import (
    DEFAULT_EAGLE3,
    DEFAULT_HEADS,
    PROMPTS_FILE,
    DraftHeads,
    TrainState,
    head_accuracy,
    head_examples,
    save_heads,
    self_distill,
    shortlist,
    train_heads,
)
from .demo import MODEL_NAME, chat_ids, pick_threads
from .train_eagle3 import aux_layers_arg, check_aux_layers, run_eagle3


def add_train_heads_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", choices=("heads", "eagle3"), default="heads",
                        help="heads: treeattn's own draft head (a .pt file); eagle3: an EAGLE-3 head, written as an "
                             "EAGLE-3 checkpoint folder (config.json + model.safetensors) for --draft-head, vLLM, SGLang")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"heads file (folder for --arch eagle3) to write (default {DEFAULT_HEADS}, "
                             f"{DEFAULT_EAGLE3} for eagle3)")
    parser.add_argument("--aux-layers", type=aux_layers_arg, default=None,
                        help="--arch eagle3: the three layer boundaries whose states the head reads, e.g. 2,15,27 "
                             "(default EAGLE-3's: 2, N // 2, N - 3 for N layers)")
    parser.add_argument("--prompts", type=Path, default=PROMPTS_FILE,
                        help="prompts, one per line (default: the 644 shipped with treeattn)")
    parser.add_argument("--max-tokens", type=int, default=160, help="answer tokens per prompt (default 160)")
    parser.add_argument("--samples", type=int, default=1,
                        help="answers per training prompt: the greedy one and N - 1 sampled at --temperature, more "
                             "data from the same prompts (default 1: greedy only)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="temperature of the sampled answers (--samples; default 0.8)")
    parser.add_argument("--depth", type=int, default=4, help="draft steps the head learns to chain (default 4)")
    parser.add_argument("--vocab", type=int, default=4096,
                        help="draft vocabulary: the answers' most frequent tokens (default 4096)")
    parser.add_argument("--epochs", type=int, default=6, help="training epochs (default 6)")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    parser.add_argument("--batch", type=int, default=16, help="prompts generated together (default 16)")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="checkpoint file (default: OUT with suffix .ckpt); --arch eagle3 keeps the target's "
                             "features beside it (a folder with suffix .features, written as the stage goes). When "
                             "training ends the features go and the checkpoint keeps only the answers, for later runs "
                             "(other training settings, more "
                             "--samples); delete it to write them again")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: as the demo)")
    parser.add_argument("--bf16", action="store_true",
                        help="--arch eagle3: sample the answers of --samples with the model in bfloat16 (1.5-1.8x "
                             "as fast) and train with bfloat16 autocast (weights, optimizer and loss stay float32; 1.6x "
                             "as fast), on a Zen 4 with AVX512-BF16; slower on CPUs without bfloat16 units")


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description:<16}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=console)


def main_train_heads(args: argparse.Namespace) -> int:
    console = Console(highlight=False)
    err = Console(stderr=True)
    for name in ("max_tokens", "depth", "epochs", "batch", "samples"):
        if getattr(args, name) < 1:
            err.print(f"[red]--{name.replace('_', '-')} must be >= 1[/red]")
            return 2
    if not args.temperature > 0:
        err.print(f"[red]--temperature must be > 0 (the sampled answers' temperature), got {args.temperature}[/red]")
        return 2
    if args.vocab < 2 or args.max_tokens < 2:
        err.print("[red]--vocab and --max-tokens must be >= 2 (a draft guesses the token after the next)[/red]")
        return 2
    for flag, given in (("--aux-layers", args.aux_layers is not None), ("--bf16", args.bf16)):
        if given and args.arch != "eagle3":
            err.print(f"[red]{flag} is for --arch eagle3 only[/red]")
            return 2
    if not args.prompts.is_file():
        err.print(f"[red]--prompts: no such file {args.prompts}[/red]")
        return 2
    texts = [line.strip() for line in args.prompts.read_text().splitlines() if line.strip()]
    if len(texts) < 2:
        err.print("[red]--prompts needs at least two prompts (one tenth is held out for evaluation)[/red]")
        return 2
    threads, why = pick_threads(args.threads)
    torch.set_num_threads(threads)
    try:
        with console.status(f"loading {MODEL_NAME}..."):
            model, tokenizer = load_smollm2()
    except ModelNotAvailable as exc:
        err.print(f"[red]treeattn train-heads needs the model:[/red] {exc}")
        return 2
    if args.arch == "eagle3":
        aux, problem = check_aux_layers(args.aux_layers, model.config.num_hidden_layers)
        if problem:
            err.print(f"[red]{problem}[/red]")
            return 2
    args.out = args.out or (DEFAULT_EAGLE3 if args.arch == "eagle3" else DEFAULT_HEADS)
    started = time.perf_counter()
    prompts = [chat_ids(tokenizer, t) for t in texts]
    # The answers depend on the prompts and their length only: they survive a change of training settings.
    data_config = {"prompts_sha256": hashlib.sha256("\n".join(texts).encode()).hexdigest(),
                   "max_tokens": args.max_tokens}
    # Sampled answers depend on the temperature too: another one samples again (the greedy answers stay).
    # Round r of them answers every training prompt once, so another --samples keeps those written.
    sample_config = {"temperature": args.temperature}
    train_config = {"depth": args.depth, "vocab": args.vocab, "epochs": args.epochs, "lr": args.lr,
                    **({"samples": args.samples, "temperature": args.temperature} if args.samples > 1 else {})}
    if args.arch == "eagle3":  # another head: the answers are reused, the training is not
        train_config.update(arch="eagle3", aux_layers=list(aux), loss="target distributions")
    ckpt_path = args.checkpoint or args.out.with_suffix(".ckpt")
    ckpt = {"data_config": data_config, "sample_config": sample_config, "train_config": train_config, "outputs": [],
            "sampled": [], "heads": None, "train": None}
    if ckpt_path.is_file():
        saved = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        if saved.get("data_config") == data_config:
            ckpt["outputs"] = saved["outputs"]
            same_temperature = (saved.get("sample_config") or {}).get("temperature") == args.temperature
            if same_temperature or args.samples == 1:  # --samples 1 reads none and keeps any
                ckpt["sample_config"], ckpt["sampled"] = saved.get("sample_config"), saved.get("sampled", [])
            if saved.get("train_config") == train_config:
                ckpt["heads"], ckpt["train"] = saved["heads"], saved["train"]
            console.print(f"resuming from {ckpt_path}: {len(ckpt['outputs'])}/{len(prompts)} answers, "
                          f"{len(ckpt['sampled'])} sampled, "
                          f"{(ckpt['train'] or {}).get('epoch', 0)}/{args.epochs} epochs"
                          + (f" and {ckpt['train']['batch']} batches" if (ckpt["train"] or {}).get("batch") else ""))
        else:
            console.print(f"[yellow]{ckpt_path} holds answers to other prompts: starting over[/yellow]")
    ckpt_path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save(ckpt, tmp)
        tmp.replace(ckpt_path)  # atomic: an interrupt never leaves half a checkpoint

    def keep_answers() -> None:
        """Training is done: the checkpoint keeps only the answers (the run's longest stage) for later runs."""
        ckpt["heads"] = ckpt["train"] = None
        save()
        console.print(f"kept the answers in {ckpt_path} for later runs (other settings reuse them; delete it to "
                      "write them again)")

    def resume(head: torch.nn.Module) -> tuple[TrainState, Callable[[TrainState], None]]:
        """The training state saved with ``head``'s weights (loaded into it), and what checkpoints it."""
        state = TrainState()
        if ckpt["heads"] is not None:
            head.load_state_dict(ckpt["heads"])
            state = TrainState(**ckpt["train"])

        def on_checkpoint(s: TrainState) -> None:
            ckpt["heads"] = head.state_dict()
            ckpt["train"] = {"epoch": s.epoch, "batch": s.batch, "losses": s.losses, "optimizer": s.optimizer}
            save()

        return state, on_checkpoint

    console.print(f"[bold]{MODEL_NAME}[/bold], {threads} thread{'s' if threads != 1 else ''}{why}: {len(prompts)} prompts, "
                  f"{args.max_tokens} tokens each, a {args.depth}-step draft head")
    with _progress(console) as bar, model.attention():  # "treeattn" for every forward of the run

        def answers(stage: str, key: str, asked: list, sampling: SamplingParams | None = None, writer=model) -> list:
            """``writer``'s answers to ``asked`` (the model, or its bfloat16 copy), checkpointed under
            ``ckpt[key]`` after each batch."""
            task = bar.add_task(stage, total=len(asked), completed=min(len(ckpt[key]), len(asked)), info="")

            def on_batch(done):
                ckpt[key] = done
                save()

            # done: the answers written so far (a run with more --samples may have written more than asked)
            return self_distill(writer, asked, max_new_tokens=args.max_tokens, batch_size=args.batch,
                                stop_tokens=[tokenizer.eos_token_id], done=ckpt[key][:len(asked)], on_batch=on_batch,
                                sampling=sampling, progress=lambda d, t, info: bar.update(task, completed=d, info=info))

        outputs = answers("model answers", "outputs", prompts)
        held_out = max(1, len(prompts) // 10)
        train = (prompts[:-held_out], outputs[:-held_out])
        held = (prompts[-held_out:], outputs[-held_out:])  # greedy answers: what drafts must match
        if args.samples > 1:
            again = train[0] * (args.samples - 1)
            writer = model
            if args.bf16 and len(ckpt["sampled"]) < len(again):
                # Sampled in bfloat16 (1.5-1.8x as fast on a Zen 4): the model's distribution up to rounding, far
                # below the sampling's own noise. The greedy answers, which the held-out accuracy is
                # measured against, are the float32 model's.
                with console.status(f"loading {MODEL_NAME} in bfloat16 to sample..."):
                    writer = load_smollm2(dtype=torch.bfloat16)[0]
            sampled = answers("sampled answers", "sampled", again, SamplingParams(args.temperature), writer)
            del writer  # the bfloat16 copy's memory, before the features
            train = (train[0] + again, train[1] + sampled)
        if args.arch == "eagle3":
            features = ckpt_path.with_suffix(".features")
            code = run_eagle3(args, model, train, held, aux, resume, bar, started, MODEL_NAME, features)
            if code == 0:
                keep_answers()
                shutil.rmtree(features, ignore_errors=True)
            return code
        task = bar.add_task("hidden states", total=len(train[0]), info="")
        try:
            data = head_examples(model, *train, progress=lambda d, t, info: bar.update(task, completed=d))
            held = head_examples(model, *held)
        except ValueError as exc:  # e.g. every answer ended at once (EOS)
            err.print(f"[red]treeattn train-heads: the answers cannot train a head: {exc}[/red]")
            return 2
        bar.update(task, completed=len(train[0]))
        weights = model.vocab_weights()
        vocab = shortlist(train[1], weights[1].shape[0], args.vocab)
        heads = DraftHeads(model.config.hidden_size, vocab, depth=args.depth)
        state, on_checkpoint = resume(heads)
        task = bar.add_task("training", total=None, info="")
        train_heads(heads, weights, data, epochs=args.epochs, lr=args.lr, state=state, on_checkpoint=on_checkpoint,
                    progress=lambda d, t, info: bar.update(task, completed=d, total=t, info=info))

    top1 = head_accuracy(heads, weights, held, top_k=1)
    top4 = head_accuracy(heads, weights, held, top_k=4)
    minutes = (time.perf_counter() - started) / 60
    save_heads(heads, args.out, model=MODEL_NAME, prompts=len(prompts), held_out=held_out, samples=args.samples,
               rows=len(data),
               max_tokens=args.max_tokens, vocab=len(vocab), epochs=args.epochs, lr=args.lr, top1=top1, top4=top4,
               minutes=round(minutes, 1), threads=threads)
    keep_answers()
    table = Table(title=f"held-out accuracy ({held_out} prompts, {len(held)} positions)", box=box.SIMPLE_HEAD)
    for col in ("draft step", "guesses", "top-1", "top-4"):
        table.add_column(col, justify="right")
    for j, (a1, a4) in enumerate(zip(top1, top4)):
        table.add_row(str(j + 1), f"token t+{j + 2}", f"{a1:.1%}", f"{a4:.1%}")
    console.print(table)
    console.print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB) in {minutes:.1f} min; "
                  f"trained on {len(data)} positions of {len(train[0])} answers")
    return 0
