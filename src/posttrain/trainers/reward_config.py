"""Configuration of reward-model training (`posttrain reward`, `RewardTrainer`).

Field names, meanings and defaults follow TRL's `RewardConfig` (TRL 1.x).
Standard library only: validation runs before torch loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.configs import ConfigError, SupervisedConfig, flag

OVERFLOW_POLICIES = ("drop", "truncate")


@dataclass
class RewardConfig(SupervisedConfig):
    """Bradley–Terry reward model on preference pairs (`chosen`, `rejected`, optional `prompt` or
    `query`, optional `margin`).

    `max_length_overflow` makes TRL's silent behaviour explicit: TRL drops every pair whose chosen
    or rejected sequence exceeds max_length; posttrain does the same by default ("drop") and prints
    how many pairs were dropped, or keeps them cut to max_length ("truncate", the prompt side is
    kept and the end is cut, so the score still reads the last real token of what remains).
    """

    learning_rate: float = flag("Initial AdamW learning rate.", default=1e-4)
    disable_dropout: bool = flag("Turn off dropout in the reward model.", default=True)
    max_length: int | None = flag(
        "Longest chosen / rejected sequence in tokens (prompt included); see max_length_overflow. None: no limit.",
        default=1024,
    )
    max_length_overflow: str = flag(
        'Pairs longer than max_length: "drop" them (TRL\'s behaviour) or "truncate" them. The count is printed.',
        default="drop",
    )
    center_rewards_coefficient: float | None = flag(
        "Weight of the auxiliary loss mean((r_chosen + r_rejected)^2) that centres rewards at 0 "
        "(Eisenstein et al. 2023; 0.01 recommended). None: off.",
        default=None,
    )
    prompt_column: str | None = flag(
        "Column holding the prompt of each pair (prepended to chosen and rejected). Default: 'prompt', or "
        "'query' ({query, chosen, rejected} data, as DeepSpeed-Chat writes it); neither: the prompt is "
        "implicit, inside chosen and rejected.",
        default=None,
    )
    num_print_samples: int = flag(
        "Eval pairs shown in the (prompt, chosen, rejected, scores) table at each evaluation (0: none).", default=4
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_length is not None and self.max_length < 1:
            raise ConfigError(f"max_length={self.max_length} must be >= 1 or None.")
        if self.max_length_overflow not in OVERFLOW_POLICIES:
            raise ConfigError(
                f"max_length_overflow={self.max_length_overflow!r} must be one of {', '.join(OVERFLOW_POLICIES)}."
            )
        if self.center_rewards_coefficient is not None and self.center_rewards_coefficient < 0:
            raise ConfigError(f"center_rewards_coefficient={self.center_rewards_coefficient} must be >= 0 or None.")
        if self.num_print_samples < 0:
            raise ConfigError(f"num_print_samples={self.num_print_samples} must be >= 0.")
