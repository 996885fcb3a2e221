"""The child of tests/hf/test_hf_trainers_in_one_process.py: many offload.hf.Trainers in one
process, at every placement, the collector forced between them, as transformers' own Trainer
test files run them. Exits 0 and prints nothing on stderr when the contract holds (the Trainers' logs go to stdout); a broken contract
exits 3 saying which; a crash is the process's own death.

Per placement: a Trainer with the user's own optimizer (torch AdamW) trains, evaluates, saves
and is dropped without close(); the model then holds what plain transformers.Trainer with the
same optimizer trains (within twice the distance between torch's single-tensor and foreach
AdamW, plus 1e-6); a second Trainer on that model trains, a third takes the model over (the
second's engine closes); all are dropped. After each collection: no swap file of a dropped
engine left, and at the end no offload-* thread and no more OS threads than after the first.
"""
import gc
import json
import os
import sys
import tempfile
import threading
import time

import warnings

import torch

from _hf import args, dataset, snapshot, tiny_llama, transformers
from _parity import max_diff, noise_bound
from offload.hf import Trainer

PLACEMENTS = {
    "host": {"offload_optimizer": {"device": "cpu"}},
    "param-cpu": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
    "param-nvme": {"offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "nvme"}},
}
EVAL = dataset(4, seed=2)


def fail(msg):
    print(msg, file=sys.stderr)
    sys.exit(3)


def config(name, root):
    cfg = json.loads(json.dumps(PLACEMENTS[name]))
    for sec in cfg.values():
        if sec["device"] == "nvme":
            sec["nvme_path"] = root
    return cfg


def custom(model, foreach):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=foreach)


def plain(foreach):
    model = tiny_llama()
    opt = custom(model, foreach)
    t = transformers.Trainer(model=model, args=args(max_steps=2), train_dataset=dataset(), optimizers=(opt, None))
    t.train()
    return snapshot(model)


def swap_files(root):
    return [f for d, _, fs in os.walk(root) if "checkpoint" not in d and "saved" not in d for f in fs]


def settled(root, base):
    """Collect until no swap file and no offload thread is left (an update in flight holds an
    engine until it ends; bounded)."""
    deadline = time.monotonic() + 60
    while True:
        gc.collect()
        files = swap_files(root)
        ours = [t.name for t in threading.enumerate() if t.name.startswith("offload-")]
        tasks = len(os.listdir("/proc/self/task"))
        if not files and not ours and (base is None or tasks <= base):
            return tasks
        if time.monotonic() > deadline:
            fail(f"after the collector: files {files[:3]}, threads {ours}, {tasks} OS threads (first {base})")
        time.sleep(0.05)


def main():
    # (initialize's advice on the precision it chose; anything else said on stderr fails the test)
    warnings.filterwarnings("ignore", message="precision fp32 .none asked for.")
    ref, other = plain(False), plain(True)
    noise = max_diff(ref, other)
    base = None
    for name in PLACEMENTS:
        root = tempfile.mkdtemp(prefix=f"offload-trainers-{name}-")
        model = tiny_llama()
        first = Trainer(model=model, args=args(max_steps=2), train_dataset=dataset(),
                        optimizers=(custom(model, False), None), offload_config=config(name, root))
        first.train()
        if not first.evaluate(EVAL)["eval_loss"] > 0:
            fail(f"{name}: evaluate gave no loss")
        first.save_model(os.path.join(root, "saved"))
        del first                                  # dropped without close(): closed when collected
        base = settled(root, base)
        got = snapshot(model)
        d = max_diff(got, ref)
        if d > noise_bound(ref, other):
            fail(f"{name}: the model after a dropped Trainer is {d:.3g} from plain Trainer (noise {noise:.3g})")
        second = Trainer(model=model, args=args(max_steps=1), train_dataset=dataset(seed=3),
                         offload_config=config(name, root))
        second.train()
        third = Trainer(model=model, args=args(max_steps=1), train_dataset=dataset(seed=4),
                        offload_config=config(name, root))
        third.train()
        if not second.engine.closed:
            fail(f"{name}: the second Trainer's engine is open after a third took the model over")
        third.evaluate(EVAL)
        del second, third, model
        base = settled(root, base)


if __name__ == "__main__":
    main()
