"""Configuration of supervised fine-tuning (`posttrain sft`, `SFTTrainer`).

Field names, meanings and defaults follow TRL's `SFTConfig` so command lines and
code written for TRL port unchanged. Standard library only: validation runs before torch loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from posttrain.configs import ConfigError, SupervisedConfig, flag, parse_json_field

TRUNCATION_MODES = ("keep_start", "keep_end")
LOSS_TYPES = ("nll", "chunked_nll", "dft")
PACKING_STRATEGIES = ("bfd", "bfd_split", "wrapped")  # TRL's names (same tuple as data.PACKING_STRATEGIES)


@dataclass
class SFTConfig(SupervisedConfig):
    """Supervised fine-tuning on language-modelling (`text` / `messages`) or prompt-completion data.

    Differences from TRL, on purpose: `loss_type` "nll" and "chunked_nll" compute the same loss
    the same memory-light way (the lm_head only runs on trained tokens, in chunks), and gradient
    accumulation divides by the number of trained tokens of the whole accumulated batch, so
    batch 1 × accumulation 4 gives the same update as batch 4 × accumulation 1. "bfd" packing
    keeps sequences apart with a block-diagonal attention mask under any attention implementation
    (TRL turns padding-free batches on for it and warns unless the model uses flash attention);
    `padding_free` stays the user's choice, because on sdpa / eager one long row costs more
    attention memory than several padded ones.
    """

    learning_rate: float = flag("Initial AdamW learning rate.", default=2e-5)
    disable_dropout: bool = flag(
        "Turn off dropout in the model. Off by default for SFT, as in TRL (the model's own dropout applies).",
        default=False,
    )
    dataset_text_field: str = flag("Column holding the text of language-modelling data.", default="text")
    dataset_kwargs: dict[str, Any] | str | None = flag(
        'Dataset preparation options as JSON; {"skip_prepare_dataset": true} trains on a dataset that '
        "already has input_ids (and optionally completion_mask / assistant_masks).",
        default=None,
    )
    max_length: int | None = flag("Truncate every example to this many tokens (None: no limit).", default=1024)
    truncation_mode: str = flag(
        'Which end of an overlong example to keep: "keep_start" or "keep_end".', default="keep_start"
    )
    shuffle_dataset: bool = flag("Shuffle the training set once before preparing it.", default=False)
    packing: bool = flag(
        "Pack several examples into each row of at most max_length tokens (see packing_strategy).",
        default=False,
    )
    packing_strategy: str = flag(
        '"bfd": best-fit decreasing; overlong examples truncated (truncation_mode), whole examples '
        "packed into rows, each attending only to itself (position ids restart per example). "
        '"bfd_split": the same, but overlong examples are split into max_length pieces instead of '
        'truncated. "wrapped": examples concatenated and cut into max_length blocks; attention '
        "crosses example boundaries within a block.",
        default="bfd",
    )
    padding_free: bool = flag(
        "Concatenate each micro-batch into one row with per-example position ids instead of padding "
        "it; examples still attend only to themselves. Saves the padding compute; best with flash "
        "attention (sdpa / eager build a row-length² mask).",
        default=False,
    )
    eval_packing: bool | None = flag("Pack the eval set (None: same as packing).", default=None)
    completion_only_loss: bool | None = flag(
        "Train only on completion tokens of prompt-completion data (None: yes for prompt-completion data).",
        default=None,
    )
    assistant_only_loss: bool = flag("Train only on assistant turns of conversational (messages) data.", default=False)
    loss_type: str = flag(
        '"chunked_nll" (default) or "nll": next-token cross-entropy on trained tokens; "dft": each '
        "token's NLL weighted by its (detached) probability (Dynamic Fine-Tuning, Wu et al. 2025).",
        default="chunked_nll",
    )
    router_aux_loss_coef: float | None = flag(
        "Weight of the router load-balancing loss for mixture-of-experts models that report one; None (TRL 1.16's "
        "default): the model config's own router_aux_loss_coef (0 if it declares none).",
        default=0.001,
    )
    loss_chunk_tokens: int = flag(
        "Trained tokens per chunk of the lm_head + cross-entropy (bounds the float32 logits held at once).",
        default=1024,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.dataset_kwargs = parse_json_field("dataset_kwargs", self.dataset_kwargs)
        if self.max_length is not None and self.max_length < 2:
            raise ConfigError(f"max_length={self.max_length} must be >= 2 (one input and one target token) or None.")
        if self.truncation_mode not in TRUNCATION_MODES:
            raise ConfigError(f"truncation_mode={self.truncation_mode!r} must be one of {', '.join(TRUNCATION_MODES)}.")
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(f"loss_type={self.loss_type!r} must be one of {', '.join(LOSS_TYPES)}.")
        if self.packing_strategy not in PACKING_STRATEGIES:
            raise ConfigError(
                f"packing_strategy={self.packing_strategy!r} must be one of {', '.join(PACKING_STRATEGIES)}."
            )
        if (self.packing or self.eval_packing) and not self.max_length:
            raise ConfigError("packing needs max_length (the length of each packed row).")
        if self.loss_chunk_tokens < 1:
            raise ConfigError(f"loss_chunk_tokens={self.loss_chunk_tokens} must be >= 1.")
        if self.router_aux_loss_coef is not None and self.router_aux_loss_coef < 0:
            raise ConfigError(f"router_aux_loss_coef={self.router_aux_loss_coef} must be >= 0.")
