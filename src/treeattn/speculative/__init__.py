"""Tree speculative decoding: drafters propose token trees, the target verifies them in one forward.

Adaptive by default: ``AdaptiveDrafter`` verifies per step only the part of a scoring drafter's
tree (``NGramDrafter``, ``SuffixDrafter``, ``HeadDrafter``) expected to pay for its verification time.
"""

from .adaptive import AdaptiveDrafter, Candidates, CostModel, LearningDrafter, ScoringDrafter
from .drafters import CandidateSource, Drafter, MedusaHeads, NGramDrafter, StaticTreeDrafter
from .generate import GenerationResult, generate
from .heads import DraftHeads, HeadDrafter
from .model import ModelOutput, TreeModel
from .suffix import SuffixDrafter
from .verify import DraftTree, SamplingParams, VerifyResult, target_probs, verify, verify_greedy, verify_sampling

__all__ = [
    "AdaptiveDrafter",
    "CandidateSource",
    "Candidates",
    "CostModel",
    "DraftHeads",
    "DraftTree",
    "Drafter",
    "GenerationResult",
    "HeadDrafter",
    "LearningDrafter",
    "MedusaHeads",
    "ModelOutput",
    "NGramDrafter",
    "SamplingParams",
    "ScoringDrafter",
    "StaticTreeDrafter",
    "SuffixDrafter",
    "TreeModel",
    "VerifyResult",
    "generate",
    "target_probs",
    "verify",
    "verify_greedy",
    "verify_sampling",
]
