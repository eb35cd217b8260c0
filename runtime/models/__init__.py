"""Model definitions written against the paged KV pool: one decoder (decoder.py) whose family
differences are ModelSpec switches (spec.py), and the streaming weight loader (weights.py)."""

from forklm.runtime.models.decoder import CausalLM
from forklm.runtime.models.spec import SUPPORTED_MODEL_TYPES, ModelSpec, spec_from_config
from forklm.runtime.models.weights import WeightLoader

__all__ = ["SUPPORTED_MODEL_TYPES", "CausalLM", "ModelSpec", "WeightLoader", "spec_from_config"]
