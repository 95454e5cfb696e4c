"""Shared helpers of the verl tests: the verl import gate, a subprocess where verl cannot be imported, a tiny
transformers model, mock vLLM log-prob entries."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

FIXTURES = Path(__file__).parent / "fixtures"
GOLDEN = Path(__file__).parent / "golden"
REPO = Path(__file__).resolve().parents[2]
#: top-level packages of the verl stack that the verl-free parts of the plugin must not need
VERL_STACK: tuple[str, ...] = ("verl", "ray", "tensordict", "vllm", "megatron")

_BLOCK = """
import importlib.abc
import sys

BLOCKED = {blocked!r}
assert not [m for m in sys.modules if m.split(".")[0] in BLOCKED], "a blocked package was imported at startup"


class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked for this test)", name=name)
        return None


sys.meta_path.insert(0, _Blocked())
for root in BLOCKED:
    try:
        __import__(root)
    except ImportError:
        pass
    else:
        raise AssertionError(f"import {{root}} succeeded although it is blocked")
"""


def run_without(code: str, blocked: Sequence[str] = VERL_STACK, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python (cwd: the repository) in which importing any of ``blocked`` fails.

    The subprocess first checks that none of them was imported at startup and that ``import <root>`` really
    raises; at the end, that none of them was imported since (a swallowed ImportError cannot hide a dependency).
    Its exit status is ``EXIT_CODE`` when ``code`` sets that variable (e.g. to ``pytest.main(...)``), else 0.
    """
    epilogue = (
        "\nleaked = sorted(m for m in sys.modules if m.split('.')[0] in BLOCKED)"
        "\nassert not leaked, f'blocked packages were imported: {leaked}'"
        "\nraise SystemExit(globals().get('EXIT_CODE', 0))\n"
    )
    script = _BLOCK.format(blocked=tuple(blocked)) + textwrap.dedent(code) + epilogue
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_MODULES"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # third-party pytest plugins (ray's, ...) are not loaded
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env=env, check=False)


def require_verl(module: str = "verl.trainer.ppo.core_algos") -> ModuleType:
    """Import ``module`` from verl; skip with the reason when verl is missing, fail instead when CI=true."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if os.environ.get("CI", "").lower() == "true":
            raise
        pytest.skip(f"verl is not importable ({exc}); install the 'verl' extra", allow_module_level=True)
        raise  # unreachable


def tiny_causal_lm(vocab: int = 48, layers: int = 1, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised Qwen3 causal LM small enough for CPU tests (no download)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    return Qwen3ForCausalLM(cfg).eval()


@dataclass(frozen=True)
class MockLogprob:
    """Stand-in for ``vllm.logprobs.Logprob`` (vLLM cannot be installed on the CPU machines)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def vllm_position(logprobs: torch.Tensor, sampled: int, k: int) -> dict[int, MockLogprob]:
    """The documented vLLM structure for one generated token: the sampled token first (with its 1-based rank),
    then the top-``k`` tokens of ``logprobs`` [V] by rank (the sampled one not repeated): k or k+1 entries."""
    order = torch.argsort(logprobs, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(1, len(order) + 1)
    out = {sampled: MockLogprob(float(logprobs[sampled]), int(rank[sampled]), f"<{sampled}>")}
    for t in order[:k].tolist():
        out.setdefault(t, MockLogprob(float(logprobs[t]), int(rank[t]), f"<{t}>"))
    return out


def padded_batch(prompt_lens: list[int], response_lens: list[int], width_p: int, width_r: int, seed: int = 0):
    """verl's left/right padded layout: prompts left-padded to width_p, responses right-padded to width_r."""
    g = torch.Generator().manual_seed(seed)
    b = len(prompt_lens)
    prompts = torch.zeros(b, width_p, dtype=torch.long)
    responses = torch.zeros(b, width_r, dtype=torch.long)
    attention = torch.zeros(b, width_p + width_r, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        prompts[i, width_p - p:] = torch.randint(1, 40, (p,), generator=g)
        responses[i, :r] = torch.randint(1, 40, (r,), generator=g)
        attention[i, width_p - p: width_p + r] = 1
    return prompts, responses, attention


def verl_composer() -> Iterator[Callable[[list[str]], tuple[Any, dict[str, str]]]]:
    """A pytest fixture body: compose overrides with verl's own ppo_trainer config (as main_ppo would), resolved,
    after the launcher's ``launch_argv`` (predmask's keys taken off, the plugin's environment added); yields
    ``run(overrides) -> (config, the launcher's own environment updates)``."""
    require_verl()
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from predmask.verl.launch import launch_argv

    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")

    def run(overrides: list[str]) -> tuple[Any, dict[str, str]]:
        # on verl's config directory afresh each time: composing a predmask run config clears Hydra's global state
        GlobalHydra.instance().clear()
        initialize_config_dir(config_dir=config_dir, version_base=None)
        verl_argv, env = launch_argv(overrides, {})
        cfg = hydra_compose(config_name="ppo_trainer", overrides=[o for o in verl_argv if not o.startswith("hydra.")])
        OmegaConf.resolve(cfg)
        return cfg, env

    yield run
    GlobalHydra.instance().clear()

