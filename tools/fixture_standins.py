"""Stand-ins for DeepSpeed and Megatron classes, registered under their real module names.

DeepSpeed and Megatron are not installed here, so the fixture scripts pickle these instead: the
files then name exactly the globals real DeepSpeed files name
(deepspeed.runtime.fp16.loss_scaler.LossScaler, ...). Importing this module registers them.
"""

import dataclasses
import enum
import sys
import types


def _module(name):
    """Registers an empty module (and its parents) so pickle can name classes in it."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        sub = ".".join(parts[:i])
        if sub not in sys.modules:
            sys.modules[sub] = types.ModuleType(sub)
            if i > 1:
                setattr(sys.modules[".".join(parts[:i - 1])], parts[i - 1], sys.modules[sub])
    return sys.modules[name]


def _define(module_name, cls):
    cls.__module__ = module_name
    setattr(_module(module_name), cls.__name__, cls)
    return cls


class LossScaler:
    def __init__(self, scale):
        self.cur_scale = scale
        self.dynamic = False


class ZeroStageEnum(int, enum.Enum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


@dataclasses.dataclass
class fragment_address:  # noqa: N801 (DeepSpeed's own spelling)
    numel: int
    start: int


class ModelType(enum.Enum):
    encoder_or_decoder = 1
    encoder_and_decoder = 2


_define("deepspeed.runtime.fp16.loss_scaler", LossScaler)
_define("deepspeed.runtime.zero.config", ZeroStageEnum)
_define("deepspeed.utils.tensor_fragment", fragment_address)
_define("megatron.core.enums", ModelType)
