"""``zerooffload.hf.TrainingArguments``: transformers' arguments whose ``--deepspeed`` names our config.

A script written for DeepSpeed passes ``--deepspeed ds_config.json``; transformers' ``__post_init__``
then builds DeepSpeed's plugin, which needs DeepSpeed installed. This subclass takes the value out
before that runs and keeps it as ``zerooffload``, the config ``zerooffload.hf.Trainer`` trains with (a
DeepSpeed JSON is read by config.deepspeed, "auto" values filled from these arguments: arguments'
[Note: who decides what]). So ``from zerooffload.hf import Trainer, TrainingArguments`` is the one line a
script such as transformers' ``run_clm.py`` changes; its command line stays as it was.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import transformers

__all__ = ["TrainingArguments"]


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    """``transformers.TrainingArguments`` plus ``zerooffload``, which ``--deepspeed`` sets (see the module)."""

    zerooffload: Any = field(default=None, metadata={
        "help": "The zerooffload config: a TOML or JSON path (ours or a DeepSpeed JSON) or a dict; --deepspeed sets it"})

    def __post_init__(self) -> None:
        if self.deepspeed is not None:
            if self.zerooffload is not None and self.zerooffload != self.deepspeed:
                raise ValueError(f"--deepspeed {self.deepspeed} and --zerooffload {self.zerooffload} name two configs: "
                                 "pass one of them")
            self.zerooffload, self.deepspeed = self.deepspeed, None
        super().__post_init__()
