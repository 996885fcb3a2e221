"""offload.lightning against plain Lightning (Trainer, Fabric, DDP) on the same seed and data.

Every run: TinyGPT (tied embeddings, a frozen layer) or its LoRA, AdamW on two param groups,
a per-step LR schedule, accumulation over 2 micro-batches, clipping that bites. Tolerance:
twice the distance between two plain runs that differ only in torch's own AdamW implementation
(single-tensor vs fused), measured here, plus 1e-6."""
import io
import os

import pytest
import torch

from _lightning import L, Lit, fabric_run, loader, optimizer, trainer, weights
from _parity import max_diff, noise_bound
from _models import make_model
from _profile import AVX2_RATES

import offload.lightning as ol
from offload.config import ConfigError

peft = pytest.importorskip("peft")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

EPOCH = 7          # Trainer: micro-batches per epoch, 4 optimizer steps (the last window is short)
HALF = 8           # Fabric: micro-batches before the save, 4 optimizer steps


@pytest.fixture(autouse=True)
def _environment_restored():
    """Fabric.launch() writes its launcher's variables (MASTER_PORT, LOCAL_RANK, WORLD_SIZE, ...)
    into os.environ, where later tests would read them: put back as they were."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


def placement(opt, param, tmp_path):
    """The engine's config: optimizer state on ``opt`` (cpu, nvme), parameters on ``param``
    (none, nvme)."""
    cfg = {"offload_optimizer": {"device": opt}}
    if opt == "nvme":
        os.makedirs(tmp_path / "opt", exist_ok=True)
        cfg["offload_optimizer"]["nvme_path"] = str(tmp_path / "opt")
    if param == "nvme":
        os.makedirs(tmp_path / "param", exist_ok=True)
        cfg["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path / "param")}
    return cfg


def lora(net):
    torch.manual_seed(0)
    return peft.get_peft_model(net, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["mlp.0", "mlp.2"],
                                                    lora_dropout=0.0))


NETS = {"full": make_model, "lora": lambda seed=0: lora(make_model(seed))}


def check_logged(got, ref, fused):
    """Each value of a series (the losses, the gradient norms) within twice torch's noise over
    the run (single-tensor vs fused AdamW)."""
    assert len(got) == len(ref) == len(fused)
    bound = max(noise_bound(r, f) for r, f in zip(ref, fused))
    worst = max(abs(g - r) for g, r in zip(got, ref))
    assert worst <= bound, (worst, bound, got, ref)


@pytest.fixture(scope="module")
def trainer_refs():
    """Plain Lightning, two epochs: {net: {impl: (losses, gradient norms, weights)}}."""
    out = {}
    for net in NETS:
        out[net] = {}
        for impl in ("single", "fused"):
            m = Lit(NETS[net](), impl)
            trainer(max_epochs=2).fit(m, loader(EPOCH))
            out[net][impl] = (m.losses, m.norms, weights(m))
    return out


# (net, optimizer tier, parameter tier): with the Fabric test's (nvme, nvme) and the default
# (cpu, none), each placement once
CASES = [("full", "cpu", "nvme"), ("lora", "nvme", "none")]


@pytest.mark.parametrize("net,opt,param", CASES)
def test_trainer_matches_plain_lightning_and_resumes_from_last(trainer_refs, net, opt, param, tmp_path):
    """Epoch 1 with ModelCheckpoint(save_last), then a new model and Trainer resume with
    ckpt_path="last" for epoch 2: every logged loss and the final weights as plain Lightning's
    uninterrupted run; the checkpoints rotate as Lightning's (directories)."""
    (rl, rn, rw), (fl, fn, fw) = trainer_refs[net]["single"], trainer_refs[net]["fused"]
    cfg = placement(opt, param, tmp_path)
    ck = str(tmp_path / "ck")
    first = Lit(NETS[net]())
    t1 = trainer(ol.OffloadStrategy(cfg), max_epochs=1, enable_checkpointing=True,
                 callbacks=[ModelCheckpoint(dirpath=ck, save_last=True)])
    t1.fit(first, loader(EPOCH))
    assert t1.strategy.engine.global_step == 4
    assert sorted(os.listdir(ck)) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    second = Lit(NETS[net](seed=7))              # other weights: the checkpoint's must replace them
    t2 = trainer(ol.OffloadStrategy(cfg), max_epochs=2, enable_checkpointing=True,
                 callbacks=[ModelCheckpoint(dirpath=ck, save_last=True)])
    t2.fit(second, loader(EPOCH), ckpt_path="last")
    assert t2.strategy.engine.global_step == 8 and t2.global_step == 8
    assert t2.strategy.engine.grad_norm() > 0.05          # the clip bites
    check_logged(first.losses + second.losses, rl, fl)
    check_logged(first.norms + second.norms, rn, fn)
    got = weights(second)                        # handed back after fit
    assert max_diff(got, rw) <= noise_bound(rw, fw), (max_diff(got, rw), noise_bound(rw, fw))
    assert sorted(os.listdir(ck)) == ["epoch=1-step=8.ckpt", "last.ckpt"]
    assert sorted(os.listdir(os.path.join(ck, "last.ckpt"))) == ["lightning.pt", "offload"]


