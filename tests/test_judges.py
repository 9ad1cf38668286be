"""Judges: order-flip mapping, the HTTP judge against a scripted local server, the reward-model
judge on a tiny model, callables, PairRM without llm-blender, the CLI spec factory and win rates.

Offline: the only network traffic goes to a server on 127.0.0.1 started (and stopped) here.
"""

from __future__ import annotations

import json
import logging
import math
import pickle
import re
import sys
import threading
import time
import types
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from posttrain.configs import ConfigError
from posttrain.judges import (
    DEFAULT_PAIRWISE_SYSTEM_PROMPT,
    AllTrueJudge,
    BaseBinaryJudge,
    BasePairwiseJudge,
    CallableJudge,
    HfPairwiseJudge,
    HTTPPairwiseJudge,
    OpenAIPairwiseJudge,
    PairRMJudge,
    RandomBinaryJudge,
    RandomPairwiseJudge,
    RandomRankJudge,
    RewardModelJudge,
    judge_from_spec,
    win_rate,
)

SECRET = "sk-test-Zq81-never-shown"
KEY_ENV = "POSTTRAIN_TEST_JUDGE_KEY"
# A template the test server can parse back into (prompt, response0, response1).
TEMPLATE = "PROMPT<{prompt}>R0<{response0}>R1<{response1}>"
TEMPLATE_RE = re.compile(r"PROMPT<(.*)>R0<(.*)>R1<(.*)>", re.S)
# The same three fields out of the default (TRL) prompt, which `posttrain judge` sends.
DEFAULT_RE = re.compile(r'"instruction": """(.*?)""",.*?"output": """(.*?)""".*?"output": """(.*?)"""', re.S)


# --------------------------------------------------------------------------------------------
# Scripted OpenAI-compatible server
# --------------------------------------------------------------------------------------------


