"""``zo.plan`` / ``zerooffload plan`` / ``train --plan``: checked against the engine itself, never
against the plan's own arithmetic.

- The bytes a prediction says a step moves (NVMe reads and writes, host<->device) equal what the
  engine's telemetry counts over a grid of layouts that exercises every rule of the step model.
- A layout the plan refuses is refused by ``zo.initialize``, and one it keeps starts.
- Pinned keys constrain the search; the written plan is a config that trains, and its run records
  the prediction beside the measurement in summary.json.
In CI: the fp32 byte checks (one shared ``Evaluator``: the nano block timed once) and the cached probe
that never measures (a plain train never probing is in test_train_cli's smoke test); the command-line
paths, pinned keys, bf16 and the model kinds are ``slow``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zerooffload as zo
from zerooffload.cli.plan import format_plan
from zerooffload.cli.train_plan import best_layout, predicted_peaks
from zerooffload.config import Config
from zerooffload.models import GPT, PRESETS
from zerooffload.planning import PlanResult, cached_probe, pinned_keys, plan, probe_machine, read_prediction
from zerooffload.planning.model_spec import gpt_of_size, load_model, named_gpt
from zerooffload.planning.probe import cache_path
from zerooffload.planning.search import Candidate, Evaluator, candidates
from zerooffload.tiers import BudgetError

MICRO = 2
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SLOW = pytest.mark.slow
LAYOUTS = [
    ("zero.stage=2", "offload.optimizer.tier=nvme"),
    ("zero.stage=3", "offload.optimizer.tier=nvme", "offload.param.tier=nvme"),
    ("zero.stage=3", "offload.optimizer.tier=nvme", "offload.param.tier=nvme", "zero.max_live_size=1MiB",
     "zero.prefetch_size=512KiB"),
    ("zero.stage=3", "offload.optimizer.tier=host", "offload.param.tier=host", "train.grad_accum_steps=2"),
    pytest.param(("zero.stage=1", "offload.optimizer.tier=host", "train.grad_accum_steps=2", "train.precision=bf16"),
                 marks=SLOW),
    pytest.param(("zero.stage=3", "offload.optimizer.tier=nvme", "offload.optimizer.fraction=0.5",
                  "offload.param.tier=host", "train.precision=bf16"), marks=SLOW),
    ("zero.stage=3", "offload.optimizer.tier=host", "offload.optimizer.fraction=0.5", "offload.param.tier=nvme"),
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A probe cache of its own, measured once for the module (and a swap directory)."""
    root = tmp_path_factory.mktemp("plan")
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(root / "cache")
    (root / "nvme").mkdir()
    yield root
    if old is None:
        os.environ.pop("XDG_CACHE_HOME")
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture(scope="module")
def evaluators(cache):
    """One evaluator of the nano GPT per compute dtype for the module (bf16's rates, slow on a CPU without
    bf16 units, are probed only when a test asks). Its blocks are counted in FLOPs, not timed: what these
    tests check (bytes moved, fits, the prediction's journey) does not depend on the seconds."""
    made: dict[str, Evaluator] = {}

    def get(config: Config) -> Evaluator:
        precision = config.train.precision
        if precision not in made:
            made[precision] = Evaluator(named_gpt("nano", PRESETS["nano"]), probe_machine(config), 1,
                                        lambda text: None, timed=False)
        return made[precision]
    return get


@pytest.fixture(scope="module")
def evaluator(cache, evaluators):
    return evaluators(_config(cache))


def _config(root: Path, overrides=()) -> Config:
    return Config.load({"nvme": {"path": str(root / "nvme")}, "train": {"micro_batch_size": MICRO}},
                       overrides=list(overrides))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: " ".join(o.split("=")[1] for o in layout)
                         if isinstance(layout, tuple) else None)
def test_predicted_bytes_moved_equal_the_engines_telemetry(cache, evaluators, make_engine, layout):
    config = _config(cache, layout)
    prediction = evaluators(config).evaluate(Candidate({}, config)).prediction
    engine = _two_steps_of_nano(make_engine, config, prediction)
    io, link = engine.stats.io, engine.stats.link
    moved = prediction.moved_bytes
    assert (moved["nvme_read"], moved["nvme_write"]) == pytest.approx((io.read_bytes, io.write_bytes), rel=0.06)
    assert moved["host_device"] == pytest.approx(link.host_to_device_bytes + link.device_to_host_bytes, rel=0.1)
    assert engine.stats.predicted is prediction
    assert set(engine.stats.phase_seconds) == {"forward", "backward", "step"}
    assert sum(engine.stats.phase_seconds.values()) <= engine.stats.seconds


