"""Scoring: logprob slicing, value / reward indices (score at the stop token, not one past it —
TRL#1893), reward-tokenizer re-tokenization, reward-function validation, missing-EOS penalty."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from helpers import make_rollout
from posttrain.scoring import (
    apply_missing_eos_penalty,
    batched_completion_logprobs,
    batched_completion_values,
    completion_logprobs,
    completion_values,
    reward_function_matrix,
    reward_function_scores,
    reward_model_scores,
)


class PositionalBackbone(nn.Module):
    """hidden = token id + 1000 · position id, so a score read anywhere names its token and position."""

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        return SimpleNamespace(last_hidden_state=(input_ids + 1000 * position_ids).float()[..., None])


class ScoreModel(nn.Module):
    base_model_prefix = "backbone"

    def __init__(self):
        super().__init__()
        self.backbone = PositionalBackbone()
        self.score = nn.Identity()
        self.anchor = nn.Parameter(torch.zeros(1))


EOS = 50


@pytest.mark.parametrize("pad", [0, EOS])
def test_reward_read_at_stop_token_not_one_past(pad):
    r = make_rollout([[7, 8, 9], [4]], [[11, EOS], [21, 22, 23]], T=5, pad=pad, ended=[True, False])
    scores = reward_model_scores(ScoreModel(), r, batch_size=1)
    # Row 0: stop token EOS at position 3+1 = 4; row 1 never ended: last token 23 at position 1+2 = 3.
    assert scores.tolist() == [EOS + 1000 * 4, 23 + 1000 * 3]


def test_reward_of_empty_completion_is_read_at_last_prompt_token():
    r = make_rollout([[7, 8], [4]], [[], [5]], T=2, pad=0, ended=[False, False])
    assert reward_model_scores(ScoreModel(), r, batch_size=4).tolist() == [8 + 1000 * 1, 5 + 1000 * 1]


def test_values_are_read_at_state_before_each_token():
    r = make_rollout([[7, 8, 9], [4]], [[11, EOS], [21, 22, 23]], T=4, pad=EOS, ended=[True, False])
    v = completion_values(ScoreModel(), r)
    assert v.tolist() == [[9 + 2000, 11 + 3000, 0, 0], [4, 21 + 1000, 22 + 2000, 0]]
    assert torch.equal(batched_completion_values(ScoreModel(), r, batch_size=1), v)


class CharTokenizer:
    """Minimal tokenizer: one id per character from `alphabet`; optional BOS id prepended."""

    def __init__(self, alphabet: str, bos: int | None = None):
        self.alphabet, self.bos = alphabet, bos
        self.all_special_tokens = ["<bos>"] if bos is not None else []
        self.bos_token = "<bos>" if bos is not None else None

    def get_vocab(self):
        return {c: i for i, c in enumerate(self.alphabet)}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.alphabet[i] for i in ids if i < len(self.alphabet))

    def __call__(self, texts, add_special_tokens=True):
        head = [self.bos] if add_special_tokens and self.bos is not None else []
        return {"input_ids": [head + [self.alphabet.index(c) for c in t] for t in texts]}


def test_reward_tokenizer_retokenizes_and_reads_last_real_token():
    policy = CharTokenizer("abcdefgh")  # ids 0..7, 8 = eos (not decodable)
    reward = CharTokenizer("hgfedcba", bos=9)
    r = make_rollout([[0, 1], [2]], [[3, 8], [4, 5, 6]], T=4, pad=8, ended=[True, False])
    scores = reward_model_scores(ScoreModel(), r, batch_size=1, policy_tokenizer=policy, reward_tokenizer=reward)
    # "abd" -> bos,7,6,4 (last real at position 3); "cefg" -> bos,5,3,2,1 (position 4).
    assert scores.tolist() == [4 + 3000, 1 + 4000]
    same = reward_model_scores(
        ScoreModel(), r, batch_size=2, policy_tokenizer=policy, reward_tokenizer=CharTokenizer("abcdefgh")
    )
    assert same.tolist() == [8 + 3000, 6 + 3000]  # ids scored directly, no BOS
    with pytest.raises(ValueError, match="policy_tokenizer"):
        reward_model_scores(ScoreModel(), r, batch_size=1, reward_tokenizer=reward)


def test_completion_logprobs_slice_matches_full_forward():
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(
        GPTNeoXConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=64)
    ).eval()
    r = make_rollout([[5, 6, 7], [9]], [[10, 11, 12], [13]], T=4, pad=0, ended=[False, False])
    lp, _ = completion_logprobs(model, r, temperature=0.5)
    with torch.no_grad():
        row = torch.tensor([[5, 6, 7, 10, 11, 12]])
        logits = model(row).logits[0, 2:5] / 0.5
        expected = torch.log_softmax(logits, -1).gather(-1, row[0, 3:, None]).squeeze(-1)
    assert torch.allclose(lp[0, :3], expected, atol=1e-5)
    assert lp[0, 3] == 0 and (lp[1, 1:] == 0).all()
    assert lp.requires_grad
    blp, bent = batched_completion_logprobs(model, r, batch_size=1, temperature=0.5, with_entropy=True)
    assert torch.allclose(blp, lp.detach(), atol=1e-5) and bent.shape == lp.shape


def test_reward_function_scores_weights_and_columns():
    def length(prompts, completions, **kw):
        return [float(len(c)) for c in completions]

    def matches(prompts, completions, answer, **kw):
        return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]

    out = reward_function_scores(
        [length, matches], ["p", "q"], ["ab", "c"], weights=[0.5, 2.0], columns={"answer": ["ab", "x"]}
    )
    assert out.tolist() == [3.0, 0.5]
    assert reward_function_matrix(length, ["p"], ["abc"]).tolist() == [[3.0]]


@pytest.mark.parametrize(
    "bad, message",
    [
        ([1.0], "returned 1 values for 2"),
        ([math.nan, 1.0], "nan at row 1 of 2"),
        ([1.0, math.inf], "inf at row 2 of 2"),
        ([1.0, "x"], "'x' at row 2 of 2"),
    ],
)
def test_reward_function_validation_names_function_and_row(bad, message):
    def my_reward(prompts, completions, **kw):
        return bad

    with pytest.raises(ValueError, match="my_reward") as err:
        reward_function_scores(my_reward, ["p", "q"], ["a", "b"])
    assert message in str(err.value)


def test_reward_function_none_everywhere_in_a_row_warns_and_scores_zero(caplog):
    """A completion that gets None from the only reward function: TRL's warning naming the row, reward 0."""

    def my_reward(prompts, completions, **kw):
        return [1.0, None]

    with caplog.at_level("WARNING"):
        assert reward_function_scores(my_reward, ["p", "q"], ["a", "b"]).tolist() == [1.0, 0.0]
    (record,) = caplog.records
    assert "'completion': 'b'" in record.getMessage() and "('my_reward')" in record.getMessage()


