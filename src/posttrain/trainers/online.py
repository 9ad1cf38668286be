"""The online skeleton: everything PPO, RLOO, GRPO, Online DPO and XPO share, written once.

An online trainer file tells its algorithm (sample → score → advantages → update → controllers)
and calls into this module for the plumbing around it:

- loading the parts of a run from a config or from the Python API (`load_parts`, the one loader
  for the command line and for trainers given paths instead of models);
- the run's environment (`OnlineRun`): accelerator, derived batch sizes, the resumable prompt
  stream (data.prompts), sampling settings and stop tokens, metric accumulation, logging, checkpoints;
- sampling and scoring a rollout batch (`sample`, `score`, `sample_and_score`) and the
  reference policy (`reference_policy`);
- batch statistics over all ranks (`OnlineRun.batch_moments`) for whitening and normalization;
- the update loop: epochs × minibatches × micro-batches whose losses are divided by the GLOBAL
  count of the minibatch (`policy_update`, `minibatch_step`), and the one non-finite policy:
  every rank learns whether any rank's loss is NaN/inf and all skip that optimizer step together;
  after `HealthMonitor.max_nonfinite` skipped steps in a row training stops with `TrainingDiverged`;
- `OnlineTrainer`: the public surface of every online trainer and the steps around the algorithm
  (`training()`: output-dir guard, OOM advice, resume, begin/end events and the final save;
  `end_of_update()`: learning-rate schedule, metrics, sample table, callbacks, checkpoint); the
  health monitor (`OnlineRun.health`) is the first of the trainer's callbacks and checks each log;
- `run()`: the command-line path (`posttrain rloo|grpo|ppo|online-dpo|xpo`); errors meant for
  people are printed once by cli.main.

docs/internals.md ("Trainers") shows where each concern lives.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from posttrain import checkpoint as ckpt
from posttrain import distributed as dist
from posttrain import hub, positions, runtime
from posttrain.configs import (
    AcceleratorConfig,
    ConfigError,
    OnPolicyConfig,
    concurrent_decode_mode,
    launch_world_size,
    shared_prompts_mode,
    transformers_generation_kwargs,
)
from posttrain.data.loading import load_split
from posttrain.data.prepare import PROMPT_MESSAGES, check_prompt_columns
from posttrain.data.prompts import (
    PromptStream,
    StreamedPrompts,
    check_prompt_batch,
    eval_dataset_sets,
    is_streaming,
    prompt_dataset,
)
from posttrain.health import HealthMonitor, oom_advice
from posttrain.models import compile_for_training, model_init_kwargs, uncompiled
from posttrain.optim import build_optimizer, build_scheduler, clip_and_step
from posttrain.preemption import log_preempted
from posttrain.rollout import (
    Rollout,
    SamplingConfig,
    decode_completions,
    decode_engine,
    decode_prompts,
    generate,
    generation_mode,
    prompt_groups,
)
from posttrain.scoring import (
    CompletionForward,
    RewardSource,
    batched_completion_logprobs,
    chunk_order,
    completion_forward,
    completion_logprobs,
    forward_full_kl,
    forward_logprobs,
    import_reward_function,
    in_rollout_order,
    same_tokenizer,
)
from posttrain.tracking import MetricAccumulator, ProgressBar, Tracker


# ---------------------------------------------------------------------------------------------
# the reference policy and sampling settings
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def reference_policy(model: nn.Module, ref_model: nn.Module | None, accelerator: Any) -> Iterator[nn.Module]:
    """The reference model in eval mode, or the PEFT policy with its adapter TRULY disabled.

    With LoRA (`peft_config` / --use_peft) and no reference model the reference is the frozen base,
    i.e. the policy with its adapter off, so no second copy of the weights is held. TRL's XPO
    generated "reference" completions with `get_base_model()`, which in PEFT still runs the LoRA
    layers (peft#430), so they came from the policy; `disable_adapter()` really switches the adapter
    off for log-probs and generation alike.
    """
    if ref_model is not None:
        with generation_mode(ref_model):
            yield ref_model
        return
    from posttrain.models import adapters_disabled

    policy = dist.unwrap(model, accelerator)
    with adapters_disabled(policy), generation_mode(policy):
        yield policy


def stop_token_ids(config: OnPolicyConfig, tokenizer: Any) -> tuple[int, ...]:
    """The ids that end a completion: the tokenizer's EOS, plus `stop_token_id` (e.g. end of turn).

    Completions always stop at EOS (TRL 0.19's PPO/RLOO sampled to response_length unless told
    otherwise, TRL#2387, which wastes time and feeds the reward model text after EOS).
    `stop_token="eos"` is accepted for TRL command lines and means the EOS id.
    """
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    if config.stop_token_id is not None:
        if not 0 <= config.stop_token_id < len(tokenizer):
            raise ConfigError(
                f"stop_token_id={config.stop_token_id} is outside the tokenizer's vocabulary (ids 0 to "
                f"{len(tokenizer) - 1}): it could never be sampled. Use an id the tokenizer has, e.g. "
                "tokenizer.convert_tokens_to_ids('<|im_end|>'), or --stop_token eos."
            )
        if config.stop_token_id not in ids:
            ids.append(int(config.stop_token_id))
    return tuple(ids)


def sampling_config(config: OnPolicyConfig, tokenizer: Any, max_new_tokens: int | None = None) -> SamplingConfig:
    return SamplingConfig(
        max_new_tokens=max_new_tokens or config.response_length,
        temperature=config.temperature,
        top_k=config.top_k,
        top_p=config.top_p,
        do_sample=config.temperature > 0,
        stop_token_ids=stop_token_ids(config, tokenizer),
        # GRPO / RLOO (configs.GroupRolloutOptions); the other online configs have neither field
        min_p=getattr(config, "min_p", None) or 0.0,
        repetition_penalty=getattr(config, "repetition_penalty", 1.0),
        generation_kwargs=transformers_generation_kwargs(config),
    )


# ---------------------------------------------------------------------------------------------
# loading the parts of a run: one loader for the command line and the Python API
# ---------------------------------------------------------------------------------------------
@dataclass
class Parts:
    """What a trainer trains with, resolved from objects, paths and the config."""

    tokenizer: Any
    policy: nn.Module
    reference: nn.Module | None
    rewards: list[Any]  # reward models (nn.Module) and reward functions, in order
    reward_tokenizer: Any
    train_dataset: Any
    eval_dataset: Any
    peft_config: Any = None  # a peft.LoraConfig: only the adapter trains; the reference is the adapter off
    # positions.PositionLimit of the policy, reference and reward models: prompt + completion must fit each
    position_limits: list[Any] = dataclasses.field(default_factory=list)
    # each reward's own tokenizer, aligned with `rewards`: None for a reward function or a reward model
    # that reads the policy's token ids (`reward_tokenizer`: the first reward model's, as PPO's critic wants)
    reward_tokenizers: list[Any] = dataclasses.field(default_factory=list)
    # TRL's `trainer.reward_processing_classes`: each reward model's tokenizer (its own, or the policy's
    # when it has none), None for a reward function; aligned with `rewards`
    reward_processing_classes: list[Any] = dataclasses.field(default_factory=list)


def as_list(x: Any) -> list[Any]:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _model_path(model: Any) -> str | None:
    if isinstance(model, (str, os.PathLike)):
        return os.fspath(model)
    return getattr(getattr(model, "config", None), "_name_or_path", None) or None


def warn_no_test_split(config: OnPolicyConfig) -> None:
    """The dataset has no dataset_test_split: say, once, that the sample tables are off and how to
    get them back (they are drawn from the eval prompts)."""
    split = config.dataset_test_split
    warnings.warn(
        f"the dataset {config.dataset_name!r} has no {split!r} split (--dataset_test_split {split}), so this run "
        "draws no sample tables of completions and cannot evaluate. To get them back, pass --dataset_test_split "
        "<split> naming a split the dataset has, or eval_dataset= in Python; --num_sample_generations 0 turns "
        "the tables, and this warning, off.",
        stacklevel=4,
    )


# TRL's words (its tests match them), then the fix
MISSING_TRAIN_DATASET = "`train_dataset` is required: pass a prompt dataset (or --dataset_name on the command line)."


def load_parts(
    config: OnPolicyConfig,
    *,
    model: Any = None,
    ref_model: Any = None,
    rewards: Any = None,
    processing_class: Any = None,
    reward_processing_class: Any = None,
    train_dataset: Any = None,
    eval_dataset: Any = None,
    peft_config: Any = None,
    needs_reference: bool = False,
    needs_reward: bool = True,
    rewards_from_config: bool = True,
) -> Parts:
    """Resolve every part of an online run; what is not given comes from the config.

    model / ref_model: a module, a hub id or folder, or None (config.sft_model_path, which defaults
    to model_name_or_path). rewards: reward models (modules or paths) and reward functions, or None
    (config.reward_model_path first, then config.reward_funcs). processing_class None: the
    tokenizer of config.model_name_or_path or of the model. A reward model given by path brings the
    tokenizer saved with it (completions are re-tokenized when it differs); a reward model saved
    without one shares the policy's. Datasets None: config.dataset_name's train / test split (no
    test split: a warning, and no sample tables). With the model loaded from the config,
    `--use_peft` gives the LoRA config. The reference is None (not loaded) when not needed or with
    PEFT; the trainer then copies the policy or disables the adapter. rewards_from_config False: no
    reward from the config (e.g. a judge was given). Cheap checks (paths set, reward functions
    importable, data readable) run before any model loads.
    """
    from posttrain.models import ensure_pad_token, load_policy, load_reward_model, load_tokenizer, peft_config_from

    from_config = model is None
    if from_config:
        model = config.sft_model_path
        if not model:
            raise ConfigError("no policy: pass --model_name_or_path (or --sft_model_path), a folder or a hub name.")
        if peft_config is None:
            peft_config = peft_config_from(config)
    rewards = as_list(rewards)
    if not rewards and rewards_from_config:
        rewards = ([config.reward_model_path] if config.reward_model_path else []) + [
            import_reward_function(path) for path in config.reward_funcs or []
        ]
        if needs_reward and not rewards:
            raise ConfigError(
                "No reward source provided: pass reward_model (a reward model or reward functions), or on the command "
                "line --reward_model_path (a reward model) and/or --reward_funcs (module:function ...)."
            )
    if train_dataset is None and config.dataset_name:
        train_dataset = load_split(config, config.dataset_train_split, streaming=config.dataset_streaming)
        if eval_dataset is None:
            eval_dataset = load_split(config, config.dataset_test_split, required=False)
            if eval_dataset is None and config.num_sample_generations > 0:
                warn_no_test_split(config)
    # A missing or wrong dataset, or an impossible batch arithmetic, is refused before any model loads.
    if train_dataset is None:
        raise ConfigError(MISSING_TRAIN_DATASET)
    check_prompt_columns(train_dataset, source="train_dataset")
    check_streaming(config, train_dataset)
    check_sizes_early(config, train_dataset)
    common = model_init_kwargs(config)
    if processing_class is None:
        path = config.model_name_or_path if from_config else _model_path(model)
        if not path:
            raise ConfigError(
                "processing_class (the policy's tokenizer) is required when the model was not loaded from a path."
            )
        processing_class = load_tokenizer(path, trust_remote_code=config.trust_remote_code)
    tokenizer = ensure_pad_token(processing_class)
    stop_token_ids(config, tokenizer)  # an impossible stop token is refused before any model loads

    def policy_from(m: Any) -> nn.Module:
        if not isinstance(m, (str, os.PathLike)):
            return m
        return load_policy(
            m,
            gradient_checkpointing=config.gradient_checkpointing,
            gradient_checkpointing_kwargs=config.gradient_checkpointing_kwargs,
            disable_dropout=config.disable_dropout,
            tokenizer=tokenizer,
            **common,
        )

    policy = policy_from(model)
    if ref_model is None and needs_reference and from_config and peft_config is None:
        ref_model = model  # the CLI loads the reference from the same path
    reference = policy_from(ref_model) if ref_model is not None else None
    loaded, reward_tokenizers, resolved = [], [], []
    for r, given in zip(rewards, reward_tokenizers_given(reward_processing_class, rewards)):
        own = given
        if own is None and (isinstance(r, (str, os.PathLike)) or isinstance(r, nn.Module)):
            # TRL: a reward model without a given tokenizer uses the one saved with it
            path = r if isinstance(r, (str, os.PathLike)) else _model_path(r)
            if path:
                try:
                    own = load_tokenizer(path, trust_remote_code=config.trust_remote_code)
                except (OSError, ValueError):
                    pass  # no tokenizer saved with the reward model: it shares the policy's
        if isinstance(r, (str, os.PathLike)):
            r = load_reward_model(r, tokenizer=own or tokenizer, disable_dropout=config.disable_dropout, **common)
        loaded.append(r)
        # None: the reward model reads the policy's token ids as they are
        same = own is None or not isinstance(r, nn.Module) or same_tokenizer(tokenizer, own)
        reward_tokenizers.append(None if same else own)
        resolved.append((own or tokenizer) if isinstance(r, nn.Module) else None)
    limits = positions.limits_of(
        [("policy", policy, None), ("reference model", reference, None)]
        + [("reward model", r, t) for r, t in zip(loaded, reward_tokenizers) if isinstance(r, nn.Module)]
    )
    first = next((t for r, t in zip(loaded, reward_tokenizers) if isinstance(r, nn.Module) and t is not None), None)
    return Parts(
        tokenizer,
        policy,
        reference,
        loaded,
        first,
        train_dataset,
        eval_dataset,
        peft_config,
        limits,
        reward_tokenizers,
        resolved,
    )


def reward_tokenizers_given(reward_processing_class: Any, rewards: list[Any]) -> list[Any]:
    """The tokenizer given for each reward: a list (TRL's reward_processing_classes, aligned with the
    rewards; None: the reward model's own, an entry for a reward function is not used), or one
    tokenizer for every reward model, or None."""
    if not isinstance(reward_processing_class, (list, tuple)):
        return [reward_processing_class] * len(rewards)
    if len(reward_processing_class) != len(rewards):
        raise ConfigError(
            f"reward_processing_classes has {len(reward_processing_class)} entries for {len(rewards)} rewards "
            "(reward_funcs); the lengths must match: give one per reward, in the same order, a reward model's "
            "tokenizer or None (a reward function, or a reward model that uses the tokenizer saved with it)."
        )
    return list(reward_processing_class)


def prepare_policy(
    policy: nn.Module,
    reference: nn.Module | None,
    config: OnPolicyConfig,
    *,
    peft_config: Any,
    needs_reference: bool,
    accelerator: Any = None,
) -> tuple[nn.Module, nn.Module | None]:
    """(policy, reference) ready to train: LoRA applied (only the adapter trains), dropout off in both
    (LoRA dropout included), the reference frozen in eval mode. No reference given: a frozen copy of
    the initial policy, or None with PEFT, meaning "the policy with its adapter disabled"; on a GPU
    that will hold the policy whole (`distributed.early_device`; `accelerator`: one passed in by the
    user) the policy moves there first and is copied there, not in host memory. A
    models.CausalLMWithValueHead (PPO's policy with a value head) is prepared through its LM, and a
    reference given as one is its LM (the reference only scores tokens). GRPO's cast_lm_head_to_fp32:
    both models' LM heads become models.Float32LMHead."""
    from posttrain.models import (
        CausalLMWithValueHead,
        apply_peft,
        cast_lm_head_to_fp32,
        disable_dropout,
        enable_gradient_checkpointing,
        is_peft_model,
    )

    if isinstance(reference, CausalLMWithValueHead):
        reference = reference.pretrained_model
    if isinstance(policy, CausalLMWithValueHead):
        policy.pretrained_model, reference = prepare_policy(
            policy.pretrained_model,
            reference,
            config,
            peft_config=peft_config,
            needs_reference=needs_reference,
            accelerator=accelerator,
        )
        return policy, reference
    if reference is not None and reference is policy:
        raise ConfigError("the reference model is the policy object itself; pass a separate copy (or None to copy it).")
    policy = apply_peft(policy, peft_config)
    if getattr(config, "cast_lm_head_to_fp32", False):  # GRPO: policy and reference (a copy made below is cast)
        for model in (policy, reference):
            if model is not None:
                cast_lm_head_to_fp32(model)
    if needs_reference and reference is None and not is_peft_model(policy):
        target = dist.early_device(config, accelerator)
        if target is not None and not getattr(policy, "hf_device_map", None):
            policy.to(target)  # where the run would move it anyway (a device_map'd model stays where it is)
        reference = copy.deepcopy(policy)  # the initial policy, frozen
    if config.disable_dropout:
        for model in (policy, reference):
            if model is not None:
                disable_dropout(model)
    if config.gradient_checkpointing and not getattr(policy, "is_gradient_checkpointing", True):
        enable_gradient_checkpointing(policy, config.gradient_checkpointing_kwargs)
    if reference is not None:
        reference.eval().requires_grad_(False)
    return policy, reference


# ---------------------------------------------------------------------------------------------
# the run: accelerator, prompts, metrics, checkpoints
# ---------------------------------------------------------------------------------------------
def default_config(config_cls: type, model: Any, algo: str) -> OnPolicyConfig:
    """TRL's default when a trainer gets no config: `config_cls(output_dir=f"{model_name}-{algo}")`,
    model_name = the last part of the model's hub id or path (the config's default output_dir for a
    model built in memory)."""
    name = model if isinstance(model, (str, os.PathLike)) else _model_path(model)
    if not name:
        return config_cls()
    return config_cls(output_dir=f"{os.fspath(name).rstrip('/').split('/')[-1]}-{algo}")


STREAMING_EPOCH_STRATEGIES = ("logging_strategy", "eval_strategy", "save_strategy")


def check_streaming(config: OnPolicyConfig, train_dataset: Any) -> None:
    """A streaming train set (datasets.IterableDataset) has no length: the run needs max_steps (or
    total_episodes) to know when to stop, and cannot tell where an epoch ends before reading past it,
    so "epoch" logging / eval / save strategies are refused. As TRL does for iterable sets,
    dataloader_num_workers is set to 0 (the prompts are read in the training process) and
    accelerator_config's dispatch_batches to False (every process reads the stream itself)."""
    if not is_streaming(train_dataset):
        return
    stream = "train_dataset is a streaming datasets.IterableDataset (load_dataset(..., streaming=True))"
    if config.max_steps <= 0 and config.total_episodes is None:
        raise ConfigError(
            f"{stream}, which has no length, so the number of training steps is unknown: set max_steps "
            "(optimizer steps) to say when to stop, or load it without streaming=True."
        )
    for name in STREAMING_EPOCH_STRATEGIES:
        if str(getattr(config, name, "")).split(".")[-1].lower() == "epoch":
            raise ConfigError(
                f'{stream}, whose epochs end only when the stream does: {name}="epoch" cannot be honoured; '
                f'use {name}="steps" with a number of steps.'
            )
    # (dispatch_batches=True itself is refused with the config: posttrain.distributed.ACCELERATOR_CONFIG_KEYS)
    config.accelerator_config = AcceleratorConfig({**(config.accelerator_config or {}), "dispatch_batches": False})
    config.dataloader_num_workers = 0


def check_sizes_early(config: OnPolicyConfig, train_dataset: Any) -> None:
    """`derive_sizes` on a copy of the config, with this launch's world size and the dataset's rows as
    given, so sizes that cannot divide are refused before any model loads. The config itself is
    left as it is: OnlineRun derives the sizes again from the validated dataset (overflow="drop"
    may remove prompts)."""
    from datasets import Dataset

    rows = len(train_dataset) if isinstance(train_dataset, (Dataset, list)) else 0
    if not rows and config.total_episodes is None and config.max_steps <= 0:
        return  # no dataset size yet (or none to count): it decides total_episodes once prepared
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        derive_sizes(copy.copy(config), launch_world_size(), rows)


def derive_sizes(config: OnPolicyConfig, world_size: int, dataset_size: int) -> None:
    """config.derive_sizes; a total_episodes smaller than one rollout batch runs one batch, with a
    warning (TRL's trainers do the same instead of stopping)."""
    requested = config.total_episodes
    try:
        config.derive_sizes(world_size, dataset_size)
    except ConfigError:
        if requested is None or not getattr(config, "batch_size", None) or requested >= config.batch_size:
            raise
        warnings.warn(
            f"total_episodes={requested} is smaller than one rollout batch ({config.batch_size} completions); "
            "running one batch.",
            stacklevel=4,
        )
        config.total_episodes = config.batch_size
        config.derive_sizes(world_size, dataset_size)


@dataclass
class RunProgress:
    """Counters that a checkpoint must restore for an exact resume (`OnlineRun.progress`; the
    transformers.TrainerState that callbacks see is `OnlineTrainer.state`)."""

    update: int = 0  # rollout batches done
    episode: int = 0  # completions generated (global)
    optimizer_steps: int = 0


class OnlineRun:
    """The environment of one online training run.

    Owns: the accelerator (one per run; gradient accumulation is done here with exact global
    normalization, so accelerate's own loss scaling stays off), derived sizes (validated before any
    forward pass), the prompt stream, the tracker and progress bar, metric accumulation, the health
    monitor (`health`: registered as the trainer's first callback by `OnlineTrainer.setup`; its
    non-finite counters serve `step_if_finite`; its state is checkpointed), checkpointing and resume.
    """

    # This train() call's loss tally and the stop request (set in __init__ and by updates(); class
    # defaults for runs built without __init__, e.g. the classic PPO step() run).
    loss_total, loss_steps, stop_requested = 0.0, 0, False
    # Called with progress.optimizer_steps after each optimizer step taken (e.g. `sync_reference`).
    step_hooks: Sequence[Callable[[int], None]] = ()
    # positions.PositionLimit of the models reading the prompts (eval sets prepared later use them too)
    position_limits: Sequence[Any] = ()

    def __init__(
        self,
        config: OnPolicyConfig,
        tokenizer: Any,
        train_dataset: Any,
        eval_dataset: Any = None,
        *,
        accelerator: Any = None,
        data_collator: Callable | None = None,
        position_limits: Sequence[Any] = (),
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.accelerator = accelerator or dist.accelerator_for(config)
        runtime.apply_log_levels(config, self.accelerator)
        runtime.seed_run(config)
        self.world_size = dist.world_size(self.accelerator)
        self.device = dist.device(self.accelerator)
        self.is_main = dist.is_main(self.accelerator)
        if train_dataset is None:
            raise ConfigError(MISSING_TRAIN_DATASET)
        self.streaming = is_streaming(train_dataset)
        check_streaming(config, train_dataset)
        self.position_limits = list(position_limits)
        self.train_dataset = prompt_dataset(
            config, tokenizer, train_dataset, source="train_dataset", limits=position_limits
        )
        # Sizes count the prompts that survived validation (overflow="drop" may remove some); a
        # streaming set has no size: max_steps decides (check_streaming).
        derive_sizes(config, self.world_size, None if self.streaming else len(self.train_dataset))
        # A resume at another world size keeps the global batch, and a DeepSpeed checkpoint its ZeRO
        # stage and world size: checked before any model step.
        resume = ckpt.resolve_checkpoint(config.output_dir, config.resume_from_checkpoint)
        ckpt.check_resume_deepspeed(resume, self.accelerator)
        ckpt.check_resume_batch(
            resume,
            world_size=self.world_size,
            sizes=self.batch_sizes(),
            accumulation=config.gradient_accumulation_steps,
        )
        # The prepared eval prompts: None, one dataset, or a dict name -> dataset (named eval sets).
        self.eval_dataset = self.prepare_eval(eval_dataset)
        from posttrain.data import PromptCollator

        self.collate = data_collator or PromptCollator(tokenizer.pad_token_id)
        self.prompts = self.prompt_stream(
            config.prompts_per_rollout,
            rank=dist.process_index(self.accelerator),
            world_size=self.world_size,
            # shuffle_dataset: GRPO / RLOO (configs.GroupRolloutOptions); train_sampling_strategy: every trainer
            shuffle=getattr(config, "shuffle_dataset", True) and config.train_sampling_strategy != "sequential",
        )
        self.sampling = sampling_config(config, tokenizer)
        # Sampling stream: one per rank, seeded so runs are reproducible and ranks differ.
        self.generator = torch.Generator(device=self.device).manual_seed(
            config.seed + 7919 * dist.process_index(self.accelerator)
        )
        self.progress = RunProgress()
        self.metrics = MetricAccumulator()
        self.tracker = Tracker(
            config.output_dir,
            config.report_to,
            config=config.to_dict(),
            run_name=config.run_name,
            is_main=self.is_main,
            logging_dir=config.logging_dir,
        )
        from posttrain.callbacks import Cadence

        # One step = one rollout batch; its epoch counts the episodes generated by then.
        self.cadence = Cadence(config, config.num_total_batches, lambda step: self.epoch(step * config.batch_size))
        self.health = HealthMonitor(enabled=self.is_main)
        self.progress_bar: ProgressBar | None = None
        self.start_time = time.time()
        self.episodes_at_start = 0
        # This train() call's optimizer steps and the sum of their global losses (the end-of-training
        # summary's train_loss), and whether a callback asked to stop after the current rollout batch.
        self.loss_total, self.loss_steps = 0.0, 0
        self.stop_requested = False
        self.step_hooks = []

    def batch_sizes(self) -> dict[str, int]:
        """The global sizes a checkpoint records and a resume must keep (checkpoint.check_resume_batch)."""
        return {"global batch per optimizer step": self.config.mini_batch_size, "rollout batch": self.config.batch_size}

    def autocast(self):
        """bf16/fp16 autocast for forwards when mixed precision is on (CPU AMX or GPU)."""
        if self.config.mixed_precision == "no":
            return contextlib.nullcontext()
        return self.accelerator.autocast()

    # -- the outer loop ---------------------------------------------------------------------------
    def updates(self) -> Iterator[int]:
        """Yield rollout-batch indices from the resumed position to num_total_batches − 1, or until
        `stop_requested` (a callback's control.should_training_stop, set by end_of_update)."""
        total = self.config.num_total_batches
        self.progress_bar = ProgressBar(
            self.config.total_episodes, disable=not self.is_main or bool(self.config.disable_tqdm)
        )
        self.progress_bar.update(self.progress.episode)
        self.episodes_at_start = self.progress.episode
        self.start_time = time.time()
        self.loss_total, self.loss_steps, self.stop_requested = 0.0, 0, False
        try:
            while self.progress.update < total and not self.stop_requested:
                yield self.progress.update
                self.progress.update += 1
                self.progress.episode += self.config.batch_size
                self.progress_bar.update(self.config.batch_size)
        finally:
            self.progress_bar.close()

    def to_device(self, batch: dict) -> dict:
        batch["input_ids"] = batch["input_ids"].to(self.device)
        batch["attention_mask"] = batch["attention_mask"].to(self.device)
        return batch

    def next_batch(self) -> dict:
        return self.to_device(next(self.prompts))

    def prepare_eval(self, eval_dataset: Any) -> Any:
        """An eval set (or a dict of named ones; streaming sets are read into memory) prepared as the
        run's prompts are: None, a prepared dataset, or a dict name -> prepared dataset."""
        return eval_dataset_sets(self.config, self.tokenizer, eval_dataset, limits=self.position_limits)

    @property
    def eval_sets(self) -> dict[str | None, Any]:
        """The prepared eval sets by name (None: the one unnamed set); empty without an eval set."""
        if self.eval_dataset is None:
            return {}
        return dict(self.eval_dataset) if isinstance(self.eval_dataset, dict) else {None: self.eval_dataset}

    @property
    def sample_dataset(self) -> Any:
        """The prepared eval prompts the sample tables draw from: the eval set, or the first named one."""
        return next(iter(self.eval_sets.values()), None)

    def eval_prompts(self, n: int) -> dict:
        data = self.sample_dataset
        rows = [data[i] for i in range(min(n, len(data)))]
        return self.to_device(self.collate(rows))

    @property
    def eps(self) -> float:
        """Episodes per second since this process started training (TRL's `eps`)."""
        elapsed = max(time.time() - self.start_time, 1e-9)
        return (self.progress.episode + self.config.batch_size - self.episodes_at_start) / elapsed

    # -- statistics over the whole rollout batch --------------------------------------------------
    def batch_moments(self, values: torch.Tensor, mask: torch.Tensor | None = None) -> tuple | None:
        """(mean, unbiased variance) of `values` over the True positions of `mask` on ALL ranks, for the
        whitening / normalization functions of advantages.py, so N processes transform exactly like
        one process with the global batch (TRL whitens per rank). None on one process: the pure
        functions then compute the statistics themselves."""
        if self.world_size == 1:
            return None
        return dist.global_moments(values, mask, self.accelerator)

    def prompt_stream(self, batch_size: int, *, rank: int = 0, world_size: int = 1, shuffle: bool = True) -> Any:
        """The stream of `batch_size` prepared prompts per batch over this run's train set: PromptStream
        (reshuffled per epoch from the data seed when `shuffle`), or for a streaming set StreamedPrompts
        (the stream's order), whose batches are checked against the reward models that re-tokenize
        them as they are read."""

        def check(rows: list[dict]) -> None:
            check_prompt_batch(
                rows, self.position_limits, response_length=self.config.response_length, source="train_dataset"
            )

        if self.streaming:
            return StreamedPrompts(self.train_dataset, batch_size, self.collate, rank, world_size, check)
        seed = runtime.data_seed(self.config)
        return PromptStream(self.train_dataset, batch_size, self.collate, seed, rank, world_size, shuffle)

    def epoch(self, episode: int) -> float:
        """Passes over the prompt dataset after `episode` completions (each prompt sampled
        samples_per_prompt times per pass); of a streaming set, which has no length, the passes
        completed so far."""
        if self.streaming:
            return float(self.prompts.epoch) if hasattr(self, "prompts") else 0.0
        return episode / max(len(self.train_dataset) * self.config.samples_per_prompt, 1)

    # -- logging, health, checkpoints -------------------------------------------------------------
    def should_log(self, update: int) -> bool:
        """logging_strategy / logging_steps / logging_first_step; the last rollout batch logs unless "no"."""
        last = update + 1 == self.config.num_total_batches and self.config.logging_strategy != "no"
        return self.cadence.log_due(update + 1) or last

    def log(self, update: int, extra: dict[str, float]) -> dict[str, float]:
        """Reduce accumulated metrics across ranks (one all-reduce), add counters, write to sinks."""
        values = self.metrics.reduce(self.accelerator)
        self.metrics.reset()
        values.update(extra)
        values["eps"] = self.eps
        values["episode"] = self.progress.episode + self.config.batch_size
        values["epoch"] = self.epoch(values["episode"])
        self.tracker.log(values, step=update + 1)
        return values

    def should_sample(self, update: int) -> bool:
        freq = self.config.sample_generations_freq
        return freq > 0 and self.eval_dataset is not None and (update + 1) % freq == 0

    def should_save(self, update: int) -> bool:
        """save_strategy "steps" / "epoch" (save_strategy "best" is decided after an evaluation); never
        after the last rollout batch (the final save follows)."""
        return self.cadence.save_due(update + 1) and update + 1 < self.config.num_total_batches

    def save(
        self,
        models: dict[str, nn.Module],
        optimizer: Any,
        scheduler: Any,
        extra: dict | None = None,
        best: str | None = None,
        after_batch: bool = True,
    ) -> None:
        """A resumable checkpoint after the current rollout batch (whose update and episode counters
        advance after this call), or with after_batch=False of the counters as they are."""
        done = int(after_batch)
        step = self.progress.update + done
        state = {
            "run": {
                "update": step,
                "episode": self.progress.episode + done * self.config.batch_size,
                "optimizer_steps": self.progress.optimizer_steps,
            },
            "prompts": self.prompts.state_dict(),
            "health": self.health.state_dict(),
            **(extra or {}),
        }
        unwrapped = {k: dist.unwrap(m, self.accelerator) for k, m in models.items()}
        ckpt.save_checkpoint(
            self.config.output_dir,
            step,
            models=unwrapped,
            tokenizer=self.tokenizer,
            config=self.config.to_dict(),
            optimizer=optimizer,
            scheduler=scheduler,
            trainer_state=state,
            save_total_limit=self.config.save_total_limit,
            accelerator=self.accelerator,
            best=best,
            model_only=self.config.save_only_model,
            on_each_node=self.config.save_on_each_node,
            # Each rank's own sampling stream.
            rank_state={"generator": self.generator.get_state()},
            batch=self.batch_sizes(),
        )

    def maybe_resume(self, models: dict[str, nn.Module], optimizer: Any, scheduler: Any) -> dict:
        """Restore weights, optimizer, scheduler, RNG, counters and data position; return the extra state."""
        path = ckpt.resolve_checkpoint(self.config.output_dir, self.config.resume_from_checkpoint)
        if path is None:
            return {}
        unwrapped = {k: dist.unwrap(m, self.accelerator) for k, m in models.items()}
        state = ckpt.load_checkpoint(
            path, models=unwrapped, optimizer=optimizer, scheduler=scheduler, accelerator=self.accelerator
        )
        run = state.pop("run")
        self.progress = RunProgress(
            update=run["update"], episode=run["episode"], optimizer_steps=run["optimizer_steps"]
        )
        self.prompts.load_state_dict(state.pop("prompts"))
        # A rank that did not exist when the checkpoint was saved keeps its freshly seeded stream;
        # checkpoints of older versions hold the main process's stream as "generator".
        legacy = state.pop("generator", None)
        generator = (state.pop("rank_state", None) or {}).get("generator", legacy)
        if generator is not None:
            self.generator.set_state(generator)
        self.health.load_state_dict(state.pop("health", {}))
        if self.is_main:
            print(f"Resumed from {path} at rollout batch {self.progress.update} (episode {self.progress.episode}).")
        return state

    def finish(self, model: nn.Module, extra_models: dict[str, nn.Module] | None = None) -> None:
        """Save the trained policy (and e.g. the critic) where plain transformers can load it.
        Called on every rank: under ZeRO-3 / FSDP the full weights are gathered collectively."""
        dist.wait_for_everyone(self.accelerator)
        ckpt.save_final(
            self.config.output_dir,
            dist.unwrap(model, self.accelerator),
            tokenizer=self.tokenizer,
            config=self.config.to_dict(),
            extra_models={k: dist.unwrap(m, self.accelerator) for k, m in (extra_models or {}).items()},
            accelerator=self.accelerator,
            on_each_node=self.config.save_on_each_node,
        )
        self.tracker.close()


# ---------------------------------------------------------------------------------------------
# sampling and scoring
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def sample(
    run: OnlineRun,
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    sampling: SamplingConfig | None = None,
    num_samples: int = 1,
    generator: torch.Generator | None = None,
    return_logprobs: bool = False,
) -> Rollout:
    """Completions of left-padded prompts from `model` (the policy, possibly DDP-wrapped, or a
    reference), in generation mode, with the run's sampling settings and sampling stream."""
    config = run.config
    multiple = getattr(config, "pad_to_multiple_of", None)  # GRPO / RLOO (configs.GroupRolloutOptions)
    with (
        dist.unwrap_for_generation(model, run.accelerator, config.ds3_gather_for_generation) as wrapped,
        uncompiled(wrapped) as m,  # torch_compile compiles training forwards only
        generation_mode(m),
        run.autocast(),
    ):
        return generate(
            m,
            prompt_ids,
            prompt_mask,
            sampling or run.sampling,
            pad_token_id=run.tokenizer.pad_token_id,
            num_samples=num_samples,
            batch_size=config.local_rollout_forward_batch_size,
            generator=run.generator if generator is None else generator,
            return_logprobs=return_logprobs,
            **decode_engine(config.cache_implementation, m),
        ).padded_to_multiple(multiple)


def forked_generator(generator: torch.Generator) -> torch.Generator:
    """A new generator on `generator`'s device, seeded with one draw from it."""
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
    return torch.Generator(device=generator.device).manual_seed(seed)


# The largest model whose rollouts run side by side with another's (decodes_side_by_side). Measured on a 2-core
# CPU (benchmarks/README.md, "XPO's two rollouts side by side"): two 8-row rollouts of 53 tokens took 27–41% less
# time side by side from 2.9M to 15.9M parameters; at 25.9M (the bench's 70m), with the trainers' oneDNN layers,
# 16% less, no difference end to end, and 7–10% more peak memory (both models' packed weights live at once).
SIDE_BY_SIDE_MAX_PARAMETERS = 16_000_000


def decodes_side_by_side(run: OnlineRun, model: nn.Module, ref_model: nn.Module | None) -> bool:
    """Whether the policy's and a reference model's rollouts of one step run at the same time
    (`runtime.side_by_side`): float32 on CPU with at least two threads, a reference model of its own (not
    the adapter-disabled policy, no shared parameters), neither with more than SIDE_BY_SIDE_MAX_PARAMETERS
    parameters, no process group of DeepSpeed or FSDP (whose gathers are collectives), no compiled
    static-cache step, and POSTTRAIN_CONCURRENT_DECODE not `off`."""
    config = run.config
    if ref_model is None or concurrent_decode_mode() == "off" or torch.get_num_threads() < 2:
        return False
    if run.device.type != "cpu" or config.mixed_precision != "no" or config.cache_implementation == "static":
        return False
    if getattr(run.accelerator, "distributed_type", "NO") not in ("NO", "MULTI_CPU"):
        return False
    policy = dist.unwrap(model, run.accelerator)
    if ref_model is policy:
        return False
    own = {id(p): p.numel() for p in policy.parameters()}
    theirs = [(id(p), p.numel()) for p in ref_model.parameters()]
    if any(key in own for key, _ in theirs):
        return False
    return max(sum(own.values()), sum(n for _, n in theirs)) <= SIDE_BY_SIDE_MAX_PARAMETERS


def sample_with_reference(
    run: OnlineRun, model: nn.Module, ref_model: nn.Module | None, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor
) -> tuple[Rollout, Rollout]:
    """One completion per prompt from the policy and one from the reference (XPO's pair).

    The policy draws from the run's sampling stream; the reference from a stream forked from it (one draw
    per call), so its tokens do not depend on which rollout ran first. A tiny model's decode step is
    per-operator overhead, so where `decodes_side_by_side` allows, the two rollouts run at the same time on
    two threads, each with half of torch's threads: at 14m on two cores two 8-row rollouts then take about
    as long as one (benchmarks/README.md, "XPO's two rollouts side by side").
    """
    fork = forked_generator(run.generator)
    if decodes_side_by_side(run, model, ref_model):
        return runtime.side_by_side(
            lambda: sample(run, model, prompt_ids, prompt_mask),
            lambda: sample(run, ref_model, prompt_ids, prompt_mask, generator=fork),  # in generation mode, as below
        )
    policy_rollout = sample(run, model, prompt_ids, prompt_mask)
    with reference_policy(model, ref_model, run.accelerator) as ref:
        return policy_rollout, sample(run, ref, prompt_ids, prompt_mask, generator=fork)


def row_texts(
    run: OnlineRun, batch: dict, rollout: Rollout, repeat: int, *, blocks: bool, messages: bool = False
) -> tuple[list, list, dict]:
    """Per-row prompt texts, completion texts and extra dataset columns (for reward functions and
    judges) of a rollout whose rows are the batch's prompts repeated `repeat` times, as blocks
    (row = sample·P + prompt) or prompt-major (row = prompt·repeat + sample); `rows_texts` with
    those rows' prompt indices."""
    P = len(batch["prompt"])
    prompts = list(range(P)) * repeat if blocks else [p for p in range(P) for _ in range(repeat)]
    return rows_texts(run, batch, rollout, prompts, messages=messages)


def rows_texts(
    run: OnlineRun, batch: dict, rollout: Rollout, prompt_index: Sequence[int], *, messages: bool = False
) -> tuple[list, list, dict]:
    """Per-row prompts, completions and extra dataset columns of a rollout whose row i completes the
    batch's prompt prompt_index[i]. With `messages` (TRL GRPO's form, and RLOO's from TRL 0.21), a
    conversational row's prompt is its list of messages as the dataset gave it and its completion
    [{"role": "assistant", "content": text}] (text decoded without special tokens; TRL 1.x adds no
    prefilled assistant content to it); a plain-text row keeps its texts."""
    skip = ("input_ids", "attention_mask", "prompt", PROMPT_MESSAGES)
    columns = {k: [v[p] for p in prompt_index] for k, v in batch.items() if k not in skip}
    prompts, completions = [batch["prompt"][p] for p in prompt_index], decode_completions(run.tokenizer, rollout)
    if messages and PROMPT_MESSAGES in batch:
        for i, p in enumerate(prompt_index):
            chat = batch[PROMPT_MESSAGES][p]
            if chat is not None:
                prompts[i], completions[i] = chat, [{"role": "assistant", "content": completions[i]}]
    return prompts, completions, columns


def score_rewards(run: OnlineRun, reward: RewardSource, rollout: Rollout, batch: dict, k: int) -> torch.Tensor:
    """Each reward's scores (B, F) (`RewardSource.per_reward`: unweighted, NaN where a reward function
    returned None) of a rollout whose prompts are `batch` repeated as k blocks; texts are decoded only
    for reward functions. Non-finite scores stop the run with a message."""
    n = len(rollout)
    prompts, completions, columns = [""] * n, [""] * n, {}
    if reward.needs_texts:
        prompts, completions, columns = row_texts(run, batch, rollout, k, blocks=True, messages=reward.messages)
    with run.autocast():
        rewards = reward.per_reward(rollout, prompts, completions, columns)
    reward.check_finite(rewards)
    return rewards


def score(run: OnlineRun, reward: RewardSource, rollout: Rollout, batch: dict, k: int) -> torch.Tensor:
    """Scores (B,) of a rollout whose prompts are `batch` repeated as k blocks: the weighted sum of
    `score_rewards`, minus missing_eos_penalty (`RewardSource.weighted_sum`)."""
    return reward.weighted_sum(score_rewards(run, reward, rollout, batch, k), rollout.ended)


@torch.no_grad()
def reference_logprobs(
    run: OnlineRun, policy: nn.Module, ref_model: nn.Module | None, rollout: Rollout, temperature: float | None = None
) -> torch.Tensor:
    """log π_ref per completion token (B, T), 0 off-mask, at `temperature` (default the rollout's
    log-prob temperature); from ref_model or, when it is None, the PEFT policy with its adapter
    disabled."""
    with reference_policy(policy, ref_model, run.accelerator) as ref, run.autocast():
        logprobs, _ = batched_completion_logprobs(
            ref,
            rollout,
            batch_size=run.config.local_rollout_forward_batch_size,
            temperature=run.sampling.logprob_temperature if temperature is None else temperature,
        )
    return logprobs


@torch.no_grad()
def reference_full_kl(
    run: OnlineRun, policy: nn.Module, ref_model: nn.Module | None, rollout: Rollout, temperature: float
) -> torch.Tensor:
    """Exact per-token KL(π‖π_ref) over the vocabulary (advantages.full_kl), (B, T), 0 off-mask, in
    chunks of local_rollout_forward_batch_size rows; π_ref is ref_model or, when it is None, the PEFT
    policy with its adapter disabled. `policy` is the unwrapped causal LM. Both models return their last
    hidden states and both LM heads run on the same blocks of positions (scoring.forward_full_kl), so
    neither model's (rows, length, vocab) logits exist whole."""
    from posttrain.models import adapters_disabled

    size, out = run.config.local_rollout_forward_batch_size, []
    ordered, restore = chunk_order(rollout, size)
    with run.autocast():
        for start in range(0, len(rollout), size):
            part = ordered.select(slice(start, start + size))
            current = completion_forward(policy, part)
            if ref_model is not None:
                ref = completion_forward(ref_model, part)
            else:
                with adapters_disabled(policy):
                    ref = completion_forward(policy, part)
                if ref.chunked:  # the reference's LM head runs later, block by block: adapters off there too
                    ref.head = _with_adapters_disabled(policy, ref.head)
            out.append(forward_full_kl(current, ref, temperature=temperature))
    return in_rollout_order(torch.cat(out), restore)


def _with_adapters_disabled(policy: nn.Module, head: Any) -> Any:
    """`head`, run with the PEFT policy's adapters disabled (a LoRA-adapted LM head then acts as the base's)."""
    from posttrain.models import adapters_disabled

    def run(hidden: torch.Tensor) -> torch.Tensor:
        with adapters_disabled(policy):
            return head(hidden)

    return run


@dataclass
class Experience:
    """One rollout batch on this rank: row = sample_index · num_prompts + prompt_index."""

    rollout: Rollout
    scores: torch.Tensor  # (B,) float32, after missing_eos_penalty
    ref_logprobs: torch.Tensor | None  # (B, T), None without a reference
    kl: torch.Tensor | None  # (B, T) k1 = rollout logprobs − ref_logprobs, 0 off-mask
    num_prompts: int
    k: int
    rewards: torch.Tensor  # (B, F) each reward's own scores (RewardSource.per_reward), NaN where not applicable


@torch.no_grad()
def sample_and_score(
    run: OnlineRun,
    policy: nn.Module,
    ref_policy: nn.Module | None,
    reward: RewardSource,
    batch: dict,
    k: int,
    *,
    with_reference: bool,
    generator: torch.Generator | None = None,
    log_metrics: bool = True,
) -> Experience:
    """k completions per prompt, their scores and (with a reference) reference log-probs and k1 KL.

    Prompts are repeated as k blocks (TRL's `queries.repeat(rloo_k, 1)`), so `scores.view(k, P)` is
    the (sample, prompt) grid. with_reference: take reference log-probs from `ref_policy`, or with
    `ref_policy` None from the PEFT policy with its adapter disabled. Logs objective/scores, objective/entropy,
    objective/kl, val/num_eos_tokens and completions/mean_length (unless `log_metrics` is False: an
    evaluation); `generator`: the sampling stream (default the run's).
    """
    from posttrain.advantages import kl_penalty

    num_prompts = batch["input_ids"].size(0)
    rollout = sample(
        run,
        policy,
        batch["input_ids"].repeat(k, 1),
        batch["attention_mask"].repeat(k, 1),
        generator=generator,
        return_logprobs=True,
    )
    rewards = score_rewards(run, reward, rollout, batch, k)
    scores = reward.weighted_sum(rewards, rollout.ended)
    mask = rollout.completion_mask
    ref_logprobs = kl = None
    if with_reference:
        ref_logprobs = reference_logprobs(run, policy, ref_policy, rollout)
        kl = kl_penalty(rollout.logprobs, ref_logprobs, "k1", mask)
    if not log_metrics:
        return Experience(rollout, scores, ref_logprobs, kl, num_prompts, k, rewards)
    m = run.metrics
    if kl is not None:
        m.add_mean("objective/kl", kl.sum(-1))
    m.add_mean("objective/scores", scores)
    m.add_mean("objective/entropy", -(rollout.logprobs * mask).sum(-1))
    m.add_sum("val/num_eos_tokens", rollout.ended.sum())
    m.add_mean("completions/mean_length", rollout.completion_lengths.float())
    return Experience(rollout, scores, ref_logprobs, kl, num_prompts, k, rewards)


@torch.no_grad()
def log_reward_metrics(run: OnlineRun, reward: RewardSource, rewards: torch.Tensor, *, total: bool) -> None:
    """TRL 1.x's reward metrics of one rollout batch, over the rows of all ranks (`rewards` (B, F), as
    `score_rewards`; columns past the rewards', e.g. GRPO's missing-EOS column, are not reward columns):
    rewards/<name>/mean and rewards/<name>/std (unbiased) of each reward over the rows it applies to
    (a function's None, NaN, skipped; a metric with no value, or a std of fewer than 2 values, is left
    out of this batch); with `total`, reward and reward_std of Σ_f w_f·r_f (nansum; before
    missing_eos_penalty and any KL term)."""
    from posttrain.grpo_losses import nanstd

    everyone = dist.gather(rewards, run.accelerator).float()[:, : len(reward.items)]
    m = run.metrics

    def add(mean_name: str, std_name: str, values: torch.Tensor) -> None:
        applied = values[~torch.isnan(values)]
        if applied.numel():
            m.add(mean_name, applied.mean(), 1)
        if applied.numel() > 1:
            m.add(std_name, nanstd(applied), 1)

    for name, column in zip(reward.names, everyone.T):
        add(f"rewards/{name}/mean", f"rewards/{name}/std", column)
    if total:
        weights = torch.tensor(reward.weights, dtype=everyone.dtype, device=everyone.device)
        summed = (everyone * weights).nansum(-1)
        summed[torch.isnan(everyone).all(-1)] = torch.nan
        add("reward", "reward_std", summed)


def log_completions_table(
    trainer: OnlineTrainer, update: int, rollout: Rollout, rewards: torch.Tensor, advantages: torch.Tensor
) -> None:
    """log_completions (TRL 1.x GRPO / RLOO): the rollout batch of every process, as prompt, completion,
    each reward (its own, unweighted; None where it does not apply), advantage and the columns reward
    functions passed to `log_extra` for these rows, kept in `trainer._logs` after every rollout batch
    (TRL's attribute and layout: lists "prompt", "completion", "advantages", and dicts "rewards" and
    "extra" of one list per name) and, at a logging step, shown as a table of the first
    num_completions_to_print rows (None: all), printed with rich on the main process and written to
    samples.jsonl (table "rollout_completions"; also a wandb table); log_unique_prompts keeps the first
    row of each distinct prompt in that table.
    `rewards` (B, F) as `score_rewards` (extra columns past the rewards' are left out), `advantages` (B,)."""
    config, run = trainer.args, trainer.run
    if not config.log_completions:
        return
    acc = run.accelerator
    prompts = dist.gather_object(decode_prompts(run.tokenizer, rollout), acc)
    completions = dist.gather_object(decode_completions(run.tokenizer, rollout), acc)
    names = trainer.reward.names
    scores = dist.gather(rewards[:, : len(names)].float().contiguous(), acc).tolist()
    advantage = dist.gather(advantages.float().reshape(-1), acc).tolist()
    # Columns reward functions passed to `log_extra` while scoring this batch (one collective call).
    extra: dict[str, list[Any]] = {}
    for part in dist.gather_objects(dict(trainer.reward.logged_columns), acc):
        for column, values in part.items():
            extra.setdefault(column, []).extend(values)
    extra = {column: values for column, values in extra.items() if len(values) == len(prompts)}
    per_reward = {name: [None if row[j] != row[j] else row[j] for row in scores] for j, name in enumerate(names)}
    trainer._logs = {
        "prompt": prompts,
        "completion": completions,
        "rewards": per_reward,
        "advantages": advantage,
        "extra": extra,
        "images": [],
    }
    if not run.should_log(update):
        return
    picked = list(range(len(prompts)))
    if config.log_unique_prompts:  # the first completion of each distinct prompt
        first = {}
        for i, prompt in enumerate(prompts):
            first.setdefault(prompt, i)
        picked = list(first.values())
    shown = len(picked) if config.num_completions_to_print is None else config.num_completions_to_print
    rows = []
    for i in picked[:shown]:
        prompt, completion, a = prompts[i], completions[i], advantage[i]
        row = {"prompt": prompt, "completion": completion}
        row.update({name: values[i] for name, values in per_reward.items()})
        row.update({column: values[i] for column, values in extra.items()})
        rows.append({**row, "advantage": a})
    run.tracker.log_table("rollout_completions", rows, step=update + 1)


def log_function_metrics(run: OnlineRun, sources: Sequence[RewardSource]) -> None:
    """What reward functions passed to `log_metric` while scoring this rollout batch, into the run's
    metrics: each name's mean over the batch's values on all processes, added once per rollout batch,
    so a logging step reports the mean of its rollout batches' means (TRL 1.x). Called on every rank
    (the names are gathered so that every rank adds the same metrics). Columns passed to `log_extra`
    for training rollouts are forgotten here: `log_completions_table` has shown them (log_completions)."""
    local: dict[str, list[float]] = {}
    for source in sources:
        metrics, _ = source.take_logs()
        for name, values in metrics.items():
            local.setdefault(name, []).extend(values)
    names = sorted(set(local).union(*dist.gather_objects(sorted(local), run.accelerator)))
    if not names:
        return
    stats = [[sum(local.get(name, [])), float(len(local.get(name, [])))] for name in names]
    totals = dist.reduce_sum(torch.tensor(stats, dtype=torch.float64, device=run.device), run.accelerator)
    for name, (total, count) in zip(names, totals.tolist()):
        run.metrics.add(name, total / count, 1)  # every rank adds the global mean: the reduction keeps it


# ---------------------------------------------------------------------------------------------
# the update: micro-batches, the global normalizer, the one non-finite policy
# ---------------------------------------------------------------------------------------------
def micro_batches(indices: torch.Tensor, size: int) -> Iterator[torch.Tensor]:
    for start in range(0, indices.numel(), size):
        yield indices[start : start + size]


def global_normalizer(local_count: torch.Tensor | float, accelerator: Any) -> float:
    """The per-rank normalizer that makes a DDP-averaged gradient equal Σ_all / N_global.

    DDP averages gradients over ranks, so each rank divides its loss sum by N_global / world_size.
    Passing this to the losses makes micro-batching and data parallelism leave the loss unchanged
    (verl's global token-mean; TRL's per-micro-batch means do not have this property).
    """
    count = torch.as_tensor(local_count, dtype=torch.float32, device=dist.device(accelerator))
    total = dist.reduce_sum(count.clone(), accelerator)
    return max(float(total.item()) / dist.world_size(accelerator), 1e-8)


def backward_micro_batches(
    accelerator: Any, model: nn.Module, micros: Sequence[torch.Tensor], micro_loss: Callable[[torch.Tensor], Any]
) -> torch.Tensor:
    """Backward `micro_loss(rows)` (already divided by the minibatch's global normalizer) of each
    micro-batch, synchronising DDP gradients on the last one only; the summed detached loss."""
    total = torch.zeros((), device=dist.device(accelerator))
    for i, rows in enumerate(micros):
        with dist.no_sync_unless_last(accelerator, model, i == len(micros) - 1):
            loss = micro_loss(rows)
            accelerator.backward(loss)
        total = total + loss.detach().float()
    return total


def step_if_finite(
    model: nn.Module, optimizer: Any, loss: torch.Tensor, *, accelerator: Any, health: HealthMonitor, config: Any
) -> float | None:
    """THE non-finite policy of every online trainer: the finiteness of this rank's loss is summed
    over all ranks, so either every rank takes the optimizer step (clipping the global grad norm)
    or every rank drops its gradients together, and ranks never fall out of step. Skipped steps
    are counted by the health monitor, which stops training after max_nonfinite in a row.
    Returns the step's loss over all ranks (the mean of the ranks' losses, each already divided by
    the global normalizer: Σ_all / N_global) when the step was taken, None when it was skipped."""
    local = loss.detach().float().reshape(())
    flags = dist.reduce_sum(
        torch.stack([local.nan_to_num(0.0, 0.0, 0.0), (~torch.isfinite(local)).float()]), accelerator
    )
    value = float(flags[0]) if float(flags[1]) == 0 else float("nan")
    if health.loss_is_finite(value):
        clip_and_step(model, optimizer, config, accelerator)
        return value / dist.world_size(accelerator)
    optimizer.zero_grad(set_to_none=True)
    return None


def minibatch_step(
    run: OnlineRun,
    model: nn.Module,
    optimizer: Any,
    micros: Sequence[torch.Tensor],
    micro_loss: Callable[[torch.Tensor], Any],
    veto: Callable[[], bool] | None = None,
) -> bool:
    """One optimizer step over a minibatch split into micro-batches (see backward_micro_batches);
    `veto()` (e.g. PPO's early stopping) may cancel it before the non-finite check. Returns
    whether the optimizer stepped."""
    total = backward_micro_batches(run.accelerator, model, micros, micro_loss)
    if veto is not None and veto():
        optimizer.zero_grad(set_to_none=True)
        return False
    loss = step_if_finite(model, optimizer, total, accelerator=run.accelerator, health=run.health, config=run.config)
    if loss is None:
        return False
    run.progress.optimizer_steps += 1
    run.loss_total, run.loss_steps = run.loss_total + loss, run.loss_steps + 1
    for hook in run.step_hooks:
        hook(run.progress.optimizer_steps)
    return True


def check_reference_sync(config: Any, peft_config: Any) -> None:
    """sync_ref_model with a PEFT policy (a peft_config, or --use_peft, already refused by the config):
    the reference is the policy with its adapter off, so there is no reference model to update. TRL
    refuses it too. Called before any model loads."""
    if getattr(config, "sync_ref_model", False) and peft_config is not None:
        raise ConfigError(
            "sync_ref_model=True with a peft_config: with PEFT the reference is the policy with its adapter "
            "disabled, so there is no separate reference model to mix the policy into (TRL refuses this too). "
            "Drop sync_ref_model, or train the full model."
        )


def sync_reference(trainer: OnlineTrainer) -> None:
    """sync_ref_model (TR-DPO, arXiv:2404.09656; TRL's SyncRefModelCallback): after every
    ref_model_sync_steps-th optimizer step, ref ← α·policy + (1 − α)·ref with α = ref_model_mixup_alpha
    (`models.mix_into`). Every process updates its own copy of the reference from its copy of the
    policy, which DDP keeps identical, so the references stay identical too. Sharded references
    (DeepSpeed ZeRO-3, FSDP) are refused: each process holds only part of them."""
    from posttrain.models import check_mixable, mix_into

    config, run = trainer.args, trainer.run
    if not getattr(config, "sync_ref_model", False):
        return
    ref = trainer.ref_model
    if ref is None:  # the policy arrived as a PEFT model: its reference is the adapter off
        raise ConfigError(
            "sync_ref_model=True with a PEFT policy: its reference is the policy with its adapter disabled, so "
            "there is no separate reference model to mix the policy into (TRL refuses this too). Drop "
            "sync_ref_model, or train the full model."
        )
    if hasattr(ref, "zero_optimization_stage") or dist.sharding_plan(run.accelerator) is not None:
        raise ConfigError(
            "sync_ref_model=True is not supported with DeepSpeed ZeRO-3 or FSDP (the reference model is sharded "
            "across processes); use DDP or ZeRO-1/2, or drop sync_ref_model."
        )
    check_mixable(ref, trainer.policy_model, "sync_ref_model")
    alpha, every = config.ref_model_mixup_alpha, config.ref_model_sync_steps

    def after_step(optimizer_steps: int) -> None:
        if optimizer_steps % every == 0:
            mix_into(ref, trainer.policy_model, alpha)

    run.step_hooks.append(after_step)


def shuffled_orders(run: OnlineRun, n: int, num_epochs: int) -> list[torch.Tensor]:
    """One permutation of the n local rows per epoch, drawn from the run's sampling stream."""
    return [
        torch.randperm(n, generator=run.generator, device=run.generator.device).to(run.device)
        for _ in range(num_epochs)
    ]


def prompt_grouped(orders: list[torch.Tensor], rollout: Rollout, minibatch: int, micro: int) -> list[torch.Tensor]:
    """Each permutation with the rows of every minibatch (its consecutive `minibatch` rows) regrouped so
    that rows sharing a prompt are next to each other, and so share micro-batches, where
    `scoring.share_prompts` packs them into one row: groups with more rows in the minibatch first, then
    by their first row there; a group's rows, and the single rows, keep their order.

    Each minibatch keeps its rows, so a loss summed over its rows and divided by the minibatch's
    normalizer is the same whichever rows share a micro-batch. Callers use it only for such losses.
    Unchanged with POSTTRAIN_SHARED_PROMPTS=off, with one micro-batch of `micro` rows per minibatch, or
    where no two rows share a prompt."""
    if shared_prompts_mode() == "off" or minibatch <= micro:
        return orders
    first, group, _ = prompt_groups(rollout.prompt_ids, rollout.prompt_mask)
    if first.numel() == len(rollout):
        return orders
    group = group.to(orders[0].device)
    regrouped = []
    for order in orders:
        parts = []
        for start in range(0, order.numel(), minibatch):
            rows = order[start : start + minibatch]
            g, n = group[rows], rows.numel()
            where = torch.arange(n, device=rows.device)
            first_here = torch.full_like(first, n, device=rows.device).scatter_reduce(0, g, where, "amin")
            size = torch.bincount(g, minlength=first.numel())
            parts.append(rows[torch.argsort((n - size[g]) * n * n + first_here[g] * n + where)])
        regrouped.append(torch.cat(parts))
    return regrouped


@dataclass
class UpdateLayout:
    """How the update cuts one rollout batch of local rows: micro-batches of `micro` rows, `accum`
    micro-batches per optimizer step, one row permutation per epoch (`orders`; None in the single
    pass, one epoch of one micro-batch, whose update forward is also the old forward)."""

    micro: int
    accum: int
    orders: list[torch.Tensor] | None


def update_layout(
    run: OnlineRun, rows: int, micro: int, accum: int, num_epochs: int, *, allow_single_pass: bool = True
) -> UpdateLayout:
    """The layout of `rows` local rows; the permutations are drawn from the run's sampling stream."""
    single_pass = allow_single_pass and num_epochs == 1 and accum == 1 and rows // micro == 1
    return UpdateLayout(micro, accum, None if single_pass else shuffled_orders(run, rows, num_epochs))


LossFn = Callable[[torch.Tensor, Rollout, torch.Tensor, torch.Tensor, float], torch.Tensor]


def policy_update(
    run: OnlineRun,
    policy: nn.Module,
    optimizer: torch.optim.Optimizer,
    rollout: Rollout,
    *,
    num_epochs: int,
    count: Callable[[torch.Tensor], Any],
    loss_fn: LossFn,
    router_aux_loss_coef: float = 0.0,
) -> None:
    """num_epochs × num_mini_batches optimizer steps over one rollout batch (PPO's inner loops).

    Each epoch draws a permutation of the rows; each minibatch (local_mini_batch_size rows) is split
    into micro-batches of per_device_train_batch_size whose losses are divided by the minibatch's
    GLOBAL `count` (sequences or tokens), gradients synchronised on the last micro-batch only. A
    minibatch's rows that share a prompt go into the same micro-batches (`prompt_grouped`), which the
    global `count` leaves the minibatch's loss unchanged by (not with a router aux loss: a mean per
    micro-batch).
    `loss_fn(rows, micro_rollout, logprobs, old_logprobs, normalizer)` returns the micro-batch loss
    and logs its own metrics; this loop logs policy/entropy_avg. log π_old comes from a no-grad pass
    over the first epoch's micro-batches (ratio exactly 1 on the first minibatch); with one epoch
    and one minibatch it is the update forward's own detached value. router_aux_loss_coef (a
    mixture-of-experts policy, `scoring.router_aux_loss_enabled`): `add_router_aux_loss`.
    """
    config, acc = run.config, run.accelerator
    temperature = run.sampling.logprob_temperature
    orders = shuffled_orders(run, len(rollout), num_epochs)
    if not router_aux_loss_coef:  # a router aux loss is a mean per micro-batch, and refuses packing anyway
        orders = prompt_grouped(orders, rollout, config.local_mini_batch_size, config.per_device_train_batch_size)
    policy.train()
    old_logprobs = None
    if not (num_epochs == 1 and config.num_mini_batches == 1):
        old_logprobs = old_policy_logprobs(run, dist.unwrap(policy, acc), rollout, orders[0], temperature)

    def micro_loss(rows: torch.Tensor, accumulation: int) -> torch.Tensor:
        mb = rollout.select(rows)
        with run.autocast():
            forward = completion_forward(policy, mb, router_aux=bool(router_aux_loss_coef))
            logprobs, entropy = forward_logprobs(forward, temperature=temperature, with_entropy=True)
        old = logprobs.detach() if old_logprobs is None else old_logprobs[rows]
        run.metrics.add_mean("policy/entropy_avg", entropy, mb.completion_mask)
        loss = loss_fn(rows, mb, logprobs, old, normalizer)
        return add_router_aux_loss(run, loss, forward, router_aux_loss_coef, accumulation)

    for order in orders:
        for start in range(0, len(rollout), config.local_mini_batch_size):
            rows = order[start : start + config.local_mini_batch_size]
            normalizer = global_normalizer(count(rows), acc)
            micros = list(micro_batches(rows, config.per_device_train_batch_size))
            minibatch_step(run, policy, optimizer, micros, lambda r, a=len(micros): micro_loss(r, a))


def add_router_aux_loss(
    run: OnlineRun, loss: torch.Tensor, forward: CompletionForward, coef: float, accumulation: int
) -> torch.Tensor:
    """A micro-batch's loss plus a mixture-of-experts policy's router load-balancing loss,
    loss + coef · aux_loss / accumulation (accumulation: the micro-batches of the optimizer step, so
    the step adds coef × their mean aux_loss), as TRL 1.9's GRPO / RLOO `router_aux_loss_coef`;
    logs `aux_loss` (mean over micro-batches and ranks). Unchanged when the forward has no aux_loss."""
    if forward.aux_loss is None:
        return loss
    aux = forward.aux_loss.float()
    run.metrics.add("aux_loss", aux.detach(), 1)
    return loss + coef * aux / accumulation


@torch.no_grad()
def old_policy_logprobs(
    run: OnlineRun, policy: nn.Module, rollout: Rollout, first_order: torch.Tensor, temperature: float
) -> torch.Tensor:
    """log π_old per completion token (B, T), computed in the first epoch's micro-batches with the same
    function and mode as the update forward, so the first minibatch's ratio is exactly 1."""
    out = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32, device=rollout.completion_ids.device)
    for rows in micro_batches(first_order, run.config.per_device_train_batch_size):
        with run.autocast():
            logprobs, _ = completion_logprobs(policy, rollout.select(rows), temperature=temperature, with_entropy=True)
        out[rows] = logprobs.float()
    return out


# ---------------------------------------------------------------------------------------------
# the trainer skeleton
# ---------------------------------------------------------------------------------------------
def check_output_dir(config: OnPolicyConfig) -> None:
    """Refuse to train into an output_dir that already holds a run, before any model loads."""
    from posttrain.trainers.supervised import check_output_dir as check

    check(config)


class OnlineTrainer(hub.PushToHub):
    """The public surface of every online trainer and the steps around its algorithm.

    A trainer's constructor calls `self.setup(...)`; its `train()` is

        with self.training():
            for update in self.run.updates():
                ...                              # sample → score → advantages → update → controllers
                self.end_of_update(update, extra_metrics)
        return self.train_output

    Attributes, as on a transformers.Trainer: args (= config), model (the trained policy, unwrapped),
    ref_model, processing_class, accelerator, optimizer, lr_scheduler, train_dataset / eval_dataset
    (as given; the prepared prompts are run.train_dataset / run.eval_dataset), data_collator, state
    (a transformers.TrainerState: global_step = rollout batches done, epoch, log_history), control,
    callback_handler. `run` is the OnlineRun; the
    counters a checkpoint restores are `run.progress`.

    Callbacks are transformers.TrainerCallback objects (`callbacks=`, add_callback / pop_callback /
    remove_callback), fired by one callbacks.TrainerEvents where transformers.Trainer fires them, one
    rollout batch being one step: on_train_begin; after each rollout batch on_step_end, then on_log at
    a logging step, on_evaluate when evaluating (eval_steps), on_save after a checkpoint; after the
    final save the summary entry (on_log) and on_train_end. A callback that sets
    control.should_training_stop ends training after that rollout batch: it is logged, no checkpoint
    is written, and the final model is saved, as in SFT.
    """

    # Learning-rate schedule stepped once per rollout batch (TRL's on-policy trainers) or, when
    # False, by the update loop once per optimizer step (TRL's Online DPO / XPO).
    schedule_per_update = True
    # metrics of the last rollout batch: they join the summary entry
    final_logs: dict[str, float] | None = None

    def setup(
        self,
        config: OnPolicyConfig,
        tokenizer: Any,
        model: nn.Module,
        *,
        train_dataset: Any,
        eval_dataset: Any = None,
        data_collator: Callable | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        callbacks: Sequence[Any] | None = None,
        accelerator: Any = None,
        position_limits: Sequence[Any] = (),
    ) -> nn.Module:
        """Build the run, the optimizer and schedule (unless given), prepare `model` with the
        accelerator and create the callback events; returns the prepared (possibly DDP-wrapped) model.
        position_limits: Parts.position_limits; the prompts must leave room for response_length in
        each of those models and in `model`'s critic, if it has one (posttrain.positions)."""
        from posttrain.models import ensure_pad_token

        self.args = config
        self.processing_class = ensure_pad_token(tokenizer)
        # log_completions (GRPO, RLOO): the last rollout batch's rows, in TRL's layout (log_completions_table)
        self._logs = {"prompt": [], "completion": [], "rewards": {}, "advantages": [], "extra": {}, "images": []}
        critic = getattr(model, "critic", None)  # PPO's separate value model
        limits = [*position_limits, *positions.limits_of([("value model", critic, None)])]
        self.run = OnlineRun(
            config,
            tokenizer,
            train_dataset,
            eval_dataset,
            accelerator=accelerator,
            data_collator=data_collator,
            position_limits=limits,
        )
        # As transformers.Trainer: the datasets as given (the prepared prompts are run.train_dataset /
        # run.eval_dataset); from the command line, the loaded splits.
        self._train_dataset, self._eval_dataset = train_dataset, eval_dataset
        self.accelerator = self.run.accelerator
        self.data_collator = self.run.collate
        if config.push_to_hub and self.run.is_main:
            # As transformers: the repository exists before training, so a bad token or name fails now.
            hub.create_repo(config, token=config.hub_token, revision=config.hub_revision)
        optimizer, scheduler = optimizers
        optimizer = optimizer or build_optimizer(model.parameters(), config)
        compile_for_training(model, config)
        steps = config.num_total_batches * (1 if self.schedule_per_update else config.num_mini_batches)
        self.lr_scheduler = scheduler or build_scheduler(optimizer, config, num_training_steps=steps)
        self.wrapped, self.optimizer = dist.prepare_trained(model, optimizer, self.run.accelerator)
        if getattr(self, "ref_model", None) is not None:
            self.ref_model = dist.prepare_frozen(self.ref_model, self.accelerator)
        # Imported here: transformers' callback module pulls in peft, which importing a trainer must not.
        from posttrain.callbacks import TrainerEvents

        self.events = TrainerEvents(
            config,
            # The health monitor first, as transformers puts its own callbacks before the user's.
            [self.run.health, *(callbacks or [])],
            model=self.model,
            processing_class=self.processing_class,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            accelerator=self.accelerator,
            max_steps=config.num_total_batches,
            train_batch_size=config.per_device_train_batch_size,
            # As TRL's on-policy trainers: total_episodes over the episodes of one pass.
            num_train_epochs=self.run.epoch(config.total_episodes),
        )
        self.train_output: Any = None
        from posttrain.trainers.supervised import check_evaluation_setup

        check_evaluation_setup(config, has_eval_dataset=self.run.eval_dataset is not None)
        return self.wrapped

    # -- hooks a trainer may override ---------------------------------------------------------------
    def checkpoint_models(self) -> dict[str, nn.Module]:
        """The modules a checkpoint saves and a resume restores."""
        return {"policy": self.policy_model}

    def extra_state(self) -> dict:
        """Algorithm state a checkpoint must restore (e.g. the KL controller)."""
        return {}

    def load_extra_state(self, state: dict) -> None:
        pass

    def final_models(self) -> tuple[nn.Module, dict[str, nn.Module] | None]:
        """(policy, extra models) saved at the end: the policy at the top of output_dir."""
        return self.policy_model, None

    def table_scores(self, rollout: Rollout, batch: dict) -> torch.Tensor | None:
        """Scores of the sample table's completions (None: the trainer has no scores, e.g. a judge)."""
        return None

    # -- public API ---------------------------------------------------------------------------------
    @property
    def policy_model(self) -> nn.Module:
        """The trained policy, unwrapped (`self.wrapped` is the accelerator-prepared module)."""
        return dist.unwrap(self.wrapped, self.accelerator)

    @property
    def model(self) -> nn.Module:
        """The module training updates, as transformers' `Trainer.model`: the policy (PPO: the policy
        and its critic, as TRL's PPOTrainer)."""
        return self.policy_model

    @property
    def generation_model(self) -> nn.Module:
        """The module that samples completions (the prepared policy)."""
        return self.wrapped

    @property
    def train_dataset(self) -> Any:
        """The train set as given (transformers.Trainer keeps it so); the prepared prompts are
        `run.train_dataset`."""
        return self._train_dataset

    @property
    def eval_dataset(self) -> Any:
        """The eval set as given: a dataset, a dict of named sets, or None (the prepared prompts are
        `run.eval_dataset`). Assigning a new one prepares it, as the constructor does."""
        return self._eval_dataset

    @eval_dataset.setter
    def eval_dataset(self, eval_dataset: Any) -> None:
        self.run.eval_dataset = self.run.prepare_eval(eval_dataset)
        self._eval_dataset = eval_dataset

    @property
    def state(self) -> Any:
        """The `transformers.TrainerState`: global_step (rollout batches done), epoch, max_steps
        (num_total_batches), log_history (one entry per logging step and per evaluation, with step
        and epoch; after train() the summary entry), logging_steps, save_steps, ..."""
        return self.events.state

    @property
    def control(self) -> Any:
        """The `transformers.TrainerControl` callbacks set (should_training_stop, should_log, should_save, ...)."""
        return self.events.control

    @property
    def callback_handler(self) -> Any:
        return self.events.handler

    def add_callback(self, callback: Any) -> None:
        """Add a `transformers.TrainerCallback` (an instance, or a class, which is instantiated)."""
        self.events.add_callback(callback)

    def pop_callback(self, callback: Any) -> Any:
        """Remove a callback (an instance, or the first of a class) and return it, or None."""
        return self.events.pop_callback(callback)

    def remove_callback(self, callback: Any) -> None:
        """Remove a callback (an instance, or the first of a class)."""
        self.events.remove_callback(callback)

    def log(self, logs: dict[str, float]) -> None:
        """Log `logs` at the current step: metrics.jsonl and the trackers, state.log_history, on_log."""
        self.run.tracker.log(logs, step=self.state.global_step)
        self.events.log(logs)

    def save_model(self, output_dir: str | None = None) -> None:
        """Save the policy (safetensors) and tokenizer where plain transformers can load them."""
        run = self.run
        ckpt.save_final(
            output_dir or run.config.output_dir,
            dist.unwrap(self.policy_model, run.accelerator),
            tokenizer=run.tokenizer,
            config=run.config.to_dict(),
            accelerator=run.accelerator,
        )

    # -- sharing on the Hub (posttrain.hub) ---------------------------------------------------------
    def create_model_card(
        self,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
        license: str | None = None,
    ) -> None:
        """Write output_dir/README.md: base model, algorithm and paper, the command or config that trained
        it, the final metrics of state.log_history, framework versions (main process only; hub.model_card)."""
        if self.run.is_main:
            hub.write_model_card(
                self.args,
                method=hub.method_of(self, self.args),
                log_history=self.state.log_history,
                model=self.policy_model,
                model_name=model_name,
                dataset_name=dataset_name,
                tags=tags,
                license=license,
            )

    def _push_from_checkpoint(self, step: int) -> None:
        """After the checkpoint of rollout batch `step` (push_to_hub, hub_strategy != "end"): the final
        models saved at the top of output_dir (every process: weights are gathered), then hub.push_checkpoint."""
        run = self.run
        policy, extra_models = self.final_models()
        ckpt.save_final(
            self.args.output_dir,
            dist.unwrap(policy, run.accelerator),
            tokenizer=run.tokenizer,
            config=self.args.to_dict(),
            extra_models={k: dist.unwrap(m, run.accelerator) for k, m in (extra_models or {}).items()},
            accelerator=run.accelerator,
        )
        folder = os.path.join(self.args.output_dir, f"{ckpt.CHECKPOINT_PREFIX}{step}")
        hub.push_checkpoint(self.args, folder, step, is_main=run.is_main, write_card=self.create_model_card)

    def evaluate(
        self, eval_dataset: Any = None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """Greedy completions of every eval prompt (batches of per_device_eval_batch_size), drawn as
        `sample_completions` draws them, summarised as
            {prefix}_objective/scores        mean score (missing_eos_penalty included; absent when
                                             the trainer has no scores, e.g. with a judge)
            {prefix}_completions/mean_length mean completion length in tokens
            {prefix}_val/num_eos_tokens      completions that ended on a stop token.
        Every rank evaluates every prompt (the numbers are the same on all ranks). The metrics are
        logged (metrics.jsonl, state.log_history, on_log), passed to on_evaluate, and returned.
        During train() this runs as eval_strategy says (every eval_steps rollout batches, or at the end
        of each pass over the prompts; never with "no"), before the first rollout batch with
        eval_on_start, and when a callback sets control.should_evaluate.

        As transformers.Trainer.evaluate: `eval_dataset` (a dataset, a streaming one, or a dict of
        named sets) is prepared and evaluated instead of the trainer's; a string names one of the
        trainer's named sets. Named sets are evaluated one by one, each logged with the prefix
        `{metric_key_prefix}_{name}` (eval_data1_objective/scores, ...), and all their metrics are
        returned together. `ignore_keys` (keys of model outputs to ignore) is accepted for the
        signature: this evaluation reads no model output dicts, as TRL's GRPOTrainer ignores it."""
        run = self.run
        if isinstance(eval_dataset, str):
            if eval_dataset not in {name for name in run.eval_sets if name is not None}:
                raise ConfigError(
                    f"evaluate(eval_dataset={eval_dataset!r}): the trainer has no eval set of that name; its named "
                    f"sets are {sorted(n for n in run.eval_sets if n is not None)}."
                )
            return self._evaluate_set(run.eval_sets[eval_dataset], f"{metric_key_prefix}_{eval_dataset}")
        if eval_dataset is not None:
            prepared = run.prepare_eval(eval_dataset)
            sets = dict(prepared) if isinstance(prepared, dict) else {None: prepared}
        else:
            sets = run.eval_sets
        if not sets:
            raise ConfigError(
                "evaluate() needs an eval_dataset: pass evaluate(eval_dataset=...), the trainer's eval_dataset=, "
                "or --dataset_test_split."
            )
        metrics: dict[str, float] = {}
        for name, data in sets.items():
            metrics.update(
                self._evaluate_set(data, metric_key_prefix if name is None else f"{metric_key_prefix}_{name}")
            )
        return metrics

    # GRPO, RLOO: the training loss of a prompt batch, on completions sampled with the given generator
    # (`{prefix}_loss` of evaluate, TRL's eval_loss); None where the trainer has none.
    eval_loss: Callable[[dict, torch.Generator], torch.Tensor] | None = None

    @torch.no_grad()
    def _evaluate_set(self, data: Any, metric_key_prefix: str) -> dict[str, float]:
        """`evaluate` of one prepared eval set: its metrics, logged and passed to on_evaluate."""
        run = self.run
        n, size = len(data), self.args.per_device_eval_batch_size
        scores, lengths, ended, losses = [], [], 0, []
        logged: dict[str, list[float]] = {}  # reward functions' log_metric: each batch's mean
        for start in range(0, n, size):
            batch = run.to_device(run.collate([data[i] for i in range(start, min(start + size, n))]))
            rollout, batch_scores = self.greedy_completions(batch)
            lengths.extend(rollout.completion_lengths.tolist())
            ended += int(rollout.ended.sum())
            if batch_scores is not None:
                scores.extend(batch_scores.float().tolist())
            for name, values in self.take_function_logs()[0].items():
                logged.setdefault(name, []).append(sum(values) / len(values))
            if self.eval_loss is not None:
                seed = self.args.seed + start  # its own stream: evaluating never moves training's samples
                loss = self.eval_loss(batch, torch.Generator(device=run.device).manual_seed(seed))
                losses.append((float(loss) * len(batch["input_ids"]), len(batch["input_ids"])))
                self.take_function_logs()  # metrics are the greedy completions' (above)
        metrics = {}
        if losses:
            metrics[f"{metric_key_prefix}_loss"] = sum(x for x, _ in losses) / sum(n for _, n in losses)
        if scores:
            metrics[f"{metric_key_prefix}_objective/scores"] = sum(scores) / len(scores)
        metrics[f"{metric_key_prefix}_completions/mean_length"] = sum(lengths) / len(lengths)
        metrics[f"{metric_key_prefix}_val/num_eos_tokens"] = float(ended)
        for name, means in sorted(logged.items()):
            metrics[f"{metric_key_prefix}_{name}"] = sum(means) / len(means)
        run.tracker.log(metrics, step=self.state.global_step)
        self.events.evaluate(metrics)
        return metrics

    # -- the steps around the algorithm -------------------------------------------------------------
    def reward_sources(self) -> list[RewardSource]:
        """The RewardSources this trainer scores with: `self.reward`, or the reward side of an Online
        DPO / XPO trainer's `self.feedback`."""
        found = [getattr(self, "reward", None), getattr(getattr(self, "feedback", None), "reward", None)]
        return [source for source in found if isinstance(source, RewardSource)]

    def take_function_logs(self) -> tuple[dict[str, list[float]], dict[str, list]]:
        """(metrics, columns) the reward functions logged (log_metric / log_extra) since last taken."""
        metrics: dict[str, list[float]] = {}
        columns: dict[str, list] = {}
        for source in self.reward_sources():
            m, c = source.take_logs()
            for name, values in m.items():
                metrics.setdefault(name, []).extend(values)
            columns.update(c)
        return metrics, columns

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """Around every train(): the output-dir guard (no half-written output_dir on failure), OOM
        advice, resume (weights, counters, state.log_history), on_train_begin; on success the final
        save, the summary entry and on_train_end, leaving the TrainOutput in `self.train_output`."""
        run, events = self.run, self.events
        runtime.reuse_freed_memory()
        with ckpt.OutputDirGuard(self.args.output_dir, is_main=run.is_main), oom_advice():
            extra = run.maybe_resume(self.checkpoint_models(), self.optimizer, self.lr_scheduler)
            events.state.global_step = run.progress.update
            events.state.epoch = run.epoch(run.progress.episode)
            if "log_history" in extra:
                events.state.log_history = list(extra.pop("log_history"))
            events.restore_checkpoint_state(extra.pop("callback_state", {}))
            if extra:
                self.load_extra_state(extra)
            for source in self.reward_sources():  # reward functions get `trainer_state`, as in TRL's GRPO
                source.trainer_state = self.state
            events.train_begin()
            if self.args.eval_on_start:
                self.evaluate()
            with self.linear_kernels(), events.preemption.installed():
                yield
            if not events.preempted:  # enable_jit_checkpoint: a SIGTERM left a checkpoint instead
                policy, extra_models = self.final_models()
                run.finish(policy, extra_models)
            # train_loss: the mean over this call's optimizer steps of each step's global loss.
            training_loss = run.loss_total / max(run.loss_steps, 1)
            episodes = run.progress.episode - run.episodes_at_start
            # total_flos is not estimated for online training (generation and scoring dominate): 0.
            self.train_output = events.train_end(training_loss, episodes, total_flos=0.0, logs=self.final_logs)
            self.final_logs = None
            if self.args.push_to_hub and not events.preempted:
                hub.push(self.args, is_main=run.is_main, write_card=self.create_model_card)

    def linear_kernels(self) -> contextlib.AbstractContextManager:
        """The float32 CPU linear layers of every model this trainer runs (policy, reference, value and
        reward models) through oneDNN where it measures faster (`cpu_linear`, POSTTRAIN_CPU_LINEAR), in
        eager float32 runs: mixed precision (autocast picks the kernels), a compiled decode step or
        torch_compile keep torch's own path."""
        from posttrain import cpu_linear

        args = self.args
        models: list[nn.Module] = [m for m in vars(self).values() if isinstance(m, nn.Module)]
        for source in self.reward_sources():
            models.extend(source.models)
        compiled = getattr(args, "cache_implementation", None) == "static" or bool(
            getattr(args, "torch_compile", False)
        )
        return cpu_linear.for_training(models, mixed_precision=self.run.config.mixed_precision, compiled=compiled)

    def end_of_update(self, update: int, extra: dict[str, float] | None = None) -> dict[str, float] | None:
        """After each rollout batch: step the schedule; on_step_end (state.global_step = update + 1);
        then, when due or asked by a callback (control.should_log / should_evaluate / should_save),
        log (metrics reduced over ranks; on_log, where the health monitor checks them), the sample
        table, evaluate, and a checkpoint (on_save; never after the last or a stopping rollout batch:
        the final save follows). Returns the logged metrics (None when this rollout batch logged nothing)."""
        run, events = self.run, self.events
        log_function_metrics(run, self.reward_sources())  # reward functions' log_metric values
        lr = self.lr_scheduler.get_last_lr()[0]
        if self.schedule_per_update:
            self.lr_scheduler.step()
        step = update + 1
        events.step_end(step, run.epoch(run.progress.episode + self.args.batch_size))
        control, logs = events.control, None
        # A callback's requests, read now: on_log / on_evaluate / on_save reset them.
        log_now, eval_now, save_now = control.should_log, control.should_evaluate, control.should_save
        if run.should_log(update) or log_now or control.should_training_stop:
            logs = run.log(update, {"lr": lr, **(extra or {})})
            if control.should_training_stop:
                # The last rollout batch's metrics join the end-of-training summary entry, so that
                # state.log_history[-1] holds them next to train_loss: TRL 0.x's on-policy trainers end
                # log_history with them, transformers.Trainer (TRL 1.x) with the summary.
                self.final_logs = logs
            if not control.should_training_stop or run.cadence.log_due(step) or log_now:
                events.log(logs)
        if run.should_sample(update):
            self.sample_table(update)
        improved = False
        if run.eval_dataset is not None and (run.cadence.eval_due(step) or eval_now):
            improved = events.update_best(self.evaluate())
        # save_strategy "best" saves every new best, the last rollout batch's included (it is then the
        # checkpoint state.best_model_checkpoint names); other saves skip the last batch (the final save follows).
        save_best = self.args.save_strategy == "best" and improved
        saves = (run.should_save(update) or save_now) and not events.control.should_training_stop or save_best
        if saves or events.preempted:  # enable_jit_checkpoint: a SIGTERM's step always saves
            best_step = events.state.best_global_step
            if best_step == step:
                events.state.best_model_checkpoint = os.path.join(self.args.output_dir, f"checkpoint-{step}")
            self.write_checkpoint()
            if hub.pushes_at_save(self.args):
                self._push_from_checkpoint(step)
        if events.preempted:
            log_preempted(self.args.output_dir, step, is_main=run.is_main)
        run.stop_requested = events.control.should_training_stop
        return logs

    def write_checkpoint(self, after_batch: bool = True) -> None:
        """A resumable checkpoint, output_dir/checkpoint-N, then on_save: after the rollout batch that
        end_of_update is finishing (N = that batch's step), or, with after_batch=False, of the state as
        it is between rollout batches (N = state.global_step)."""
        events = self.events
        state = {
            **self.extra_state(),
            "log_history": events.state.log_history,
            "callback_state": events.checkpoint_state(),
        }
        self.run.save(
            self.checkpoint_models(),
            self.optimizer,
            self.lr_scheduler,
            extra=state,
            best=events.state.best_model_checkpoint,
            after_batch=after_batch,
        )
        events.note_checkpoint(self.args.output_dir)
        events.save()

    def _save_checkpoint(self, model: Any = None, trial: Any = None) -> None:
        """transformers.Trainer's name for `write_checkpoint(after_batch=False)` (TRL code calls it);
        `model` and `trial` are accepted and unused: the checkpoint holds the trainer's own models."""
        self.write_checkpoint(after_batch=False)

    def sample_table(self, update: int) -> None:
        """THE sample table of every online trainer, every sample_generations_freq rollout batches:
        columns query, model response, score (TRL's on-policy trainers' names) and the columns reward
        functions logged with `log_extra`, from the rows of `sample_completions` for the first
        per_device_eval_batch_size eval prompts; printed and written to samples.jsonl by the tracker."""
        rows = self.sample_completions(self.args.per_device_eval_batch_size)
        renamed = {"prompt": "query", "completion": "model response"}
        table = [{renamed.get(k, k): v for k, v in r.items()} for r in rows]
        self.run.tracker.log_table("completions", table, step=update + 1)

    @torch.no_grad()
    def greedy_completions(self, batch: dict) -> tuple[Rollout, torch.Tensor | None]:
        """Greedy completions of a collated prompt batch (TRL samples its tables at temperature
        0.01), and their scores as objective/scores computes them (missing_eos_penalty included;
        None where the trainer has no scores, e.g. with a judge)."""
        run = self.run
        greedy = dataclasses.replace(run.sampling, temperature=0.0, do_sample=False)
        rollout = sample(run, self.generation_model, batch["input_ids"], batch["attention_mask"], sampling=greedy)
        return rollout, self.table_scores(rollout, batch)

    @torch.no_grad()
    def sample_completions(self, num_prompts: int) -> list[dict]:
        """Greedy completions of the first `num_prompts` eval prompts (of several named eval sets, the
        first set's; see greedy_completions),
        decoded with special tokens (EOS shown, padding not), with their scores: rows {prompt,
        completion, score}, TRL LogCompletionsCallback's names, plus one key per column a reward
        function logged for them with `log_extra`. The same rows make every trainer's
        sample table (see `end_of_update`)."""
        run = self.run
        if run.sample_dataset is None:
            raise ConfigError("sampling completions needs an eval_dataset (--dataset_test_split).")
        batch = run.eval_prompts(num_prompts)
        self.take_function_logs()  # what was logged before belongs to other completions
        rollout, scores = self.greedy_completions(batch)
        columns = self.take_function_logs()[1]  # log_extra columns of these completions
        scores = scores.tolist() if scores is not None else [None] * len(rollout)
        shown = decode_completions(run.tokenizer, rollout, skip_special_tokens=False)
        return [
            {"prompt": p, "completion": c, "score": s, **{name: values[i] for name, values in columns.items()}}
            for i, (p, c, s) in enumerate(zip(batch["prompt"], shown, scores))
        ]


# ---------------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------------
def run_command(trainer_cls: type, config: OnPolicyConfig) -> int:
    """`posttrain <algorithm>`: refuse to overwrite a finished run, then build the trainer from the
    config alone (its constructor loads every part with `load_parts`) and train. Errors are
    reported by cli.main."""
    check_output_dir(config)
    trainer_cls.from_config(config).train()
    return 0
