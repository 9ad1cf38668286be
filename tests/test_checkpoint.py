import copy
import json
import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import transformers

from posttrain import checkpoint as ckpt
from posttrain.checkpoint import (
    CheckpointError,
    OutputDirGuard,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
    save_final,
)


def tiny_lm(seed: int, tie: bool = False) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        tie_word_embeddings=tie,
    )
    return transformers.LlamaForCausalLM(config)


def tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(10)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")


class Setup:
    """Policy + plain value head + AdamW + warmup scheduler, trained on batches drawn from the
    global torch RNG so a resume is only exact if the RNG state is restored too."""

    def __init__(self, seed: int):
        self.policy = tiny_lm(seed)
        self.value_head = torch.nn.Linear(16, 1)
        params = list(self.policy.parameters()) + list(self.value_head.parameters())
        self.optimizer = torch.optim.AdamW(params, lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / 3))

    @property
    def models(self):
        return {"policy": self.policy, "value_model": self.value_head}

    def train_step(self):
        ids = torch.randint(0, 64, (2, 5))
        out = self.policy(input_ids=ids, labels=ids, output_hidden_states=True)
        loss = out.loss + self.value_head(out.hidden_states[-1]).pow(2).mean()
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()

    def params(self):
        return [p.detach().clone() for p in (*self.policy.parameters(), *self.value_head.parameters())]


def test_round_trip_resume_is_bitwise_exact(tmp_path):
    torch.manual_seed(0)
    run = Setup(seed=0)
    run.train_step()
    gen = torch.Generator().manual_seed(5)
    state = {
        "episode": 128,
        "data_position": 3,
        "kl_coef": 0.05,
        "sampler": gen.get_state(),
        "running": {"mean": torch.tensor(1.5)},
    }
    path = save_checkpoint(
        tmp_path,
        1,
        models=run.models,
        tokenizer=tiny_tokenizer(),
        config={"learning_rate": 1e-2},
        optimizer=run.optimizer,
        scheduler=run.scheduler,
        trainer_state=state,
    )
    assert path == tmp_path / "checkpoint-1"
    saved_opt = copy.deepcopy(run.optimizer.state_dict())
    py_rng, np_rng, torch_rng = random.getstate(), np.random.get_state(), torch.get_rng_state()
    run.train_step()
    uninterrupted = run.params()

    # A "new process": different weights, fresh optimizer, scrambled RNG.
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    resumed = Setup(seed=1)
    trainer_state = load_checkpoint(
        path, models=resumed.models, optimizer=resumed.optimizer, scheduler=resumed.scheduler
    )
    assert random.getstate() == py_rng and torch.equal(torch.get_rng_state(), torch_rng)
    assert np_rng[0] == np.random.get_state()[0] and np.array_equal(np_rng[1], np.random.get_state()[1])
    assert np_rng[2:] == np.random.get_state()[2:]
    assert trainer_state["step"] == 1 and trainer_state["episode"] == 128
    assert trainer_state["kl_coef"] == 0.05 and trainer_state["data_position"] == 3
    assert torch.equal(trainer_state["sampler"], gen.get_state())
    assert torch.equal(trainer_state["running"]["mean"], torch.tensor(1.5))
    assert resumed.scheduler.state_dict()["last_epoch"] == run.scheduler.state_dict()["last_epoch"] - 1

    # The optimizer's state (in dcp/, keyed by parameter name) comes back as it was at the save.
    loaded_opt = resumed.optimizer.state_dict()
    assert saved_opt["param_groups"] == loaded_opt["param_groups"]
    assert saved_opt["state"].keys() == loaded_opt["state"].keys()
    for key, value in saved_opt["state"].items():
        assert value.keys() == loaded_opt["state"][key].keys()
        for name, tensor in value.items():
            assert torch.equal(tensor, loaded_opt["state"][key][name])

    resumed.train_step()
    for a, b in zip(uninterrupted, resumed.params()):
        assert torch.equal(a, b)

    # The policy folder is a plain transformers model folder.
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(path / "policy")
    assert (path / "policy" / "model.safetensors").is_file()
    assert (path / "tokenizer" / "tokenizer.json").is_file()
    assert json.loads((path / "posttrain_config.json").read_text()) == {"learning_rate": 1e-2}
    assert sum(p.numel() for p in reloaded.parameters()) == sum(p.numel() for p in run.policy.parameters())


def test_tied_weights_load(tmp_path):
    model = tiny_lm(0, tie=True)
    path = save_checkpoint(tmp_path, 5, models={"policy": model})
    other = tiny_lm(1, tie=True)
    load_checkpoint(path, models={"policy": other}, restore_rng=False)
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b)
    assert other.lm_head.weight.data_ptr() == other.model.embed_tokens.weight.data_ptr()


def test_wrong_architecture_is_a_clear_error(tmp_path):
    path = save_checkpoint(tmp_path, 1, models={"value_model": torch.nn.Linear(16, 1)})
    with pytest.raises(CheckpointError, match="missing keys"):
        load_checkpoint(path, models={"value_model": torch.nn.Sequential(torch.nn.Linear(16, 1))})
    with pytest.raises(CheckpointError, match="'policy'"):
        load_checkpoint(path, models={"policy": torch.nn.Linear(16, 1)})


