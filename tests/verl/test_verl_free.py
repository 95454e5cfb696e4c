"""The plugin's verl-free parts really need no verl: their tests pass in a process where verl cannot be imported.

``run_without`` starts a fresh Python whose import system refuses verl, ray, tensordict, vLLM and Megatron (and
checks that ``import verl`` fails there and that none of them was imported by the end). In it run: the tests of
the top-K functions (test_verl_topk_pure.py), of the post-import hooks (test_verl_hooks.py), of predmask's own
keys (test_verl_settings.py) and loss statistics (test_verl_stats.py), the CPU tests of scripts/gpu_check.py, the
command translation
(:mod:`predmask.verl.overrides`) and ``python -m sweeps.datasets prepare``'s functions. And importing the plugin's
package or its overrides installs nothing: no import hook, no loss in verl's registry.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from verl_helpers import FIXTURES, REPO, require_verl, run_without

pytestmark = pytest.mark.verl
HERE = Path(__file__).parent


def _passed(out: str) -> int:
    match = re.search(r"(\d+) passed", out)
    return int(match.group(1)) if match else 0


@pytest.mark.parametrize("test_file", ["test_verl_topk_pure.py", "test_verl_hooks.py", "test_verl_gpu_check.py",
                                       "test_verl_settings.py", "test_verl_stats.py"])
def test_verl_free_tests_pass_without_verl(test_file: str) -> None:
    proc = run_without(f"""
        import pytest
        EXIT_CODE = int(pytest.main([{str(HERE / test_file)!r}, "-q", "-p", "no:cacheprovider", "-m", "not slow"]))
    """)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _passed(proc.stdout) >= 2 and "skipped" not in proc.stdout, proc.stdout[-2000:]


def test_overrides_and_data_preparation_run_without_verl(tmp_path) -> None:
    proc = run_without(f"""
        import json
        from pathlib import Path

        import predmask.verl
        from predmask.config import compose
        from predmask.verl.overrides import verl_command
        from sweeps.datasets import prepare

        cfg = compose("train", ["method=predmask_kl_agg", "precision=fp8_rollout", "seed=1", "cluster=h20_4x8",
                                "model=qwen3_4b_base", "model.path=Qwen/Qwen3-4B-Base", "model.engine=fsdp",
                                "cluster.nodes=1", "cluster.data_dir=/data"])
        argv = verl_command(cfg, "/runs/r1", python="python3")
        assert argv[:3] == ["python3", "-m", "predmask.verl.launch"], argv[:3]
        assert "actor_rollout_ref.rollout.quantization=fp8" in argv
        out = Path({str(tmp_path / "data")!r})
        manifest = prepare(out, train_file=Path({str(FIXTURES / "dapo_math_tiny.jsonl")!r}),
                           aime24_file=Path({str(FIXTURES / "aime24_tiny.jsonl")!r}),
                           aime25_file=Path({str(FIXTURES / "aime25_tiny.json")!r}))
        assert manifest["sets"]["train"]["rows"] == 5, manifest
        print(json.dumps(sorted(p.name for p in out.iterdir())))
    """)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "manifest.json" in proc.stdout and "dapo_math_13k.parquet" in proc.stdout


def test_the_blocker_is_real() -> None:
    """The harness itself: code that needs verl fails under it (so a pass above is not vacuous)."""
    proc = run_without("import predmask.verl.reward\n")
    assert proc.returncode != 0 and "No module named 'verl" in proc.stderr and "blocked for this test" in proc.stderr


def test_importing_the_package_or_its_overrides_installs_nothing() -> None:
    """Only predmask.verl.plugin installs hooks: the sweep driver's import of the overrides leaves verl untouched."""
    require_verl()
    code = """
import sys

import predmask.verl
import predmask.verl.launch
import predmask.verl.overrides
from predmask.verl._hooks import _FINDER

assert _FINDER not in sys.meta_path and not _FINDER.callbacks, "a post-import hook was installed"
assert not [m for m in sys.modules if m.split(".")[0] == "verl"], "verl was imported"
from verl.trainer.ppo import core_algos

import predmask

assert not set(predmask.METHODS) & set(core_algos.POLICY_LOSS_REGISTRY), "losses were registered"
import predmask.verl.plugin

assert set(predmask.METHODS) <= set(core_algos.POLICY_LOSS_REGISTRY), "the plugin did not register the losses"
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_MODULES"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=env, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
