"""Model integration: Llama-family decoders running their attention through ``treeattn.PagedKVCache``."""

from .llama import LlamaConfig, LlamaTreeModel, ModelOutput, rope_from_hf
from .loader import INSTALL_HINT, ModelNotAvailable, load_smollm2, smollm2_dir

__all__ = ["INSTALL_HINT", "LlamaConfig", "LlamaTreeModel", "ModelNotAvailable", "ModelOutput", "load_smollm2",
           "rope_from_hf", "smollm2_dir"]
