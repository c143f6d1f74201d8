#!/usr/bin/env python3
"""A 1.1B-parameter Llama (TinyLlama's shape, fp32) fine-tuned through the Hugging Face Trainer: the plain
``transformers.Trainer`` against ``zerooffload.hf.Trainer`` (ZeRO-3, parameters and optimizer on NVMe), each
in a child process, one batch of 1 x 2048 tokens per step, both recomputing activations in backward
(the plain side's ``activation_checkpointing``, our config's ``train.activation_checkpointing``).

The plain Trainer holds the model, its gradients and AdamW's two moments in RAM (16 B per parameter,
~17.6 GB) beside the activations: on a 24 GiB machine it is stopped by this script when the machine's
available memory falls under ``--floor`` (before the kernel's OOM killer picks a victim), and its peak
is then a lower bound. Ours builds the model on the meta device (``zo.init_context``), so it is never
whole in RAM. Each child's RSS is sampled every 0.2 s from outside; "above start" subtracts the RSS the
child had once its imports were done (its first line of output). Seconds per step: the Trainer's own
step times (a callback), the mean past the first step. The plain side runs ``--plain-steps`` (3): its
peak comes with AdamW's moments, at the first step, and a step here takes minutes.

    python bench/hf_trainer_1b.py [--steps 10] [--dir /tmp] [--sides ours,plain]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from pairs import record

LLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                tie_word_embeddings=False)
"""TinyLlama-1.1B's shape."""
OURS = {"train": {"activation_checkpointing": True}, "zero": {"stage": 3},
        "offload": {"param": {"tier": "nvme"}, "optimizer": {"tier": "nvme"}},
        "memory": {"host_budget": "4GiB", "device_budget": "3GiB"}, "aio": {"blocks_in_flight": 2}}
"""Our side's config (the batch, clipping and optimizer come from the TrainingArguments): ZeRO-3 with
parameters and optimizer on NVMe, engine memory within 4 GiB of host buffers and 3 GiB of "device"
(RAM here), activation checkpointing as the plain side's ``activation_checkpointing``."""
MARK = "zo-bench: "
"""The child's own lines (the Trainer prints its logs to the same stdout)."""


def child(side: str, steps: int, seq: int, work: Path, layers: int) -> None:
    """One side's run: print the RSS after imports, then train and print the step times as JSON."""
    import torch
    import transformers
    from transformers import LlamaConfig, AutoModelForCausalLM, TrainerCallback, TrainingArguments
    import zerooffload as zo
    from zerooffload.hf import Trainer
    print(MARK + json.dumps({"start_rss": psutil.Process().memory_info().rss}), flush=True)

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times, self.losses = [time.perf_counter()], []

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter())
            print(MARK + json.dumps({"step": state.global_step, "seconds": self.times[-1] - self.times[-2]}), flush=True)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(logs["loss"])

    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            self.ids = torch.randint(0, LLAMA_1B["vocab_size"], (steps, seq), generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    config = LlamaConfig(**{**LLAMA_1B, "num_hidden_layers": layers})
    args = TrainingArguments(output_dir=str(work / f"out-{side}"), max_steps=steps, per_device_train_batch_size=1,
                             learning_rate=1e-5, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=0, activation_checkpointing=side == "plain")
    times = StepTimes()
    if side == "plain":
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[times])
    else:
        with zo.init_context():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[times],
                          zerooffload={**OURS, "nvme": {"path": str(work / "nvme")}})
    trainer.train()
    print(MARK + json.dumps({"losses": times.losses, "params": sum(p.numel() for p in model.parameters())}), flush=True)