def test_a_binding_clip_moves_the_bytes_of_the_redone_prediction(cache, evaluators, make_engine):
    """A clip below any gradient's norm: stage 3's tentative updates (optimizer on NVMe) are all undone and
    redone in the step, moving what ``Prediction.redone`` says: their blocks and kept gradients again."""
    config = _config(cache, ("zero.stage=3", "offload.optimizer.tier=nvme", "offload.param.tier=nvme",
                             "train.grad_clip=1e-9"))
    prediction = evaluators(config).evaluate(Candidate({}, config)).prediction
    engine = _two_steps_of_nano(make_engine, config, prediction)
    io, redone = engine.stats.io, prediction.redone.moved_bytes
    assert engine.stats.undone_updates == sum(u.layout.trainable for u in engine.state.units)  # every one redone
    assert (redone["nvme_read"], redone["nvme_write"]) == pytest.approx((io.read_bytes, io.write_bytes), rel=0.06)
    assert redone["nvme_write"] > 1.5 * prediction.moved_bytes["nvme_write"]  # what the clip-free step would move
    assert pickle.loads(pickle.dumps(prediction)) == prediction  # rank 0's plan reaches the others, redone too


def _two_steps_of_nano(make_engine, config: Config, prediction):
    """The nano GPT's engine after two steps: the second reads ahead by the first's trace."""
    with zo.init_context():
        model = GPT(PRESETS["nano"])
    engine = make_engine(model, config, init_fn=model.init_fn(), prediction=prediction)
    tokens = torch.zeros(MICRO, PRESETS["nano"].block_size, dtype=torch.long)
    for _ in range(2 * config.train.grad_accum_steps):
        engine.backward(engine(tokens, tokens))
        engine.step()
    return engine


def test_the_step_model_takes_each_state_formats_own_pass_rate(cache):
    """A plan that comes to a state format measures that format's pass (int8 moments' is bound by its
    arithmetic: the fp32 rate scaled by bytes would flatter it) and keeps it in the cache; the optimizer's
    seconds then come from it. A probe without it (read from an older cache) takes the fp32 states' rate."""
    layout = ["zero.stage=1", "offload.optimizer.tier=host"]
    fp32, int8 = _config(cache, layout), _config(cache, [*layout, "optimizer.moments=int8"])
    probe = plan("nano", int8, batch_size=MICRO, timed=False).probe
    rates = probe.adam_elements_per_s
    assert json.loads(cache_path().read_text())["machine"]["adam_elements_per_s"]["fp32+fp32+int8"] \
        == rates["fp32+fp32+int8"] != rates["fp32"]
    evaluator = Evaluator(named_gpt("nano", PRESETS["nano"]), probe, 1, lambda text: None, timed=False)
    work = {name: evaluator.evaluate(Candidate({}, config)).prediction.work["optimizer"]
            for name, config in (("fp32", fp32), ("int8", int8))}
    assert work["int8"] / work["fp32"] == pytest.approx(rates["fp32"] / rates["fp32+fp32+int8"], rel=1e-9)
    older = dataclasses.replace(probe, adam_elements_per_s={"fp32": rates["fp32"]})
    assert older.adam_rate(int8) == rates["fp32"]


@SLOW
def test_a_refused_layout_is_refused_by_the_engine_and_a_kept_one_starts(cache, make_engine):
    base = _config(cache, ["memory.device_budget=16MB", "memory.host_budget=64MB"])
    result = plan("nano", base, batch_size=MICRO)
    assert result.fitting and result.refused
    for candidate, fits in ((result.refused[0], False), (result.fitting[0], True)):
        with zo.init_context():
            model = GPT(PRESETS["nano"])
        tokens = torch.zeros(candidate.config.train.micro_batch_size, PRESETS["nano"].block_size, dtype=torch.long,
                             device="meta")
        start = lambda: make_engine(model, candidate.config, init_fn=model.init_fn(),  # noqa: E731
                                    example_inputs=(tokens, tokens))
        if fits:
            start()
        else:
            with pytest.raises(BudgetError):
                start()


