"""`python -m analysis calibrate`: measure the CPU engine's training regime in every setting of the main comparison.

For each model-precision setting of ``conf/sweep/main_comparison.yaml`` it trains DPPO-TopK-KL and the predictive
mask (``predmask_kl_agg``) at one seed with the trainer's defaults (``conf/train.yaml``) plus any Hydra overrides,
then prints, per setting, what the regime targets speak of:

- **outside**: share of response tokens outside the trust region (``D > δ``) over the whole run, token-weighted,
  in the DPPO-TopK-KL run (``actor/mask/outside_frac`` × ``actor/mask/tokens`` summed over steps);
- **clip fraction**: mean over steps of ``actor/pg_clipfrac`` (the share of tokens with ``A ≠ 0`` whose update
  the method drops) in both runs;
- **disagreement**: outside tokens with ``A ≠ 0`` where the predictive and the ratio direction differ, summed over
  the predictive run (``actor/mask/direction_disagree``);
- **gain**: validation accuracy (mean of the two stand-in splits) at the last step minus step 0, per run;
- **identical**: whether the two runs logged the same validation curve and the same training reward at every
  step (the trust region never told the two criteria apart).

The targets the defaults are chosen for (``check_targets``) are printed beside the numbers. Runs live under
``results/calibrate/<run_id>/`` (a finished run is read, not trained again) and are trained by
``analysis.calibrate_runs``; the table is written to ``results/calibrate/calibration.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from analysis.calibrate_runs import METHODS, plan_runs, read_run, train_runs
from analysis.training.stats import mean_on_common_steps
from predmask import metrics as M
from predmask.config import ConfigError, group_options, label, sweep_params
from predmask.console import error
from predmask.io import atomic_write_text
from predmask.rl.task import EVAL_SPLITS

#: the calibration's output root (run directories and the table), under the working directory
DEFAULT_OUT = Path("results") / "calibrate"
#: the sweep whose settings are calibrated
SWEEP = "main_comparison"
#: the regime's target share of response tokens outside the trust region in the bf16 settings (lower, upper);
#: the other targets (more outside under FP8, every run learns, the two runs differ) have no number
BF16_OUTSIDE: tuple[float, float] = (0.0005, 0.02)
#: the least disagreement (outside tokens where the predictive and ratio directions differ) per setting's run
MIN_DISAGREEMENT = 1


@dataclass(frozen=True)
class RunRegime:
    """What one training run's metrics say about its regime (see the module docstring)."""

    steps: int
    tokens: float
    outside_share: float
    clipfrac: float
    disagreement: float | None
    divergence_max: float
    val_start: float
    val_end: float
    seconds: float

    @property
    def gain(self) -> float:
        return self.val_end - self.val_start


@dataclass(frozen=True)
class SettingRegime:
    """One setting's calibration row: the DPPO-TopK-KL run, the predictive run, and whether they are identical."""

    setting: str
    precision: str
    reference: RunRegime
    predictive: RunRegime
    identical: bool


def _validation(records: Sequence[Mapping[str, Any]], val_n: int) -> tuple[list[int], list[float]]:
    """Validation accuracy per validated step: the mean of the two stand-in splits' avg@val_n."""
    series = []
    for split in EVAL_SPLITS:
        name = M.val_acc(split, val_n)
        pts = [(int(r["step"]), float(r["data"][name])) for r in records if r["data"].get(name) is not None]
        series.append((np.array([p[0] for p in pts], dtype=np.int64), np.array([p[1] for p in pts], dtype=float)))
    steps, values = mean_on_common_steps(*series)
    return [int(x) for x in steps], [float(x) for x in values]


def run_regime(records: Sequence[Mapping[str, Any]], val_n: int = 16) -> RunRegime:
    """The regime of one run from its ``metrics.jsonl`` records (step 0 = validation only; validation
    avg@``val_n``). Raises ValueError when the run has no training step or no validation at its start and
    end."""
    train = [r["data"] for r in records if int(r["step"]) > 0]
    vals = list(zip(*_validation(records, val_n), strict=True))
    if not train or len(vals) < 2 or vals[0][0] != 0:
        raise ValueError(f"a run needs training steps and validation at step 0 and at its end; got {len(train)} "
                         f"steps and validation at steps {[s for s, _ in vals]}")

    def num(d: Mapping[str, Any], key: str) -> float:
        v = d.get(key)
        return float(v) if v is not None and math.isfinite(float(v)) else 0.0

    tokens = sum(num(d, M.MASK_TOKENS) for d in train)
    outside = sum(num(d, M.MASK_OUTSIDE_FRAC) * num(d, M.MASK_TOKENS) for d in train)
    has_disagree = any(M.MASK_DIRECTION_DISAGREE in d for d in train)
    return RunRegime(
        steps=len(train),
        tokens=tokens,
        outside_share=outside / tokens if tokens else 0.0,
        clipfrac=sum(num(d, M.CLIPFRAC) for d in train) / len(train),
        disagreement=sum(num(d, M.MASK_DIRECTION_DISAGREE) for d in train) if has_disagree else None,
        divergence_max=max(num(d, M.MASK_DIVERGENCE_MAX) for d in train),
        val_start=vals[0][1],
        val_end=vals[-1][1],
        seconds=sum(num(d, M.TIMING_STEP) for d in train),
    )