def test_trainer_strategy_by_name_with_defaults(trainer_refs):
    """Trainer(strategy="offload"): the engine with its default config (optimizer state on the
    host, parameters on the device), as plain Lightning on one device (the data in its order:
    no distributed sampler, no process group)."""
    (rl, rn, rw), (fl, fn, fw) = trainer_refs["full"]["single"], trainer_refs["full"]["fused"]
    got = Lit()
    t = trainer("offload", max_epochs=2)
    t.fit(got, loader(EPOCH))
    assert isinstance(t.strategy, ol.OffloadStrategy) and t.strategy.engine.global_step == 8
    assert not t.strategy.is_distributed and not torch.distributed.is_initialized()   # one process: no group
    check_logged(got.losses, rl, fl)
    check_logged(got.norms, rn, fn)
    assert max_diff(weights(got), rw) <= noise_bound(rw, fw)


def _fabric(strategy="auto"):
    f = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    f.launch()
    return f


def test_fabric_matches_plain_and_resumes(tmp_path):
    """A plain Fabric loop (no_backward_sync, clip_gradients, a scheduler), parameters and
    optimizer state on NVMe, fabric.save half-way; a new Fabric (by name, the default config)
    and model fabric.load and go on: the losses, gradient norms and final weights of plain
    Fabric's uninterrupted run."""
    rl, rg, rn = fabric_run(_fabric(), data=loader(2 * HALF))
    fl, fg, fn = fabric_run(_fabric(), "fused", data=loader(2 * HALF))
    cfg = placement("nvme", "nvme", tmp_path)
    f1 = _fabric(ol.OffloadFabricStrategy(cfg))
    first, first_norms, _ = fabric_run(f1, data=loader(2 * HALF), save_at=HALF, save_to=str(tmp_path / "ck"))
    f1.strategy.engine.close()
    f2 = _fabric("offload")                     # by name: the default config (optimizer on the host)
    second, second_norms, _ = fabric_run(f2, data=loader(2 * HALF), resume_from=str(tmp_path / "ck"),
                                         net=make_model(seed=7))
    check_logged(first, rl, fl)                      # the whole run, saving half-way
    check_logged(first_norms, rg, fg)
    check_logged(second, rl[HALF:], fl[HALF:])     # resumed from the save
    check_logged(second_norms, rg[HALF // 2:], fg[HALF // 2:])
    got = f2.strategy.engine.full_state_dict()
    assert max_diff(got, weights(rn)) <= noise_bound(weights(rn), weights(fn))
    assert f2.strategy.engine.global_step == 2 * HALF // 2     # windows of 2 micro-batches
    assert not torch.distributed.is_initialized()              # one process: no group left behind
    assert f2.strategy.engine.grad_norm() > 0.05          # clip_gradients' norm bites



def _check_ranks(kids, what: str) -> None:
    """Each rank's losses, gradient norms and final weights within torch's noise of plain DDP's
    on that rank; the ranks end with one model."""
    got = [torch.load(io.BytesIO(k.result(timeout_s=300, what=f"{what} rank {r}"))) for r, k in enumerate(kids)]
    for g in got:
        assert g["world"] == 2
        (rl, rg, rw), (fl, fg, fw), (el, eg, ew) = g["single"], g["fused"], g["engine"]
        check_logged(el, rl, fl)
        check_logged(eg, rg, fg)
        assert max_diff(ew, rw) <= noise_bound(rw, fw)
    assert max_diff(got[0]["engine"][2], got[1]["engine"][2]) == 0      # the ranks hold one model


def test_fabric_two_gloo_ranks_match_plain_ddp(tmp_path):
    """Two ranks (gloo), each on its half of the batches: the engine with ZeRO-2, optimizer
    state on NVMe, against Fabric's plain DDP: each rank's losses and the final weights."""
    import _forked
    from _lightning_worker import fabric_rank
    port = _forked.free_port()
    os.makedirs(tmp_path / "nvme")
    _check_ranks([_forked.Child(fabric_rank, r, 2, port, str(tmp_path / "nvme")) for r in range(2)], "Fabric")


def test_trainer_two_gloo_ranks_match_plain_ddp():
    """Two ranks (gloo) started as torchrun does, Trainer(devices=2): OffloadStrategy with ZeRO-2
    against Trainer(strategy="ddp"), each rank reading its share of the data through the
    distributed sampler (7 micro-batches, a short last window): each rank's losses, gradient
    norms and the final weights."""
    import _forked
    from _lightning_worker import trainer_rank
    port = _forked.free_port()
    _check_ranks([_forked.Child(trainer_rank, r, 2, port, EPOCH) for r in range(2)], "Trainer")


# ---- settings the engine cannot honour: refused at setup, naming the fix -----------------------
class _Manual(Lit):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


class _RMSprop(Lit):
    def configure_optimizers(self):
        return torch.optim.RMSprop(self.net.parameters())


class _NoOptimizer(Lit):
    def configure_optimizers(self):
        return None


class _OwnClipping(Lit):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        pass


TRAINER_REFUSALS = {
    "manual": (_Manual, {"gradient_clip_val": None, "accumulate_grad_batches": 1},
               "manual optimization .* use automatic optimization"),
    "another optimizer class": (_RMSprop, {}, "no rule for torch.optim.rmsprop.RMSprop: give one of"),
    "no optimizer": (_NoOptimizer, {}, "configure_optimizers returned None: the engine needs the torch optimizer"),
    "clip by value": (Lit, {"gradient_clip_algorithm": "value"}, "use gradient_clip_algorithm='norm'"),
    "own clipping": (_OwnClipping, {}, "configure_gradient_clipping is overridden.*remove the override"),
    "config disagrees": (Lit, {"cfg": {"gradient_clipping": 1.0}},
                         "gradient_clipping=1.0 disagrees with Trainer gradient_clip_val \\(0.05\\)"),
}


@pytest.mark.parametrize("case", list(TRAINER_REFUSALS))
def test_trainer_refuses_what_the_engine_cannot_honour(case):
    cls, kw, msg = TRAINER_REFUSALS[case]
    kw = dict(kw)
    t = trainer(ol.OffloadStrategy(kw.pop("cfg", None)), **kw)
    m = cls()
    with pytest.raises(ConfigError, match=msg):
        t.fit(m, loader(2))
    assert m.losses == []                          # nothing trained


@pytest.mark.parametrize("api", ["Trainer", "Fabric"])
def test_unsupported_precision_is_refused_when_built(api):
    with pytest.raises(ConfigError, match="precision='bf16-true .*use precision='32-true', 'bf16-mixed' or "
                                          "'16-mixed'"):
        if api == "Trainer":
            trainer(ol.OffloadStrategy(), precision="bf16-true")
        else:
            L.Fabric(accelerator="cpu", devices=1, strategy=ol.OffloadFabricStrategy(), precision="bf16-true")


def test_fabric_refuses_what_the_engine_cannot_honour(matmul_rates):
    f = _fabric("offload")
    net = make_model()
    with pytest.raises(ConfigError, match=r"fabric.setup\(model\) without its optimizer"):
        f.setup(net)
    with pytest.raises(ConfigError, match="fabric.setup got 2 optimizers; .* pass one"):
        f.setup(net, optimizer(net.parameters()), optimizer(net.parameters()))
    model, opt = f.setup(net, optimizer(net.parameters()))
    other = make_model(seed=3)
    with pytest.raises(ConfigError, match="a second model set up: one engine trains one model per Fabric"):
        f.setup(other, optimizer(other.parameters()))
    x, y = next(iter(loader(1)))
    with pytest.raises(ConfigError, match="use fabric.clip_gradients\\(model, optimizer, max_norm=...\\)"):
        f.clip_gradients(model, opt, clip_val=1.0)
    with pytest.raises(ConfigError, match="clips the global 2-norm; use norm_type=2"):
        f.clip_gradients(model, opt, max_norm=1.0, norm_type=1)
    with pytest.raises(ValueError, match="max_norm=-1.0 must be a finite number >= 0"):
        f.clip_gradients(model, opt, max_norm=-1.0)
    with f.no_backward_sync(model, enabled=True):
        f.backward(model(x, y))
    with pytest.raises(ConfigError, match="after a backward inside no_backward_sync.*enabled=False"):
        opt.step()
    assert f.strategy.engine.global_step == 0
    matmul_rates(AVX2_RATES)
    low = L.Fabric(accelerator="cpu", devices=1, strategy="offload", precision="bf16-mixed")
    low.launch()
    model, opt = low.setup(other, optimizer(other.parameters()))
    with low.no_backward_sync(model, enabled=True), \
            pytest.raises(ConfigError, match="set offload_config gradient_accumulation_steps to the window's length"):
        low.backward(model(x, y))