class ScriptedServer:
    """Answers /v1/chat/completions according to the prompt's mode, "<mode>|<id>":

    good      "0"/"1": the index of the response starting with GOOD
    flaky     HTTP 500 on the first request for this prompt, then like good
    rate429   HTTP 429 (Retry-After: 0) on the first request, then like good
    fail500   always HTTP 500
    sleep     holds the request (until teardown) so the client times out
    slow      answers like good after 0.2 s (requests overlap: `max_in_flight` counts them)
    malformed 200 with a body that is not JSON
    chatty    200 with a reply that holds no 0/1
    auth401   HTTP 401
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: list[dict] = []  # {"prompt", "r0", "r1", "auth", "payload", "path"}
        self.counts: Counter[str] = Counter()
        self.in_flight = self.max_in_flight = 0
        self.release = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass  # keep pytest output clean

            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                content = payload["messages"][0]["content"]
                prompt, r0, r1 = (TEMPLATE_RE.fullmatch(content) or DEFAULT_RE.search(content)).groups()
                with server.lock:
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                self.counted = True
                try:
                    self._answer(payload, prompt, r0, r1)
                finally:
                    self._leave()

            def _leave(self):
                # A request stops counting before its answer is written: once the client has read it,
                # the client may send its next request while this thread is still finishing.
                if getattr(self, "counted", False):
                    self.counted = False
                    with server.lock:
                        server.in_flight -= 1

            def _answer(self, payload, prompt, r0, r1):
                with server.lock:
                    server.requests.append(
                        {
                            "prompt": prompt,
                            "r0": r0,
                            "r1": r1,
                            "auth": self.headers.get("Authorization"),
                            "payload": payload,
                            "path": self.path,
                        }
                    )
                    server.counts[prompt] += 1
                    attempt = server.counts[prompt]
                mode = prompt.split("|")[0]
                answer = "0" if r0.startswith("GOOD") else "1"
                if self.path != "/v1/chat/completions":
                    self._send(404, b"{}")
                elif mode == "good" or (mode in ("flaky", "rate429") and attempt > 1):
                    self._reply(answer)
                elif mode == "flaky" or mode == "fail500":
                    self._send(500, b'{"error": "boom"}')
                elif mode == "rate429":
                    self._send(429, b'{"error": "slow down"}', {"Retry-After": "0"})
                elif mode == "sleep":
                    server.release.wait(timeout=3.0)
                    self._reply(answer)
                elif mode == "slow":
                    time.sleep(0.2)
                    self._reply(answer)
                elif mode == "malformed":
                    self._send(200, b'{"choices": [ not json')
                elif mode == "chatty":
                    self._reply("Both answers are equally good.")
                elif mode == "auth401":
                    self._send(401, b'{"error": "invalid key"}')
                else:
                    self._send(400, b'{"error": "unknown test mode"}')

            def _reply(self, content):
                body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}
                self._send(200, json.dumps(body).encode())

            def _send(self, code, body, headers=None):
                self._leave()
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    for k, v in (headers or {}).items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    pass  # the client gave up (timeout test); nothing to answer

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)

    def seen(self, prompt):
        with self.lock:
            return [r for r in self.requests if r["prompt"] == prompt]


@pytest.fixture
def server(monkeypatch):
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv(KEY_ENV, SECRET)
    srv = ScriptedServer()
    yield srv
    srv.close()


def make_judge(server, **kw):
    options = dict(api_key_env=KEY_ENV, system_prompt=TEMPLATE, timeout=2.0, backoff=0.001, max_backoff=0.01, seed=0)
    options.update(kw)
    return HTTPPairwiseJudge(server.url, "judge-model", **options)


def good_pairs(n, mode="good"):
    """Prompts "<mode>|i" and pairs whose GOOD completion alternates between slot 0 and slot 1."""
    prompts = [f"{mode}|{i}" for i in range(n)]
    pairs = [[f"GOOD {i}", f"bad {i}"] if i % 2 == 0 else [f"bad {i}", f"GOOD {i}"] for i in range(n)]
    return prompts, pairs, [i % 2 for i in range(n)]


def flipped_prompts(server, prompts, pairs):
    """Prompts the server saw with the pair swapped."""
    return {p for p, pair in zip(prompts, pairs) for r in server.seen(p) if r["r0"] != pair[0]}


def judge_warnings(caplog):
    return [
        r.getMessage() for r in caplog.records if r.name.startswith("posttrain.judges") and r.levelno >= logging.WARNING
    ]


# --------------------------------------------------------------------------------------------
# HTTP judge
# --------------------------------------------------------------------------------------------


def test_http_good_answers_map_back_through_flips(server, caplog):
    prompts, pairs, expected = good_pairs(8)
    judge = make_judge(server, max_concurrency=4)
    assert judge.judge(prompts, pairs, shuffle_order=True) == expected
    flipped = flipped_prompts(server, prompts, pairs)
    # The seeded RNG swapped some pairs but not all, and the answers still point at GOOD.
    assert 0 < len(flipped) < len(prompts)

    # Same seed, same flips: the order shown to the judge is reproducible.
    prompts2 = [p.replace("good|", "good|again-") for p in prompts]
    assert make_judge(server).judge(prompts2, pairs) == expected
    assert {p.replace("good|again-", "good|") for p in flipped_prompts(server, prompts2, pairs)} == flipped

    prompts3 = [p.replace("good|", "good|fixed-") for p in prompts]
    assert make_judge(server).judge(prompts3, pairs, shuffle_order=False) == expected
    assert flipped_prompts(server, prompts3, pairs) == set()

    request = server.seen("good|0")[0]
    assert request["path"] == "/v1/chat/completions"
    assert request["auth"] == f"Bearer {SECRET}"
    assert request["payload"]["model"] == "judge-model"
    assert request["payload"]["max_tokens"] == 1
    assert judge.num_requests == 8 and judge.num_failures == 0
    assert judge_warnings(caplog) == []


def test_http_5xx_is_retried_then_succeeds(server, caplog):
    prompts, pairs, expected = good_pairs(4, mode="flaky")
    judge = make_judge(server, max_retries=2)
    assert judge.judge(prompts, pairs) == expected
    assert all(server.counts[p] == 2 for p in prompts)
    assert judge_warnings(caplog) == []


def test_http_429_is_retried(server):
    prompts, pairs, expected = good_pairs(2, mode="rate429")
    assert make_judge(server, max_retries=1).judge(prompts, pairs) == expected
    assert all(server.counts[p] == 2 for p in prompts)


def test_http_always_500_stays_minus_one_after_flip(server, caplog):
    prompts = [f"fail500|{i}" for i in range(6)]
    pairs = [[f"A {i}", f"B {i}"] for i in range(6)]
    judge = make_judge(server, max_retries=2)
    # TRL mapped a swapped answer back with 1 - rank, turning -1 into 2; every answer must stay -1.
    assert judge.judge(prompts, pairs, shuffle_order=True) == [-1] * 6
    assert flipped_prompts(server, prompts, pairs), "seed=0 should swap at least one of 6 pairs"
    assert all(server.counts[p] == 3 for p in prompts)  # 1 try + 2 retries
    assert judge.num_failures == 6
    warnings = judge_warnings(caplog)
    assert len(warnings) == 1, "one summary line per judge() call, not one per request"
    assert "6 of 6 pairs failed" in warnings[0] and "HTTP 500 x6" in warnings[0]


def test_http_timeout_is_a_failure(server, caplog):
    judge = make_judge(server, timeout=0.2, max_retries=1)
    start = time.monotonic()
    assert judge.judge(["sleep|0"], [["GOOD", "bad"]]) == [-1]
    assert time.monotonic() - start < 2.5
    assert server.counts["sleep|0"] == 2
    assert "timeout x1" in judge_warnings(caplog)[0]


def test_http_malformed_body_and_chatty_reply(server, caplog):
    judge = make_judge(server, max_retries=3)
    answers = judge.judge(["malformed|0", "chatty|0", "good|0"], [["GOOD", "bad"], ["GOOD", "bad"], ["bad", "GOOD"]])
    assert answers == [-1, -1, 1]
    # A 200 with a useless body is an answer, not a transient error: no retry.
    assert server.counts["malformed|0"] == 1 and server.counts["chatty|0"] == 1
    (line,) = judge_warnings(caplog)
    assert "2 of 3 pairs failed" in line and "malformed reply x1" in line and "reply without 0/1 x1" in line


def test_http_401_is_not_retried(server, caplog):
    judge = make_judge(server, max_retries=3)
    assert judge.judge(["auth401|0"], [["GOOD", "bad"]]) == [-1]
    assert server.counts["auth401|0"] == 1
    (line,) = judge_warnings(caplog)
    assert "HTTP 401" in line and f"${KEY_ENV}" in line and SECRET not in line


def test_http_max_requests_cap(server, caplog):
    prompts, pairs, expected = good_pairs(5)
    judge = make_judge(server, max_requests=3)
    assert judge.judge(prompts, pairs, shuffle_order=False) == expected[:3] + [-1, -1]
    assert judge.judge(["good|x", "good|y"], [["GOOD", "b"], ["GOOD", "b"]]) == [-1, -1]
    assert len(server.requests) == 3
    cap_lines = [m for m in judge_warnings(caplog) if "max_requests=3" in m]
    assert len(cap_lines) == 1, "the cap is announced once"


def test_http_api_key_never_leaks(server, caplog):
    judge = make_judge(server, max_retries=0)
    judge.judge(["fail500|k", "auth401|k", "malformed|k"], [["a", "b"]] * 3)
    assert server.seen("fail500|k")[0]["auth"] == f"Bearer {SECRET}"
    assert SECRET not in repr(judge)
    assert SECRET not in repr(vars(judge))
    assert SECRET.encode() not in pickle.dumps(judge)
    assert all(SECRET not in m for m in judge_warnings(caplog))
    restored = pickle.loads(pickle.dumps(judge))
    assert restored.judge(["good|restored"], [["bad", "GOOD"]]) == [1]
    assert server.seen("good|restored")[0]["auth"] == f"Bearer {SECRET}"


def test_http_without_key_sends_no_authorization(server):
    judge = make_judge(server, api_key_env=None)
    assert judge.judge(["good|nokey"], [["GOOD", "bad"]]) == [0]
    assert server.seen("good|nokey")[0]["auth"] is None


def test_http_prompt_validation_and_default_prompt():
    text = DEFAULT_PAIRWISE_SYSTEM_PROMPT.format(prompt="P?", response0="first", response1="second")
    assert '"""P?"""' in text and '"""first"""' in text and '"""second"""' in text
    with pytest.raises(ValueError, match="system_prompt"):
        HTTPPairwiseJudge("http://127.0.0.1:9/v1", "m", api_key_env=None, system_prompt="{question} {response0}")
    with pytest.raises(ValueError, match="base_url"):
        HTTPPairwiseJudge("127.0.0.1:9/v1", "m", api_key_env=None)


def test_openai_judge_defaults(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ValueError, match="OPENAI_API_KEY"):
        OpenAIPairwiseJudge()
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    judge = OpenAIPairwiseJudge()
    assert isinstance(judge, HTTPPairwiseJudge)
    assert (judge.base_url, judge.model, judge.max_requests) == ("https://api.openai.com/v1", "gpt-4o-mini", 1000)
    assert SECRET not in repr(judge)


def test_hf_judge_takes_trls_arguments_and_the_hub_token(server, monkeypatch, caplog):
    """TRL's HfPairwiseJudge(model, token, system_prompt): the token given, else huggingface_hub's
    ($HF_TOKEN or `hf auth login`'s), sent as a bearer token to Inference Providers' router (here the
    scripted server); never in repr() or a pickle; a pickled judge finds the token again where it lands."""
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    with pytest.raises(ValueError, match=r"HfPairwiseJudge needs a Hugging Face token.*HF_TOKEN.*hf auth login"):
        HfPairwiseJudge()
    judge = HfPairwiseJudge("org/judge", "hf_given", TEMPLATE, base_url=server.url, seed=0, backoff=0.001)
    assert (judge.model, judge.max_requests) == ("org/judge", 1000)
    assert HfPairwiseJudge("org/judge", "hf_given").base_url == "https://router.huggingface.co/v1"
    assert HfPairwiseJudge("org/judge", "hf_given").model == "org/judge"
    assert HfPairwiseJudge(token="hf_given").model == "meta-llama/Meta-Llama-3-70B-Instruct"  # TRL's default
    prompts, pairs, expected = good_pairs(4)
    assert judge.judge(prompts, pairs) == expected
    assert {r["auth"] for r in server.requests} == {"Bearer hf_given"}
    assert {r["payload"]["model"] for r in server.requests} == {"org/judge"}
    assert "hf_given" not in repr(judge) and b"hf_given" not in pickle.dumps(judge)

    monkeypatch.setattr("huggingface_hub.get_token", lambda: "hf_from_login")
    restored = pickle.loads(pickle.dumps(judge))
    assert restored.judge(["good|moved"], [["GOOD", "bad"]]) == [0]
    assert server.seen("good|moved")[0]["auth"] == "Bearer hf_from_login"
    from_login = HfPairwiseJudge("org/judge", system_prompt=TEMPLATE, base_url=server.url, max_retries=0)
    assert from_login.judge(["auth401|hf"], [["a", "b"]]) == [-1]
    assert server.seen("auth401|hf")[0]["auth"] == "Bearer hf_from_login"
    assert any("HTTP 401 (check the Hugging Face token" in m for m in judge_warnings(caplog))


# --------------------------------------------------------------------------------------------
# Order flip, callables, random and binary judges
# --------------------------------------------------------------------------------------------


def test_flip_maps_answers_back_and_keeps_failures():
    # A judge that always says "slot 0" reveals the flips: answers are 1 exactly on swapped pairs.
    pairs = [["a", "b"]] * 64
    always_first = CallableJudge(lambda prompts, pairs: [0] * len(pairs), mode="pairwise", seed=1)
    shuffled = always_first.judge(["p"] * 64, pairs)
    assert set(shuffled) == {0, 1}
    assert always_first.judge(["p"] * 64, pairs, shuffle_order=False) == [0] * 64

    always_fails = CallableJudge(lambda prompts, pairs: [-1] * len(pairs), mode="pairwise", seed=1)
    assert always_fails.judge(["p"] * 64, pairs) == [-1] * 64


def test_callable_pairwise_form_detected_from_signature():
    def prefer_shorter(prompts, pairs):
        return [0 if len(a) < len(b) else 1 for a, b in pairs]

    judge = CallableJudge(prefer_shorter, seed=0)
    assert judge.mode == "pairwise"
    pairs = [["short", "much longer"], ["much longer", "short"]] * 4
    assert judge.judge(["q"] * 8, pairs) == [0, 1] * 4


def test_callable_score_form_and_nan():
    def length_score(prompt, completion):
        return float("nan") if completion == "broken" else len(completion)

    judge = CallableJudge(length_score, seed=0)
    assert judge.mode == "score"
    pairs = [["a", "abc"], ["abcd", "ab"], ["broken", "ab"], ["ab", "broken"]]
    assert judge.judge(["q"] * 4, pairs) == [1, 0, -1, -1]


def test_callable_ambiguous_or_bad_returns():
    with pytest.raises(ValueError, match="mode="):
        CallableJudge(lambda p, c: 1.0)
    assert CallableJudge(lambda p, c: len(c), mode="score").judge(["q"], [["a", "bb"]], shuffle_order=False) == [1]
    with pytest.raises(ValueError, match="answered 0.5"):
        CallableJudge(lambda prompts, pairs: [0.5] * len(pairs), mode="pairwise").judge(["q"], [["a", "b"]])
    with pytest.raises(ValueError, match="returned 2 answers for 1 pairs"):
        CallableJudge(lambda prompts, pairs: [0, 1], mode="pairwise").judge(["q"], [["a", "b"]])
    with pytest.raises(ValueError, match="exactly 2"):
        CallableJudge(lambda prompts, pairs: [0], mode="pairwise").judge(["q"], [["a", "b", "c"]])
    with pytest.raises(ValueError, match="1 prompts but 2"):
        RandomPairwiseJudge(0).judge(["q"], [["a", "b"], ["a", "b"]])


def test_random_judges_are_reproducible():
    pairs = [["a", "b"]] * 20
    first = RandomPairwiseJudge(seed=3).judge(["p"] * 20, pairs)
    assert first == RandomPairwiseJudge(seed=3).judge(["p"] * 20, pairs)
    assert set(first) <= {0, 1}
    ranks = RandomRankJudge(seed=0).judge(["p", "q"], [["a", "b", "c"], ["x", "y"]])
    assert sorted(ranks[0]) == [0, 1, 2] and sorted(ranks[1]) == [0, 1]


class _FixedBinary(BaseBinaryJudge):
    def __init__(self, verdicts):
        self.verdicts = verdicts

    def judge(self, prompts, completions, gold_completions=None, shuffle_order=True):
        return list(self.verdicts)


def test_all_true_judge():
    judge = AllTrueJudge([_FixedBinary([1, 1, 0, 1]), _FixedBinary([1, 0, 0, -1])])
    assert judge.judge(["p"] * 4, ["c"] * 4) == [1, 0, 0, -1]
    with pytest.raises(ValueError, match="expected 0, 1 or -1"):
        AllTrueJudge([_FixedBinary([2])]).judge(["p"], ["c"])


def test_trl_style_subclass_overriding_judge_still_works():
    class Legacy(BasePairwiseJudge):
        def judge(self, prompts, completions, shuffle_order=True):
            return [0] * len(prompts)

    assert Legacy().judge(["p"], [["a", "b"]]) == [0]


# --------------------------------------------------------------------------------------------
# Judge state (checkpoint / resume)
# --------------------------------------------------------------------------------------------


def _always_first(prompts, pairs):
    return [0] * len(pairs)


PAIRS = [["a", "b"]] * 16
JUDGES_WITH_STATE = {
    # name: (build(seed), one round of decisions)
    "random_pairwise": (lambda seed: RandomPairwiseJudge(seed=seed), lambda j: j.judge(["p"] * 16, PAIRS)),
    # Always answering slot 0 makes the decisions exactly the order flips (1 = swapped pair).
    "callable_flips": (
        lambda seed: CallableJudge(_always_first, mode="pairwise", seed=seed),
        lambda j: j.judge(["p"] * 16, PAIRS),
    ),
    "random_rank": (lambda seed: RandomRankJudge(seed=seed), lambda j: j.judge(["p"] * 4, [["a", "b", "c", "d"]] * 4)),
    "random_binary": (lambda seed: RandomBinaryJudge(seed=seed), lambda j: j.judge(["p"] * 16, ["c"] * 16)),
    "all_true": (
        lambda seed: AllTrueJudge([RandomBinaryJudge(seed=seed), RandomBinaryJudge(seed=seed + 1)]),
        lambda j: j.judge(["p"] * 16, ["c"] * 16),
    ),
}


@pytest.mark.parametrize("name", sorted(JUDGES_WITH_STATE))
def test_judge_state_round_trips_and_resume_repeats_decisions(name):
    build, decide = JUDGES_WITH_STATE[name]
    judge = build(3)
    decide(judge)  # the run before the checkpoint
    # Checkpoints keep this state in trainer_state.json: it must survive JSON unchanged.
    state = json.loads(json.dumps(judge.state_dict(), allow_nan=False))
    uninterrupted = [decide(judge) for _ in range(3)]

    resumed = build(100)  # built with another seed: only the loaded state can make it agree
    resumed.load_state_dict(state)
    assert [decide(resumed) for _ in range(3)] == uninterrupted
    assert resumed.state_dict() == judge.state_dict()
    # Without the state, that seed decides differently (48 coin flips or 12 permutations agreeing by chance: never).
    assert [decide(build(100)) for _ in range(3)] != uninterrupted


def test_load_state_dict_rejects_another_judges_state():
    state = RandomPairwiseJudge(seed=0).state_dict()
    assert sorted(state) == ["answer_rng", "flip_rng"]
    with pytest.raises(ValueError, match=r"missing keys \['rng'\], unexpected keys \['answer_rng', 'flip_rng'\]"):
        RandomRankJudge(seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="holds 1 judges' states but this AllTrueJudge combines 2"):
        AllTrueJudge([RandomBinaryJudge(0), RandomBinaryJudge(1)]).load_state_dict({"judges": [{"rng": [3, [], None]}]})
    # A judge without state saves {} and takes back only {}.
    assert _FixedBinary([1]).state_dict() == {}
    _FixedBinary([1]).load_state_dict({})
    with pytest.raises(ValueError, match=r"unexpected keys \['rng'\]"):
        _FixedBinary([1]).load_state_dict({"rng": [3, [], None]})


def test_trl_style_subclass_without_init_has_flip_state():
    class Legacy(BasePairwiseJudge):
        def __init__(self):  # never calls super().__init__(), as some TRL judges do
            pass

        def judge_pairs(self, prompts, pairs):
            return [0] * len(pairs)

    judge = Legacy()
    state = judge.state_dict()
    expected = judge.judge(["p"] * 16, PAIRS)
    other = Legacy()
    other.load_state_dict(state)
    assert other.judge(["p"] * 16, PAIRS) == expected


def test_http_judge_state_keeps_the_request_cap_across_resume(server):
    first_prompts, first_pairs, first_expected = good_pairs(3)
    later_prompts, later_pairs, later_expected = good_pairs(3)
    later_prompts = [p + "-later" for p in later_prompts]
    judge = make_judge(server, max_requests=5, seed=0)
    assert judge.judge(first_prompts, first_pairs) == first_expected
    state = json.loads(json.dumps(judge.state_dict()))
    assert (state["num_requests"], state["num_failures"]) == (3, 0)

    resumed = make_judge(server, max_requests=5, seed=7)
    resumed.load_state_dict(state)
    # 3 of the 5 allowed requests were spent before the checkpoint: 2 more are sent, the third pair is -1.
    assert resumed.judge(later_prompts, later_pairs) == later_expected[:2] + [-1]
    assert resumed.num_requests == 5 and sum(len(server.seen(p)) for p in later_prompts) == 2
    # The flip RNG continued from the checkpoint too: it now matches the uninterrupted judge's.
    judge.judge(later_prompts, later_pairs)
    assert resumed.state_dict()["flip_rng"] == judge.state_dict()["flip_rng"]


# --------------------------------------------------------------------------------------------
# Reward-model judge on a tiny model
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_rm():
    """A 1-layer Llama reward model (hidden 16) whose score head prefers GOOD_COMPLETION.

    pad == eos, so reading the score from pad ids would pick the wrong token when the completion
    ends with eos. The head is w = h_good - h_bad (last-token hidden states of the two sequences):
    then score_good - score_bad = w·(h_good - h_bad) = |h_good - h_bad|² > 0.
    """
    torch = pytest.importorskip("torch")
    from posttrain.testing import build_tiny_reward_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(pad_equals_eos=True)
    model = build_tiny_reward_model(tokenizer, hidden_size=16, num_layers=1, num_heads=2, seed=0)
    prompt = "Question: how many legs does a spider have? Answer:"
    good, bad = " eight legs." + tokenizer.eos_token, " 42"
    with torch.no_grad():
        h = [last_hidden(model, tokenizer(prompt + c)["input_ids"]) for c in (good, bad)]
        model.score.weight.copy_((h[0] - h[1])[None, :])
    return model, tokenizer, prompt, good, bad


def last_hidden(model, ids):
    import torch

    with torch.no_grad():
        return model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]


def manual_score(model, ids):
    """Unpadded, batch of one: no padding or mask can be wrong."""
    return float(model.score.weight[0].detach() @ last_hidden(model, ids))


def test_reward_model_judge_prefers_known_completion(tiny_rm):
    model, tokenizer, prompt, good, bad = tiny_rm
    judge = RewardModelJudge(model, tokenizer, batch_size=16, seed=0)
    pairs = [[good, bad], [bad, good]] * 3
    assert judge.judge([prompt] * 6, pairs) == [0, 1] * 3


def test_reward_model_judge_reads_last_real_token_with_pad_equal_eos(tiny_rm):
    model, tokenizer, prompt, good, bad = tiny_rm
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    completions = [good, bad, " The capital of France is Paris." + tokenizer.eos_token, ""]
    expected = [manual_score(model, tokenizer(prompt + c)["input_ids"]) for c in completions]
    batched = RewardModelJudge(model, tokenizer, batch_size=16).score([prompt] * 4, completions)
    one_by_one = RewardModelJudge(model, tokenizer, batch_size=1).score([prompt] * 4, completions)
    assert batched == pytest.approx(expected, abs=1e-5)
    assert one_by_one == pytest.approx(expected, abs=1e-5)


def test_reward_model_judge_conversational_uses_chat_template(tiny_rm):
    model, tokenizer, _, _, _ = tiny_rm
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": "Paris."}], tokenize=False)
    expected = manual_score(model, tokenizer(text, add_special_tokens=False)["input_ids"])
    (score,) = RewardModelJudge(model, tokenizer).score([messages], ["Paris."])
    assert score == pytest.approx(expected, abs=1e-5)


# --------------------------------------------------------------------------------------------
# PairRM
# --------------------------------------------------------------------------------------------


def test_pair_rm_without_llm_blender_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "llm_blender", None)  # makes `import llm_blender` fail
    with pytest.raises(ImportError, match="pip install llm-blender") as info:
        PairRMJudge()
    assert "network access" in str(info.value) and "llm-blender/PairRM" in str(info.value)
    with pytest.raises(ImportError, match="pip install llm-blender"):
        judge_from_spec("pair_rm")


def test_pair_rm_with_stub_blender_hard_and_soft(monkeypatch):
    class Blender:
        def loadranker(self, name, device=None):
            self.loaded = (name, device)

        def rank(self, prompts, candidates, return_scores=False, batch_size=8, disable_tqdm=False):
            assert return_scores
            return [[float(len(c)) for c in pair] for pair in candidates]

    monkeypatch.setitem(sys.modules, "llm_blender", types.SimpleNamespace(Blender=Blender))
    judge = PairRMJudge(device="cpu", seed=0)
    assert judge.blender.loaded == ("llm-blender/PairRM", "cpu")
    pairs = [["abc", "a"], ["a", "abc"]] * 4
    assert judge.judge(["p"] * 8, pairs) == [0, 1] * 4
    # Logits are the lengths (3, 1): p0 = 1 / (1 + exp(-(3 - 1) / T)); at T = 1 that is
    # 1 / (1 + e^-2) = 0.8807970779778823, at T = 2 it is 1 / (1 + e^-1) = 0.7310585786300049.
    probs = judge.judge(["p"] * 8, pairs, return_scores=True)
    assert probs == pytest.approx([0.8807970779778823, 1 - 0.8807970779778823] * 4)
    probs_t2 = judge.judge(["p"] * 2, pairs[:2], return_scores=True, temperature=2.0)
    assert probs_t2 == pytest.approx([0.7310585786300049, 1 - 0.7310585786300049])


# --------------------------------------------------------------------------------------------
# judge_from_spec
# --------------------------------------------------------------------------------------------


def test_judge_from_spec_simple_forms(monkeypatch):
    assert isinstance(judge_from_spec("random"), RandomPairwiseJudge)
    pairs = [["a", "b"]] * 10
    assert judge_from_spec("random:4").judge(["p"] * 10, pairs) == RandomPairwiseJudge(4).judge(["p"] * 10, pairs)

    judge = judge_from_spec("http:http://127.0.0.1:8000/v1#org/some-model", api_key_env=None, max_retries=1)
    assert isinstance(judge, HTTPPairwiseJudge)
    assert (judge.base_url, judge.model, judge.max_retries) == ("http://127.0.0.1:8000/v1", "org/some-model", 1)
    bare = judge_from_spec("http://127.0.0.1:8000/v1#m", api_key_env=None)
    assert (bare.base_url, bare.model) == ("http://127.0.0.1:8000/v1", "m")

    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    assert judge_from_spec("openai").model == "gpt-4o-mini"
    assert judge_from_spec("openai:gpt-4o").model == "gpt-4o"

    for bad in ("http:http://127.0.0.1:8000/v1", "random:x", "python:only_module", "nonsense", "pair_rm:x"):
        with pytest.raises(ValueError, match="spec"):
            judge_from_spec(bad)


def test_judge_from_spec_python(tmp_path, monkeypatch):
    (tmp_path / "my_judges_mod.py").write_text(
        "from posttrain.judges import BasePairwiseJudge\n"
        "def prefer_second(prompts, pairs):\n"
        "    return [1] * len(pairs)\n"
        "class Always0(BasePairwiseJudge):\n"
        "    def judge_pairs(self, prompts, pairs):\n"
        "        return [0] * len(pairs)\n"
        "INSTANCE = Always0()\n"
        "class Holder:\n"
        "    @staticmethod\n"
        "    def score(prompt, completion):\n"
        "        return len(completion)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn_judge = judge_from_spec("python:my_judges_mod:prefer_second")
    assert isinstance(fn_judge, CallableJudge) and fn_judge.judge(["p"], [["a", "b"]], shuffle_order=False) == [1]
    assert type(judge_from_spec("python:my_judges_mod:Always0")).__name__ == "Always0"
    assert judge_from_spec("python:my_judges_mod:INSTANCE") is sys.modules["my_judges_mod"].INSTANCE
    dotted = judge_from_spec("python:my_judges_mod:Holder.score")
    assert dotted.mode == "score" and dotted.judge(["p"], [["a", "bb"]]) == [1]
    with pytest.raises(ValueError, match="no attribute"):
        judge_from_spec("python:my_judges_mod:missing")


def test_judge_from_spec_reward_model(tiny_rm, tmp_path):
    model, tokenizer, prompt, good, bad = tiny_rm
    model.save_pretrained(str(tmp_path))
    tokenizer.save_pretrained(str(tmp_path))
    judge = judge_from_spec(f"reward_model:{tmp_path}", batch_size=4)
    assert isinstance(judge, RewardModelJudge) and judge.batch_size == 4
    assert judge.judge([prompt] * 2, [[good, bad], [bad, good]]) == [0, 1]


# --------------------------------------------------------------------------------------------
# Win rate
# --------------------------------------------------------------------------------------------


def test_win_rate_wilson_interval_by_hand():
    # 7 wins of 10 valid, 2 failures ignored. z = 1.959963984540054, z² = 3.8414588206941254.
    # p = 0.7, z²/n = 0.38414588206941254, denominator 1 + z²/n = 1.3841458820694126
    # center = (0.7 + z²/20) / 1.38414588... = 0.89207294103470627 / 1.38414588... = 0.6444934400274221
    # half = z·sqrt(0.7·0.3/10 + z²/400) / 1.38414588... = z·sqrt(0.021 + 0.0096036470517353) / 1.384...
    #      = 1.959963984540054 · 0.17494133 / 1.38414588 = 0.2477152925662768
    # interval = [0.39677814746114537, 0.8922087325936989]
    result = win_rate([0] * 7 + [1] * 3 + [-1] * 2)
    assert (result.n, result.failures) == (10, 2)
    assert result.rate == pytest.approx(0.7)
    assert result.ci_low == pytest.approx(0.39677814746114537, abs=1e-12)
    assert result.ci_high == pytest.approx(0.8922087325936989, abs=1e-12)

    # 0 wins of 5: center = half = (z²/10) / (1 + z²/5) = 0.38414588 / 1.76829176 = 0.21724123,
    # so the interval is [0, 2·0.21724123] = [0, 0.43448246478317476], not the Wald interval's [0, 0].
    none_won = win_rate([1] * 5)
    assert none_won.rate == 0.0 and none_won.ci_low == pytest.approx(0.0, abs=1e-12)
    assert none_won.ci_high == pytest.approx(0.43448246478317476, abs=1e-12)
    # The same judgements counted for index 1: 5 of 5, interval mirrored to [0.56551753521682524, 1].
    all_won = win_rate([1] * 5, index=1)
    assert all_won.rate == 1.0 and all_won.ci_low == pytest.approx(1 - 0.43448246478317476, abs=1e-12)
    assert all_won.ci_high == pytest.approx(1.0, abs=1e-12)


def test_win_rate_edge_cases():
    empty = win_rate([-1, -1])
    assert empty.n == 0 and empty.failures == 2 and math.isnan(empty.rate) and math.isnan(empty.ci_low)
    with pytest.raises(ValueError, match="judgement 1 is 2"):
        win_rate([0, 2])
    assert "70.0%" in str(win_rate([0] * 7 + [1] * 3))


# --------------------------------------------------------------------------------------------
# `posttrain judge`: --judge_model, the HTTP flags and the progress display
# --------------------------------------------------------------------------------------------
def judge_files(tmp_path, mode, n):
    """Prompts "<mode>|i", model completions that are GOOD and bad references, as jsonl files."""
    rows = [{"prompt": f"{mode}|{i}", "completion": f"GOOD {i}"} for i in range(n)]
    model_file = tmp_path / f"{mode}-model.jsonl"
    model_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ref_file = tmp_path / f"{mode}-ref.jsonl"
    ref_file.write_text("".join(json.dumps({"completion": f"bad {i}"}) + "\n" for i in range(n)))
    return ["--completions_file", str(model_file), "--reference_file", str(ref_file)]


def test_judge_flags_parse_like_judge_tldr(monkeypatch):
    from posttrain.cli import parse_config
    from posttrain.evaluate import build_judge
    from posttrain.judges.spec import HF_ROUTER_URL

    # judge_tldr.py's command as written: trl-lib/tldr's validation split against its references.
    config = parse_config(
        "judge", ["--model_name_or_path", "m", "--judge_model", "gpt-4o-mini", "--num_examples", "1000"]
    )
    assert (config.judge_model, config.judge, config.num_examples) == ("gpt-4o-mini", None, 1000)
    assert (config.dataset_name, config.dataset_split, config.reference_column) == (
        "trl-lib/tldr",
        "validation",
        "completion",
    )
    assert (config.temperature, config.max_new_tokens) == (0.0, 200)  # judge_tldr.py: greedy, 200 tokens

    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    argv = ["--model_name_or_path", "m", "--judge_model", "gpt-4o-mini", "--timeout", "2.5"]
    config = parse_config("judge", [*argv, "--max_retries", "5", "--max_concurrency", "3"])
    judge = build_judge(config)
    assert isinstance(judge, OpenAIPairwiseJudge) and judge.model == "gpt-4o-mini"
    assert (judge.timeout, judge.max_retries, judge.max_concurrency) == (2.5, 5, 3)

    # A name without "gpt" is a model hosted by Hugging Face (TRL: HfPairwiseJudge), keyed by $HF_TOKEN
    # (or the token `hf auth login` saved, which this machine has none of).
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    config = parse_config(
        "judge", ["--model_name_or_path", "m", "--judge_model", "meta-llama/Meta-Llama-3-70B-Instruct"]
    )
    with pytest.raises(ConfigError, match=r"--judge_model meta-llama/Meta-Llama-3-70B-Instruct: .*\$HF_TOKEN"):
        build_judge(config)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: "hf_test")
    judge = build_judge(config)
    assert isinstance(judge, HfPairwiseJudge)
    assert (judge.base_url, judge.model) == (HF_ROUTER_URL, "meta-llama/Meta-Llama-3-70B-Instruct")
    assert (judge.timeout, judge.max_retries, judge.max_concurrency) == (30.0, 3, 8)  # the judge's defaults

    # The http spec takes the flags too; the defaults stay with the judge when they are not given.
    config = parse_config(
        "judge",
        [
            "--model_name_or_path",
            "m",
            "--dataset_name",
            "d",
            "--reference_column",
            "c",
            "--judge",
            "http:http://127.0.0.1:9/v1#m",
            "--max_concurrency",
            "2",
        ],
    )
    judge = build_judge(config)
    assert (judge.max_concurrency, judge.timeout, config.dataset_split) == (2, 30.0, "test")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--judge", "random", "--judge_model", "gpt-4o-mini"], "both name the judge"),
        (["--judge", "random", "--timeout", "3"], "--timeout apply to HTTP judges"),
        (["--judge_model", "gpt-4o-mini", "--max_concurrency", "0"], "max_concurrency=0 must be >= 1"),
        (["--judge_model", "gpt-4o-mini", "--timeout", "0"], "timeout=0.0 must be > 0"),
        (["--judge_model", "gpt-4o-mini", "--max_retries", "-1"], "max_retries=-1 must be >= 0"),
        ([], "judge is not set: pass --judge .* or --judge_model"),
    ],
)
def test_judge_flag_errors(argv, message, capsys):
    from posttrain.cli import parse_config

    with pytest.raises(SystemExit) as refused:
        parse_config("judge", ["--model_name_or_path", "m", *argv])
    assert refused.value.code == 2 and re.search(message, capsys.readouterr().err)


def test_judge_command_honours_timeout_and_retries(server, tmp_path, capsys):
    from posttrain.cli import main

    argv = ["judge", *judge_files(tmp_path, "sleep", 2), "--judge", f"http:{server.url}#judge-model"]
    start = time.monotonic()
    code = main([*argv, "--timeout", "0.2", "--max_retries", "2", "--output_file", str(tmp_path / "out.jsonl")])
    # Every request times out after 0.2 s and is tried 1 + 2 times (with up to 1.5 s of backoff); then the
    # pair is a failure. The server would hold each request 3 s: without the timeout this takes 9 s.
    assert code == 1 and time.monotonic() - start < 6
    assert server.counts["sleep|0"] == server.counts["sleep|1"] == 3
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["winner"] for r in rows] == ["failure", "failure"]
    assert "every judgement failed" in capsys.readouterr().out


def test_judge_command_bounds_concurrency_and_shows_progress(server, tmp_path, capsys):
    from posttrain.cli import main

    argv = ["judge", *judge_files(tmp_path, "slow", 6), "--judge", f"http:{server.url}#judge-model"]
    assert main([*argv, "--max_concurrency", "2"]) == 0
    captured = capsys.readouterr()
    # 6 requests of 0.2 s each, at most 2 at a time (and 2 were in flight together).
    assert server.max_in_flight == 2 and len(server.requests) == 6
    assert "Model win rate: 100.00%" in captured.out  # the default (TRL) prompt; the server picked GOOD
    assert "judging" in captured.err and "6/6" in captured.err  # the progress bar, on stderr
    # Without the flag, the judge's default (8) lets all 6 run at once.
    server.max_in_flight = 0
    assert main(argv) == 0 and server.max_in_flight > 2


def test_progress_hook_counts_every_pair_once(server):
    settled = []
    judge = make_judge(server, max_requests=4, progress=settled.append, max_concurrency=3)
    prompts, pairs, expected = good_pairs(6)
    assert judge.judge(prompts, pairs, shuffle_order=False) == expected[:4] + [-1, -1]
    assert sum(settled) == 6 and settled.count(1) == 4 and 2 in settled  # 4 answers, 2 past the cap at once
    assert pickle.loads(pickle.dumps(judge)).progress is None  # a display stays with its process


def test_local_judges_show_progress_in_chunks():
    from posttrain.evaluate import judge_with_progress

    calls = []

    class Counting(BasePairwiseJudge):
        def judge_pairs(self, prompts, pairs):
            calls.append(len(pairs))
            return [0] * len(pairs)

    prompts, pairs = [f"p{i}" for i in range(10)], [["a", "b"]] * 10
    assert judge_with_progress(RandomPairwiseJudge(3), prompts, pairs, chunk_size=4) == RandomPairwiseJudge(3).judge(
        prompts, pairs
    )  # same answers as one call: flips and draws go pair by pair
    judge_with_progress(Counting(), prompts, pairs, chunk_size=4)
    assert calls == [4, 4, 2]
