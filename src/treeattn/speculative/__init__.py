"""Tree speculative decoding: drafters propose token trees, the target verifies them in one forward.

Adaptive by default: ``AdaptiveDrafter`` verifies per step only the part of a scoring drafter's
tree (``NGramDrafter``, ``SuffixDrafter``, ``HeadDrafter``, ``EagleDrafter``) expected to pay for its
verification time. ``EagleDrafter`` drafts with a published EAGLE-3 or EAGLE-1/2 head
(``load_draft_head``), reading per-position target features (``TargetFeatures``).
"""

from .adaptive import AdaptiveDrafter, Candidates, CostModel, LearningDrafter, ScoringDrafter
from .checkpoints import DraftTarget, load_draft_head
from .drafters import CandidateSource, Drafter, MedusaHeads, NGramDrafter, StaticTreeDrafter
from .eagle import Eagle3Head, EagleHead, HeadConfig, HeadKVCache, HeadOutput
from .eagle_drafter import EagleDrafter
from .features import FINAL, TargetFeatures
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
    "DraftTarget",
    "DraftTree",
    "Drafter",
    "FINAL",
    "Eagle3Head",
    "EagleDrafter",
    "EagleHead",
    "GenerationResult",
    "HeadConfig",
    "HeadDrafter",
    "HeadKVCache",
    "HeadOutput",
    "LearningDrafter",
    "MedusaHeads",
    "ModelOutput",
    "NGramDrafter",
    "SamplingParams",
    "ScoringDrafter",
    "StaticTreeDrafter",
    "SuffixDrafter",
    "TargetFeatures",
    "TreeModel",
    "VerifyResult",
    "generate",
    "load_draft_head",
    "target_probs",
    "verify",
    "verify_greedy",
    "verify_sampling",
]