@SLOW
def test_pinned_keys_hold_in_every_candidate(cache):
    base = _config(cache, ["zero.stage=3", "offload.optimizer.tier=nvme"])
    pinned = pinned_keys(base)
    assert {"zero.stage", "offload.optimizer.tier", "train.micro_batch_size"} <= pinned
    result = plan("nano", base, batch_size=4)
    assert result.fitting
    for candidate in result.fitting + result.refused:
        config = candidate.config
        assert (config.zero.stage, config.offload.optimizer.tier, config.train.micro_batch_size) == (3, "nvme", MICRO)
        assert config.train.micro_batch_size * config.train.grad_accum_steps == 4


def test_activations_go_to_the_host_only_where_they_would_move():
    """``offload.activations.tier = host`` moves checkpointed inputs off a CUDA device; on a CPU device, or
    without checkpointing, it is the device layout again, so the search leaves it out (a pinned one stays)."""
    found = {(c.config.offload.activations.tier, c.config.train.activation_checkpointing)
             for c in candidates(Config.load({}), set(), 4, 1, DEVICE)}
    on_gpu = DEVICE == "cuda"
    assert found == ({("device", False), ("device", True), ("host", True)} if on_gpu else
                     {("device", False), ("device", True)})
    pinned = Config.load({"offload": {"activations": {"tier": "host"}}, "train": {"activation_checkpointing": True}})
    kept = candidates(pinned, pinned_keys(pinned), 4, 1, DEVICE)
    assert {c.config.offload.activations.tier for c in kept} == {"host"}


def test_a_precision_whose_matmuls_crawl_gets_a_note_naming_fp32(cache):
    """torch's bf16 matmuls on a CPU without bf16 units fall back to a generic loop (an AVX2 AMD EPYC:
    1.36 GFLOP/s against fp32's 178): a bf16 plan measures fp32's rate too, and says so where it is at
    least twice as fast, naming the setting; not where bf16 is the faster (a Xeon with AMX), nor for fp32."""
    config = _config(cache, ["train.precision=bf16"])
    probe_machine(config)
    data = json.loads(cache_path().read_text())
    del data["machine"]["matmul_flops"]["fp32"]  # as a cache from before the comparison has it
    cache_path().write_text(json.dumps(data))
    probe = probe_machine(config)
    assert {"bf16", "fp32"} <= set(probe.matmul_flops)
    crawling = dataclasses.replace(probe, matmul_flops={"bf16": 1.36e9, "fp32": 1.78e11})
    assert crawling.precision_hint("bf16") == ("train.precision = bf16: its matmuls run at 1.36 GFLOP/s on this "
                                               "machine and fp32's at 178 (131x): train.precision=fp32 computes "
                                               "faster here")
    assert crawling.precision_hint("fp32") is None
    assert dataclasses.replace(probe, matmul_flops={"bf16": 8.1e11, "fp32": 1.4e11}).precision_hint("bf16") is None


@SLOW
def test_a_machine_with_no_room_gets_an_error_naming_the_budgets(cache):
    result = plan("nano", _config(cache, ["memory.device_budget=1MB", "memory.host_budget=1MB",
                                          "offload.optimizer.tier=device"]), batch_size=MICRO)
    with pytest.raises(zo.ConfigError, match="no layout of nano fits"):
        result.best


def test_a_model_too_large_is_refused_once_naming_the_nearest_layout(cache):
    """A 1T-parameter GPT: one reason, the layout needing the least memory, its parentheses balanced;
    the model is named by its size, not by a preset it is not."""
    result = plan("nano", _config(cache), params=1e12, layers=100, batch_size=1)
    with pytest.raises(zo.ConfigError) as info:
        result.best
    message = str(info.value)
    assert message.startswith("no layout of a GPT of 1e+12 parameters in 100 layers fits this machine (")
    assert "; the one needing the least memory, stage 3, optimizer nvme, params nvme, checkpointing" in message
    assert message.count("the run needs") == 1 and message.count("(") == message.count(")"), message


def _assert_columns_line_up(header: str, rows: list[str]) -> None:
    """Each row's step time sits under the header's "step s", its layout ending before it, however long."""
    column = header.index("  step s")
    assert rows and max(len(row.split("  ")[1]) for row in rows) >= 60  # long layouts are among them
    for row in rows:
        assert row[column - 1] == " " and float(row[column:column + 8]) > 0, (header, row)


