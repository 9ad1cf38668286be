import os, sys, ctypes
sys.path.insert(0, "/work/shared/bench")
os.environ.setdefault("ART", os.path.expanduser("~/.cache/posttrain-bench/artifacts"))
import posttrain
sys.modules["trl"] = posttrain
from common import *
from transformers import TrainerCallback
class MI(ctypes.Structure):
    _fields_=[(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc=ctypes.CDLL("libc.so.6"); libc.mallinfo2.restype=MI
def rss():
    for l in open("/proc/self/status"):
        if l.startswith("VmRSS"): return int(l.split()[1])//1024
class CB(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        mi=libc.mallinfo2()
        print(f"STEP {state.global_step} rss {rss()} heap_arena {mi.arena>>20} in_use {mi.uordblks>>20} free {mi.fordblks>>20} mmap {mi.hblkhd>>20}", flush=True)
tok = tokenizer(); train, _ = prompts()
from posttrain import XPOConfig, XPOTrainer
cfg = XPOConfig(output_dir="/tmp/xpo-steps", per_device_train_batch_size=BATCH // 2, max_steps=STEPS, max_new_tokens=RESP_LEN, **COMMON)
trainer = XPOTrainer(model=policy(), ref_model=policy(), args=cfg, processing_class=tok, train_dataset=train, reward_model=reward_model(), reward_processing_class=tok, callbacks=[CB()])
trainer.train()
