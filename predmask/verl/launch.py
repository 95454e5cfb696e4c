"""``python -m predmask.verl.launch <verl hydra overrides>``: verl's PPO trainer with the plugin in every process.

Runs verl's own Hydra app (``verl.trainer.main_ppo``) in this process, after it prepared the environment as
docs/verl-plugin.md, "What the launcher does", describes.

verl's trackers (``trainer.logger``; verl's default list when the command line has none) write into the run
directory, as the CPU engine's do (:mod:`predmask.rl.trackers`): with ``tensorboard`` every worker gets
``TENSORBOARD_DIR=<run_dir>/tensorboard``, with ``wandb`` ``WANDB_DIR=<run_dir>``, ``WANDB_RUN_ID`` from
``<run_dir>/wandb_id`` (made by the first attempt, under the run lock) and ``WANDB_RESUME=allow``, so every
attempt of a run continues one W&B run. ``TENSORBOARD_DIR`` / ``WANDB_DIR`` set here win, as in verl;
``WANDB_MODE`` and ``WANDB_ENTITY`` set here are forwarded. Any Hydra flag (``--cfg job``, ``--help``) passes
through to verl.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from predmask.console import error
from predmask.rl.trackers import TENSORBOARD_ENV, WANDB_DIR_ENV, tensorboard_dir, wandb_dir, wandb_run_id
from predmask.rundir import (
    STAGE_FILE,
    RunDirBusyError,
    first_line,
    hold_run_lock,
    keep_previous_attempt,
    last_step,
    write_status,
)
from predmask.verl.overrides import HYDRA_SUBDIR, PLUGIN_ENV, PLUGIN_MODULE, RUNTIME_ENV, hydra_value
from predmask.verl.settings import SETTINGS_ENV, PluginSettings, current_settings, parse_value, split_argv
from predmask.verl.stages import STAGE_ENV, hang_line, hung_stage

_KEY = re.compile(r"^(\+\+|\+|~)?([^=]+)=(.*)$", re.DOTALL)
#: how often the launcher copies verl's last step into status.json (seconds)
STATUS_EVERY_S = 5.0
#: how long the launcher waits for verl to stop after a hung stage interrupted it, before it exits hard (seconds)
HANG_EXIT_GRACE_S = 60.0
#: variables of this process's environment handed to every Ray worker (verl reads them in the trainer actor)
FORWARDED_ENV: tuple[str, ...] = ("VERL_FILE_LOGGER_PATH", "VERL_FILE_LOGGER_ROOT", "WANDB_MODE", "WANDB_ENTITY")


def _modules(value: str | None) -> list[str]:
    return [m.strip() for m in (value or "").strip("'\"").split(",") if m.strip()]


def plugin_modules_value(current: str | None) -> str:
    """``VERL_USE_EXTERNAL_MODULES`` with ``predmask.verl.plugin`` included (existing entries kept, order kept)."""
    modules = _modules(current)
    if PLUGIN_MODULE not in modules:
        modules.append(PLUGIN_MODULE)
    return ",".join(modules)


def _override_keys(overrides: Sequence[str]) -> dict[str, str]:
    keys: dict[str, str] = {}
    for item in overrides:
        match = _KEY.match(item)
        if match and not item.startswith("-"):
            keys[match.group(2).strip()] = match.group(3).strip()
    return keys


def launch_argv(overrides: Sequence[str], environ: Mapping[str, str],
                session: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The verl argv (overrides without predmask's keys, plus the plugin's defaults) and the environment updates
    for this process; ``session`` names this launch in the settings (None: left out)."""
    overrides, values = split_argv(overrides)
    settings = PluginSettings.from_mapping({**values, **({"session": session} if session else {})})
    keys = _override_keys(overrides)
    settings_key = f"{RUNTIME_ENV.lstrip('+')}.{SETTINGS_ENV}"
    if settings_key in keys:
        raise ValueError(f"{settings_key} is set by the launcher: give predmask.<key>=<value> overrides instead")
    use_v1 = keys.get("trainer.use_v1")
    if use_v1 is not None and use_v1.strip("'\"").lower() not in ("false", "0"):
        raise ValueError(
            f"trainer.use_v1={use_v1} is not supported: predmask's top-K plumbing runs on verl's DataProto "
            "trainer (trainer.use_v1=false)"
        )
    argv = list(overrides)
    env_key = f"{RUNTIME_ENV.lstrip('+')}.{PLUGIN_ENV}"
    if env_key not in keys:
        modules = plugin_modules_value(environ.get(PLUGIN_ENV))
        argv.append(f"{RUNTIME_ENV}.{PLUGIN_ENV}={hydra_value(modules)}")
    elif PLUGIN_MODULE not in _modules(keys[env_key]):
        raise ValueError(f"{env_key}={keys[env_key]} must include {PLUGIN_MODULE}")
    else:  # the workers' modules (the CPU platform's among them) are this process's too
        modules = ",".join(_modules(keys[env_key]))
    if use_v1 is None:
        argv.append("trainer.use_v1=false")
    for var in FORWARDED_ENV:
        value = environ.get(var)
        if value:
            argv = _with_worker_env(argv, var, value)
    argv.append(f"{RUNTIME_ENV}.{SETTINGS_ENV}={hydra_value(settings.to_json())}")
    return argv, {PLUGIN_ENV: modules, SETTINGS_ENV: settings.to_json()}