def test_compact_moments_only_when_no_lossless_layout_fits_under_the_swap_cap(cache, evaluator):
    """nano on NVMe (pinned): the swap holds ~12 bytes per parameter with fp32 moments, ~8 with bf16.
    A cap of 10 takes bf16, and says why; a cap of 14 keeps fp32; fp32 pinned under a cap of 10 is refused."""
    params = sum(p.numel() for p in GPT(PRESETS["nano"]).parameters())
    nvme = ["zero.stage=3", "offload.optimizer.tier=nvme", "offload.optimizer.fraction=1.0", "offload.param.tier=nvme"]

    def planned(cap_per_param: int, *extra: str) -> PlanResult:
        overrides = [*nvme, f"nvme.max_bytes={cap_per_param * params}", *extra]
        return plan("nano", _config(cache, overrides), pinned={*(o.split("=")[0] for o in overrides)},
                    batch_size=MICRO, probe=evaluator.probe, timed=False)

    compact = planned(10)
    assert compact.best.config.optimizer.moments == "bf16" and "moments bf16" in compact.best.describe()
    overrides, _ = best_layout(compact)  # what train --plan auto applies to the user's config
    assert Config.load(_config(cache), overrides=overrides).optimizer.moments == "bf16"
    assert all("nvme.max_bytes" in c.refusal for c in compact.refused if c.config.optimizer.moments == "fp32")
    table = format_plan(compact, 8).splitlines()
    assert table[1].startswith("no layout of the formats before fits: these keep an fp32 master, bf16 moments")
    _assert_columns_line_up(table[2], table[3:3 + min(8, len(compact.fitting))])
    assert planned(14).best.config.optimizer.moments == "fp32"
    with pytest.raises(zo.ConfigError, match=r"the swap files need [\d,]+ bytes on this machine but nvme.max_bytes"):
        planned(10, 'optimizer.moments="fp32"').best


def test_a_bf16_plan_takes_a_lossless_split_master_before_compact_moments(cache, evaluators):
    """bf16 weights on NVMe beside the state: 14 B per parameter with an fp32 master, 12.125 split, 8.125
    split with bf16 moments, 6.16 with int8 moments. A cap of 13 takes the split master alone; a cap of 10
    needs bf16 moments too, one of 7 int8 moments."""
    probe = evaluators(_config(cache, ['train.precision="bf16"'])).probe
    params = sum(p.numel() for p in GPT(PRESETS["nano"]).parameters())
    pinned = ["zero.stage=3", "offload.optimizer.tier=nvme", "offload.optimizer.fraction=1.0",
              "offload.param.tier=nvme", 'train.precision="bf16"']

    def formats(cap_per_param: int) -> tuple[str, str]:
        overrides = [*pinned, f"nvme.max_bytes={cap_per_param * params}"]
        best = plan("nano", _config(cache, overrides), pinned={o.split("=")[0] for o in overrides},
                    batch_size=MICRO, probe=probe, timed=False).best.config
        return best.optimizer.master, best.optimizer.moments

    assert formats(13) == ("split", "fp32")
    assert formats(10) == ("split", "bf16")
    assert formats(7) == ("split", "int8")
    assert formats(15) == ("fp32", "fp32")


def test_the_engine_refuses_swap_files_past_the_cap_before_allocating(make_engine, cache):
    model = GPT(PRESETS["nano"])
    with pytest.raises(BudgetError, match=r"the swap files need [\d,]+ bytes on this machine but nvme.max_bytes is "
                                          r"1,000,000 \([\d,]+ short\); raise it, or keep more state in RAM "
                                          r"\(offload.\*.tier\), or in fewer bytes \(optimizer.moments = 'bf16'\)"):
        make_engine(model, _config(cache, ["zero.stage=3", "offload.optimizer.tier=nvme", "nvme.max_bytes=1MB"]))


@SLOW
def test_models_by_every_name(cache, tmp_path):
    assert load_model("nano").num_params == PRESETS["nano"].num_params
    shaped = gpt_of_size(50e6, 8, 256)
    assert abs(shaped.num_params - 50e6) / 50e6 < 0.15 and shaped.n_layer == 8
    (tmp_path / "mymodels.py").write_text(
        "import torch\n"
        "def build():\n"
        "    return torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Sequential(\n"
        "        torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)), torch.nn.Linear(32, 64))\n")
    sys.path.insert(0, str(tmp_path))
    try:
        factory = load_model("mymodels:build", seq_len=16)
        result = plan(factory, _config(cache), batch_size=MICRO)
        assert result.best.prediction.step_seconds > 0
    finally:
        sys.path.remove(str(tmp_path))
    with pytest.raises(ValueError, match="preset"):
        load_model("no-such-model")


