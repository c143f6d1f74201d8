#!/usr/bin/env python3
"""transformers' own ``examples/pytorch/language-modeling/run_clm.py`` with one changed line (issue 45).

The script is run as its users run it, offline: a GPT-2 from ``--model_type gpt2 --config_overrides``, a
byte-level BPE tokenizer trained here with ``tokenizers``, this repository's docs as ``--train_file`` and
``--validation_file``. Four runs of ``--max_steps`` steps, a ``checkpoint-N`` every ``--save`` steps:
  plain    the script as it is;
  ours     a copy whose only change is one import line (``from zerooffload.hf import Trainer,
           TrainingArguments``, added after transformers' import), ``--deepspeed`` naming a stage-3 NVMe
           DeepSpeed JSON;
  ours<-plain   ours resuming the plain run's checkpoint-N;
  plain<-ours   the plain script resuming ours' checkpoint-N (the plain Trainer's layout, docs/hugging-face.md).
Each is judged by its per-step losses against the run it should equal (within 1e-5), recorded as checks.

Needs ``pip install datasets evaluate`` (not in the test extra: no CI test runs this) and the script's source,
which is not in this repository (it is transformers' code, Apache-2.0): ``--run-clm PATH`` or $ZO_RUN_CLM,
default the copy in /work/shared/transformers-examples/. Its SHA-256 goes into the records.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from pairs import record

HERE = Path(__file__).resolve().parent
DEFAULT_SCRIPT = Path(os.environ.get("ZO_RUN_CLM", "/work/shared/transformers-examples/run_clm.py"))
ANCHOR = "from transformers.testing_utils import CaptureLogger\n"
IMPORT = "from zerooffload.hf import Trainer, TrainingArguments\n"
TOLERANCE = 1e-5


def patched(source: str) -> str:
    """run_clm.py with one line added after its ``from transformers import (...)``: ``from zerooffload.hf
    import Trainer, TrainingArguments``, which rebinds both names (the whole change)."""
    if source.count(ANCHOR) != 1 or "    Trainer,\n    TrainingArguments,\n" not in source:
        raise SystemExit("run_clm.py: no 'from transformers import (... Trainer, TrainingArguments ...)' followed by "
                         "the CaptureLogger import; pass the example of a transformers 4.5x/5.x release")
    return source.replace(ANCHOR, IMPORT + ANCHOR)


def tokenizer(work: Path, text: Path) -> Path:
    """A 512-token byte-level BPE tokenizer trained on ``text``, saved as transformers loads it."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train([str(text)], vocab_size=512, min_frequency=2, special_tokens=["<|endoftext|>"], show_progress=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   model_max_length=64)
    fast.save_pretrained(work / "tokenizer")
    return work / "tokenizer"


def data(work: Path) -> tuple[Path, Path]:
    """docs/*.md (in name order) as the training text, README.md as the validation text."""
    train = work / "train.txt"
    train.write_text("\n".join(p.read_text() for p in sorted((HERE.parent / "docs").glob("*.md"))))
    valid = work / "valid.txt"
    valid.write_text((HERE.parent / "README.md").read_text())
    return train, valid


