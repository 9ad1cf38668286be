"""`posttrain.experimental.ppo.ppo_trainer` (TRL 1.x module path): the trainer, the masked statistics and
TRL's `batch_generation` helper."""

from __future__ import annotations

from typing import Any

from posttrain.ops import masked_mean, masked_var, masked_whiten
from posttrain.trainers.ppo import PPOTrainer

__all__ = ["PPOTrainer", "batch_generation", "masked_mean", "masked_var", "masked_whiten"]


def batch_generation(
    model: Any, queries: Any, local_rollout_forward_batch_size: int, pad_token_id: int, generation_config: Any
) -> tuple[Any, Any]:
    """TRL's helper: `model.generate(generation_config)` on left-padded `queries` (B, P), in batches of
    `local_rollout_forward_batch_size` rows. Returns (query_responses (B, P + T): each query followed by
    its generated tokens, padded with `pad_token_id` to the longest batch; logits (B, T, vocab): the
    scores of each generated position, padded with 0). posttrain's trainers sample with their own engine
    (posttrain.rollout); this is for code written against TRL's."""
    import torch

    responses, scores = [], []
    with torch.no_grad():
        for start in range(0, queries.size(0), local_rollout_forward_batch_size):
            query = queries[start : start + local_rollout_forward_batch_size]
            out = model.generate(
                input_ids=query,
                attention_mask=(query != pad_token_id).long(),
                generation_config=generation_config,
                return_dict_in_generate=True,
                output_scores=True,
            )
            responses.append(out.sequences[:, query.size(1) :])
            scores.append(torch.stack(out.scores, 1))
    length = max(r.size(1) for r in responses)
    responses = [torch.nn.functional.pad(r, (0, length - r.size(1)), value=pad_token_id) for r in responses]
    scores = [torch.nn.functional.pad(s, (0, 0, 0, length - s.size(1))) for s in scores]
    return torch.cat((queries, torch.cat(responses)), 1), torch.cat(scores)
