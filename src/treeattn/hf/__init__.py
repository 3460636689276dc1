"""Tree speculative decoding for HF transformers models, with no model code of our own.

Importing this package registers the ``"treeattn"`` attention implementation (and its mask function)
with transformers. ``speculative_generate(model, input_ids, max_new_tokens=...)`` is the entry point::

    from transformers import AutoModelForCausalLM
    from treeattn.hf import speculative_generate

    model = AutoModelForCausalLM.from_pretrained(path)
    out = speculative_generate(model, input_ids, max_new_tokens=64)   # == model.generate(do_sample=False)

On the CPU, ``pack_linears(model)`` once beforehand makes multi-token tree steps nearly as cheap as
one-token steps (oneDNN on prepacked weights instead of PyTorch's per-call GEMM packing).
"""

from ..packed_linear import PackedLinear, pack_linears
from .attention import ATTN_IMPLEMENTATION, TreeCache, tree_attention_forward
from .generate import speculative_generate
from .model import HFTreeModel, check_model

__all__ = ["ATTN_IMPLEMENTATION", "HFTreeModel", "PackedLinear", "TreeCache", "check_model", "pack_linears",
           "speculative_generate", "tree_attention_forward"]
