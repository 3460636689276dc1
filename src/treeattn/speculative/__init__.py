"""Tree speculative decoding: drafters propose token trees, the target verifies them in one forward."""

from .drafters import (
    CandidateSource,
    Drafter,
    MedusaHeads,
    NGramDrafter,
    StaticTreeDrafter,
)
from .generate import GenerationResult, generate
from .verify import (
    DraftTree,
    SamplingParams,
    VerifyResult,
    target_probs,
    verify,
    verify_greedy,
    verify_sampling,
)

__all__ = [
    "CandidateSource",
    "DraftTree",
    "Drafter",
    "GenerationResult",
    "MedusaHeads",
    "NGramDrafter",
    "SamplingParams",
    "StaticTreeDrafter",
    "VerifyResult",
    "generate",
    "target_probs",
    "verify",
    "verify_greedy",
    "verify_sampling",
]
