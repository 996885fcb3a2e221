"""The child side of the crash tests (tests/system/test_crash.py): runs one program (a list of calls
on the public API) in a process of its own and checks the engine's contract after each call.

``python tests/_crash_worker.py serve`` imports torch, transformers, peft and the engine once,
then reads one JSON program per line on stdin; for each it forks a child that runs the program
and ends through a normal interpreter exit (atexit hooks, finalizers, module teardown: where
"Exception ignored" would appear), its stdout and stderr in a file. The server writes one JSON
line back: the child's exit status (a negative number is the signal that killed it), what it
printed, and whether it ran past its time limit (then it is killed: a hang is a failure).
The server itself runs no torch op and starts no thread, so forking it is safe.

A program is a list of ``[op, args]``. The contract, checked after every call (``Violation``
ends the child with status 3 and says which call broke what):
  * the call returned, or raised an ``Exception`` with a message (KeyboardInterrupt only where
    the program raised one itself);
  * an open engine's weights (``full_state_dict``) equal the last commit, bitwise, at every
    ``check`` call of the program and at its end: every call but a committing ``step()`` and
    ``load_checkpoint`` leaves them alone; a first commit on one batch equals plain
    ``torch.optim`` on the same model and batch within torch's own noise (the distance between
    its foreach and single-tensor AdamW). Only ``check`` reads the weights (which waits for every
    update and write in flight), so the other calls keep the timing of a user's loop;
  * a model handed back (``close``, ``hand_back``, a second engine taking over, a dropped engine
    collected) holds the last commit;
  * at the end, with every engine closed or dropped and collected: no file under any
    ``nvme_path``, no ``offload-*`` thread and no more OS threads than before the first engine.
"""
import gc
import json
import os
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import weakref

import torch
from _parity import FLOOR, max_diff

VOCAB, SEQ = 64, 8


class Violation(Exception):
    """The engine broke its contract."""


class UsersError(ValueError):
    """The error a user's own hook raises (on purpose)."""


def tiny_llama(seed):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2,
                                        max_position_embeddings=32))


def batch(i):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randint(0, VOCAB, (2, SEQ), generator=g)


def config(spec, root):
    def place(dev):
        if dev == "nvme":
            return {"device": "nvme", "nvme_path": root}
        return {"device": dev}
    cfg = {"optimizer": {"type": "AdamW", "lr": 1e-2, "weight_decay": 0.0},
           "offload_optimizer": place(spec["opt"]), "offload_param": place(spec["param"]),
           "gradient_accumulation_steps": spec["accum"], "gradient_clipping": spec["clip"],
           "wait_timeout_s": 60.0}
    if spec["acts"] != "none":
        cfg["offload_activations"] = dict(place(spec["acts"]), min_bytes=0)
    if spec["quant"] and spec["param"] != "none":
        cfg["offload_param"].update(frozen_dtype="int8", frozen_quant_min_numel=0)
    return cfg


