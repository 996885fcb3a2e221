"""CPU optimizers for offloaded training: update rules (rule.py) and their standalone
torch.optim.Optimizer forms; the native fused Adam / AdamW (cpu_adam.py) as before."""
from offload.optim.rule import RULES, Row, UpdateRule, get_rule, register
from offload.optim.adam import Adam, AdamW
from offload.optim.lion import Lion
from offload.optim.sgd import SGD
from offload.optim.adagrad import Adagrad
from offload.optim.adafactor import Adafactor

register(AdamW)
register(Adam)
register(Lion)
register(SGD)
register(Adagrad)
register(Adafactor)

from offload.optim.cpu_adam import CPUAdam, adam_step, get_num_threads, set_num_threads  # noqa: E402
from offload.optim.optimizer import (CPUAdafactor, CPUAdagrad, CPUAdamW, CPULion, CPURuleAdam,  # noqa: E402
                                     CPUSGD, RuleOptimizer)

__all__ = ["CPUAdam", "adam_step", "set_num_threads", "get_num_threads", "UpdateRule", "Row", "RULES",
           "register", "get_rule", "RuleOptimizer", "CPUAdamW", "CPURuleAdam", "CPULion", "CPUSGD",
           "CPUAdagrad", "CPUAdafactor"]
