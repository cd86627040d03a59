"""The modeling file `checkpoint.py to-hf` copies into the Hugging Face folder of a model fine-tuned with
model.pooling=mean (recipes/esm2_finetune/hf.py): EsmForSequenceClassification pools the <cls> token, this model
the mean of the final hidden states over each sequence's residues (not <cls>, <eos> or padding), as the recipe does.

The folder's config.json names a model_type of its own, which transformers knows only through the auto_map to this
file: `AutoModelForSequenceClassification.from_pretrained(folder, trust_remote_code=True)` loads it, and without
trust_remote_code the Auto classes refuse the folder instead of building a <cls>-pooled model. It needs nothing but
torch and transformers.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.nn import BCEWithLogitsLoss, CrossEntropyLoss, MSELoss
from transformers import EsmConfig, EsmForSequenceClassification
from transformers.modeling_outputs import SequenceClassifierOutput
from transformers.models.esm.modeling_esm import EsmClassificationHead

MODEL_TYPE = "esm2_mean_pooled"


class Esm2MeanPooledConfig(EsmConfig):
    model_type = MODEL_TYPE


class EsmMeanPooledClassificationHead(EsmClassificationHead):
    """EsmClassificationHead (same parameters: dense, out_proj) on the mean of the residues' hidden states."""

    def forward(self, features: torch.Tensor, residues: torch.Tensor) -> torch.Tensor:
        weights = residues.to(features.dtype).unsqueeze(-1)
        x = (features * weights).sum(1) / weights.sum(1).clamp(min=1)
        x = self.dropout(x)
        x = torch.tanh(self.dense(x))
        return self.out_proj(self.dropout(x))


class Esm2MeanPooledForSequenceClassification(EsmForSequenceClassification):
    config_class = Esm2MeanPooledConfig

    def __init__(self, config: Esm2MeanPooledConfig):
        super().__init__(config)
        self.classifier = EsmMeanPooledClassificationHead(config)
        self.post_init()

    def residues(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """[batch, length] True at the residue tokens: attended, and not <cls>, <eos> or padding."""
        c = self.config
        mask = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
        for special in (c.cls_token_id, c.eos_token_id, c.pad_token_id):
            if special is not None:
                mask = mask & (input_ids != special)
        return mask

    def forward(
        self,
        input_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        **kwargs,
    ) -> SequenceClassifierOutput:
        if input_ids is None:
            raise ValueError("mean pooling over the residues needs input_ids (to tell residues from special tokens)")
        outputs = self.esm(
            input_ids, attention_mask=attention_mask, position_ids=position_ids, inputs_embeds=inputs_embeds, **kwargs
        )
        logits = self.classifier(outputs[0], self.residues(input_ids, attention_mask))
        loss = None
        if labels is not None:
            labels = labels.to(logits.device)
            problem = self.config.problem_type
            if problem == "regression":
                loss = (
                    MSELoss()(logits.squeeze(), labels.squeeze()) if self.num_labels == 1 else MSELoss()(logits, labels)
                )
            elif problem == "multi_label_classification":
                loss = BCEWithLogitsLoss()(logits, labels)
            else:
                loss = CrossEntropyLoss()(logits.view(-1, self.num_labels), labels.view(-1))
        return SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
