"""``zo.plan``: the layout of a run chosen for this machine, by measuring it and predicting every layout.

The parts: ``probe`` measures the machine (cached), ``model_spec`` builds the model on the meta device
and times one of its blocks, ``search`` enumerates the layouts that fit, ``predict`` models each one's
step ([Note: the step model]). The chosen layout is a complete config (``PlanResult.to_toml``) and its
``Prediction``, which ``zo.initialize(prediction=)`` takes as data and ``engine.stats`` reports
beside what it measures.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Callable, Iterable

from ..block_stream import stream_depth
from ..config import Config, ConfigError
from ..telemetry import Prediction
from .model_spec import ModelSpec, gpt_of_size, load_model, named_gpt
from .predict import predict
from .probe import Probe, cached_probe, measure_adam_rate, probe_machine
from .search import SEARCHED, Candidate, Evaluator, candidates, rank
from .volumes import proposes_zero_pp

__all__ = ["PREDICTION", "PlanResult", "Probe", "SEARCHED", "cached_probe", "model_spec", "pinned_keys", "plan",
           "predict", "predict_config", "read_prediction", "state_format_words"]


@dataclass
class PlanResult:
    """The ranked layouts that fit (best first), those refused, and what they were predicted from."""

    model: ModelSpec
    probe: Probe
    fitting: list[Candidate]
    refused: list[Candidate]
    batch_size: int
    world_size: int
    evaluator: Evaluator

    def predict(self, config: Config | dict | str) -> Candidate:
        """Any other layout of the same model, judged as the ranked ones were (same probe, same timed
        block): its refusal, or its prediction."""
        return self.evaluator.evaluate(Candidate({}, Config.load(config)))

    @property
    def best(self) -> Candidate:
        if not self.fitting:
            nearest = min(self.refused, key=lambda c: c.memory_need)
            raise ConfigError(f"no layout of {self.model.name} fits this machine ({len(self.refused)} tried); the one "
                              f"needing the least memory, {nearest.describe()}, is refused: {nearest.refusal}")
        return self.fitting[0]

    @property
    def precision_note(self) -> str | None:
        """The probe's word on the best layout's precision (``Probe.precision_hint``), if it has one."""
        return self.probe.precision_hint(self.best.config.train.precision)

    def to_toml(self) -> str:
        """The best layout as a complete config, its prediction in the header: in words, and whole on the
        ``PREDICTION`` line (``read_prediction``), which ``train --plan FILE`` prints beside what it measures."""
        best = self.best
        p = best.prediction
        header = [f"# zerooffload plan: {self.model.name}, batch {self.batch_size}, world size {self.world_size}",
                  f"# layout: {best.describe()}",
                  f"# predicted step {p.step_seconds:.2f} s; " + ", ".join(
                      f"{tier} {n / 1e9:.2f} GB" for tier, n in p.peak_bytes.items()),
                  f"# {p.bottleneck}",
                  f"{PREDICTION}{json.dumps(p.as_json())}"]
        return "\n".join(header) + "\n" + best.config.to_toml()


PREDICTION = "# prediction: "
"""The plan file's line holding its prediction as JSON (a comment: the file stays a plain config)."""


def read_prediction(path: str) -> Prediction | None:
    """The prediction a plan file carries (``PlanResult.to_toml``), or None for a file without one."""
    with open(path) as file:
        for line in file:
            if line.startswith(PREDICTION):
                return Prediction.from_json(json.loads(line[len(PREDICTION):]))
    return None


def pinned_keys(config: Config, overrides: Iterable[str] = ()) -> set[str]:
    """The searched keys a user fixed: set in ``overrides``, or given a value other than the library's
    default in ``config``."""
    default, mine = _flat(Config.load({}).to_dict()), _flat(config.to_dict())
    fixed = {key.partition("=")[0].strip() for key in overrides}
    return {key for key in SEARCHED if key in fixed or mine.get(key) != default.get(key)}


def _flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def plan(model: str | ModelSpec, config: Config | dict | str | None = None, *, pinned: Iterable[str] | None = None,
         world_size: int = 1, batch_size: int | None = None, seq_len: int | None = None,
         params: float | None = None, layers: int | None = None, refresh: bool = False,
         progress: Callable[[str], None] | None = None, probe: Probe | None = None, timed: bool = True,
         ranks_per_node: int | None = None, inter_node_gbps: float | None = None) -> PlanResult:
    """Probe the machine (cached), enumerate the layouts of ``model`` that fit and rank them by predicted
    step time (search's [Note: the search]).

    ``model``: a preset, a Hugging Face ``config.json``, a ``module:factory``, or with ``params`` and
    ``layers`` a name for a GPT of that size. ``config``: the rest of the run (budgets, paths, optimizer,
    precision); its ``pinned`` keys stay as set (default: ``pinned_keys(config)``). ``batch_size``:
    sequences per optimizer step over all ranks (default: the config's micro × accumulation × world).
    ``probe``: the machine's, when the caller has one (nothing is then measured but one block).
    ``timed=False``: not even that; blocks are counted in FLOPs (a refusal's suggestion, in seconds).
    ``ranks_per_node`` and ``inter_node_gbps`` (bytes a second a rank sends across nodes): the job's nodes and
    their link, which no probe on one machine measures; over a slow link ZeRO++ is tried (``zero_pp``).
    """
    config = Config.load(config if config is not None else {})
    progress = progress or (lambda text: None)
    spec = model if isinstance(model, ModelSpec) else model_spec(model, seq_len, params, layers)
    batch = batch_size or config.train.micro_batch_size * config.train.grad_accum_steps * world_size
    if batch % world_size:
        raise ConfigError(f"batch size {batch} is not a multiple of the world size {world_size}")
    measure = probe is None
    probe = probe or probe_machine(config, refresh=refresh, progress=progress, world_size=world_size)
    if ranks_per_node and world_size % ranks_per_node:
        raise ConfigError(f"{ranks_per_node} ranks a node do not divide the world size {world_size}: every node "
                          "runs as many ranks")
    if ranks_per_node or inter_node_gbps:
        probe = dataclasses.replace(probe, ranks_per_node=ranks_per_node or probe.ranks_per_node,
                                    inter_node_gbps=inter_node_gbps or probe.inter_node_gbps)
    pinned = pinned_keys(config) if pinned is None else set(pinned)
    evaluator = Evaluator(spec, probe, world_size, progress, timed=timed)
    refused: list[Candidate] = []
    for format_overrides, state_format in _state_formats(config, pinned):
        if measure:
            measure_adam_rate(probe, state_format, progress)
        pool = candidates(state_format, pinned, batch, world_size, probe.device, _unit_bytes(spec, config, world_size))
        pool += zero_pp(pool, probe, world_size, pinned)
        for candidate in pool:  # a format is part of the layout: train --plan applies the overrides alone
            candidate.overrides = {**format_overrides, **candidate.overrides}
        progress(f"predicting {len(pool)} layouts" + ("" if state_format is config else
                                                       f" with {state_format_words(state_format)}: none fits with "
                                                       "fewer changes"))
        fitting, refused_now = rank(evaluator, pool)
        refused += refused_now
        if fitting:
            break
    return PlanResult(spec, probe, fitting, refused, batch, world_size, evaluator)