def run(script: Path, work: Path, out: Path, args: argparse.Namespace, *extra: str) -> dict[int, float]:
    """One run of ``script`` into ``out``; its per-step losses from the saved trainer_state.json."""
    train, valid = work / "train.txt", work / "valid.txt"
    line = [sys.executable, str(script), "--model_type", "gpt2", "--config_overrides",
            "n_embd=64,n_layer=2,n_head=2,n_positions=64,vocab_size=512,resid_pdrop=0,embd_pdrop=0,attn_pdrop=0",
            "--tokenizer_name", str(work / "tokenizer"), "--train_file", str(train), "--validation_file", str(valid),
            "--block_size", "64", "--do_train", "--per_device_train_batch_size", "4", "--max_steps",
            str(args.steps), "--save_steps", str(args.save), "--logging_steps", "1", "--learning_rate", "1e-3",
            "--weight_decay", "0.1", "--warmup_steps", "5", "--use_cpu", "--report_to", "none", "--seed", "0",
            "--dataloader_num_workers", "0", "--output_dir", str(out), *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(work / "hf-home"), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    done = subprocess.run(line, cwd=work, env=env, capture_output=True, text=True, timeout=1800)
    (work / f"{out.name}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"{script.name} -> {out.name} failed:\n{(done.stdout + done.stderr)[-4000:]}")
    state = json.loads((out / "trainer_state.json").read_text())
    return {e["step"]: e["loss"] for e in state["log_history"] if "loss" in e}


def resumed_from(source: Path, out: Path, step: int) -> Path:
    """``out`` holding a copy of ``source``'s checkpoint-``step`` (what a resume continues)."""
    out.mkdir()
    shutil.copytree(source / f"checkpoint-{step}", out / f"checkpoint-{step}")
    return out / f"checkpoint-{step}"


def judge(title: str, ours: dict[int, float], reference: dict[int, float], steps: range, detail: str) -> bool:
    if sorted(ours) != list(steps) or not set(steps) <= set(reference):
        raise SystemExit(f"{title}: logged steps {sorted(ours)}, expected {list(steps)}")
    worst = max(abs(ours[s] - reference[s]) for s in steps)
    met = worst <= TOLERANCE
    print(f"{title}: max |loss difference| {worst:.3g} over steps {steps.start}-{steps.stop - 1} "
          f"({'met' if met else 'NOT met'}: <= {TOLERANCE:g})")
    record("check", title=title, value=worst, target=f"<= {TOLERANCE:g}", met=met, detail=detail)
    return met


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-clm", type=Path, default=DEFAULT_SCRIPT, help="transformers' run_clm.py (its source)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save", type=int, default=20, help="save every N steps; the resumes start at checkpoint-N")
    p.add_argument("--work", type=Path, help="keep the runs here (default: a temporary directory, removed)")
    args = p.parse_args()
    if not args.run_clm.is_file():
        raise SystemExit(f"{args.run_clm}: no run_clm.py there; pass --run-clm with transformers' "
                         "examples/pytorch/language-modeling/run_clm.py")
    import transformers

    work = Path(tempfile.mkdtemp(prefix="run_clm_check-")) if args.work is None else args.work
    work.mkdir(parents=True, exist_ok=True)
    try:
        source = args.run_clm.read_text()
        digest = hashlib.sha256(source.encode()).hexdigest()[:16]
        plain_script, ours_script = work / "run_clm.py", work / "run_clm_zerooffload.py"
        plain_script.write_text(source)
        ours_script.write_text(patched(source))
        data(work)
        tokenizer(work, work / "train.txt")
        (work / "swap").mkdir(exist_ok=True)
        ds = work / "ds_config.json"
        sys.path.insert(0, str(HERE.parent / "tests"))
        from hf_trainer_job import deepspeed_json
        ds.write_text(json.dumps(deepspeed_json(3, str(work / "swap"))))
        deepspeed = ("--deepspeed", str(ds))
        detail = (f"run_clm.py sha256 {digest}…, transformers {transformers.__version__}, GPT-2 64x2 on docs/, "
                  f"{args.steps} steps, batch 4x64 tokens, ours: stage 3, parameters and optimizer on NVMe")
        plain = run(plain_script, work, work / "plain", args)
        ours = run(ours_script, work, work / "ours", args, *deepspeed)
        every = range(1, args.steps + 1)
        after = range(args.save + 1, args.steps + 1)
        ok = judge("run_clm.py, import line changed + --deepspeed (stage 3 NVMe), losses against the plain script",
                   ours, plain, every, detail)
        start = resumed_from(work / "plain", work / "ours-from-plain", args.save)
        continued = run(ours_script, work, work / "ours-from-plain", args, *deepspeed, "--resume_from_checkpoint",
                        str(start))
        ok &= judge(f"run_clm.py: ours resuming the plain script's checkpoint-{args.save}, losses after it",
                    {s: v for s, v in continued.items() if s > args.save}, plain, after, detail)
        start = resumed_from(work / "ours", work / "plain-from-ours", args.save)
        continued = run(plain_script, work, work / "plain-from-ours", args, "--resume_from_checkpoint", str(start))
        ok &= judge(f"run_clm.py: the plain script resuming ours' checkpoint-{args.save}, losses after it",
                    {s: v for s, v in continued.items() if s > args.save}, ours, after, detail)
        print("all met" if ok else "NOT all met")
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
