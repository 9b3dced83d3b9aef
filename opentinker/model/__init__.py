"""Models: base models by name (loading), the adapter a job trains, and trained policies rebuilt
from checkpoints."""

from opentinker.core.model_names import KNOWN_MODELS, SMOLLM2, SMOLVLM, TINY, TINY_VLM
from opentinker.model.adapters import adapter_files, wrap_model
from opentinker.model.loading import load_base, resolve_model
from opentinker.model.policy import POLICY_FILE, load_model, load_policy, policy_info, read_policy_info

__all__ = ["KNOWN_MODELS", "SMOLLM2", "SMOLVLM", "TINY", "TINY_VLM", "POLICY_FILE", "adapter_files", "load_base", "load_model", "load_policy",
           "policy_info", "read_policy_info", "resolve_model", "wrap_model"]
