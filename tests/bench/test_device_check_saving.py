"""scripts/device_check.py's old-log-prob saving on CPU (the tiny model): the record has the promised shape and the
share is the forward's part of forward + update by its own definition; ``--cpu`` presets the small loss sizes.

No GPU here: on the GPU machine the same code builds a Qwen3-0.6B-shaped model. Timings on a shared CPU are noise;
what is checked is the record, not a speed."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def import_script(name: str):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def test_the_saving_record_on_cpu() -> None:
    device_check = import_script("device_check")
    r = device_check.old_log_prob_share("cpu", repeats=1)
    assert r["device"] == "cpu" and r["model"] == device_check.TINY and r["dtype"] == "float32"
    assert (r["sequences"], r["tokens_each"]) == device_check.OLP_BATCH["cpu"]
    for mode in ("plain", "checkpointing"):
        m = r[mode]
        assert m["forward_s"] > 0 and m["update_s"] > 0
        assert m["share"] == pytest.approx(m["forward_s"] / (m["forward_s"] + m["update_s"]))
    lines = device_check.saving_lines(r)
    assert len(lines) == 4 and "the dry-run assumes 0.333" in lines[-1]


def test_cpu_flag_presets_the_small_loss_sizes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    device_check, entry = import_script("device_check"), import_script("benchmark")
    seen: list[list[str]] = []
    monkeypatch.setattr(entry, "main", lambda argv: seen.append(argv) or 0)
    monkeypatch.setattr(device_check, "old_log_prob_share", lambda device: {"device": device})
    monkeypatch.setattr(device_check, "saving_lines", lambda r: [f"saving on {r['device']}"])
    monkeypatch.setattr(entry, "write_json", lambda path, doc: None)
    monkeypatch.setenv("OUT", str(tmp_path))
    assert device_check.main(["--cpu", "--repeats", "3"]) == 0
    ns = entry.parser().parse_args(seen[0])
    assert (ns.device, ns.tokens, ns.vocab, ns.repeats) == ("cpu", [256], 4096, 3)
