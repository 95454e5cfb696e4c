"""A stand-in trained by verl on a CPU is its own panel, titled so, beside the CPU engine's runs of the same model."""

from __future__ import annotations

from reports.queries import RunInfo, panel_keys, runs_in_panel


def _run(run_id: str, cluster: dict) -> RunInfo:
    config = {"model": {"name": "cpu_s32", "stands_in_for": "qwen3_4b_base"}, "cluster": cluster}
    return RunInfo(run_id, "smoke", "predmask_kl_agg", 0.15, "cpu_s32", "bf16", 0, "local", "completed", config)


def test_verl_on_a_cpu_and_the_cpu_engine_are_separate_panels() -> None:
    engine = _run("a", {"name": "local", "trainer": "cpu"})
    verl = _run("b", {"name": "verl_cpu", "trainer": "verl", "device": "cpu", "standin": "cpu_s32"})
    gpu = _run("c", {"name": "h20_4x8", "trainer": "verl", "device": "cuda"})
    keys = [k for k in panel_keys([engine, verl, gpu]) if k.model == "cpu_s32"]
    assert [(k.on_cpu_verl, [r.run_id for r in runs_in_panel([engine, verl, gpu], k)]) for k in keys] == [
        (False, ["a", "c"]), (True, ["b"])]
    assert keys[0].title.endswith("CPU stand-in cpu_s32, emulated precision")
    assert keys[1].title.endswith("CPU stand-in cpu_s32, trained by verl on a CPU")