def _with_worker_env(argv: Sequence[str], var: str, value: str) -> list[str]:
    """``argv`` with the Ray workers' variable ``var`` set to ``value`` (an override of the same variable replaced)."""
    key = f"{RUNTIME_ENV.lstrip('+')}.{var}"
    return [*(a for a in argv if _override_keys([a]).get(key) is None), f"{RUNTIME_ENV}.{var}={hydra_value(value)}"]


def requested_loggers(argv: Sequence[str]) -> list[str]:
    """The trackers a verl command line asks for: its ``trainer.logger`` (a list or one name), else verl's default."""
    value = _override_keys(argv).get("trainer.logger")
    if value is None:
        import verl
        from omegaconf import OmegaConf

        default = OmegaConf.load(Path(verl.__file__).parent / "trainer" / "config" / "ppo_trainer.yaml")
        return [str(name) for name in default.trainer.logger]
    parsed = parse_value(value)
    return [str(name) for name in parsed] if isinstance(parsed, list) else [str(parsed)]


def tracker_argv(argv: Sequence[str], run_dir: Path, environ: Mapping[str, str],
                 wandb_id: str | None) -> tuple[list[str], dict[str, str]]:
    """``argv`` with the trackers' variables for every Ray worker (the module docstring), and the same variables
    for this process; ``wandb_id`` is the run's W&B id (None: the command line asks for no W&B)."""
    loggers = requested_loggers(argv)
    env: dict[str, str] = {}
    if "tensorboard" in loggers:
        env[TENSORBOARD_ENV] = str(tensorboard_dir(run_dir, environ))
    if "wandb" in loggers:
        if wandb_id is None:
            raise ValueError("trainer.logger asks for wandb: the launcher needs the run's W&B id")
        env.update({WANDB_DIR_ENV: str(wandb_dir(run_dir, environ)), "WANDB_RUN_ID": wandb_id, "WANDB_RESUME": "allow"})
    out = list(argv)
    for var, value in env.items():
        out = _with_worker_env(out, var, value)
    return out, env


def run_dir_of(overrides: Sequence[str]) -> Path | None:
    """The run directory a verl command line writes (its ``hydra.run.dir`` is ``<run_dir>/hydra``), or None."""
    value = _override_keys(overrides).get("hydra.run.dir")
    if not value:
        return None
    path = Path(value.strip("'\""))
    return path.parent if path.name == HYDRA_SUBDIR else None


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: hold the run directory's writer lock, set up the plugin environment, hand the command line to
    verl's Hydra app."""
    overrides = list(sys.argv[1:] if argv is None else argv)
    try:
        verl_argv, env = launch_argv(overrides, os.environ, session=f"{time.time_ns():020d}")
    except ValueError as exc:
        raise SystemExit(f"predmask.verl.launch: {exc}") from None
    run_dir = run_dir_of(verl_argv)
    if run_dir is None:
        _launch(verl_argv, env)
        return
    try:
        with hold_run_lock(run_dir):  # one attempt at a time makes (or reads) the run's W&B id
            wandb_id = wandb_run_id(run_dir) if "wandb" in requested_loggers(verl_argv) else None
            verl_argv, tracker_env = tracker_argv(verl_argv, run_dir, os.environ, wandb_id)
            watch = StageWatch.of(run_dir, current_settings(env).stage_timeout_s)
            if watch is not None:  # the trainer actor marks its stages there (predmask.verl.stages)
                verl_argv = _with_worker_env(verl_argv, STAGE_ENV, str(watch.path))
            with kept_status(run_dir, total_steps_of(verl_argv), watch=watch):
                _launch(verl_argv, {**env, **tracker_env})
    except RunDirBusyError as exc:
        raise SystemExit(f"predmask.verl.launch: {exc}") from None


