"""Configuration of reward-model training (`posttrain reward`, `RewardTrainer`).

Field names, meanings and defaults follow TRL's `RewardConfig` at HEAD (trl-notes §7).
Standard library only: validation runs before torch loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from posttrain.configs import ConfigError, TrainingConfig, _help
from posttrain.trainers.sft_config import parse_json_field

OVERFLOW_POLICIES = ("drop", "truncate")


@dataclass
class RewardConfig(TrainingConfig):
    """Bradley–Terry reward model on preference pairs (`chosen`, `rejected`, optional `prompt`, `margin`).

    `max_length_overflow` makes TRL's silent behaviour explicit: TRL drops every pair whose chosen
    or rejected sequence exceeds max_length; posttrain does the same by default ("drop") and prints
    how many pairs were dropped, or keeps them cut to max_length ("truncate", the prompt side is
    kept and the end is cut, so the score still reads the last real token of what remains).
    """

    learning_rate: float = _help("Initial AdamW learning rate.", default=1e-4)
    disable_dropout: bool = _help("Turn off dropout in the reward model.", default=True)
    model_init_kwargs: dict[str, Any] | str | None = _help(
        'Extra keyword arguments for from_pretrained, as JSON on the command line (e.g. \'{"attn_implementation": "sdpa"}\').',
        default=None,
    )
    chat_template_path: str | None = _help(
        "A Jinja chat-template file, or a tokenizer folder whose template is used, for conversational data.",
        default=None,
    )
    eos_token: str | None = _help(
        "End-of-sequence token appended to non-conversational chosen / rejected (default: the tokenizer's).",
        default=None,
    )
    pad_token: str | None = _help(
        "Padding token (default: the tokenizer's pad, else unk, else eos). Must already exist in the vocabulary.",
        default=None,
    )
    max_length: int | None = _help(
        "Longest chosen / rejected sequence in tokens (prompt included); see max_length_overflow. None: no limit.",
        default=1024,
    )
    max_length_overflow: str = _help(
        'Pairs longer than max_length: "drop" them (TRL\'s behaviour) or "truncate" them. The count is printed.',
        default="drop",
    )
    pad_to_multiple_of: int | None = _help("Pad every batch's length up to a multiple of this.", default=None)
    center_rewards_coefficient: float | None = _help(
        "Weight of the auxiliary loss mean((r_chosen + r_rejected)^2) that centres rewards at 0 "
        "(Eisenstein et al. 2023; 0.01 recommended). None: off.",
        default=None,
    )
    activation_offloading: bool = _help("Keep activations saved for backward in CPU memory instead of the GPU.", default=False)
    num_print_samples: int = _help(
        "Eval pairs shown in the (prompt, chosen, rejected, scores) table at each evaluation (0: none).", default=4
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.model_init_kwargs = parse_json_field("model_init_kwargs", self.model_init_kwargs)
        if self.max_length is not None and self.max_length < 1:
            raise ConfigError(f"max_length={self.max_length} must be >= 1 or None.")
        if self.max_length_overflow not in OVERFLOW_POLICIES:
            raise ConfigError(
                f"max_length_overflow={self.max_length_overflow!r} must be one of {', '.join(OVERFLOW_POLICIES)}."
            )
        if self.center_rewards_coefficient is not None and self.center_rewards_coefficient < 0:
            raise ConfigError(f"center_rewards_coefficient={self.center_rewards_coefficient} must be >= 0 or None.")
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            raise ConfigError(f"pad_to_multiple_of={self.pad_to_multiple_of} must be >= 1 or None.")
        if self.num_print_samples < 0:
            raise ConfigError(f"num_print_samples={self.num_print_samples} must be >= 0.")