def test_reward_function_argument_errors():
    f = lambda prompts, completions, **kw: [0.0] * len(completions)  # noqa: E731
    with pytest.raises(ValueError, match="weights"):
        reward_function_scores([f], ["p"], ["a"], weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="column 'answer'"):
        reward_function_scores([f], ["p"], ["a"], columns={"answer": ["x", "y"]})


def test_missing_eos_penalty_uses_ended_flag():
    scores = torch.tensor([1.0, 2.0, 3.0])
    ended = torch.tensor([True, False, True])
    assert apply_missing_eos_penalty(scores, ended, 1.5).tolist() == [1.0, 0.5, 3.0]
    assert apply_missing_eos_penalty(scores, ended, None) is scores
    assert scores.tolist() == [1.0, 2.0, 3.0]


def test_reward_scores_match_hf_pooling_when_pad_is_distinct():
    from transformers import GPTNeoXForSequenceClassification

    torch.manual_seed(0)
    config = GPTNeoXConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=64,
        num_labels=1,
        pad_token_id=63,
    )
    rm = GPTNeoXForSequenceClassification(config).eval()
    r = make_rollout([[5, 6, 7], [9]], [[10, 11], [13, 14, 15, 16]], T=4, pad=63, ended=[True, False])
    ours = reward_model_scores(rm, r, batch_size=2)
    with torch.no_grad():
        hf = rm(input_ids=r.sequence_ids, attention_mask=r.sequence_mask.long(), position_ids=r.position_ids).logits[
            :, 0
        ]
    assert torch.allclose(ours, hf, atol=1e-5)


def test_trl_grpo_style_reward_functions_get_keywords():
    from posttrain.scoring import reward_function_scores

    def trl_style(completions, **kwargs):  # TRL GRPO: prompts arrive as a keyword
        return [float(len(c)) + (10.0 if kwargs["prompts"][i] == "b" else 0.0) for i, c in enumerate(completions)]

    def with_solution(completions, solution, **kwargs):
        return [1.0 if c == s else 0.0 for c, s in zip(completions, solution)]

    def positional(p, c):
        return [float(len(x)) for x in p]

    prompts, completions = ["a", "b"], ["xy", "z"]
    assert reward_function_scores([trl_style], prompts, completions).tolist() == [2.0, 11.0]
    assert reward_function_scores(
        [with_solution], prompts, completions, columns={"solution": ["xy", "q"]}
    ).tolist() == [1.0, 0.0]
    assert reward_function_scores([positional], prompts, completions).tolist() == [1.0, 1.0]


