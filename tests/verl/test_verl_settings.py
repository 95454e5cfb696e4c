"""predmask's own keys on a verl command line: parsed off verl's argv, carried as JSON, read back in every process.

Pure Python with Hydra's real override grammar; no verl needed.
"""

from __future__ import annotations

import json

import pytest

from predmask.verl.launch import launch_argv
from predmask.verl.settings import SETTINGS_ENV, SETTINGS_KEYS, PluginSettings, current_settings, split_argv

RUNTIME = "+ray_kwargs.ray_init.runtime_env.env_vars"


def test_split_argv_takes_predmask_keys_off_and_parses_their_values() -> None:
    rest, values = split_argv(["a.b=1", "predmask.delta=0.05", "+predmask.top_k=20", "predmask.anchor=old",
                               "predmask.stats_dir='/runs/x y/loss_stats'", "predmask.delta=0.1", "c=predmask.x"])
    assert rest == ["a.b=1", "c=predmask.x"]
    assert values == {"delta": 0.1, "top_k": 20, "anchor": "old", "stats_dir": "/runs/x y/loss_stats"}


@pytest.mark.parametrize(
    ("item", "match"),
    [
        ("predmask.clip_ratio=0.2", "unknown key predmask.clip_ratio; allowed: predmask.delta"),
        ("predmask.delta=0", "predmask.delta must be a finite number > 0"),
        ("predmask.delta=inf", "predmask.delta must be a finite number > 0"),
        ("predmask.delta=abc", "predmask.delta must be a number, got 'abc'"),
        ("predmask.anchor=pi", "predmask.anchor must be one of old, rollout"),
        ("predmask.support=all", "predmask.support must be one of topk_plus_sampled, topk"),
        ("predmask.top_k=-1", "predmask.top_k must be an integer >= 0"),
        ("predmask.top_k=2.5", "predmask.top_k must be an integer >= 0"),
    ],
)
def test_bad_predmask_keys_fail_with_one_line(item: str, match: str) -> None:
    with pytest.raises(ValueError, match=match) as err:
        split_argv([item])
    assert "\n" not in str(err.value)


def test_launcher_hands_the_settings_to_this_process_and_every_worker() -> None:
    argv, env = launch_argv(["x=1", "predmask.delta=0.05", "predmask.top_k=8"], {}, session="00042")
    assert not any(a.startswith("predmask.") for a in argv)
    (carried,) = [a for a in argv if a.startswith(f"{RUNTIME}.{SETTINGS_ENV}=")]
    from hydra.core.override_parser.overrides_parser import OverridesParser

    (override,) = OverridesParser.create().parse_overrides([carried])
    assert json.loads(override.value()) == json.loads(env[SETTINGS_ENV]) == {"delta": 0.05, "top_k": 8,
                                                                              "session": "00042"}
    assert current_settings(env) == PluginSettings(delta=0.05, top_k=8, session="00042")
    with pytest.raises(ValueError, match="set by the launcher"):
        launch_argv([f"{RUNTIME}.{SETTINGS_ENV}='{{}}'"], {})


def test_current_settings_defaults_and_bad_environment() -> None:
    assert current_settings({}) == PluginSettings()
    assert PluginSettings().top_k == 0 and PluginSettings().anchor is None
    with pytest.raises(ValueError, match="not JSON"):
        current_settings({SETTINGS_ENV: "{delta:"})
    with pytest.raises(TypeError, match="JSON object"):
        current_settings({SETTINGS_ENV: "[1]"})
    with pytest.raises(ValueError, match="unknown key predmask.eps"):
        current_settings({SETTINGS_ENV: '{"eps": 1}'})
    assert set(SETTINGS_KEYS) == {"delta", "ratio_cap", "anchor", "support", "top_k", "stats_dir", "stage_timeout_s"}
