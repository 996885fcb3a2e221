"""Many offload.hf.Trainers in one process at every placement, the collector forced between
them: train, evaluate, save, the user's own optimizer, a Trainer dropped without close(), a
second and a third Trainer on the same model (tests/_trainers_worker.py states the contract).
transformers' own Trainer test files run this way; an engine left to the collector used to end
them with a segfault. The child must exit 0 and print nothing on stderr ("Exception ignored" included)."""
import os
import subprocess
import sys

import pytest
from _paths import TESTS

pytest.importorskip("transformers")

HERE = TESTS


def test_many_trainers_in_one_process():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]), PYTHONFAULTHANDLER="1")
    r = subprocess.run([sys.executable, os.path.join(HERE, "_trainers_worker.py")], capture_output=True, text=True,
                       timeout=600, env=env, cwd=os.path.dirname(HERE))
    assert r.returncode == 0 and r.stderr == "", (r.returncode, r.stderr[-4000:])