def _curve(records: Sequence[Mapping[str, Any]], val_n: int) -> tuple[Any, ...]:
    return (_validation(records, val_n), [(int(r["step"]), r["data"].get(M.SCORE_MEAN)) for r in records])


def setting_regime(setting: str, precision: str, reference: Sequence[Mapping[str, Any]],
                   predictive: Sequence[Mapping[str, Any]], val_n: int = 16) -> SettingRegime:
    """A setting's row from the metrics records of its DPPO-TopK-KL and its predictive run."""
    return SettingRegime(setting, precision, run_regime(reference, val_n), run_regime(predictive, val_n),
                         identical=_curve(reference, val_n) == _curve(predictive, val_n))


def check_targets(rows: Sequence[SettingRegime]) -> list[tuple[str, bool, str]]:
    """Each target of the regime as (target, met, what was measured)."""
    lo, hi = BF16_OUTSIDE
    bf16 = [r for r in rows if r.precision == "bf16"]
    fp8 = [r for r in rows if r.precision.startswith("fp8")]
    out: list[tuple[str, bool, str]] = []
    if bf16:
        shares = [r.reference.outside_share for r in bf16]
        out.append((f"bf16 share outside in [{lo:.2%}, {hi:.0%}]", all(lo <= s <= hi for s in shares),
                    ", ".join(f"{r.setting} {r.reference.outside_share:.3%}" for r in bf16)))
    if bf16 and fp8:
        top = max(r.reference.outside_share for r in bf16)
        out.append(("more outside under FP8 than in any bf16 setting",
                    all(r.reference.outside_share > top for r in fp8),
                    ", ".join(f"{r.setting} {r.reference.outside_share:.3%}" for r in fp8) + f" vs {top:.3%}"))
    least = MIN_DISAGREEMENT
    out.append((f"disagreement >= {least} in every setting",
                all((r.predictive.disagreement or 0) >= least for r in rows),
                ", ".join(f"{r.setting} {r.predictive.disagreement or 0:.0f}" for r in rows)))
    out.append(("every run learns (gain > 0)", all(x.gain > 0 for r in rows for x in (r.reference, r.predictive)),
                ", ".join(f"{r.setting} {r.reference.gain:+.3f}/{r.predictive.gain:+.3f}" for r in rows)))
    out.append(("DPPO-TopK-KL and the predictive mask differ", not any(r.identical for r in rows),
                ", ".join(f"{r.setting} {'identical' if r.identical else 'differ'}" for r in rows)))
    return out


def render_markdown(rows: Sequence[SettingRegime], checks: Sequence[tuple[str, bool, str]], overrides: Sequence[str],
                    steps: int, seed: int) -> str:
    """The calibration table and target checks as Markdown (what the command prints and writes)."""
    ref, pred = (label("method", m) for m in METHODS)
    lines = [
        (f"# Training-regime calibration (CPU stand-in, emulated precision; {steps} steps, seed {seed}, "
         f"overrides: {' '.join(overrides) or 'none'})"),
        "",
        (f"outside = share of response tokens with D > δ over the run ({ref}); clip = mean actor/pg_clipfrac "
         f"({ref} / {pred}); disagree = outside tokens with A ≠ 0 whose predictive and ratio directions differ "
         f"({pred}, summed over the run); gain = validation accuracy, last step minus step 0."),
        "",
        "| setting | precision | outside | largest D | clip | disagree | gain | runs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.setting} | {r.precision} | {r.reference.outside_share:.3%} | {r.reference.divergence_max:.3f} | "
            f"{r.reference.clipfrac:.3%} / {r.predictive.clipfrac:.3%} | {r.predictive.disagreement or 0:.0f} | "
            f"{r.reference.gain:+.3f} / {r.predictive.gain:+.3f} | {'identical' if r.identical else 'differ'} |"
        )
    lines += ["", "| target | met | measured |", "|---|---|---|"]
    lines += [f"| {name} | {'yes' if ok else 'NO'} | {what} |" for name, ok, what in checks]
    return "\n".join(lines) + "\n"


