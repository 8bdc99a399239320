"""Hugging Face integration (optional: pip install -e '.[hf]'): a config/model pair that
AutoConfig and AutoModelForCausalLM build, save and reload.

    from nsa.models.hf import NSALMConfig, NSALMForCausalLM, register_auto_classes
    register_auto_classes()                   # once per process: maps model_type "nsa_lm"
    model = AutoModelForCausalLM.from_config(NSALMConfig(preset="tiny"))
    model.save_pretrained(path); AutoModelForCausalLM.from_pretrained(path)

The wrapper holds a CausalLM (nsa/models/lm.py) as `model`; its forward takes input_ids
(B, N) padded, or (1, T) / (T,) packed with cu_seqlens (and host_cu_seqlens), and returns a
CausalLMOutput whose loss, given labels, is the next-token loss with the usual Hugging Face
convention: labels are the input ids themselves (-100 = ignored), shifted inside.
Transformers is imported when this module is, never by nsa or nsa.models.
"""
from __future__ import annotations

from dataclasses import fields

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from nsa.models.lm import MODEL_PRESETS, CausalLM, LMConfig

MODEL_TYPE = "nsa_lm"
_LM_FIELDS = tuple(f.name for f in fields(LMConfig))


class NSALMConfig(PretrainedConfig):
    """Every LMConfig field as a config attribute; `preset` fills the unset ones from
    MODEL_PRESETS (default "tiny")."""

    model_type = MODEL_TYPE

    def __init__(self, preset: str | None = None, **kwargs):
        base = MODEL_PRESETS[preset or "tiny"].to_dict()
        for name in _LM_FIELDS:
            setattr(self, name, kwargs.pop(name, base[name]))
        # PretrainedConfig keeps its own `vocab_size`-like keys; ours are set above.
        super().__init__(**kwargs)

    def lm_config(self) -> LMConfig:
        return LMConfig(**{name: getattr(self, name) for name in _LM_FIELDS})


class NSALMForCausalLM(PreTrainedModel):
    config_class = NSALMConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False

    def __init__(self, config: NSALMConfig):
        super().__init__(config)
        self.model = CausalLM(config.lm_config())
        # Transformers' bookkeeping (tied-weight keys, hooks); _init_weights below is a no-op.
        self.post_init()

    def _init_weights(self, module):
        """CausalLM initialises itself (per-name seeded); from_pretrained then loads weights."""

    def get_input_embeddings(self):
        return self.model.embedding

    def set_input_embeddings(self, value):
        self.model.embedding = value

    def get_output_embeddings(self):
        return self.model.lm_head

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *,
                cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
                host_cu_seqlens: tuple[int, ...] | None = None,
                position_ids: torch.Tensor | None = None, return_dict: bool | None = None,
                **unused) -> CausalLMOutput | tuple:
        packed = cu_seqlens is not None
        shape = input_ids.shape
        tokens = input_ids.reshape(-1) if packed else input_ids
        logits = self.model(tokens, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                            host_cu_seqlens=host_cu_seqlens,
                            position_ids=None if position_ids is None
                            else position_ids.reshape(tokens.shape))
        loss = None
        if labels is not None:
            loss = _shifted_loss(logits, labels.reshape(tokens.shape), cu_seqlens)
        logits = logits.reshape(*shape, -1)
        if return_dict is False:
            return (logits,) if loss is None else (loss, logits)
        return CausalLMOutput(loss=loss, logits=logits)


def _shifted_loss(logits: torch.Tensor, labels: torch.Tensor,
                  cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """Mean cross-entropy of position t predicting labels[t + 1], within a sequence only."""
    if cu_seqlens is None:  # padded (B, N): shift along N
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                               ignore_index=-100)
    targets = torch.cat([labels[1:], labels.new_full((1,), -100)])
    # A sequence's last row would predict the next sequence's first token: ignored.
    ends = cu_seqlens[1:].to(torch.int64) - 1
    targets = targets.index_fill(0, ends[ends >= 0], -100)
    return F.cross_entropy(logits, targets, ignore_index=-100)


def register_auto_classes() -> None:
    """Let AutoConfig / AutoModelForCausalLM resolve model_type "nsa_lm" (idempotent)."""
    try:
        AutoConfig.register(MODEL_TYPE, NSALMConfig)
    except ValueError:  # already registered in this process
        pass
    try:
        AutoModelForCausalLM.register(NSALMConfig, NSALMForCausalLM)
    except ValueError:
        pass