def state(module):
    """The trainable and frozen weights by the model's own names (PEFT: the base's names)."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k].float(), b[k].float()) for k in a)


class World:
    """The program's state: the models made, the engines open (by slot), the last commit."""

    def __init__(self, root):
        import offload
        self.offload, self.root = offload, root
        self.engines = {}       # slot -> (engine, model, spec)
        self.commit = {}        # slot -> full_state_dict at the last commit
        self.models = {}        # slot -> the model an engine of that slot was made on
        self.handed = {}        # slot -> weights the model must hold after the engine hands back
        self.initial = {}       # slot -> full_state_dict at initialize
        self.window = {}        # slot -> batches landed since the last commit, None if disturbed
        self.first = {}         # slot -> (initial weights, batch) of a first commit to check against torch

    # ---- ops ------------------------------------------------------------------------------
    def init(self, slot, spec):
        model = self.models.get(spec["model_of"]) if spec["model_of"] is not None else None
        if model is None:
            model = tiny_llama(spec.get("seed", 0))
            if spec["lora"]:
                from peft import LoraConfig, get_peft_model
                model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
            if spec["ckpt"]:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        before = state(model)
        others = [s for s, (e, m, _) in self.engines.items() if m is model and not e.closed]
        engine = self.offload.initialize(model, config(spec, self.root))
        new = engine.full_state_dict()
        for s in others:       # taken over: closed, its weights handed back to the model first
            if not self.engines[s][0].closed:
                raise Violation(f"the engine in slot {s} holds the model and was not closed by a new engine")
            if self.commit[s] is not None and not same(self._kept(self.commit[s], model, spec),
                                                       self._kept(new, model, spec)):
                raise Violation(f"the engine in slot {s} did not hand its last commit to the engine taking over")
        self.engines[slot] = (engine, model, spec)
        self.models[slot] = model
        self.commit[slot] = self.initial[slot] = new
        self.window[slot] = []
        self.first[slot] = None
        if not others and not spec["quant"] and not same(self._model_view(new, model), self._model_view(before, model)):
            raise Violation("initialize changed the weights it was given")

    def train(self, slot, i):
        engine, model, _ = self.engines[slot]
        x = batch(i)
        landed, self.window[slot] = self.window[slot], None    # (a backward that raises may land part)
        engine.backward(engine(input_ids=x, labels=x).loss)
        self.window[slot] = None if landed is None else landed + [i]

    def step(self, slot):
        engine, model, spec = self.engines[slot]
        committed = engine.step()
        if committed:       # the commit's value is read at the next check: the updates stay in flight
            plain = not (spec["lora"] or spec["quant"] or spec["clip"]) and spec["accum"] == 1
            if plain and engine.global_step == 1 and self.window[slot] is not None and len(self.window[slot]) == 1:
                self.first[slot] = (self.initial[slot], self.window[slot][0])
            self.commit[slot] = None
            self.window[slot] = []
        return committed

    def zero_grad(self, slot):
        self.engines[slot][0].zero_grad()
        self.window[slot] = []

    def bad_forward(self, slot):
        engine = self.engines[slot][0]
        engine(input_ids=torch.full((2, SEQ), VOCAB + 900))         # a token id past the vocabulary

    def hook_raises(self, slot, i, interrupt):
        engine = self.engines[slot][0]
        x = batch(i)
        self.window[slot] = None
        loss = engine(input_ids=x, labels=x).loss

        def hook(grad):
            raise KeyboardInterrupt("fuzzer's interrupt") if interrupt else UsersError("the user's hook failed")
        loss.register_hook(hook)
        engine.backward(loss)

    def save(self, slot, name):
        self.engines[slot][0].save_checkpoint(os.path.join(self.root, "ckpt", name))

    def load(self, slot, name):
        engine = self.engines[slot][0]
        self.window[slot] = None
        engine.load_checkpoint(os.path.join(self.root, "ckpt", name))
        self.commit[slot], self.first[slot] = None, None

    def hand_back(self, slot):
        engine, model, _ = self.engines[slot]
        if engine.hand_back():
            self._check_model(slot, self._resolve(slot), "hand_back")

    def close(self, slot):
        engine = self.engines[slot][0]
        was_open = not engine.closed
        engine.close(restore=True)
        if was_open:
            self._handed_back(slot)

    def after_close(self, slot):
        engine = self.engines[slot][0]
        if not engine.closed:
            return
        try:
            engine.step()
        except RuntimeError as exc:
            if "closed" not in str(exc):
                raise Violation(f"a call after close raised {exc!r}, not 'this engine is closed'")
        else:
            raise Violation("a call after close returned")

    def drop(self, slot, with_model):
        engine, model, _ = self.engines.pop(slot)
        was_open = not engine.closed
        want = self.commit.get(slot)
        gone = weakref.ref(engine)
        del engine
        if with_model:
            self.models.pop(slot, None)
            del model
        gc.collect()
        deadline = time.monotonic() + 30           # an update in flight holds the engine until it ends
        while gone() is not None and time.monotonic() < deadline:
            time.sleep(0.02)
            gc.collect()
        if gone() is not None:
            raise Violation(f"the engine dropped from slot {slot} was not collected within 30 s")
        if was_open and not with_model:
            self.commit[slot] = want
            self._settle_reaper()
            self._check_model_obj(model, want, "a dropped engine, collected")
        self.commit.pop(slot, None)

    # ---- checks ---------------------------------------------------------------------------
    def _kept(self, weights, model, spec):
        """The weights an engine of ``spec`` keeps as they are (a quantized base: its trainable ones)."""
        if spec["quant"]:
            names = {n for n, p in model.named_parameters() if p.requires_grad}
            return {k: v for k, v in weights.items() if k in names}
        return self._model_view(weights, model)

    def _model_view(self, weights, model):
        names = set(state(model))
        return {k: v for k, v in weights.items() if k in names}

    def _handed_back(self, slot):
        if self.commit[slot] is not None:     # (a commit not read before close is not known)
            self._check_model(slot, self.commit[slot], "close")

    def _check_model(self, slot, want, what):
        self._check_model_obj(self.engines[slot][1], want, what)

    def _check_model_obj(self, model, want, what):
        if want is None:
            return
        got = state(model)
        for k, v in want.items():
            if k in got and not torch.equal(got[k].float(), v.float()):
                raise Violation(f"after {what} the model's {k} is not the last commit")

    def _settle_reaper(self):
        settle_reaper()

    def _check_against_torch(self, initial, i, got):
        """A first commit on one batch against plain torch AdamW from the same weights on the
        same batch, within 4x the foreach/single-tensor distance (at least 1e-6)."""
        runs = []
        for foreach in (False, True):
            m = tiny_llama(0)
            m.load_state_dict(initial)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0, foreach=foreach)
            x = batch(i)
            m(input_ids=x, labels=x).loss.backward()
            opt.step()
            runs.append(state(m))
        noise = max_diff(runs[0], runs[1])
        tol = 4 * noise + FLOOR
        for k, v in got.items():
            d = (v.float() - runs[0][k].float()).abs().max().item()
            if d > tol:
                raise Violation(f"the first commit of {k} is {d:.3g} from torch AdamW (noise {noise:.3g})")

    def _resolve(self, slot):
        """The slot's last commit, read now if it was not yet (the first one checked against torch)."""
        engine = self.engines[slot][0]
        if self.commit[slot] is None and not engine.closed:
            self.commit[slot] = engine.full_state_dict()
            if self.first.get(slot) is not None:
                self._check_against_torch(*self.first[slot], self.commit[slot])
                self.first[slot] = None
        return self.commit[slot]

    def check(self, slot):
        """The contract's weight check, a call of its own so that the others keep the timing a
        user's loop has (reading the weights waits for every update and write in flight)."""
        engine = self.engines[slot][0]
        if engine.closed:
            return
        want = self._resolve(slot)
        if not same(engine.full_state_dict(), want):
            raise Violation(f"engine {slot}'s weights are not its last commit")