def next_step(checks: Sequence[tuple[str, bool, str]], overrides: Sequence[str]) -> str:
    """What to do with the targets: run the main comparison with these overrides, or try others."""
    import shlex

    ovs = " ".join(shlex.quote(ov) for ov in overrides)
    missed = [name for name, ok, _ in checks if not ok]
    if missed:
        return (f"next: {len(missed)} target(s) missed ({'; '.join(missed)}); try other overrides, e.g. "
                f"python -m analysis calibrate trainer.lr=2e-4 (runs already trained are reused), and once every "
                f"target is met run python -m sweeps {SWEEP} with them")
    if not overrides:
        return f"next: every target met by conf/train.yaml's defaults; python -m sweeps {SWEEP}"
    return (f"next: every target met with {ovs}; python -m sweeps {SWEEP} {ovs} (or make them the defaults "
            f"in conf/train.yaml)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m analysis calibrate",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        epilog=(
            "examples:\n"
            "  python -m analysis calibrate                                   # the defaults of conf/train.yaml\n"
            "  python -m analysis calibrate trainer.lr=2e-4                   # try another learning rate\n"
            "  python -m analysis calibrate --settings qwen3_4b_bf16 trainer.ppo_mini_batch_size=4\n"
            "Numbers are those of the CPU stand-in (tiny models, synthetic task, emulated precision).\n"
            "Exit status: 0 every target met, 3 a target missed, 1 a run failed, 2 bad input."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("overrides", nargs="*", help="Hydra overrides of conf/train.yaml, e.g. trainer.lr=2e-4")
    p.add_argument("--settings", default=None,
                   help=f"comma-separated settings (default: those of conf/sweep/{SWEEP}.yaml)")
    p.add_argument("--seed", type=int, default=0, help="RL seed of every run (default 0)")
    p.add_argument("--out", type=Path, default=None, help=f"output root (default: {DEFAULT_OUT} under the cwd)")
    p.add_argument("--max-parallel", type=int, default=2, help="training runs at once (default 2)")
    return p


def _settings(arg: str | None) -> list[str]:
    known = sweep_params(SWEEP)["+setting"].split(",")
    chosen = [s for s in arg.split(",") if s] if arg else known
    allowed = group_options("setting")
    for s in chosen:
        if s not in allowed:
            raise ConfigError(f"unknown setting {s!r}; valid: {', '.join(allowed)}")
    return chosen


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(list(argv) if argv is not None else None)
    if args.max_parallel < 1:
        error(f"--max-parallel must be >= 1, got {args.max_parallel}")
        return 2
    out = (args.out or Path.cwd() / DEFAULT_OUT).resolve()
    try:
        settings = _settings(args.settings)
        planned = plan_runs(settings, args.seed, args.overrides, out)
        out.mkdir(parents=True, exist_ok=True)
    except (ConfigError, OSError) as err:
        error(str(err))
        return 2
    t0 = time.perf_counter()
    print(f"calibration: {len(planned)} runs ({len(settings)} settings x {', '.join(METHODS)}), seed {args.seed}, "
          f"under {out}", flush=True)
    failed = train_runs(planned, args.max_parallel, out)
    if failed:
        for msg in failed:
            error(msg)
        print(f"{len(failed)} of {len(planned)} runs failed: fix the cause in its log and rerun the same command "
              "(completed runs are reused)", file=sys.stderr)
        return 1
    rows = []
    by_key = {(p.setting, p.method): p for p in planned}
    try:
        for s in settings:
            ref, pred = (read_run(by_key[(s, m)].run_dir) for m in METHODS)
            cfg = by_key[(s, METHODS[0])].config
            rows.append(setting_regime(s, str(cfg["precision"]["name"]), ref, pred, int(cfg["trainer"]["val_n"])))
    except (RuntimeError, ValueError) as err:
        error(str(err))
        return 1
    checks = check_targets(rows)
    steps = int(planned[0].config["trainer"]["steps"])
    text = render_markdown(rows, checks, args.overrides, steps, args.seed)
    atomic_write_text(out / "calibration.md", text)
    atomic_write_text(out / "calibration.json", json.dumps({
        "overrides": list(args.overrides), "seed": args.seed, "steps": steps,
        "rows": [{**asdict(r), "gain": [r.reference.gain, r.predictive.gain]} for r in rows],
        "targets": [{"target": n, "met": ok, "measured": w} for n, ok, w in checks],
    }, indent=2) + "\n")
    print(text, end="")
    print(f"written: {out / 'calibration.md'} and .json ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(next_step(checks, args.overrides), flush=True)
    return 0 if all(ok for _, ok, _ in checks) else 3
