"""posttrain's XPO on ../shared/bench's run_xpo.py settings, printing RSS and glibc's main-arena figures
(mallinfo2) after every optimizer step (benchmarks/README.md, "Three levers measured and not kept").

    OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 PYTHONPATH=src python benchmarks/results/session-2026-12-07-3/xpo_steps.py
"""

import ctypes
import os
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "shared", "bench")
sys.path.insert(0, os.path.abspath(BENCH))
os.environ.setdefault("ART", os.path.expanduser("~/.cache/posttrain-bench/artifacts"))

import posttrain  # noqa: E402

sys.modules["trl"] = posttrain  # the bench's common.py imports trl
import common  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from posttrain import XPOConfig, XPOTrainer  # noqa: E402

FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"


class MallInfo(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS.split()]


libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo


def rss_mb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))


class Report(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        mi = libc.mallinfo2()
        print(
            f"STEP {state.global_step} rss {rss_mb()} heap_arena {mi.arena >> 20} in_use {mi.uordblks >> 20} "
            f"free {mi.fordblks >> 20} mmap {mi.hblkhd >> 20}",
            flush=True,
        )


tok = common.tokenizer()
train, _ = common.prompts()
cfg = XPOConfig(
    output_dir="/tmp/xpo-steps",
    per_device_train_batch_size=common.BATCH // 2,
    max_steps=common.STEPS,
    max_new_tokens=common.RESP_LEN,
    **common.COMMON,
)
trainer = XPOTrainer(
    model=common.policy(),
    ref_model=common.policy(),
    args=cfg,
    processing_class=tok,
    train_dataset=train,
    reward_model=common.reward_model(),
    reward_processing_class=tok,
    callbacks=[Report()],
)
trainer.train()