def test_failed_save_leaves_previous_checkpoint_usable(tmp_path, monkeypatch):
    run = Setup(seed=0)
    run.train_step()
    first = save_checkpoint(tmp_path, 1, models=run.models, optimizer=run.optimizer)
    run.train_step()

    real_save = torch.save

    def failing_save(obj, f, *args, **kwargs):
        if str(f).endswith(ckpt.OPTIMIZER_GROUPS):
            raise OSError("disk full")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, models=run.models, optimizer=run.optimizer)
    monkeypatch.undo()

    assert not (tmp_path / "checkpoint-2").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]
    assert resolve_checkpoint(tmp_path, "latest") == first
    fresh = Setup(seed=3)
    assert load_checkpoint(first, models=fresh.models, optimizer=fresh.optimizer)["step"] == 1


def test_killed_save_leftovers_are_ignored_and_cleaned(tmp_path):
    save_checkpoint(tmp_path, 1, models={"v": torch.nn.Linear(2, 1)})
    # What a SIGKILL mid-save leaves: a temp dir, and (from a non-atomic copy) an unmarked dir.
    (tmp_path / ".tmp-checkpoint-2-abc").mkdir()
    (tmp_path / "checkpoint-3").mkdir()
    assert resolve_checkpoint(tmp_path, True) == tmp_path / "checkpoint-1"
    with pytest.raises(CheckpointError, match="not a complete"):
        resolve_checkpoint(tmp_path, tmp_path / "checkpoint-3")
    save_checkpoint(tmp_path, 4, models={"v": torch.nn.Linear(2, 1)})
    assert not (tmp_path / ".tmp-checkpoint-2-abc").exists()


def test_save_total_limit_rotation_and_resave(tmp_path):
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, models={"v": torch.nn.Linear(2, 1)}, save_total_limit=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint-3", "checkpoint-4"]
    # Saving the same step again (e.g. after a resume) replaces it.
    save_checkpoint(tmp_path, 4, models={"v": torch.nn.Linear(2, 1)}, trainer_state={"episode": 9})
    assert json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())["episode"] == 9
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "checkpoint-4"]
    with pytest.raises(ValueError, match="save_total_limit"):
        save_checkpoint(tmp_path, 5, models={}, save_total_limit=0)


def test_resolve_checkpoint(tmp_path):
    assert resolve_checkpoint(tmp_path, None) is None
    assert resolve_checkpoint(tmp_path, False) is None
    assert resolve_checkpoint(tmp_path, "false") is None
    with pytest.raises(CheckpointError, match="no complete checkpoint-<step>"):
        resolve_checkpoint(tmp_path, "latest")
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(tmp_path, tmp_path / "checkpoint-7")
    for step in (2, 10):  # numeric order, not string order: 10 is newest
        save_checkpoint(tmp_path, step, models={"v": torch.nn.Linear(2, 1)})
    assert resolve_checkpoint(tmp_path, "latest") == tmp_path / "checkpoint-10"
    assert resolve_checkpoint(tmp_path, True) == tmp_path / "checkpoint-10"
    assert resolve_checkpoint(tmp_path, str(tmp_path / "checkpoint-2")) == tmp_path / "checkpoint-2"
    assert resolve_checkpoint("elsewhere", tmp_path) == tmp_path / "checkpoint-10"


def test_save_final_loads_with_plain_transformers(tmp_path):
    @dataclass
    class Cfg:
        learning_rate: float = 3e-6
        model_name_or_path: str = "tiny"

    model = tiny_lm(0)
    critic = torch.nn.Linear(16, 1)
    out = tmp_path / "run"
    save_final(out, model, tokenizer=tiny_tokenizer(), config=Cfg(), extra_models={"value_model": critic})
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    for a, b in zip(model.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(a, b)
    assert transformers.AutoTokenizer.from_pretrained(out).pad_token == "[PAD]"
    assert json.loads((out / "posttrain_config.json").read_text())["learning_rate"] == 3e-6
    assert (out / "value_model" / "model.safetensors").is_file()
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]

    # Saving again overwrites in place; no stale files or temp dirs remain.
    save_final(out, tiny_lm(1))
    assert not torch.equal(transformers.AutoModelForCausalLM.from_pretrained(out).lm_head.weight, model.lm_head.weight)
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]


def test_output_dir_guard(tmp_path):
    created = tmp_path / "new_run"
    with pytest.raises(RuntimeError):
        with OutputDirGuard(created):
            assert created.is_dir()
            (created / ".tmp-checkpoint-1-x").mkdir()
            raise RuntimeError("bad reward function")
    assert not created.exists()

    existing = tmp_path / "user_dir"
    existing.mkdir()
    with pytest.raises(RuntimeError):
        with OutputDirGuard(existing):
            raise RuntimeError("boom")
    assert existing.is_dir()

    with_metrics = tmp_path / "crashed_later"
    with pytest.raises(RuntimeError):
        with OutputDirGuard(with_metrics):
            (with_metrics / "metrics.jsonl").write_text('{"step": 1}\n')
            raise RuntimeError("boom")
    assert (with_metrics / "metrics.jsonl").is_file()

    ok = tmp_path / "ok"
    with OutputDirGuard(ok):
        pass
    assert ok.is_dir()
