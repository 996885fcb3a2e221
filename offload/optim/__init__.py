"""CPU optimizers for offloaded training: update rules (rule.py, with AdamW / Adam), their
standalone torch.optim.Optimizer forms (optimizer.py) and ``adam_step``, the Adam rule as a function."""
from offload.optim.rule import (RULES, Adam, AdamW, Row, UpdateRule, adam_step, get_num_threads, get_rule,
                                register, set_num_threads)
from offload.optim.lion import Lion
from offload.optim.sgd import SGD
from offload.optim.adagrad import Adagrad
from offload.optim.adafactor import Adafactor
from offload.optim.adafactor_hf import TransformersAdafactor

register(AdamW)
register(Adam)
register(Lion)
register(SGD)
register(Adagrad)
register(Adafactor)
register(TransformersAdafactor)

from offload.optim.optimizer import (CPUAdafactor, CPUAdagrad, CPUAdam, CPUAdamW, CPULion,  # noqa: E402
                                     CPURuleAdam, CPUSGD, RuleOptimizer)

__all__ = ["CPUAdam", "adam_step", "set_num_threads", "get_num_threads", "UpdateRule", "Row", "RULES",
           "register", "get_rule", "RuleOptimizer", "CPUAdamW", "CPURuleAdam", "CPULion", "CPUSGD",
           "CPUAdagrad", "CPUAdafactor"]