def run_side(side: str, steps: int, seq: int, work: Path, layers: int, floor: float) -> dict:
    """Run one side in a child, sampling its RSS (and stopping it when available memory drops under ``floor``)."""
    proc = subprocess.Popen([sys.executable, __file__, "--child", side, "--steps", str(steps), "--seq", str(seq),
                             "--dir", str(work), "--layers", str(layers)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"})
    peak, stopped, lines = [0], [None], []
    process = psutil.Process(proc.pid)

    def sample() -> None:
        while proc.poll() is None:
            try:
                peak[0] = max(peak[0], process.memory_info().rss)
            except psutil.Error:
                return
            if psutil.virtual_memory().available < floor and stopped[0] is None:
                stopped[0] = f"stopped by the bench: the machine's available memory fell under {floor / 2**30:.1f} GiB"
                proc.kill()
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    for line in proc.stdout:
        if line.startswith(MARK):
            lines.append(json.loads(line[len(MARK):]))
        print(f"  {side}: {line.rstrip()}", flush=True)
    proc.wait()
    sampler.join()
    start = next(d["start_rss"] for d in lines if "start_rss" in d)
    seconds = [d["seconds"] for d in lines if "seconds" in d]
    end = next((d for d in lines if "losses" in d), {})
    return {"side": side, "returncode": proc.returncode, "stopped": stopped[0], "steps_done": len(seconds),
            "peak_rss_above_start": peak[0] - start, "peak_rss": peak[0], "step_seconds": seconds,
            "mean_step_seconds": sum(seconds[1:]) / len(seconds[1:]) if len(seconds) > 1 else None,
            "losses": end.get("losses"), "params": end.get("params"), "wall": time.perf_counter() - started}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--plain-steps", type=int, default=3, help="the plain side's steps (its peak comes by step 2)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--layers", type=int, default=LLAMA_1B["num_hidden_layers"])
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--sides", default="ours,plain")
    p.add_argument("--floor", type=float, default=1.5 * 2**30, help="bytes of available memory that stop a side")
    p.add_argument("--child")
    a = p.parse_args()
    if a.child:
        return child(a.child, a.steps, a.seq, Path(a.dir), a.layers)
    work = Path(tempfile.mkdtemp(prefix="zo-hf1b-", dir=a.dir))
    (work / "nvme").mkdir()
    try:
        results = [run_side(side, a.plain_steps if side == "plain" else a.steps, a.seq, work, a.layers, a.floor)
                   for side in a.sides.split(",")]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for r in results:
        state = r["stopped"] or ("finished" if r["returncode"] == 0 else f"failed ({r['returncode']})")
        mean = f"{r['mean_step_seconds']:.1f} s/step" if r["mean_step_seconds"] else "no step past the first"
        print(f"{r['side']:>5}: {state}, {r['steps_done']} steps, {mean}, peak RSS above start "
              f"{r['peak_rss_above_start'] / 1e9:.2f} GB (peak {r['peak_rss'] / 1e9:.2f} GB), losses {r['losses']}")
    by_side = {r["side"]: r for r in results}
    if {"ours", "plain"} <= set(by_side):
        ratio = by_side["ours"]["peak_rss_above_start"] / by_side["plain"]["peak_rss_above_start"]
        bound = "at most" if by_side["plain"]["stopped"] else "exactly"
        print(f"ours / plain peak RSS above start: {bound} {ratio:.3f} (target <= 0.5)")
    record_results(results)


def record_results(results: list[dict]) -> None:
    """RESULTS.md's rows: each side's seconds a step and peak RSS above its start, and ours against the plain
    Trainer's (the raw results, every step's seconds and loss, in a record of their own)."""
    by_side = {r["side"]: r for r in results}
    params = next((r["params"] for r in results if r["params"]), None)
    model = f"{params / 1e9:.2g}B Llama" if params else "Llama"
    for r in results:
        state = r["stopped"] or ("finished" if r["returncode"] == 0 else f"failed ({r['returncode']})")
        detail = f"{r['steps_done']} steps, {state}; peak RSS {r['peak_rss'] / 1e9:.2f} GB"
        if r["mean_step_seconds"]:
            record("check", title=f"{model}, {r['side']} Trainer: s/step (mean past the first)",
                   value=r["mean_step_seconds"], target="—", met=None, detail=detail)
        record("check", title=f"{model}, {r['side']} Trainer: peak RSS above start (GB)",
               value=r["peak_rss_above_start"] / 1e9, target="—", met=None, detail=detail)
    if {"ours", "plain"} <= set(by_side):
        ours, plain = by_side["ours"], by_side["plain"]
        ratio = ours["peak_rss_above_start"] / plain["peak_rss_above_start"]
        record("check", title=f"{model}: peak RSS above start, ours / plain Trainer", value=ratio, target="≤ 0.5",
               met=ratio <= 0.5, detail="at most: the plain side was stopped" if plain["stopped"] else "")
        if ours["mean_step_seconds"] and plain["mean_step_seconds"]:
            record("check", title=f"{model}: s/step, ours / plain Trainer", target="—", met=None,
                   value=ours["mean_step_seconds"] / plain["mean_step_seconds"], detail="")
    record("raw", results=results)


if __name__ == "__main__":
    main()
