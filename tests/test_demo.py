"""The offline demo: the task's gold rule and grammar, the report's logic, and a --quick end-to-end run."""

from __future__ import annotations

import json

import pytest
from transformers import TrainerCallback

from posttrain.configs import ConfigError
from posttrain.demo import report, task
from posttrain.demo.pipeline import DemoConfig, GoldMonitor, _prepare_output_dir

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------
# the gold rule
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("was great .", 1.0),
        ("was awful .", -1.0),
        ("was great and the staff were friendly .", 2.0),  # two distinct positive terms
        ("was great but the soup was bland .", 0.0),  # +1 − 1
        ("was not great .", -1.0),  # "not" flips a positive word
        ("was not bad .", 1.0),  # ... and a negative one
        ("was not very clean .", -1.0),  # across an adverb
        ("i would not recommend it .", -1.0),  # a flipped sentiment verb
        ("was not big and the food was great .", 1.0),  # "not" ends at the clause break, flips nothing
        ("was big and the room was red .", 0.0),  # neutral words count nothing
        ("was great great great .", -1.0),  # 1 distinct term − 2 repeats: repetition does not pay
        ("was great and the cake was great .", 0.0),  # the same praise twice: 1 − 1
        ("was great and not great .", 0.0),  # "great" and "not great" are different terms: +1 − 1
        ("", 0.0),
    ],
)
def test_gold_score_on_hand_written_reviews(text, expected):
    assert task.gold_score(text) == expected


def test_repetition_never_beats_the_distinct_review():
    varied = "was great and the staff were friendly and the room was clean ."
    repeated = "was great and the staff were great and the room was great ."
    assert task.gold_score(varied) == 3.0
    assert task.gold_score(repeated) == -1.0  # 1 distinct − 2 repeats
    assert task.gold_preference(varied, repeated) == 0
    assert task.gold_preference(repeated, varied) == 1
    assert task.gold_preference("was great .", "was lovely .") is None


def test_gold_reward_scores_completions_only():
    assert task.gold_reward(["the food was awful and"], ["was great .", "was bad ."]) == [1.0, -1.0]


# ---------------------------------------------------------------------------------------------
# the grammar, the splits and the tokenizer
# ---------------------------------------------------------------------------------------------
def test_corpus_is_deterministic_for_a_seed_and_varies_across_seeds():
    prompts = task.all_prompts()
    first = task.generate_reviews(prompts, 200, seed=3)
    assert first == task.generate_reviews(prompts, 200, seed=3)
    assert first != task.generate_reviews(prompts, 200, seed=4)


def test_corpus_uses_only_the_vocabulary_and_covers_every_mood():
    vocabulary = set(task.vocabulary())
    reviews = task.generate_reviews(task.all_prompts(), 2000, seed=0)
    used = {word for review in reviews for word in review.text.split()}
    assert used <= vocabulary
    assert 150 <= len(vocabulary) <= 400
    scores = [task.gold_score(r.completion) for r in reviews]
    assert min(scores) <= -2 and max(scores) >= 2
    # Moods are balanced, so the SFT model starts near 0 and RL has room both ways.
    assert abs(sum(scores) / len(scores)) < 0.2


def test_prompts_carry_no_sentiment_and_held_out_prompts_are_unseen():
    t = task.build_task(seed=5, num_reviews=300)
    assert all(task.gold_score(p) == 0 for p in task.all_prompts())
    assert not set(t.train_prompts) & set(t.heldout_prompts)
    assert set(t.train_prompts) | set(t.heldout_prompts) == set(task.all_prompts())
    assert len(t.sft_train) + len(t.sft_eval) == 300
    assert all(any(text.startswith(p + " ") for p in t.train_prompts) for text in t.sft_train[:50])
    assert t.heldout_prompts == task.build_task(seed=5, num_reviews=300).heldout_prompts


def test_word_level_tokenizer_round_trips_the_corpus():
    t = task.build_task(seed=1, num_reviews=500)
    tok = task.build_tokenizer(t.sft_train)
    assert tok.padding_side == "left"
    assert tok.pad_token_id != tok.eos_token_id
    for text in t.sft_train[:100] + t.sft_eval:
        ids = tok(text)["input_ids"]
        assert tok.unk_token_id not in ids
        assert len(ids) == len(text.split())  # one token per word
        assert tok.decode(ids) == text


