"""Each health warning triggered on purpose, the non-finite-loss policy, and the OOM advice."""

import math

import pytest
import torch

from posttrain.health import OOM_HINT, HealthMonitor, TrainingDiverged, oom_advice


def monitor(**kw):
    return HealthMonitor(enabled=False, **kw)


def test_ratio_outside_bounds_warns_once():
    h = monitor()
    assert h.check({"val/ratio": 1.05}, 1) == []
    (msg,) = h.check({"val/ratio": 2.6}, 2)
    assert "val/ratio" in msg and "too drastic" in msg
    assert h.check({"val/ratio": 0.1}, 3) == []  # one-time


def test_ratio_below_half_warns():
    (msg,) = monitor().check({"val/ratio": 0.4}, 1)
    assert "0.4" in msg


def test_kl_past_threshold_warns():
    h = monitor(kl_threshold=5.0)
    assert h.check({"objective/kl": 4.9}, 1) == []
    (msg,) = h.check({"objective/kl": 5.1}, 2)
    assert "kl_coef" in msg


def test_flat_reward_over_window_warns_and_rising_reward_does_not():
    rising = monitor(reward_window=3)
    for step, r in enumerate([0, 1, 2, 3, 4, 5]):
        assert rising.check({"objective/rlhf_reward": r}, step) == []
    flat = monitor(reward_window=3)
    issued = []
    for step, r in enumerate([1.0, 1.0, 1.0, 1.0, 1.0, 0.9]):
        issued += flat.check({"objective/rlhf_reward": r}, step)
    (msg,) = issued
    assert "has not risen" in msg


def test_nan_metric_is_reported():
    (msg,) = monitor().check({"loss/policy_avg": math.nan}, 7)
    assert "loss/policy_avg" in msg


def test_nonfinite_losses_are_skipped_then_training_stops():
    h = monitor(max_nonfinite=3)
    assert h.loss_is_finite(torch.tensor(1.0))
    assert not h.loss_is_finite(torch.tensor(float("nan")))
    assert not h.loss_is_finite(torch.tensor(float("inf")))
    assert h.loss_is_finite(torch.tensor(0.5))  # resets the streak
    assert not h.loss_is_finite(torch.tensor(float("nan")))
    assert not h.loss_is_finite(torch.tensor(float("nan")))
    with pytest.raises(TrainingDiverged, match="3 non-finite losses in a row"):
        h.loss_is_finite(torch.tensor(float("nan")))
    assert h.nonfinite_total == 5


def test_oom_gets_the_batch_size_advice():
    with pytest.raises(MemoryError) as exc:
        with oom_advice():
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert "--per_device_train_batch_size" in str(exc.value) and "--gradient_accumulation_steps" in str(exc.value)
    assert OOM_HINT in str(exc.value)
    with pytest.raises(ValueError):
        with oom_advice():
            raise ValueError("unrelated")


def test_state_round_trip_keeps_one_time_warnings():
    h = monitor()
    h.check({"val/ratio": 3.0}, 1)
    h2 = monitor()
    h2.load_state_dict(h.state_dict())
    assert h2.check({"val/ratio": 3.0}, 2) == []


# -- the monitor as a transformers.TrainerCallback in the online trainers ----------------------------
ONLINE = ["rloo", "grpo", "ppo", "online_dpo", "xpo"]


def test_a_monitor_is_a_transformers_callback_checking_on_log(capsys):
    from transformers import TrainerCallback, TrainerControl, TrainerState

    h = HealthMonitor(kl_threshold=5.0)  # enabled: the warning is printed
    assert isinstance(h, TrainerCallback) and isinstance(h, HealthMonitor)
    h.on_log(None, TrainerState(global_step=3), TrainerControl(), logs={"objective/kl": 7.0, "epoch": 0.5})
    assert h.state_dict()["warned"] == ["kl"]
    err = capsys.readouterr().err
    assert "objective/kl = 7 at step 3 exceeds 5.0" in err
    h.on_log(None, TrainerState(global_step=4), TrainerControl(), logs={"objective/kl": 8.0})
    assert capsys.readouterr().err == ""  # once per run


@pytest.mark.parametrize("algo", ONLINE)
def test_every_online_trainer_registers_its_monitor_first(tmp_path, tiny_tokenizer, algo):
    from transformers import TrainerCallback

    from helpers import online_trainer

    user = TrainerCallback()
    trainer = online_trainer(algo, tmp_path / algo, tiny_tokenizer, callbacks=[user])
    assert trainer.callback_handler.callbacks == [trainer.run.health, user]


def narrow_ratio_band(trainer):
    """val/ratio is about 1 in training; a band of [0, 0.5] makes the monitor warn at the first log."""
    trainer.run.health.ratio_low, trainer.run.health.ratio_high = 0.0, 0.5


def test_the_monitor_checks_each_training_log_and_resumes_its_one_time_warnings(tmp_path, tiny_tokenizer, capsys):
    import shutil

    from helpers import online_trainer

    trainer = online_trainer("rloo", tmp_path / "run", tiny_tokenizer, save_steps=1)
    narrow_ratio_band(trainer)
    trainer.train()
    assert trainer.run.health.state_dict()["warned"] == ["ratio"]
    err = capsys.readouterr().err
    assert err.count("posttrain health:") == 1 and "val/ratio" in err and "at step 1 left [0.0, 0.5]" in err

    # Resumed from the checkpoint after step 1: the warning was given, and is not given again.
    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "run" / "checkpoint-1", tmp_path / "resumed" / "checkpoint-1")
    resumed = online_trainer("rloo", tmp_path / "resumed", tiny_tokenizer, resume_from_checkpoint="latest")
    narrow_ratio_band(resumed)
    resumed.train()
    assert resumed.state.global_step == 2 and resumed.run.health.state_dict()["warned"] == ["ratio"]
    assert "posttrain health:" not in capsys.readouterr().err


def test_a_removed_monitor_checks_nothing(tmp_path, tiny_tokenizer, capsys):
    from helpers import online_trainer

    trainer = online_trainer("rloo", tmp_path / "run", tiny_tokenizer, save_steps=0)
    narrow_ratio_band(trainer)
    trainer.remove_callback(HealthMonitor)
    assert not any(isinstance(cb, HealthMonitor) for cb in trainer.callback_handler.callbacks)
    trainer.train()
    assert trainer.state.global_step == 2 and "val/ratio" in trainer.state.log_history[0]
    assert trainer.run.health.state_dict()["warned"] == []
    assert "posttrain health:" not in capsys.readouterr().err
