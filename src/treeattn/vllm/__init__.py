"""treeattn inside vLLM: an attention-backend plugin (vLLM 0.32's ``vllm.general_plugins`` entry point).

Installing treeattn changes nothing: ``register`` acts only when the environment has
``TREEATTN_VLLM=1``. vLLM runs every plugin in every one of its processes (front end, engine core,
each tensor-parallel worker), so the variable reaches all of them. Then:

- on the CPU, the class behind vLLM's ``CPU_ATTN`` member becomes treeattn's CPU backend (vLLM's CPU
  platform always picks ``CPU_ATTN`` and ignores ``attention_backend``);
- on CUDA, treeattn's Triton backend is registered as ``CUSTOM`` (``attention_backend="CUSTOM"``).

Only this module is imported by the entry point; ``treeattn.vllm.backend`` (which imports vLLM's
internals) is imported by vLLM when it resolves the registered class path.

Tree speculative decoding: ``vllm.LLM(model, speculative_config=treeattn.vllm.tree_speculative_config())``
(defined in ``treeattn.vllm.speculative``, imported on first use).
"""

from __future__ import annotations

import os

__all__ = ["ENV_VAR", "enabled", "register", "tree_speculative_config"]

ENV_VAR = "TREEATTN_VLLM"


def enabled() -> bool:
    return os.environ.get(ENV_VAR, "") == "1"


def register() -> None:
    """The entry point: route vLLM's attention through treeattn when ``TREEATTN_VLLM=1``."""
    if not enabled():
        return
    from vllm.logger import init_logger
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    logger = init_logger("vllm.treeattn")
    if current_platform.is_cpu():
        member, cls = AttentionBackendEnum.CPU_ATTN, "TreeAttentionCPUBackend"
    elif current_platform.is_cuda():
        member, cls = AttentionBackendEnum.CUSTOM, "TreeAttentionCUDABackend"
    else:
        logger.warning("%s=1, but treeattn has no vLLM backend for the %s platform; vLLM's attention is unchanged",
                       ENV_VAR, current_platform.device_name)
        return
    register_backend(member, f"{__name__}.backend.{cls}")
    from .speculative import install_engine_hooks, install_sampling_params_hook

    install_sampling_params_hook()  # here: the API server validates requests before any proposer exists
    install_engine_hooks()  # and the engine core, which builds no proposer, takes the drafts
    logger.info("%s=1: vLLM attention backend %s now runs through treeattn (%s)", ENV_VAR, member.name, cls)


def __getattr__(name: str):
    if name == "tree_speculative_config":
        from .speculative import tree_speculative_config

        return tree_speculative_config
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
