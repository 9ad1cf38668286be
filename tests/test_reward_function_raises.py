"""A reward function that raises: one message naming `module:function` and the exception, the
user's own frames only (not posttrain's or torch's), exit 2 on the command line; from Python a
typed RewardFunctionRaised chained from the original exception."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

USER_MODULE = textwrap.dedent(
    """
    def lookup(row):
        return row["score"]  # KeyError: the user's bug


    def keyed_reward(prompts, completions, **columns):
        scores = []
        for c in completions:
            scores.append(float(lookup({"text": c})))
        return scores
    """
)


def test_the_python_api_raises_a_typed_error_chained_from_the_users_exception(tmp_path, monkeypatch):
    from posttrain.scoring import RewardFunctionError, RewardFunctionRaised, reward_function_matrix

    (tmp_path / "user_rewards.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    from user_rewards import keyed_reward

    with pytest.raises(RewardFunctionRaised) as info:
        reward_function_matrix([keyed_reward], ["p1", "p2"], ["c1", "c2"])
    err = info.value
    assert isinstance(err, RewardFunctionError)  # the command line prints it as a user error
    assert isinstance(err.__cause__, KeyError)
    assert err.function == "user_rewards:keyed_reward"
    assert str(err).startswith("reward function 'user_rewards:keyed_reward' raised KeyError: 'score'")
    # the two frames of the user's file, innermost last; none of posttrain's
    assert err.user_frames.count('File "') == 2 and err.user_frames.count("user_rewards.py") == 2
    assert 'return row["score"]' in err.user_frames and "posttrain" not in err.user_frames


def test_the_command_line_prints_the_function_the_exception_and_the_users_frames_only(tmp_path, tiny_policy_dir):
    (tmp_path / "user_rewards.py").write_text(USER_MODULE)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(f'{{"prompt": "Prompt {i}"}}\n' for i in range(4)))
    argv = ["rloo", "--dataset_name", str(data), "--model_name_or_path", str(tiny_policy_dir)]
    argv += ["--reward_funcs", "user_rewards:keyed_reward", "--output_dir", str(tmp_path / "out")]
    argv += ["--per_device_train_batch_size", "4", "--total_episodes", "4", "--response_length", "3"]
    argv += ["--report_to", "none"]
    proc = subprocess.run(
        [sys.executable, "-m", "posttrain", *argv], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    err = proc.stderr
    assert proc.returncode == 2, err
    assert "Traceback" not in err
    assert "posttrain rloo: reward function 'user_rewards:keyed_reward' raised KeyError: 'score'" in err
    frames = err.split("In your code (most recent call last):\n", 1)[1]
    assert frames.count('File "') == 2 and frames.count("user_rewards.py") == 2
    assert 'return row["score"]' in frames
    assert "site-packages" not in frames and "/posttrain/" not in frames
