#!/usr/bin/env python3
"""The 7b on one GPU under a 24 GiB budget, against no offload and against FSDP2's CPU offload (issue 43).

Four runs of the same model, batch and steps (bf16, ``--batch`` x ``--seq`` tokens a step, no accumulation,
every block checkpointed, ``--warmup`` steps then ``--steps`` timed), each in a process of its own with a
timeout (a run that fails or overruns is reported, the others still run):
- ``ceiling``: no offload, no budget: plain PyTorch, fp32 weights (the master) and AdamW's moments on the
  GPU (``fused=True``), bf16 autocast. Our engine cannot be this run: its own check counts ~147 GB for the
  7b with every state on the device at 32 x 1024 tokens (the step's fp32 gradients included), past 141;
- ``ours``: ``memory.device_budget = --budget`` (the allocator capped there: device_memory's note) and the
  layout ``plan`` chooses (``train --plan auto``), ``train.grad_clip = 0`` (units update inside backward);
- ``fsdp2``: ``fully_shard`` per block and on the root with ``CPUOffloadPolicy(pin_memory=True)`` and
  ``MixedPrecisionPolicy(param_dtype=bfloat16)``, ``torch.optim.AdamW(fused=True)``, the allocator capped
  at the same budget; its checkpointed inputs wait on the host (``save_on_cpu``) only if a step on the GPU
  ran out of memory (it says which);
- ``ours_clip``: ``ours`` under the default clip (1.0), with the steps whose clip redid the updates.
Per run: s/step (median of the timed steps; every step's time kept), tokens/s, TFLOP/s (6 N tokens a step,
recompute not counted) and MFU against ``plan``'s probe of the GPU's bf16 GEMM and against the spec (989
TFLOP/s for an H200 SXM, 835 for the NVL: from the GPU's name); from a profiled step after the timed ones
(torch.profiler; "n/a" on a CPU): the GPU's idle share (no kernel running) and the bytes each way over PCIe;
from the engine (ours): the link's bytes each way, the CPU update's seconds and the share of them that hid
under backward (its step trace: the update worker's spans less the time backward waited on them); peaks:
device memory reserved, host RSS above the start; ``plan``'s prediction beside ours (and its prediction, or
refusal, of our engine with every state on the device); the losses, and how close ours stay to the
ceiling's (one computation: bf16 weights rounded from an fp32 master, the same batches and initial weights).

Records (``pairs.record``, for ``results.py``): one check per run, the acceptance ratios, and a raw record
with the GPU, the CPU, each run's command and raw per-step times. On a GPU (the project's H200, no network):
    python bench/results.py --only gpu_workstation
On a CPU, its logic end to end in about a minute (gloo, the nano preset):
    python bench/gpu_workstation.py --preset nano --batch 2 --seq 64
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pairs import record

HERE = Path(__file__).resolve().parent
RUNS = ("ours", "ceiling", "fsdp2", "ours_clip")
"""Run order: ours first, so its plan measures the probe the clip run then reads from the cache."""
TIMEOUTS = {"ours": 100, "ceiling": 75, "fsdp2": 120, "ours_clip": 95}
"""Seconds per run: 390 in all, under the 7 minutes the GPU session has for the script."""
SPEC_BF16 = (("H200 NVL", 835e12), ("H200", 989e12))
"""Dense bf16 TFLOP/s by the GPU's name (the first that matches): the NVL part's, else the SXM part's."""
OPTIMIZER = {"type": "adamw", "lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="7b")
    parser.add_argument("--batch", type=int, default=32, help="sequences a step (one micro-batch)")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--budget", default="24GiB", help="memory.device_budget of ours (FSDP2's cap too)")
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--timeout-scale", type=float, default=1.0, help="multiplies every run's timeout")
    parser.add_argument("--worker", choices=RUNS, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.runs = [run for run in RUNS if run in args.runs.split(",")]
    return args


# ------------------------------------------------------------------------------------------------ one run


def worker(args: argparse.Namespace) -> None:
    """One run in this process: its step built, timed, profiled; its result written as JSON."""
    import torch

    from zerooffload.tiers.device_memory import context_bytes, note_context

    cuda = torch.cuda.is_available()
    if cuda:
        note_context(0)  # before anything makes the context: device_memory's note
    from zerooffload.cli.measured import RunMemory

    device = torch.device("cuda" if cuda else "cpu")
    memory = RunMemory()
    build = {"ours": _ours, "ours_clip": _ours, "ceiling": _ceiling, "fsdp2": _fsdp2}[args.worker]
    step, info, after_step = build(args, device)
    timed = _timed(args, device, step, after_step, info)  # takes the engine out of info, and closes it
    result = {"run": args.worker, **info, **timed}
    result["peaks"] = {"device_reserved": torch.cuda.max_memory_reserved() if cuda else None,
                       "host_rss": memory.peak_ram()}
    result["cuda_context"] = context_bytes(device) if cuda else None
    Path(args.result).write_text(json.dumps(result))


def _model(args: argparse.Namespace, device):
    """The preset at ``--seq`` tokens built eagerly on the CPU, its weights then drawn again as ours' lazy
    build draws them (lazy_init's ``initial_values``: seed 0, ``init_fn`` module by module, a weight shared
    with an earlier module kept as that one drew it), then moved to ``device``: every run starts alike."""
    import dataclasses

    import torch

    from zerooffload.models import GPT, PRESETS

    model = GPT(dataclasses.replace(PRESETS[args.preset], block_size=args.seq))
    init, done = model.init_fn(), set()
    torch.manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            own = [p for p in module._parameters.values() if p is not None]
            kept = {id(p): p.clone() for p in own if id(p) in done}
            init(module)
            for p in own:
                if id(p) in kept:
                    p.copy_(kept[id(p)])
            done.update(id(p) for p in own)
    return model.to(device)


def _config(args: argparse.Namespace) -> dict:
    clip = 1.0 if args.worker == "ours_clip" else 0.0
    return {"train": {"precision": "bf16", "micro_batch_size": args.batch, "grad_accum_steps": 1,
                      "activation_checkpointing": True, "grad_clip": clip, "seed": 0},
            "optimizer": OPTIMIZER, "memory": {"device_budget": args.budget}, "nvme": {"path": args.scratch}}


def _ours(args: argparse.Namespace, device):
    """The engine with ``plan``'s layout under the budget (``train --plan auto``'s way: cli.train_plan)."""
    import dataclasses

    import torch

    import zerooffload as zo
    from zerooffload.cli.train_plan import best_layout
    from zerooffload.config import Config
    from zerooffload.models import GPT, PRESETS
    from zerooffload.planning import plan
    from zerooffload.planning.model_spec import named_gpt

    shape = dataclasses.replace(PRESETS[args.preset], block_size=args.seq)
    config = Config.load(_config(args))
    result = plan(named_gpt(args.preset, shape), config, batch_size=args.batch,
                  progress=lambda text: print(f"plan: {text}", file=sys.stderr, flush=True))
    overrides, prediction = best_layout(result)
    everything_on_device = result.predict(Config.load(config, overrides=[
        "zero.stage=1", "offload.optimizer.tier=device", 'memory.device_budget="auto"']))
    config = Config.load(config, overrides=overrides)
    torch.manual_seed(0)
    with zo.init_context(config):
        model = GPT(shape)
    meta = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    engine = zo.initialize(model, config, init_fn=model.init_fn(), example_inputs=(meta, meta), prediction=prediction)

    def step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    def after_step() -> dict:
        stats = engine.stats
        return {"h2d_bytes": stats.link.host_to_device_bytes, "d2h_bytes": stats.link.device_to_host_bytes,
                "undone_updates": stats.undone_updates, "phases": dict(stats.phase_seconds)}
    info = {"layout": result.best.describe(), "overrides": overrides, "prediction": prediction.as_json(),
            "probe_bf16_flops": result.probe.matmul_flops.get("bf16"), "engine": engine,
            "everything_on_device": everything_on_device.refusal or everything_on_device.prediction.as_json(),
            "command": f"zerooffload train --model {args.preset} --plan auto " + " ".join(
                f"{k}={json.dumps(v)}" for k, v in _flat(_config(args)).items() if k != "nvme.path")}
    return step, info, after_step


def _ceiling(args: argparse.Namespace, device):
    """Plain PyTorch with every state on the device: fp32 weights, fused AdamW, bf16 autocast (no cast cache:
    it would hold a bf16 copy of every weight through the step), the same blocks checkpointed."""
    import torch

    from zerooffload.activations import checkpoint_forward

    model = _model(args, device)
    for block in model.h:
        checkpoint_forward(block)
    optimizer = torch.optim.AdamW(model.parameters(), **_torch_adamw(), fused=True)

    def step(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False):
            loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()
    return step, {"layout": "plain PyTorch, every state on the device, fp32 weights, bf16 autocast",
                  "command": "python bench/gpu_workstation.py --runs ceiling"}, None


def _fsdp2(args: argparse.Namespace, device):
    """FSDP2 at world size 1 (NCCL on a GPU, gloo on a CPU): CPU offload, bf16 parameters, fused AdamW."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    from zerooffload.activations import checkpoint_forward
    from zerooffload.config import Config
    from zerooffload.tiers.device_memory import cap_allocator

    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                            init_method=f"file://{args.scratch}/fsdp2-store")
    model = _model(args, "cpu")
    for block in model.h:
        checkpoint_forward(block)
    offload = CPUOffloadPolicy(pin_memory=True) if device.type == "cuda" else OffloadPolicy()  # a CPU: in place
    policy = {"mesh": init_device_mesh(device.type, (1,)), "offload_policy": offload,
              "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}
    for block in model.h:
        fully_shard(block, **policy)
    fully_shard(model, **policy)
    optimizer = torch.optim.AdamW(model.parameters(), **_torch_adamw(), fused=True)
    cap_allocator(Config.load(_config(args)).memory.device_budget, device)  # the same cap as ours
    on_host = {"activations": "device"}

    def step(x, y):
        try:
            return _fsdp2_step(model, optimizer, x, y, on_host["activations"] == "host")
        except torch.OutOfMemoryError:
            if on_host["activations"] == "host":
                raise
            on_host["activations"] = "host"  # what a user would try next: the checkpointed inputs to the host
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            return _fsdp2_step(model, optimizer, x, y, True)
    kept = "CPUOffloadPolicy(pin_memory=True)" if device.type == "cuda" else "on the CPU device"
    return step, {"layout": f"FSDP2 per block and root, {kept}, bf16 params, fused AdamW",
                  "activations": on_host, "command": "python bench/gpu_workstation.py --runs fsdp2"}, None


def _fsdp2_step(model, optimizer, x, y, on_host: bool):
    import torch

    with torch.autograd.graph.save_on_cpu(pin_memory=True) if on_host else contextlib.nullcontext():
        loss = model(x, y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _torch_adamw() -> dict:
    return {k: OPTIMIZER[k] for k in ("lr", "betas", "eps", "weight_decay")}


def _flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def _timed(args: argparse.Namespace, device, step, after_step, info: dict) -> dict:
    """``--warmup`` + ``--steps`` steps on the byte corpus (the same batches for every run), each timed to its
    loss on the host; then one step profiled (a GPU) and traced by the engine (ours)."""
    import torch

    from zerooffload.data import ByteCorpus

    corpus = ByteCorpus()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    losses, seconds, per_step = [], [], []
    for index in range(args.warmup + args.steps):
        x, y = corpus.batch(index, batch_size=args.batch, seq_len=args.seq)
        x, y = x.to(device), y.to(device)
        sync()
        started = time.perf_counter()
        losses.append(float(step(x, y)))
        sync()
        seconds.append(time.perf_counter() - started)
        per_step.append(after_step() if after_step else {})
        print(f"{args.worker}: step {index} loss {losses[-1]:.4f} {seconds[-1]:.3f} s", flush=True)
    x, y = corpus.batch(args.warmup + args.steps, batch_size=args.batch, seq_len=args.seq)
    engine = info.pop("engine", None)
    out = {"losses": losses, "warmup_seconds": seconds[:args.warmup], "step_seconds": seconds[args.warmup:],
           "per_step": per_step[args.warmup:],
           **_profiled(step, x.to(device), y.to(device), device, engine, args.scratch, sync)}
    if engine is not None:
        engine.close()
    return out


def _profiled(step, x, y, device, engine, scratch: str, sync) -> dict:
    """One more step under torch.profiler (a GPU: kernels and copies) and the engine's trace (ours)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    trace = Path(scratch, "engine-trace.json")
    if engine is not None:
        engine.trace(trace, steps=1)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        with record_function("gpu_workstation step"):
            step(x, y)
            sync()
    out = _cpu_updates(trace) if engine is not None else {}
    if device.type == "cuda":
        path = Path(scratch, "profile.json")
        prof.export_chrome_trace(str(path))
        out["profile"] = _gpu_activity(json.loads(path.read_text()))
    return out


def _gpu_activity(trace: dict) -> dict:
    """From a profiler trace of one step: its wall time, the share of it no kernel ran, and the bytes and
    busy seconds of the copies each way."""
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    step = next(e for e in events if e.get("name") == "gpu_workstation step" and e.get("ph") == "X")
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel")
    busy, end = 0.0, float("-inf")
    for start, stop in kernels:  # the union of the kernels' intervals (streams overlap)
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    copies = {"h2d": [0, 0.0], "d2h": [0, 0.0]}
    for e in events:
        if e.get("cat") == "gpu_memcpy":
            way = "h2d" if "HtoD" in e["name"] else "d2h" if "DtoH" in e["name"] else None
            if way:
                copies[way][0] += int(e.get("args", {}).get("bytes", 0))
                copies[way][1] += e["dur"] / 1e6
    wall = step["dur"] / 1e6
    return {"wall_seconds": wall, "idle_share": max(0.0, 1 - busy / 1e6 / wall),
            **{f"{way}_bytes": n for way, (n, _) in copies.items()},
            **{f"{way}_busy_seconds": s for way, (_, s) in copies.items()}}


def _cpu_updates(path: Path) -> dict:
    """The engine's trace of one step: the seconds of every unit's update, and of those the ones that ran
    on the update worker while backward went on (its spans less the main thread's waits on it)."""
    if not path.exists():
        return {"update_seconds": None, "update_hidden_seconds": None}
    data = json.loads(path.read_text())
    events = data.get("traceEvents", data) if isinstance(data, dict) else data
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans = [(tracks.get(e.get("tid")), e["name"], e["dur"] / 1e6) for e in events if e.get("ph") == "X"]
    updates = sum(d for _, name, d in spans if name.startswith("update "))
    on_worker = sum(d for track, name, d in spans if track == "updates" and name.startswith("update "))
    waited = sum(d for _, name, d in spans if name == "wait: updates")
    return {"update_seconds": updates, "update_hidden_seconds": max(0.0, on_worker - waited)}


# ------------------------------------------------------------------------------------------------ the table


def run(name: str, args: argparse.Namespace, scratch: str) -> dict:
    """``name`` in a process of its own, killed with its children past its timeout; its result, or why not."""
    result = Path(scratch, f"{name}.json")
    folder = Path(scratch, name)
    folder.mkdir()
    argv = [sys.executable, __file__, "--worker", name, "--result", str(result), "--scratch", str(folder),
            "--preset", args.preset, "--batch", str(args.batch), "--seq", str(args.seq), "--warmup",
            str(args.warmup), "--steps", str(args.steps), "--budget", args.budget]
    timeout = TIMEOUTS[name] * args.timeout_scale
    print(f"== {name} (timeout {timeout:.0f} s)", flush=True)
    started = time.perf_counter()
    child = subprocess.Popen(argv, cwd=HERE, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        code = child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    seconds = time.perf_counter() - started
    if code != 0 or not result.exists():
        why = f"timed out after {timeout:.0f} s" if code is None else f"exit status {code}"
        print(f"== {name} failed: {why}", flush=True)
        return {"run": name, "failed": why, "seconds": seconds}
    return {**json.loads(result.read_text()), "seconds": seconds}


def gpu_name() -> str:
    """nvidia-smi's name of the first GPU, or "none: CPU"."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30, check=True)
        if done.stdout.strip():
            return done.stdout.strip().splitlines()[0]
    return "none: CPU"


def spec_flops(gpu: str) -> float | None:
    return next((flops for name, flops in SPEC_BF16 if name in gpu), None)


def columns(r: dict, args: argparse.Namespace, params: int, probe: float | None, spec: float | None) -> dict:
    """One run's row: its figures, each None where it does not apply (shown "n/a")."""
    per_step = statistics.median(r["step_seconds"])
    tokens = args.batch * args.seq
    flops = 6 * params * tokens / per_step
    steps, profile = r.get("per_step") or [], r.get("profile")
    link = None
    if steps and "h2d_bytes" in steps[0]:  # the engine's own count of each way
        link = tuple(statistics.median(s[k] / t for s, t in zip(steps, r["step_seconds"])) / 1e9
                     for k in ("h2d_bytes", "d2h_bytes"))
    elif profile:
        link = (profile["h2d_bytes"] / profile["wall_seconds"] / 1e9, profile["d2h_bytes"] / profile["wall_seconds"] / 1e9)
    prediction = r.get("prediction") or {}
    hidden, update = r.get("update_hidden_seconds"), r.get("update_seconds")
    return {"s/step": per_step, "tokens/s": tokens / per_step, "TFLOP/s": flops / 1e12,
            "MFU probe": flops / probe if probe else None, "MFU spec": flops / spec if spec else None,
            "GPU idle": profile["idle_share"] if profile else None,
            "PCIe h2d GB/s": link[0] if link else None, "PCIe d2h GB/s": link[1] if link else None,
            "update s": update, "update hidden": hidden / update if update and hidden is not None else None,
            "device reserved GiB": r["peaks"]["device_reserved"] / 2**30 if r["peaks"]["device_reserved"] else None,
            "host RSS GiB": r["peaks"]["host_rss"] / 2**30,
            "plan s/step": prediction.get("step_seconds"),
            "plan device GiB": prediction["peak_bytes"]["device"] / 2**30 if prediction else None,
            "plan host GiB": prediction["peak_bytes"]["host"] / 2**30 if prediction else None,
            "redone steps": sum(s["undone_updates"] > 0 for s in steps) if steps and "undone_updates" in steps[0]
            else None}


def show(value) -> str:
    return "n/a" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


def report(results: dict, args: argparse.Namespace, gpu: str) -> bool:
    """The table, the losses, and the records; whether every run ran."""
    from results_report import cpu_name

    from zerooffload.models import PRESETS

    params = PRESETS[args.preset].num_params
    spec = spec_flops(gpu)
    probe = next((r["probe_bf16_flops"] for r in results.values() if r.get("probe_bf16_flops")), None)
    rows = {name: columns(r, args, params, probe, spec) for name, r in results.items() if "failed" not in r}
    where = f"{args.preset} ({params / 1e9:.2f}B), {args.batch} x {args.seq} tokens, on {gpu}"
    print(f"\n{where}; bf16 GEMM: probe {show(probe and probe / 1e12)} TFLOP/s, spec {show(spec and spec / 1e12)}")
    names = list(next(iter(rows.values()))) if rows else []
    print(f"{'':<22}" + "".join(f"{name:>12}" for name in rows))
    for column in names:
        print(f"{column:<22}" + "".join(f"{show(row[column]):>12}" for row in rows.values()))
    for name, r in results.items():
        print(f"{name}: " + (f"FAILED ({r['failed']})" if "failed" in r else f"{r['layout']}; losses " +
                             " ".join(f"{x:.4f}" for x in r["losses"])))
    closeness = _closeness(results)
    for name, row in rows.items():
        record("check", title=f"{where}: {name}, s/step", value=row["s/step"], target="—", met=None,
               detail="; ".join(f"{k} {show(v)}" for k, v in row.items() if k != "s/step"))
    _acceptance(rows, args, where)
    record("raw", gpu=gpu, cpu=cpu_name(), spec_bf16_flops=spec, probe_bf16_flops=probe, params=params,
           tokens_per_step=args.batch * args.seq, closeness=closeness, results=results)
    return all("failed" not in r for r in results.values())


def _closeness(results: dict) -> dict | None:
    """The largest step-by-step gap between ours' losses and the ceiling's, absolute and relative."""
    ours, ceiling = results.get("ours", {}).get("losses"), results.get("ceiling", {}).get("losses")
    if not ours or not ceiling:
        return None
    gaps = [abs(a - b) for a, b in zip(ours, ceiling)]
    close = {"max_abs": max(gaps), "max_rel": max(g / abs(b) for g, b in zip(gaps, ceiling))}
    print(f"ours vs ceiling losses: largest gap {close['max_abs']:.4g} ({close['max_rel']:.2%})")
    return close


def _acceptance(rows: dict, args: argparse.Namespace, where: str) -> None:
    """The issue's ratios, judged where both runs ran."""
    def check(title: str, a: str, b: str, column: str, target: float, at_most: bool, detail: str = "") -> None:
        if a in rows and b in rows:
            value = rows[a][column] / rows[b][column]
            met = value <= target if at_most else value >= target
            record("check", title=f"{where}: {title}", value=value, target=f"{'≤' if at_most else '≥'} {target}",
                   met=met, detail=detail)
            print(f"{title}: {value:.3f} (target {'≤' if at_most else '≥'} {target}: {'met' if met else 'NOT met'})")

    check("ours / ceiling, s/step, clip 0", "ours", "ceiling", "s/step", 1.25, True)
    redone = rows.get("ours_clip", {}).get("redone steps")
    check("ours clip 1.0 / ceiling, s/step", "ours_clip", "ceiling", "s/step", 1.5, True,
          f"redone_steps {redone} of {args.steps}")
    check("ours / FSDP2, tokens/s", "ours", "fsdp2", "tokens/s", 1.3, False)
    from zerooffload.config import Config

    budget = Config.load({"memory": {"device_budget": args.budget}}).memory.device_budget / 2**30
    if rows.get("ours", {}).get("device reserved GiB") is not None:
        value = rows["ours"]["device reserved GiB"]
        record("check", title=f"{where}: ours, device memory reserved (GiB)", value=value, target=f"≤ {budget:g}",
               met=value <= budget, detail="torch.cuda.max_memory_reserved")


def main() -> int:
    args = parse_args()
    if args.worker:
        worker(args)
        return 0
    gpu = gpu_name()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zo-gpu-workstation-") as scratch:
        results = {name: run(name, args, scratch) for name in args.runs}
    ok = report(results, args, gpu)
    print(f"done in {time.perf_counter() - started:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
