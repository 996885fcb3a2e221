"""One training loop written for Accelerate, run by plain ``accelerate.Accelerator`` and by
``offload.accelerate.Accelerator`` (tests/integrations/test_hf_accelerate.py, tests/_accelerate_ddp_worker.py):
accumulation, clipping, an LR scheduler, and optionally ``save_state`` after some micro-batches
then a fresh Accelerator, model and optimizer that ``load_state`` and go on."""
import torch

from _hf import dataset, tiny_llama

import accelerate

GAS, BATCH, N, LR = 2, 2, 16, 1e-2
CLIP = {"full": 0.5, "lora": 0.1}     # below the gradient norms of the loop: clipping bites


def fresh_state() -> None:
    """Accelerate keeps its state in process-wide singletons: a new Accelerator starts clean."""
    accelerate.state.AcceleratorState._reset_state(True)
    accelerate.state.GradientState._reset_state()


def lora(model):
    import peft
    torch.manual_seed(0)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.0))


def make_model(kind: str):
    return lora(tiny_llama()) if kind == "lora" else tiny_llama()


def adamw(params, **kw):
    """AdamW and a decaying LambdaLR: the loop's default optimizer and scheduler."""
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.01, **kw)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _start(make_acc, kind, make_opt, n=N):
    fresh_state()
    acc = make_acc()
    model = make_model(kind)
    opt, sched = make_opt([p for p in model.parameters() if p.requires_grad])
    loader = torch.utils.data.DataLoader(dataset(n), batch_size=BATCH, shuffle=False)
    return (acc, *acc.prepare(model, opt, loader, sched))


def _train(acc, model, opt, loader, sched, logs, clip, stop=None):
    for i, batch in enumerate(loader):
        if stop is not None and i == stop:
            return
        with acc.accumulate(model):
            loss = model(**batch).loss
            acc.backward(loss)
            if acc.sync_gradients:
                logs["norm"].append(float(acc.clip_grad_norm_(model.parameters(), clip)))
            opt.step()
            sched.step()
            opt.zero_grad()
        logs["loss"].append(loss.item())
        logs["lr"].append(sched.get_last_lr()[0])


def run(make_acc, kind="full", opt_kwargs=None, save_at=None, ckpt=None, n=N, make_opt=None):
    """(logs, final weights): the whole loop, or ``save_at`` micro-batches, ``save_state(ckpt)``,
    then a new Accelerator / model / optimizer that ``load_state(ckpt)`` and train on.
    ``make_opt(params) -> (optimizer, scheduler)``: default ``adamw(params, **opt_kwargs)``."""
    opt_kwargs = opt_kwargs or {}
    make_opt = make_opt or (lambda params: adamw(params, **opt_kwargs))
    logs = {"loss": [], "norm": [], "lr": []}
    acc, model, opt, loader, sched = _start(make_acc, kind, make_opt, n)
    _train(acc, model, opt, loader, sched, logs, CLIP[kind], stop=save_at)
    if save_at is not None:
        acc.save_state(ckpt)
        _close(acc)
        acc, model, opt, loader, sched = _start(make_acc, kind, make_opt, n)
        acc.load_state(ckpt)
        _train(acc, model, opt, acc.skip_first_batches(loader, save_at), sched, logs, CLIP[kind])
    weights = {k: v.detach().clone().float() for k, v in acc.get_state_dict(model).items()}
    _close(acc)
    if hasattr(acc, "engine"):              # after close() the model holds the trained weights
        back = acc.unwrap_model(model).state_dict()
        assert all(torch.equal(back[k].float(), weights[k]) for k in weights)
    return logs, weights


def _close(acc):
    if hasattr(acc, "close"):
        acc.close()
