"""Model loading: HF transformers causal LMs (SmolLM2 shipped as a GGUF, or any local model folder or
GGUF file) wrapped in ``treeattn.hf.HFTreeModel``, the one model path of treeattn."""

from .loader import INSTALL_HINT, ModelNotAvailable, load_model, load_smollm2, save_smollm2, smollm2_dir

__all__ = ["INSTALL_HINT", "ModelNotAvailable", "load_model", "load_smollm2", "save_smollm2", "smollm2_dir"]
