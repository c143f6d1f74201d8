"""``zerooffload.hf.Trainer``: transformers' Trainer with the engine underneath.

[Note: the Trainer's loop over an engine]
The Trainer keeps its loop, its logging, callbacks, evaluation and checkpoint folders; what it would
hand to Accelerate (wrapping the model in DDP, the optimizer, clipping, the backward) goes to the
engine instead, the way transformers hands it to DeepSpeed:
- the model the loop sees is ``EngineModule``, whose forward is the engine's: never DDP, never
  under it. It is built at first need (``train``, ``evaluate``, ``predict``, ``save_model``) from
  ``self.model``, again when ``model_init`` builds a new model;
- ``training_step`` scales the loss exactly as the Trainer does, then runs ``engine.backward(loss,
  scale_wrt_gas=False, closes_window=...)`` (the Trainer already divided by the accumulation, and it
  decides where a window ends, also the shorter last one of an epoch) and ``engine.step()``, which
  updates, clipped to ``max_grad_norm``, when the window closes; the loop's optimizer step is then a
  no-op, its ``zero_grad`` too, and the gradient norm it logs is the engine's (before clipping);
- the learning rate: the Trainer's schedule (``lr_scheduler_type``, or the config's own: arguments'
  note) over the engine's optimizer, stepped by the loop after each update, as it steps its own;
- parameter groups: the Trainer's (no weight decay on biases and norms), given to ``zo.initialize``;
  units: the model's ``_no_split_modules`` and its embeddings, unless the config names them
  (``with_model_units``);
- ``checkpoint-N/`` is in the plain Trainer's layout (``model.safetensors``, ``optimizer.pt`` as torch's
  AdamW state_dict, written unit by unit, with a ``zerooffload.json`` of their digests: trainer_files'
  [Note: one checkpoint both Trainers read]), or, where that layout cannot hold the state, the engine's
  sharded checkpoint in ``zerooffload/``; beside them the Trainer's state, scheduler and RNG files and
  the model's config; ``save_model`` writes ``model.safetensors`` from the live engine, unit by unit,
  which ``from_pretrained`` loads;
- resuming loads that checkpoint (or the plain Trainer's) into the engine; ``resume_from_checkpoint=True`` takes the newest
  ``checkpoint-N`` whose checkpoint verifies, saying so when that is not the newest; at another
  world size the accumulation is changed to keep the saved global batch (``checkpoints``' note);
- ``save_total_limit`` prunes by the engine's rules (``checkpoints``' note).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from ..checkpoint.by_name import load_by_name
from ..config import Config, ConfigError
from ..engine import Engine
from ..initialization import initialize
from ..lazy_init import is_lazy
from ..optim import build_scheduler
from ..pretrained import load_safetensors
from .arguments import TrainerConfig, refuse_arguments, resolve
from .checkpoints import (
    ENGINE_DIR,
    check_links,
    global_batch_for,
    folder_kind,
    newest_loadable,
    prune_checkpoints,
    run_shape,
    trainer_layout_source,
)
from .lazy_model import hf_initializer, pretrained_weights
from .trainer_files import MODEL_FILE, read_digests, save_trainer_files, save_weights, unsupported

__all__ = ["Trainer", "EngineModule"]

logger = logging.getLogger(__name__)

SCHEDULER_FILE = "scheduler.pt"
"""The Trainer's own name for its scheduler state in checkpoint-N (transformers' SCHEDULER_NAME)."""


class EngineModule(nn.Module):
    """The model as the Trainer's loop sees it: the user's module (for parameter counts, train/eval
    modes, ``config``) whose forward runs through the engine."""

    def __init__(self, engine: Engine):
        super().__init__()
        self.module = engine.module
        self.engine = engine  # not an nn.Module: a plain attribute

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def _get_name(self) -> str:
        return self.module._get_name()  # the Trainer's label smoothing tells causal LMs by this name

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)  # config, accepts_loss_kwargs, ... as the Trainer reads them


class EngineOptimizer:
    """``trainer.optimizer``: the engine's optimizer (torch-style param groups, for the schedule and for
    callbacks), whose ``step`` and ``zero_grad`` the loop calls after the engine has already updated."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.optimizer = engine.optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def step(self, closure: Any = None) -> None:
        """Nothing: ``engine.step()`` in ``training_step`` updated at the window's end."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the engine's step clears its gradients."""