def raised_here(exc) -> bool:
    """The exception comes from this file's own code, not from a call into the library."""
    tb = exc.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return os.path.abspath(tb.tb_frame.f_code.co_filename) == os.path.abspath(__file__)


def settle_reaper():
    """Wait for engines dropped on the engine's own threads to be closed (bounded)."""
    from offload.engine import holders
    settle = getattr(holders, "_settle_deferred", None)
    if settle is not None:
        settle(60.0)


def os_threads():
    return len(os.listdir("/proc/self/task"))


def run(program):
    root = tempfile.mkdtemp(prefix="offload-crash-")
    try:
        check(program, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def check(program, root):
    m = tiny_llama(0)                              # torch's own threads and one-time costs first
    m(input_ids=batch(0), labels=batch(0)).loss.backward()
    del m
    base_threads = os_threads()
    world = World(root)
    for n, (op, args) in enumerate(program):
        where = f"call {n} {op}{tuple(args)}"
        if op != "init" and args[0] not in world.engines:
            continue                               # (its initialize was refused)
        try:
            getattr(world, op)(*args)
        except Violation as exc:
            raise Violation(f"{where}: {exc}") from None
        except KeyboardInterrupt:
            if not (op == "hook_raises" and args[-1]):
                raise
        except Exception as exc:                   # the user's own errors and refusals: named
            if raised_here(exc) and not isinstance(exc, UsersError):
                raise Violation(f"{where}: the test's own code failed: {exc!r}") from exc
            if not str(exc).strip():
                raise Violation(f"{where} raised {type(exc).__name__} with no message") from exc
    for slot in list(world.engines):
        try:
            world.check(slot)
        except Violation as exc:
            raise Violation(f"at the end: {exc}") from None
        world.engines[slot][0].close()
    world.engines.clear()
    world.models.clear()
    gc.collect()
    settle_reaper()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        gc.collect()                               # (an update in flight held a dropped engine)
        left = [f for d, _, fs in os.walk(root) if "ckpt" not in d for f in fs]
        ours = [t.name for t in threading.enumerate() if t.name.startswith("offload-")]
        if not left and not ours and os_threads() <= base_threads:
            break
        time.sleep(0.1)
    else:
        raise Violation(f"after every engine closed or dropped: files {left[:3]}, threads {ours}, "
                        f"{os_threads()} OS threads (was {base_threads})")


def child(program, out_path):
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        run(program)
    except Violation as exc:
        print(f"VIOLATION: {exc}", file=sys.stderr)
        sys.exit(3)
    except BaseException:
        traceback.print_exc()
        sys.exit(4)
    sys.exit(0)                  # a normal interpreter exit: atexit, finalizers, teardown


def serve():
    import transformers  # noqa: F401  (imported once, before any fork)
    import peft  # noqa: F401
    import offload  # noqa: F401
    from offload.engine import holders  # noqa: F401
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        out_path = req["out"]
        pid = os.fork()
        if pid == 0:
            try:
                child(req["program"], out_path)  # ends in sys.exit: up and out of this loop
            except SystemExit:
                raise
            except BaseException:
                os._exit(5)                      # child() itself failed before running
        deadline = time.monotonic() + req["timeout_s"]
        status, hung = None, False
        while status is None:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
            elif time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                status, hung = os.waitpid(pid, 0)[1], True
            else:
                select.select([], [], [], 0.05)
        code = os.waitstatus_to_exitcode(status)
        with open(out_path, errors="replace") as f:
            text = f.read()
        print(json.dumps({"rc": code, "hung": hung, "output": text[-20000:]}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        serve()
    else:
        run(json.loads(sys.argv[1]))
