"""Training keeps freed memory for reuse (posttrain.runtime.reuse_freed_memory): glibc's trim and mmap
thresholds are set once per process when train() starts, never over a user's own malloc settings, and
POSTTRAIN_MALLOC=off leaves malloc as it is."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import SENTENCES, prompt_dataset, sft_trainer
from helpers import rloo_config as config
from posttrain import runtime
from posttrain.configs import ConfigError
from posttrain.testing import build_tiny_causal_lm
from posttrain.trainers.rloo import RLOOTrainer

MALLOC_SETTINGS = (*runtime.USER_MALLOC_ENV, "GLIBC_TUNABLES", "POSTTRAIN_MALLOC")


class FakeLibc:
    """Records mallopt calls; glibc's mallopt returns 1 on success."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1


@pytest.fixture
def fake_libc(monkeypatch):
    for name in MALLOC_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    libc = FakeLibc()
    monkeypatch.setattr(runtime, "glibc", lambda: libc)
    monkeypatch.setattr(runtime, "_reusing", False)
    monkeypatch.setattr(sys, "platform", "linux")
    return libc


def test_sets_the_mmap_then_the_trim_threshold_once_per_process(fake_libc):
    assert runtime.reuse_freed_memory() is True
    assert fake_libc.calls == [(-3, 32 * 2**20), (-1, 256 * 2**20)]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    assert runtime.reuse_freed_memory() is True
    assert len(fake_libc.calls) == 2


@pytest.mark.parametrize(
    "name, value",
    [
        ("POSTTRAIN_MALLOC", "off"),
        ("POSTTRAIN_MALLOC", " OFF "),
        ("MALLOC_TRIM_THRESHOLD_", "1048576"),
        ("MALLOC_MMAP_THRESHOLD_", "65536"),
        ("MALLOC_TOP_PAD_", "0"),
        ("MALLOC_MMAP_MAX_", "0"),
        ("GLIBC_TUNABLES", "glibc.cpu.hwcaps=-AVX512F:glibc.malloc.trim_threshold=4096"),
    ],
)
def test_off_or_the_users_own_malloc_settings_leave_malloc_alone(fake_libc, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert runtime.reuse_freed_memory() is False
    assert fake_libc.calls == []


def test_other_glibc_tunables_do_not_count_as_malloc_settings(fake_libc, monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.cpu.hwcaps=-AVX512F")
    assert runtime.reuse_freed_memory() is True
    assert len(fake_libc.calls) == 2


def test_not_glibc_or_not_linux_changes_nothing(fake_libc, monkeypatch):
    monkeypatch.setattr(runtime, "glibc", lambda: None)
    assert runtime.reuse_freed_memory() is False
    monkeypatch.setattr(runtime, "glibc", lambda: fake_libc)
    monkeypatch.setattr(sys, "platform", "darwin")
    assert runtime.reuse_freed_memory() is False
    assert fake_libc.calls == []


def test_a_refused_threshold_is_reported_and_tried_again(fake_libc, monkeypatch):
    monkeypatch.setattr(fake_libc, "mallopt", lambda param, value: fake_libc.calls.append((param, value)) or 0)
    assert runtime.reuse_freed_memory() is False
    assert fake_libc.calls == [(-3, 32 * 2**20)]  # the trim threshold is not set after a refused mmap one
    assert runtime.reuse_freed_memory() is False
    assert len(fake_libc.calls) == 2


def test_a_bad_mode_stops_the_run_when_its_config_is_built(tmp_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_MALLOC", "sometimes")
    with pytest.raises(ConfigError, match="POSTTRAIN_MALLOC='sometimes': expected one of auto, off"):
        config(tmp_path)


def test_train_starts_by_setting_it(tmp_path, tiny_tokenizer, monkeypatch):
    calls = []
    monkeypatch.setattr(runtime, "reuse_freed_memory", lambda: calls.append("called") or True)
    trainer = RLOOTrainer(
        config=config(tmp_path, total_episodes=8),
        tokenizer=tiny_tokenizer,
        policy=build_tiny_causal_lm(tiny_tokenizer),
        ref_policy=None,
        reward_model=lambda prompts, completions, **cols: [float(len(c)) for c in completions],
        train_dataset=prompt_dataset(8),
    )
    assert calls == []
    trainer.train()
    assert calls == ["called"]
    sft = sft_trainer(tmp_path, tiny_tokenizer, [{"text": s} for s in SENTENCES], name="sft", max_steps=1)
    sft.train()
    assert calls == ["called", "called"]


def test_glibc_accepts_both_thresholds_in_a_fresh_process():
    """glibc takes both values (mallopt returns 1 for each); what they save is measured in
    benchmarks/README.md, "Page faults and glibc's trim threshold"."""
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_SETTINGS}
    code = "from posttrain import runtime; print(runtime.reuse_freed_memory())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    on_glibc = runtime.glibc() is not None and sys.platform.startswith("linux")
    assert out.split() == [str(on_glibc)]
