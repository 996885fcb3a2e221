"""Shared pieces of the Lightning tests: a LightningModule over tests/_models.py's TinyGPT
(tied embeddings, a frozen layer), its data, and the plain runs the engine is compared with."""
import torch
from torch.utils.data import DataLoader, TensorDataset

from _models import batches, make_model

L = __import__("pytest").importorskip("lightning")

LR, WD = 3e-3, 0.1


def loader(n=12, batch=2, seed=1):
    xs = batches(n, batch=batch, seed=seed)
    x = torch.cat([b[0] for b in xs])
    y = torch.cat([b[1] for b in xs])
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)


def groups(net):
    """Two param groups: weight decay on the matrices, none on the rest (trainable only)."""
    named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if p.ndim >= 2], "weight_decay": WD},
            {"params": [p for n, p in named if p.ndim < 2], "weight_decay": 0.0}]


def optimizer(params, impl="single"):
    """torch's AdamW: ``single`` (foreach=False) or ``fused``: the two differ by torch's own noise."""
    kw = {"foreach": False} if impl == "single" else {"fused": True}
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), **kw)


def scheduler(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


class Lit(L.LightningModule):
    """TinyGPT under Lightning: AdamW on two groups, a per-step LR schedule; records each
    training_step's loss."""

    def __init__(self, net=None, impl="single"):
        super().__init__()
        self.net = net if net is not None else make_model()
        self.impl = impl
        self.losses = []
        self.norms = []          # each step's gradient norm before clipping
        self._steps = None

    def training_step(self, batch, i):
        loss = self.net(*batch)
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer):
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if grads:                # plain Lightning (the engine keeps the gradients in its own buffers)
            self.norms.append(torch.nn.utils.get_total_norm(grads).item())

    def on_train_start(self):
        engine = getattr(self.trainer.strategy, "engine", None)
        self._steps = engine.global_step if engine is not None else None

    def on_train_batch_end(self, outputs, batch, i):
        engine = getattr(self.trainer.strategy, "engine", None)
        if engine is not None:   # the engine's norm of the step this batch committed
            if engine.global_step > self._steps:
                self.norms.append(engine.grad_norm())
            self._steps = engine.global_step

    def configure_optimizers(self):
        opt = optimizer(groups(self.net), self.impl)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler(opt), "interval": "step"}}


def trainer(strategy="auto", **kw):
    kw = dict(dict(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2,
                   gradient_clip_val=0.05), **kw)
    return L.Trainer(strategy=strategy, **kw)


def weights(module):
    return {k: v.detach().clone().float() for k, v in module.state_dict().items()}


def fabric_run(fabric, impl="single", *, data=None, accumulate=2, clip=0.05, save_at=None, save_to=None,
               resume_from=None, net=None):
    """A plain Fabric loop, the way Fabric's docs write one: accumulation with no_backward_sync,
    clipping, AdamW on two groups, a per-step schedule; ``save_at`` micro-batches it saves
    (``fabric.save``), ``resume_from`` it loads and goes on from there. Returns (losses,
    gradient norms before clipping, model)."""
    net = net if net is not None else make_model()
    opt = optimizer(groups(net), impl)
    sched = scheduler(opt)
    model, opt = fabric.setup(net, opt)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "seen": 0}
    if resume_from is not None:
        fabric.load(resume_from, state)
    losses, norms = [], []
    for i, (x, y) in enumerate(data if data is not None else loader()):
        if i < state["seen"]:
            continue
        micro = (i + 1) % accumulate != 0
        with fabric.no_backward_sync(model, enabled=micro):
            loss = model(x, y)
            fabric.backward(loss / accumulate)
        losses.append(loss.item())
        if not micro:
            norm = fabric.clip_gradients(model, opt, max_norm=clip)
            opt.step()
            # plain Fabric returns the norm; the engine computes it at the step
            norms.append(norm.item() if norm is not None else fabric.strategy.engine.grad_norm())
            opt.zero_grad()
            sched.step()
        if save_at is not None and i + 1 == save_at:
            state["seen"] = i + 1
            fabric.save(save_to, state)
    return losses, norms, net