# ---------------------------------------------------------------------------------------------
# the gold observer and the config
# ---------------------------------------------------------------------------------------------
def test_gold_monitor_leaves_the_reward_unchanged_and_logs_means_per_logging_step():
    monitor = GoldMonitor()
    assert monitor(["p", "p"], ["was great .", "was bad and the soup was bland ."]) == [0.0, 0.0]
    monitor.on_log(None, None, None, logs={"episode": 2})
    monitor(["p"], ["was not bad ."])
    callback = monitor.as_callback()  # what the trainers get: a transformers.TrainerCallback
    assert isinstance(callback, TrainerCallback)
    callback.on_step_end(None, None, None)  # not a logging step: keep accumulating
    callback.on_log(None, None, None, logs={"eval_completions/mean_length": 3.0})  # an evaluation: no row
    monitor(["p"], ["was great and the staff were friendly ."])
    callback.on_log(None, None, None, logs={"episode": 4})
    monitor(["p"], ["was bad ."])  # e.g. the last sample table's completions
    callback.on_log(None, None, None, logs={"train_runtime": 1.0})  # the end-of-training summary: no row
    assert monitor.rows == [
        {"step": 1, "gold/score": (1.0 - 2.0) / 2, "episode": 2},
        {"step": 2, "gold/score": (1.0 + 2.0) / 2, "episode": 4},
    ]


def test_gold_monitor_stride_keeps_the_policy_rows_of_xpo_pairs():
    monitor = GoldMonitor(stride=2)
    assert monitor(["p"] * 4, ["was great .", "was bad .", "was lovely .", "was awful ."]) == [0.0] * 4
    monitor.on_log(None, None, None, logs={"episode": 2})
    assert monitor.rows[0]["gold/score"] == 1.0


def test_demo_config_rejects_unknown_algorithms_and_bad_sizes():
    with pytest.raises(ConfigError, match="algo"):
        DemoConfig(algo="dpo")
    with pytest.raises(ConfigError, match="rl_episodes"):
        DemoConfig(rl_episodes=0)


