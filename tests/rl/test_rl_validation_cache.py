"""The base policy's validation is computed once per setting and seed (``Engine.validate_base``): the cached value equals
a fresh computation, another method's run reads it, and a changed input misses the cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from predmask.config import compose
from predmask.rl.engine import Engine, base_validation_key

TINY = ["model=cpu_s", "precision=bf16", "base.steps=20", "base.batch_size=8", "base.eval_problems=4",
        "task.eval_size=3", "rollout.n=2", "rollout.response_length=6", "trainer.val_n=2", "trainer.progress=false"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _engine(cache: Path, *extra: str) -> Engine:
    return Engine(compose("train", [*TINY, f"cache_dir={cache}", *extra]), progress=False)


def _files(cache: Path) -> set[str]:
    return {p.name for p in (cache / "validation").glob("*.json")} if (cache / "validation").exists() else set()


def test_the_cached_validation_equals_a_fresh_one_and_other_methods_read_it(cache: Path) -> None:
    first = _engine(cache, "method=dppo_topk_kl")
    fresh = first.validate(7)
    assert first.validate_base(7) == fresh  # computed (the file did not exist) and written
    (written,) = _files(cache)
    assert json.loads((cache / "validation" / written).read_text()) == fresh
    other = _engine(cache, "method=predmask_kl_agg")
    assert base_validation_key(other, 7) == base_validation_key(first, 7)
    calls: list[int] = []
    other.validate = lambda seed: calls.append(seed) or {}  # type: ignore[method-assign]
    assert other.validate_base(7) == fresh and calls == []  # read from the cache, not computed
    assert _files(cache) == {written}


@pytest.mark.parametrize("change", ["precision=fp8_rollout", "trainer.val_n=3", "rollout.temperature=0.7", "top_k=5",
                                    "task.eval_size=4"])
def test_a_changed_input_misses_the_cache(cache: Path, change: str) -> None:
    base = _engine(cache, "method=dppo_topk_kl")
    changed = _engine(cache, "method=dppo_topk_kl", change)
    assert base_validation_key(changed, 7) != base_validation_key(base, 7)
    assert base_validation_key(base, 8) != base_validation_key(base, 7)  # the sampling seed is an input too
    before = _files(cache)
    changed.validate_base(7)
    assert len(_files(cache) - before) == 1


def test_an_unreadable_cache_file_is_computed_again(cache: Path) -> None:
    engine = _engine(cache, "method=dppo_topk_kl")
    path = cache / "validation" / f"base-{base_validation_key(engine, 11)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"val-core/x": "not a number"')
    assert engine.validate_base(11) == engine.validate(11)
    assert json.loads(path.read_text()) == engine.validate(11)
