"""Loss curves judged by their tails: each run's mean loss over its last steps against a reference run's,
within a relative bound (a quantity that noise per step does not swing, unlike one step's loss). The
first curve is the reference; every curve is recorded (``curve``) so ``results.py --report`` redraws its
plot from the records."""
from __future__ import annotations

import statistics

from pairs import record


def judge_tails(curves: dict[str, list[float]], title: str, bound: float, tail: int = 50) -> int:
    """Print and record each curve's last-``tail``-step mean over the first curve's; the number outside
    ``1 ± bound``."""
    names = list(curves)
    reference = statistics.fmean(curves[names[0]][-tail:])
    print(f"\n| run | last-{tail}-step mean loss | / {names[0]} | within {bound:.0%} |\n|---|---|---|---|")
    print(f"| {names[0]} | {reference:.4f} | the reference | - |")
    record("check", title=f"{title}, {names[0]}: the reference", value=reference, target="—", met=None,
           reference=True, detail="the other runs' means are divided by this")
    failed = 0
    for name in names[1:]:
        mean = statistics.fmean(curves[name][-tail:])
        ok = abs(mean / reference - 1) <= bound
        failed += not ok
        print(f"| {name} | {mean:.4f} | {mean / reference:.4f} | {'yes' if ok else 'NO'} |")
        record("check", title=f"{title}, {name} / {names[0]}", value=mean / reference,
               target=f"{1 - bound:.2f}–{1 + bound:.2f}", met=ok, detail=f"{mean:.4f}")
    for name, values in curves.items():
        record("curve", title=name, values=values)
    return failed