@pytest.mark.slow  # 13 s of train runs: bench/peaks_check.py judges the same bound; the suite stays under 6 minutes
def test_the_predicted_ram_peak_holds_the_blocks_updates_stream_through_in_backward(cache, tmp_path):
    """Stage 3 on NVMe in bf16 updates units in backward, so up to the block stream's depth of optimizer
    blocks (read ahead, updating, written back) are held beside backward's activations: a prediction
    that counted one block there read 0.71-0.73 of the measured peak RSS here (cli/measured.py's, apart from
    the engine's accounting); held to the ±15% peaks_check judges by."""
    probe_machine(_config(cache, ["train.precision=bf16"]))  # train predicts from the probe's cached bf16 rates
    out = tmp_path / "out"
    done = _cli(["train", "--model", "small", "--steps", "3", "--out", str(out), "zero.stage=3",
                 "offload.param.tier=nvme", "offload.optimizer.tier=nvme", f"nvme.path={cache / 'nvme'}",
                 "train.precision=bf16", "train.activation_checkpointing=false", "train.micro_batch_size=1"],
                cache / "cache", tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    predicted, measured = summary["predicted"]["ram_peak_bytes"], summary["measured"]["peak_bytes"]["device+host"]
    assert 0.85 <= predicted / measured <= 1.15, (predicted, measured)


@SLOW
def test_a_hugging_face_config_is_planned(cache, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config.save_pretrained(tmp_path)
    spec = load_model(str(tmp_path / "config.json"), seq_len=32)
    assert spec.num_params == sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    result = plan(spec, _config(cache), batch_size=MICRO)
    assert isinstance(result, PlanResult) and result.best.prediction.peak_bytes["device"] > 0


def _cli(args, cache_dir, cwd):
    env = {**os.environ, "XDG_CACHE_HOME": str(cache_dir)}
    return subprocess.run([sys.executable, "-m", "zerooffload", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


def timed_collective_case() -> int:
    """Every rank times an all-reduce with ``median_seconds``, each wanting a different time (rank r:
    0.2 (r + 1) s), rank 0 deciding for all; returns how often this rank ran it."""
    import torch.distributed as dist

    from zerooffload import comm
    from zerooffload.planning.probe import median_seconds, rank_zero_decides

    group, runs = comm.init_comm(), []
    tensor = torch.ones(1024)

    def all_reduce() -> None:
        dist.all_reduce(tensor)
        runs.append(1)
    median_seconds(all_reduce, seconds=0.2 * (dist.get_rank() + 1), agreed=rank_zero_decides(group))
    return len(runs)


def test_ranks_timing_a_collective_run_it_equally_often(rank_pools):
    """The collective probe: each rank's own clock would stop it after a different number of runs, and
    the rank that leaves first would leave the others waiting in the collective (a failed probe)."""
    counts = rank_pools(2).run(timed_collective_case)
    assert counts[0] == counts[1] >= 7


def test_a_prediction_reaches_the_other_ranks_as_it_was(evaluator, cache):
    """Rank 0 plans and sends its choice to every rank (``all_gather_object``): the prediction pickles."""
    prediction = evaluator.evaluate(Candidate({}, _config(cache))).prediction
    copy = pickle.loads(pickle.dumps(prediction))
    assert copy == prediction and copy.as_json() == prediction.as_json()


@SLOW
def test_plan_auto_under_torchrun_measures_the_collectives_and_trains(cache, tmp_path):
    """World size 2: rank 0 probes gloo's collectives with ranks of its own, plans, and both ranks train
    its choice; the prediction is checked against the run's own step time."""
    torchrun = shutil.which("torchrun") or pytest.skip("torchrun not on PATH")
    done = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "zerooffload", "train", "--model",
                           "nano", "--steps", "6", "--plan", "auto", "--out", "run", f"nvme.path={cache / 'nvme'}"],
                          capture_output=True, text=True, env={**os.environ, "XDG_CACHE_HOME": str(cache / "cache")},
                          cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    probe = json.loads((cache / "cache" / "zerooffload" / "probe.json").read_text())
    assert probe["machine"]["collective_gbps"]["gloo:2"] > 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["predicted"]["work"]["collectives"] > 0
    assert 0.5 < summary["measured"]["step_seconds"] / summary["predicted"]["step_seconds"] < 2.0


@SLOW
def test_plan_writes_a_config_that_train_runs_and_reports_against(cache, tmp_path):
    """Without --batch, plan plans the batch train trains by default (16 of the nano preset); the
    prediction travels in the file, and train --plan reports that one, not a fresh one."""
    nvme = f"nvme.path={cache / 'nvme'}"
    done = _cli(["plan", "--model", "nano", "--out", "plan.toml", nvme], cache / "cache", tmp_path)
    assert done.returncode == 0, done.stderr
    assert "best:" in done.stdout and "step s" in done.stdout and "batch 16 x 128 tokens" in done.stdout
    written = Config.load(tmp_path / "plan.toml")
    assert written.train.micro_batch_size * written.train.grad_accum_steps == 16
    assert written.optimizer.lr == 3e-3  # train's default for the nano preset
    done = _cli(["train", "--steps", "3", "--plan", "plan.toml", "--out", "run"], cache / "cache", tmp_path)
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stage"] == written.zero.stage
    assert summary["predicted"] == read_prediction(str(tmp_path / "plan.toml")).as_json()
    assert set(summary["predicted"]["peak_bytes"]) == {"device", "host", "nvme"}
    assert set(summary["measured"]["peak_bytes"]) == ({"device", "host", "nvme"} if torch.cuda.is_available() else
                                                      {"device+host", "nvme"})
    assert summary["measured"]["step_seconds"] > 0 and summary["measured"]["peak_bytes"]["nvme"] >= 0
    assert "predicted vs measured" in done.stdout


@SLOW
@pytest.mark.parametrize("stage", [1, 3])
def test_train_plan_auto_holds_the_memory_it_predicts(cache, tmp_path, stage):
    """The nano preset under train's defaults: the plan's peaks against those measured apart from the
    engine (summary.json's ``measured``: the process's RSS, one RAM on a CPU; the swap files' blocks),
    within ±15% or ±32 MiB (bench/peaks_check.py runs small and 50m too)."""
    done = _cli(["train", "--model", "nano", "--steps", "3", "--plan", "auto", "--out", "run", f"zero.stage={stage}",
                 f"nvme.path={cache / 'nvme'}"], cache / "cache", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    for tier, predicted in predicted_peaks(summary["predicted"], summary["measured"]).items():
        measured = summary["measured"]["peak_bytes"][tier]
        assert abs(predicted - measured) <= max(0.15 * measured, 32 << 20), (tier, predicted, measured)


def test_the_cached_probe_alone_never_measures(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert cached_probe(Config.load({"nvme": {"path": str(tmp_path)}})) is None
    assert not (tmp_path / "cache").exists()


@SLOW
def test_plan_usage_errors_are_one_line(tmp_path):
    done = _cli(["plan", "--params", "1B"], tmp_path / "cache", tmp_path)
    assert done.returncode == 2 and "--params needs --layers" in done.stderr
    done = _cli(["plan", "--model", "missing.json"], tmp_path / "cache", tmp_path)
    assert done.returncode != 0 and "Traceback" not in done.stderr and "missing.json" in done.stderr


def test_evaluator_keeps_the_given_config(cache, evaluator):
    config = _config(cache, ["zero.stage=2"])
    candidate = evaluator.evaluate(Candidate({}, config))
    assert candidate.config is config and candidate.refusal is None


@SLOW
def test_a_refused_train_names_the_plans_layout(cache, tmp_path):
    budgets = ["memory.device_budget=16MB", "memory.host_budget=64MB", f"nvme.path={cache / 'nvme'}",
               "train.micro_batch_size=2"]
    done = _cli(["train", "--steps", "1", "--out", "run", *budgets], cache / "cache", tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "zerooffload plan's best here: " in done.stderr and "--plan auto" in done.stderr
    done = _cli(["train", "--steps", "1", "--out", "run", *budgets], tmp_path / "empty", tmp_path)
    assert done.returncode == 2 and "let zerooffload choose: train --plan auto" in done.stderr
    assert not (tmp_path / "empty" / "zerooffload").exists()
