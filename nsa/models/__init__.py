"""Models built on nsa.layer.NSAAttention: a small causal LM (lm.py), the document corpus it
trains on (corpus.py), and an optional Hugging Face wrapper (hf.py, needs transformers)."""
from nsa.models.lm import MODEL_PRESETS, CausalLM, LMConfig

__all__ = ["CausalLM", "LMConfig", "MODEL_PRESETS"]