def total_steps_of(argv: Sequence[str]) -> int:
    """The steps a verl command line trains (``trainer.total_training_steps``; 0 when it does not say)."""
    value = _override_keys(argv).get("trainer.total_training_steps", "")
    return int(value) if value.strip().isdigit() else 0


@dataclass
class StageWatch:
    """The launcher's bound on a hung rollout or weight sync (:mod:`predmask.verl.stages`): the stage file the trainer
    actor marks, the timeout, and the line once a stage outlasted it."""

    path: Path
    timeout_s: float
    line: str | None = None

    @classmethod
    def of(cls, run_dir: Path, timeout_s: float | None) -> StageWatch | None:
        """The watch of a run (None without a timeout); a previous attempt's stage file is removed."""
        if timeout_s is None:
            return None
        path = run_dir / STAGE_FILE
        path.unlink(missing_ok=True)
        return cls(path, float(timeout_s))

    def check(self, run_dir: Path) -> bool:
        """Whether a stage has just outlasted the timeout: then its line is printed (``error: ...``) and kept, and
        verl, running in this process's main thread, is interrupted (SIGINT)."""
        hung = None if self.line is not None else hung_stage(self.path, self.timeout_s)
        if hung is None:
            return False
        self.line = hang_line(*hung, self.timeout_s, last_step(run_dir))
        error(self.line)
        os.kill(os.getpid(), signal.SIGINT)
        return True


@contextmanager
def kept_status(run_dir: Path, total_steps: int, every_s: float = STATUS_EVERY_S,
                watch: StageWatch | None = None) -> Iterator[None]:
    """The run's ``status.json`` while verl trains, as the CPU trainer keeps it: ``running`` with the last step of
    ``metrics.jsonl`` (verl's file logger writes it in its trainer actor) every ``every_s`` seconds, then
    ``completed``, or ``failed`` with the error's line (``interrupted`` for Ctrl-C). With ``watch``, a stage that
    outlasts its timeout ends verl: ``failed`` with the watch's line and exit status 1 (a hard exit when verl has not
    stopped :data:`HANG_EXIT_GRACE_S` after the interrupt)."""
    write_status(run_dir, "running", last_step(run_dir), total_steps)
    stop = threading.Event()

    def follow() -> None:
        while not stop.wait(every_s):
            write_status(run_dir, "running", last_step(run_dir), total_steps)
            if watch is not None and watch.check(run_dir) and not stop.wait(HANG_EXIT_GRACE_S):
                write_status(run_dir, "failed", last_step(run_dir), total_steps, error=watch.line)
                os._exit(1)

    thread = threading.Thread(target=follow, name="predmask-status", daemon=True)
    thread.start()
    try:
        yield
    except BaseException as exc:
        stop.set()
        thread.join()
        if watch is not None and watch.line is not None:
            write_status(run_dir, "failed", last_step(run_dir), total_steps, error=watch.line)
            raise SystemExit(1) from None
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            write_status(run_dir, "completed", last_step(run_dir), total_steps)
        else:
            why = "interrupted" if isinstance(exc, KeyboardInterrupt) else first_line(exc, typed=True)
            write_status(run_dir, "failed", last_step(run_dir), total_steps, error=why)
        raise
    stop.set()
    thread.join()
    write_status(run_dir, "completed", last_step(run_dir), total_steps)


def _launch(verl_argv: list[str], env: Mapping[str, str]) -> None:
    logger_path = (_override_keys(verl_argv).get(f"{RUNTIME_ENV.lstrip('+')}.VERL_FILE_LOGGER_PATH")
                   or os.environ.get("VERL_FILE_LOGGER_PATH"))
    if logger_path:
        keep_previous_attempt(Path(logger_path.strip("'\"")))
    os.environ.update(env)
    from predmask.verl.plugin import install

    install()  # the driver's hooks, whatever imports verl first
    from verl.trainer import main_ppo

    sys.argv = [main_ppo.__file__, *verl_argv]
    main_ppo.main()


if __name__ == "__main__":
    main()