def zero_pp(pool: list[Candidate], probe: Probe, world_size: int, pinned: set[str]) -> list[Candidate]:
    """Each stage 3 layout of ``pool`` again with ZeRO++'s three settings (hpZ over the node, qwZ, qgZ with
    8 bits), where the link between nodes is slow (volumes' ``proposes_zero_pp``) and the user left them
    free; the ranking then decides by the predicted step (a slow link's seconds, hpZ's device bytes)."""
    keys = {"zero.hpz_partition_size": probe.ranks_per_node, "zero.quantized_weights": True,
            "zero.quantized_gradients": True}
    local = probe.ranks_per_node or world_size
    if keys.keys() & pinned or not proposes_zero_pp(probe.collective_gbps, probe.inter_node_gbps,
                                                      world_size // local):
        return []
    out = []
    for candidate in pool:
        if candidate.config.zero.stage == 3:
            overrides = {**candidate.overrides, **keys}
            out.append(Candidate(overrides, Config.load(candidate.config, overrides=[
                f"{k}={json.dumps(v)}" for k, v in keys.items()])))
    return out


def _state_formats(config: Config, pinned: set[str]) -> list[tuple[dict[str, str], Config]]:
    """The optimizer state formats a plan tries, in turn, until a layout fits, as overrides and the config
    they make: the config's; then, where the user left them free, a split master (lossless: bf16 runs of
    Adam only); then bf16 moments too; then int8 moments; then, as well, two host buffers per block stream
    instead of three (``aio.blocks_in_flight``: less overlap of the I/O, a unit's block less in RAM)."""
    optimizer, adam = config.optimizer, config.optimizer.type != "sgd"
    steps = [("optimizer.master", "split", adam and optimizer.master == "fp32" and config.train.precision == "bf16"),
             ("optimizer.moments", "bf16", adam and optimizer.moments == "fp32"),
             ("optimizer.moments", "int8", adam and optimizer.moments in ("fp32", "bf16")),
             ("aio.blocks_in_flight", 2, stream_depth(config.aio) > 2)]
    formats, overrides = [({}, config)], {}
    for key, value, applies in steps:
        if applies and key not in pinned:
            overrides = {**overrides, key: value}
            formats.append((overrides, Config.load(config, overrides=[f"{k}={json.dumps(v)}" for k, v in overrides.items()])))
    return formats


def state_format_words(config: Config) -> str:
    """The optimizer state format of ``config`` in words (and its block streams' depth when the plan made it 2)."""
    depth = f", {stream_depth(config.aio)} blocks in flight" if stream_depth(config.aio) == 2 else ""
    return (f"{'a split' if config.optimizer.master == 'split' else 'an fp32'} master, {config.optimizer.moments} "
            f"moments{depth}")


def model_spec(model: str, seq_len: int | None = None, params: float | None = None,
               layers: int | None = None) -> ModelSpec:
    """The ``ModelSpec`` ``plan`` takes for ``model`` (see ``plan``), built on the meta device."""
    if params:
        return named_gpt(f"a GPT of {params:.3g} parameters in {layers} layers",
                         gpt_of_size(params, layers, seq_len or 1024))
    return load_model(model, seq_len)


def _unit_bytes(spec: ModelSpec, config: Config, world_size: int) -> tuple[int, int]:
    """The root unit's and the largest other unit's gathered bytes in the compute dtype (stage 3's windows)."""
    from ..config import dtype_bytes
    from ..zero.unit_layout import find_units

    layouts = find_units(spec.module, config.zero.unit_modules, world_size)
    cb = dtype_bytes(config.train.precision)
    root = sum(u.padded_numel for u in layouts if not u.name) * cb
    return root, max((u.padded_numel for u in layouts if u.name), default=0) * cb


def predict_config(model: ModelSpec, config: Config, probe: Probe, world_size: int = 1,
                   progress: Callable[[str], None] | None = None):
    """The ``Prediction`` of ``config`` as it is (``train`` with a cached probe or a ``--plan FILE``
    without one); ``progress`` hears the block it times."""
    return Evaluator(model, probe, world_size, progress or (lambda text: None)).evaluate(
        Candidate({}, config)).prediction