def test_reward_functions_get_completion_ids_and_trainer_state_by_name():
    """TRL GRPO's reward-function keywords: a function may ask for `completion_ids` or `trainer_state`
    alone; a function without **kwargs gets only the keywords it names (extra dataset columns and
    extras never break it); a positional one keeps (prompts, completions)."""
    prompts, completions = ["a", "b"], ["xy", "z"]
    extras = {"completion_ids": [[7, 8, 2], [9]], "trainer_state": "STATE"}
    columns = {"answer": ["xy", "q"]}

    def by_ids(completion_ids, **kwargs):
        return [float(len(ids)) for ids in completion_ids]

    def by_state(completions, trainer_state):
        assert trainer_state == "STATE"
        return [1.0] * len(completions)

    def no_kwargs(prompts, completions):
        return [float(len(c)) for c in completions]

    def positional(p, c, completion_ids):
        return [float(len(x) + len(ids)) for x, ids in zip(p, completion_ids)]

    matrix = reward_function_matrix(
        [by_ids, by_state, no_kwargs, positional], prompts, completions, columns=columns, extras=extras
    )
    assert matrix.tolist() == [[3.0, 1.0, 2.0, 4.0], [1.0, 1.0, 1.0, 2.0]]


def test_async_reward_functions_run_concurrently_also_inside_a_running_loop():
    """`async def` reward functions (TRL GRPO supports them) are awaited together: `waits` finishes
    only once `signals` has started, which a one-after-the-other schedule would never allow. Called
    from code that already runs an event loop (a notebook), they run on a loop of their own."""
    import asyncio

    started = {}

    async def waits(completions, **kwargs):
        await asyncio.wait_for(started["event"].wait(), timeout=5)
        return [float(len(c)) for c in completions]

    def plain(completions, **kwargs):
        return [10.0] * len(completions)

    async def signals(completions, **kwargs):
        started["event"].set()
        return [1.0] * len(completions)

    def score():
        started["event"] = asyncio.Event()  # binds to the loop that first waits on it
        return reward_function_matrix([waits, plain, signals], ["p", "q"], ["ab", "c"]).tolist()

    assert score() == [[2.0, 10.0, 1.0], [1.0, 10.0, 1.0]]

    async def notebook():
        return score()

    assert asyncio.run(notebook()) == [[2.0, 10.0, 1.0], [1.0, 10.0, 1.0]]


def test_async_reward_function_errors_name_the_function():
    async def broken_grader(completions, **kwargs):
        raise ConnectionError("grader down")

    with pytest.raises(ValueError, match="broken_grader") as err:
        reward_function_matrix([broken_grader], ["p"], ["a"])
    assert "grader down" in str(err.value)


def test_a_reward_model_with_several_labels_is_read_at_its_first_label(caplog):
    """A two-label classifier as reward model (what TRL's RLOO tests pass: AutoModelForSequenceClassification
    of a causal LM, num_labels=2 by default): the reward is its first logit, as TRL's GRPOTrainer reads
    `logits[:, 0]`, with one warning; a critic must still have one label."""
    from transformers import GPTNeoXForSequenceClassification

    torch.manual_seed(0)
    config = GPTNeoXConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=64,
        num_labels=2, pad_token_id=63,
    )  # fmt: skip
    rm = GPTNeoXForSequenceClassification(config).eval()
    r = make_rollout([[5, 6, 7], [9]], [[10, 11], [13, 14, 15, 16]], T=4, pad=63, ended=[True, False])
    with caplog.at_level("WARNING", logger="posttrain.scoring"):
        ours = reward_model_scores(rm, r, batch_size=2)
        again = reward_model_scores(rm, r, batch_size=1)
    with torch.no_grad():
        hf = rm(input_ids=r.sequence_ids, attention_mask=r.sequence_mask.long(), position_ids=r.position_ids).logits
    assert ours.shape == (2,) and torch.allclose(ours, hf[:, 0], atol=1e-5) and torch.allclose(again, ours)
    assert sum("num_labels=2: its first logit is the reward" in m for m in caplog.messages) == 1
    with pytest.raises(ValueError, match=r"must output one value per token \(num_labels=1\), got 2"):
        completion_values(rm, r)