class EngineSchedule:
    """``trainer.lr_scheduler``: steps the schedule only after an update, so a skipped window (an fp16
    overflow) does not advance it, as Accelerate skips the scheduler after a skipped optimizer step."""

    def __init__(self, schedule: Any, engine: Engine):
        self.schedule, self.engine = schedule, engine

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self.engine.stats is None or self.engine.stats.updated:
            self.schedule.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.schedule.get_last_lr()

    def state_dict(self) -> dict:
        return self.schedule.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.schedule.load_state_dict(state)


def with_model_units(config: Config, model: nn.Module) -> Config:
    """``zero.unit_modules``, unless the config names them: the blocks the model declares unsplittable
    (``_no_split_modules``, what Accelerate's device maps and FSDP wrapping use) and its output
    embeddings (the LM head), a unit of its own. Left in the root unit beside the input embeddings,
    the head (with them a Llama's two largest tensors) would make one block gathered, streamed and
    updated whole; the root keeps the input embeddings (used first, so its gradients complete last, as
    the reduction order expects) and the final norm. A head tied to the input embeddings stays there."""
    if config.zero.unit_modules:
        return config
    names = list(getattr(model, "_no_split_modules", None) or [])
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        names.append(type(head).__name__)
    if not names:
        return config
    return config.replace(zero=dataclasses.replace(config.zero, unit_modules=list(dict.fromkeys(names))))


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` plus ``zerooffload=`` (default: ``args.zerooffload``, which
    ``TrainingArguments``' ``--deepspeed`` sets): a zerooffload TOML path or dict, or a DeepSpeed JSON path or dict, whose ``"auto"`` values come from the TrainingArguments (arguments' note).
    Everything else is the Trainer's, trained by the engine (this module's note)."""

    def __init__(self, *args: Any, zerooffload: Any = None, **kwargs: Any):
        arguments = kwargs.get("args", args[1] if len(args) > 1 else None)
        if arguments is not None:
            refuse_arguments(arguments)  # before the Trainer sets up a DeepSpeed or FSDP of its own
        zerooffload = zerooffload if zerooffload is not None else getattr(arguments, "zerooffload", None)
        if zerooffload is None:
            raise ConfigError("no zerooffload config: pass --deepspeed ds_config.json with "
                              "zerooffload.hf.TrainingArguments, or Trainer(..., zerooffload=\"config.toml\")")
        self._zo_source = zerooffload
        self._zo_engine: Engine | None = None
        self._zo_said_sharded = False
        self._zo_good: str | None = None
        """The last checkpoint-N saved outside a skip streak: never pruned (checkpoints' note)."""
        super().__init__(*args, **kwargs)
        self._zo: TrainerConfig = resolve(zerooffload, self.args)  # refused now, not at train()

    # ------------------------------------------------------------------ the engine
    @property
    def engine(self) -> Engine:
        """The engine training ``self.model`` (built at first use)."""
        return self._engine_module().engine

    def _engine_module(self) -> EngineModule:
        if self._zo_engine is None or self._zo_engine.module is not self.model:
            if self._zo_engine is not None:
                self._zo_engine.close()  # model_init built a new model
            self._zo_engine = self._build_engine(self.model)
            self._zo_module = EngineModule(self._zo_engine)
        return self._zo_module

    def _build_engine(self, model: nn.Module) -> Engine:
        lazy = is_lazy(model)
        engine = initialize(model, with_model_units(self._zo.engine, model), param_groups=self._param_groups(model),
                            init_fn=hf_initializer(model) if lazy else None)
        weights = pretrained_weights(model)
        if weights is not None:
            load_safetensors(engine, weights)
        return engine

    def _param_groups(self, model: nn.Module) -> list[dict]:
        """The Trainer's groups: weight decay except on biases and norms (``get_decay_parameter_names``)."""
        params = dict(model.named_parameters())
        groups = [{"params": [params[n] for n in names], "weight_decay": decay}
                  for names, decay in zip(self._group_names(model), (self.args.weight_decay, 0.0))]
        return [g for g in groups if g["params"]]

    def _group_names(self, model: nn.Module) -> list[list[str]]:
        """The plain Trainer's two groups by parameter name, in its order (``create_optimizer``)."""
        decay = set(self.get_decay_parameter_names(model))
        named = [n for n, p in model.named_parameters() if p.requires_grad]
        return [[n for n in named if n in decay], [n for n in named if n not in decay]]

    def _load_engine(self, folder: Path) -> None:
        """The engine's state from ``folder``: its own checkpoint, or the plain Trainer's weights and AdamW
        state (``checkpoints``' [Note: Trainer checkpoints]); anything else refused saying what it holds."""
        if folder_kind(folder) == "trainer":
            record = read_digests(folder, verify=True)  # ours: its files verified first
            load_by_name(self.engine, trainer_layout_source(folder, self._group_names(self.model)))
            if record is not None:  # what the Trainer's files do not hold
                self.engine.scaler.load_state(record["scaler"])
                self.engine.window.restore(*(record["counters"][k] for k in ("global_steps", "micro_steps",
                                                                              "skipped_steps")))
        else:
            self.engine.load_checkpoint(folder / ENGINE_DIR)

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """Nothing: the engine places every tensor (a lazy model has nothing to move)."""

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        return self._engine_module()

    # ------------------------------------------------------------------ training
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, **kwargs: Any):
        if resume_from_checkpoint is True:
            resume_from_checkpoint = newest_loadable(Path(self.args.output_dir), self.args.process_index)
        if resume_from_checkpoint:
            self._keep_global_batch(Path(resume_from_checkpoint))
        return super().train(resume_from_checkpoint=resume_from_checkpoint or None, trial=trial, **kwargs)

    def _keep_global_batch(self, checkpoint: Path) -> None:
        """At another world size, the accumulation that keeps the saved run's global batch."""
        accum = global_batch_for(checkpoint, self.args)
        if accum != self.args.gradient_accumulation_steps:
            logger.warning("resuming %s at world size %d: gradient_accumulation_steps %d -> %d keeps its global batch",
                           checkpoint, self.args.world_size, self.args.gradient_accumulation_steps, accum)
            self.args.gradient_accumulation_steps = accum
            self._zo = resolve(self._zo_source, self.args)
            if self._zo_engine is not None:  # built for the old window length (by an evaluate() before)
                self._zo_engine.close()
                self._zo_engine = None

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | None):
        module = self._engine_module()
        engine = module.engine
        self.optimizer = EngineOptimizer(engine)
        self.lr_scheduler = None
        self.create_scheduler(num_training_steps=max_steps, optimizer=engine.optimizer)
        self.model_wrapped = module
        if resume_from_checkpoint is not None:
            self._load_engine(Path(resume_from_checkpoint))
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return module, train_dataloader

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """The config's own schedule when it has one, else the Trainer's ``lr_scheduler_type``; stepped
        by the loop only after an update (``EngineSchedule``)."""
        engine = self.engine
        if self.lr_scheduler is None:
            if self._zo.has_schedule:
                schedule = build_scheduler(engine.optimizer, self._zo.schedule(self.args, num_training_steps))
                schedule = schedule or torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda step: 1.0)
            else:
                schedule = super().create_scheduler(num_training_steps, optimizer=engine.optimizer)
            self.lr_scheduler = EngineSchedule(schedule, engine)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def training_step(self, model: nn.Module, inputs: dict, num_items_in_batch: Any = None) -> torch.Tensor:
        """The Trainer's step with the engine's backward and step (this module's note)."""
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        if not self._loss_is_scaled_for_accumulation(num_items_in_batch):
            loss = loss / self.current_gradient_accumulation_steps
        engine = model.engine
        engine.backward(loss, scale_wrt_gas=False, closes_window=self.accelerator.sync_gradients)
        engine.step()
        return loss.detach()

    def _loss_is_scaled_for_accumulation(self, num_items_in_batch: Any) -> bool:
        """As the Trainer decides it: the loss was normalized over the whole window already."""
        if self.loss_is_scaled_for_ga is not None:
            return self.loss_is_scaled_for_ga
        return (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or self.compute_loss_func is not None

    def _clip_grad_norm(self, model: nn.Module) -> float | None:
        """The engine clipped in its step; the norm before clipping, as the Trainer logs it."""
        return self._get_grad_norm(model)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> float | None:
        stats = self.engine.stats
        return None if stats is None else stats.grad_norm

    # ------------------------------------------------------------------ checkpoints and the model
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The weights and AdamW state in the plain Trainer's layout (every rank takes part; the engine's
        sharded format where that layout cannot hold the state: trainer_files' note), and the schedule's
        state (rank 0), into checkpoint-N."""
        engine, folder = self.engine, Path(output_dir)
        reason = unsupported(engine)
        if reason is None:
            record = {"client_state": run_shape(self.args), "scaler": engine.scaler.state(),
                      "counters": {"global_steps": engine.window.global_steps, "micro_steps": engine.window.micro_steps,
                                   "skipped_steps": engine.window.skipped_steps}}
            save_trainer_files(engine, folder, self._group_names(self.model), self._group_settings(), record)
        else:
            if not self._zo_said_sharded and self.args.should_save:
                logger.warning("zerooffload: checkpoints in the engine's sharded format (%s/), which the plain "
                               "Trainer cannot resume: %s", ENGINE_DIR, reason)
                self._zo_said_sharded = True
            engine.save_checkpoint(folder / ENGINE_DIR, client_state=run_shape(self.args))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    def _group_settings(self) -> list[dict]:
        """Each Trainer group's settings as the plain Trainer's optimizer holds them (its class and
        arguments: the keys its ``load_state_dict`` restores), with the engine's current values."""
        cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, self.model)
        probe = cls([{"params": [torch.zeros(1, requires_grad=True)], "weight_decay": decay}
                     for decay in (self.args.weight_decay, 0.0)], **kwargs)
        settings = [{k: v for k, v in group.items() if k != "params"} for group in probe.state_dict()["param_groups"]]
        engine_groups = iter(self.engine.optimizer.param_groups)
        current = {}
        for names, group in zip(self._group_names(self.model), settings):
            if names:  # the engine has a group for each non-empty one (_param_groups)
                current = next(engine_groups)
            group.update({k: tuple(current[k]) if k == "betas" else current[k]
                          for k in ("lr", "betas", "eps", "weight_decay", "initial_lr") if k in current})
        return settings

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None and os.path.isfile(os.path.join(checkpoint, SCHEDULER_FILE)):
            self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_FILE), weights_only=True))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Nothing here: the engine loads its checkpoint once it exists (``_prepare_for_training``)."""

    def _load_best_model(self) -> None:
        self._load_engine(Path(self.state.best_model_checkpoint))

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """The Trainer's save (a link at its checkpoint-N refused first), then pruning by the engine's
        rules instead of the Trainer's rotation (checkpoints' note)."""
        run_dir = Path(self._get_output_dir(trial))
        check_links(run_dir)
        limit, self.args.save_total_limit = self.args.save_total_limit, None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        if self.engine.window.streak.length == 0:
            self._zo_good = str(run_dir / f"checkpoint-{self.state.global_step}")
        if self.args.should_save:
            prune_checkpoints(run_dir, limit, spare={self.state.best_model_checkpoint, self._zo_good})

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``model.safetensors`` (from the engine, unit by unit) beside the model's config, as
        ``from_pretrained`` reads them; inside a checkpoint-N only the config (the weights are written with
        the optimizer state, in one pass: ``_save_optimizer_and_scheduler``), unless ``save_only_model``.
        Every rank must call it."""
        output_dir = Path(output_dir or self.args.output_dir)
        engine = self.engine
        with_weights = not _internal_call or self.args.save_only_model
        if self.args.should_save:
            output_dir.mkdir(parents=True, exist_ok=True)
        if with_weights:
            save_weights(engine, output_dir / MODEL_FILE)
        if not self.args.should_save:
            return
        unwrapped = self.model
        if hasattr(unwrapped, "config") and hasattr(unwrapped.config, "save_pretrained"):
            unwrapped.config.architectures = [type(unwrapped).__name__]  # as save_pretrained records them
            unwrapped.config.dtype = torch.float32  # the weights' dtype in model.safetensors (fp32 masters)
            unwrapped.config.save_pretrained(output_dir)
        if getattr(unwrapped, "generation_config", None) is not None and hasattr(unwrapped, "can_generate") \
                and unwrapped.can_generate():
            unwrapped.generation_config.save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, output_dir / "training_args.bin")