def test_output_dir_that_is_not_a_demo_is_refused(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not empty"):
        _prepare_output_dir(tmp_path)
    assert (tmp_path / "precious.txt").read_text() == "keep me"


# ---------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------
def test_overoptimization_is_flagged_only_when_proxy_rises_and_gold_falls():
    sentence = report.overoptimization_warning(proxy_before=0.1, proxy_after=1.4, gold_before=0.8, gold_after=0.2)
    assert sentence is not None and "over-optimisation" in sentence
    assert "+0.10 → +1.40" in sentence and "+0.80 → +0.20" in sentence
    assert report.overoptimization_warning(0.1, 1.4, 0.8, 1.9) is None  # both rose: RLHF worked
    assert report.overoptimization_warning(0.1, -0.3, 0.8, 0.2) is None  # both fell: not over-optimisation


def _made_up_results(gold_before, gold_after, proxy_before, proxy_after):
    n = len(gold_before)
    wins = sum(a > b for a, b in zip(gold_after, gold_before))
    ties = sum(a == b for a, b in zip(gold_after, gold_before))
    return {
        "prompts": [f"the food {i}" for i in range(n)],
        "before": ["was bad ."] * n,
        "after": ["was great | fine ."] * n,
        "gold_before": gold_before,
        "gold_after": gold_after,
        "proxy_before": proxy_before,
        "proxy_after": proxy_after,
        "win_rate": (wins + 0.5 * ties) / n,
        "wins": wins,
        "ties": ties,
        "losses": n - wins - ties,
        "kl": 3.25,
        "length_before": 3.0,
        "length_after": 4.0,
    }


def _render(results, rl_records=(), gold_records=()):
    return report.render(
        config={"algo": "ppo"},
        rm_stats={"accuracy": 0.8, "chosen_score": 1.5, "rejected_score": -0.5},
        sft_eval={"eval_loss": 1.5},
        results=results,
        timings={"total": 12.0},
        rl_args={"total_episodes": 64, "learning_rate": 1e-3, "kl_coef": 0.05, "temperature": 0.7},
        rl_records=list(rl_records),
        gold_records=list(gold_records),
        plots=["plots/objective_kl.png"],
    )


def test_report_states_overoptimization_with_made_up_numbers():
    # Proxy up (0 → 2), gold down (1 → 0) on held-out prompts.
    text = _render(_made_up_results([1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [2.0, 2.0]))
    assert "Reward over-optimisation" in text and "+1.00 → +0.00" in text
    assert "0.0%" in text and "Below the 75% bar" in text


def test_report_flags_overoptimization_seen_during_training():
    # Held-out numbers look fine, but over training the proxy rose while the gold score fell.
    rl = [{"step": i, "episode": 8 * i, "objective/scores": 0.1 * i} for i in range(1, 11)]
    gold = [{"step": i, "episode": 8 * i, "gold/score": 2.0 - 0.2 * i} for i in range(1, 11)]
    text = _render(_made_up_results([0.0, 0.0], [1.0, 1.0], [0.0, 0.0], [1.0, 1.0]), rl, gold)
    assert "over training (first vs last fifth of the run)" in text


def test_report_headline_when_rlhf_worked():
    text = _render(_made_up_results([0.0, -1.0, 1.0, 0.0], [2.0, 2.0, 1.0, 3.0], [0.0] * 4, [1.0] * 4))
    assert "**87.5%** (3 wins, 1 ties, 0 losses" in text and "Meets the 75% bar" in text
    assert "No reward over-optimisation" in text
    assert "acc (higher is better) : 0.8000" in text
    assert "![objective_kl](plots/objective_kl.png)" in text
    assert "was great \\| fine ." in text  # table cells escape the pipe


def test_health_warnings_are_replayed_from_the_rl_metrics():
    records = [{"step": 1, "val/ratio": 1.0, "objective/kl": 0.5}, {"step": 2, "val/ratio": 3.5, "objective/kl": 12.0}]
    warnings = report.health_warnings(records)
    assert len(warnings) == 2
    assert any("val/ratio" in w for w in warnings) and any("objective/kl" in w for w in warnings)
    assert "## Health checks\n\n- " in _render(_made_up_results([0.0], [1.0], [0.0], [1.0]), records)


# ---------------------------------------------------------------------------------------------
# the whole pipeline, quick
# ---------------------------------------------------------------------------------------------
def test_quick_demo_end_to_end_writes_every_artifact(tmp_path):
    from posttrain.cli import main

    out = tmp_path / "demo"
    assert main(["demo", "--output_dir", str(out), "--quick"]) == 0

    text = (out / "report.md").read_text()
    for heading in (
        "## Headline",
        "## Step 1: supervised fine-tuning",
        "## Step 2: reward model",
        "## Step 3: RL (ppo)",
        "## Before and after",
        "## Health checks",
    ):
        assert heading in text
    for phrase in (
        "Gold win rate of the RL policy over the SFT policy",
        "Gold score:",
        "Proxy (reward-model) score:",
        "KL(RL ‖ SFT)",
        "Reward model held-out accuracy",
        "chosen_last_scores (higher is better)",
    ):
        assert phrase in text
    assert "| prompt | SFT policy (before) | gold | RL policy (after) | gold |" in text

    summary = json.loads((out / "summary.json").read_text())
    assert 0.0 <= summary["win_rate"] <= 1.0
    assert f"{summary['win_rate']:.1%}" in text
    assert f"{summary['gold_after']:+.2f}" in text

    for name in ("objective_rlhf_reward", "objective_scores", "objective_kl", "gold_score", "proxy_vs_gold"):
        png = out / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC
        assert f"](plots/{name}.png)" in text
    rows = [json.loads(line) for line in (out / "before_after.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and {"prompt", "before", "after", "gold_before", "gold_after"} <= set(rows[0])
    gold = [json.loads(line) for line in (out / "rl" / "gold_metrics.jsonl").read_text().splitlines()]
    assert gold and all("gold/score" in r and "episode" in r for r in gold)
    for sub in ("sft", "reward_model", "rl"):
        assert (out / sub / "model.safetensors").is_file() and (out / sub / "metrics.jsonl").is_file()

    # A second run into its own folder is allowed (make demo twice).
    assert main(["demo", "--output_dir", str(out), "--quick", "--algo", "rloo"]) == 0
    assert "## Step 3: RL (rloo)" in (out / "report.md").read_text()
