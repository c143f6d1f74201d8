"""The preemption pattern README documents, with real signals: a user SIGTERM handler sets a flag, the
loop keeps training until its step ends, saves a checkpoint and exits; the resumed run is bitwise the
uninterrupted one (stage 3, parameters and optimizer on NVMe, a model with buffers of every kind)."""
from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from harness import fresh_process_context

STEPS = 6
SIGNALLED_AT = 2
"""The step after which the script waits for SIGTERM; it trains one more step before it saves."""

SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {tests!r})
    import torch, torch.distributed as dist
    import zerooffload as zo
    from reference import make_batches, make_buffered_model

    stop = False
    def on_sigterm(signum, frame):  # the user's handler: only a flag (installed before the engine)
        global stop
        stop = True
    signal.signal(signal.SIGTERM, on_sigterm)

    mode, out, steps, signalled_at = {mode!r}, {out!r}, {steps}, {signalled_at}
    config = {{"zero": {{"stage": 3, "persist_threshold": 0}}, "train": {{"grad_clip": 0.05}},
              "optimizer": {{"lr": 1e-2}}, "nvme": {{"path": out}},
              "offload": {{"param": {{"tier": "nvme"}}, "optimizer": {{"tier": "nvme"}}}}}}
    with zo.initialize(make_buffered_model(), config) as engine:  # closed on exit, sys.exit included
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        checkpoints = os.path.join(out, "checkpoints")
        first = engine.load_checkpoint(checkpoints)["next_step"] if mode == "resume" else 0
        batches = make_batches(steps, 1, 4, seed=9)
        for step in range(first, steps):
            (idx, targets), = batches[step]
            rows = slice(rank * 4 // world, (rank + 1) * 4 // world)
            engine.backward(engine(idx[rows], targets[rows]))
            engine.step()
            if mode == "signalled" and step == signalled_at:
                open(os.path.join(out, f"ready.{{rank}}"), "w").write(str(os.getpid()))
                while not stop:
                    time.sleep(0.01)
                continue  # the signal has arrived: the engine trains on, on its swap files
            flag = torch.tensor([float(stop)])
            if world > 1:
                dist.all_reduce(flag)  # every rank stops after the same step, or the save would deadlock
            if flag.item():
                engine.save_checkpoint(checkpoints, client_state={{"next_step": step + 1}})
                sys.exit(143)
        state = engine.full_state_dict()
        if rank == 0:
            torch.save(state, os.path.join(out, "final.pt"))
""")


def _run_script(program: str, output: str) -> None:
    """In a fresh process: run ``program`` as ``python program`` runs it, stdout and stderr to ``output``."""
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 sets it for the torchrun ranks
    sys.argv = [program]
    runpy.run_path(program, run_name="__main__")  # sys.exit(143) is the process's status


class _Run:
    """The script running: at world size 1 a fresh process forked from the rank pools' forkserver (torch and
    the engine already imported: harness's [Note: rank pool]), in which it runs as a user's ``python
    script.py``; at world size 2 under torchrun."""

    def __init__(self, program: Path, world: int):
        self.output = program.with_suffix(".out")
        if world == 1:
            self.popen = None
            self.process = fresh_process_context().Process(target=_run_script, args=(str(program), str(self.output)))
            self.process.start()
        else:
            launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
            self.popen = subprocess.Popen([*launcher, str(program)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def poll(self) -> int | None:
        if self.popen is not None:
            return self.popen.poll()
        return None if self.process.is_alive() else self.process.exitcode

    def finish(self, timeout: float = 180) -> tuple[int, str]:
        if self.popen is not None:
            output, _ = self.popen.communicate(timeout=timeout)
            return self.popen.returncode, output
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        return self.process.exitcode, self.output.read_text() if self.output.exists() else ""


def _start(tmp_path, mode: str, world: int) -> _Run:
    out = tmp_path / mode if mode != "resume" else tmp_path / "signalled"
    out.mkdir(exist_ok=True)
    script = SCRIPT.format(tests=os.path.dirname(__file__), mode=mode, out=str(out), steps=STEPS,
                           signalled_at=SIGNALLED_AT)
    program = tmp_path / f"{mode}.py"
    program.write_text(script)
    return _Run(program, world)


def _finish(process: _Run, timeout: float = 180) -> tuple[int, str]:
    return process.finish(timeout)


def _signal_when_ready(tmp_path, process: _Run, world: int) -> None:
    """SIGTERM to every rank (as a scheduler signals every process of a job) once each waits for it."""
    ready = [tmp_path / "signalled" / f"ready.{rank}" for rank in range(world)]
    deadline = time.monotonic() + 120
    while not all(p.exists() and p.read_text() for p in ready):
        assert process.poll() is None, _finish(process)[1][-4000:]
        assert time.monotonic() < deadline, "the run never reached the signalled step"
        time.sleep(0.05)
    for path in ready:
        os.kill(int(path.read_text()), signal.SIGTERM)


def _preempt_and_resume(tmp_path, world: int) -> None:
    straight = _start(tmp_path, "straight", world)
    code, output = _finish(straight)
    assert code == 0, output[-4000:]
    signalled = _start(tmp_path, "signalled", world)
    _signal_when_ready(tmp_path, signalled, world)
    code, output = _finish(signalled)
    if world == 1:
        assert code == 143 and "Traceback" not in output, output[-4000:]
    else:  # torchrun reports a worker's exit status 143 as its own failure, with its own traceback (and
        # may SIGTERM a rank that is already exiting, once the first one has: the save was done by then)
        assert code == 1 and "exitcode  : 143" in output, output[-4000:]
    assert "IndexError" not in output and "KeyError" not in output, output[-4000:]
    swap = tmp_path / "signalled" / "zerooffload-swap"
    assert not list(swap.glob("*.swap")), "swap files outlived the process"
    code, output = _finish(_start(tmp_path, "resume", world))
    assert code == 0, output[-4000:]
    resumed = torch.load(tmp_path / "signalled" / "final.pt")
    reference = torch.load(tmp_path / "straight" / "final.pt")
    assert list(resumed) == list(reference) and "calls" in resumed
    for name, value in reference.items():
        assert resumed[name].dtype == value.dtype and torch.equal(resumed[name], value), name


def test_the_sigterm_pattern_saves_and_resumes_bitwise(tmp_path):
    _preempt_and_resume(tmp_path, 1)


@pytest.mark.slow
def test_the_sigterm_pattern_under_torchrun_saves_and_resumes_bitwise(tmp_path):
    _preempt_and_resume(tmp_path, 2)
