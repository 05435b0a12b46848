"""bench/scale_model.py: the projection's arithmetic, its overrides and its output (no job runs)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "scale_model.py"


def _load():
    spec = importlib.util.spec_from_file_location("scale_model", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["scale_model"] = module  # dataclasses look the module up while the class is built
    spec.loader.exec_module(module)
    return module


sm = _load()


def values(**overrides: float) -> dict[str, float]:
    v = {name: float(item.value) for name, item in sm.defaults().items()}
    v.update(overrides)
    return v


def test_failure_rate_reproduces_the_llama3_report() -> None:
    result = sm.project(values(), (16384,))[16384]
    # 419 unexpected interruptions in 54 days on 16,384 GPUs
    assert result["failures_per_day"] * 54 == pytest.approx(419)
    # and it scales linearly with GPUs
    small = sm.project(values(), (2048,))[2048]["failures_per_day"]
    assert small == pytest.approx(result["failures_per_day"] / 8)


def test_tier0_goodput_decreases_with_scale() -> None:
    results = sm.project(values(), sm.SCALES)
    goodputs = [results[n]["tiers"][0]["goodput"] for n in sm.SCALES]
    assert goodputs == sorted(goodputs, reverse=True)
    assert goodputs[0] > goodputs[-1]


def test_tier4_recovers_faster_than_tier0_at_every_scale() -> None:
    for source in ("hsdp", "buddy"):
        results = sm.project(values(), (256, 2304, 16384), source)
        for n, result in results.items():
            t0, t4 = result["tiers"][0], result["tiers"][4]
            assert t4["phases_s"]["restart"] < t0["phases_s"]["restart"], n
            if source == "hsdp":
                assert t4["recovery_s"] < t0["recovery_s"], n
                assert t4["lost_work_s"] < t0["lost_work_s"], n


def test_recovery_is_the_sum_of_its_phases_and_the_store_grows_with_ranks() -> None:
    results = sm.project(values(), (256, 16384))
    for result in results.values():
        for tier in result["tiers"].values():
            assert tier["recovery_s"] == pytest.approx(sum(tier["phases_s"].values()))
    small, large = (results[n]["tiers"][3]["phases_s"]["store"] for n in (256, 16384))
    assert large > 50 * small  # the serial term: trips x ranks / store_rps
    # a faster store shrinks it
    faster = sm.project(values(store_rps=3e6), (16384,))[16384]["tiers"][3]["phases_s"]["store"]
    assert faster < large / 10


def test_measured_file_overrides_a_default(tmp_path: Path) -> None:
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps({"detect_peer_s": 2.5, "handover_s": {"value": 7, "origin": "H200 run"}}))
    doc = sm.main(["--measured", str(measured), "--scales", "256", "--hang-fraction", "0"])
    assert doc["inputs"]["detect_peer_s"]["value"] == 2.5
    assert doc["inputs"]["detect_peer_s"]["origin"].startswith("--measured")
    assert "H200 run" in doc["inputs"]["handover_s"]["origin"]
    t4 = doc["scales"]["256"]["tiers"]["4"]["phases_s"]
    assert t4["detect"] == pytest.approx(2.5)
    assert t4["restart"] == pytest.approx(7)
    with pytest.raises(SystemExit):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({"no_such_input": 1}))
        sm.main(["--measured", str(bad)])


def test_flag_wins_over_measured_file(tmp_path: Path) -> None:
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps({"handover_s": 7}))
    doc = sm.main(["--measured", str(measured), "--handover-s", "1.5", "--scales", "256"])
    assert doc["inputs"]["handover_s"]["value"] == 1.5
    assert "command line" in doc["inputs"]["handover_s"]["origin"]


def test_script_runs_and_writes_json_for_every_scale_and_tier(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", str(out)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    assert set(doc["scales"]) == {"256", "2304", "16384"}
    for scale in doc["scales"].values():
        assert set(scale["tiers"]) == {"0", "1", "2", "3", "4"}
        for tier in scale["tiers"].values():
            assert set(tier["phases_s"]) == set(sm.PHASES)
            assert 0 <= tier["goodput"] <= 1
    assert "not a measurement" in doc["note"]
    kinds = {item["kind"] for item in doc["inputs"].values()}
    assert {"measured", "assumed", "published"} <= kinds
    text = result.stdout
    assert "NOT measured" in text.splitlines()[0]
    aws = [line for line in text.splitlines() if line.startswith("AWS PUBLISHED")]
    assert len(aws) == 2
    assert all("their claim, not our measurement" in line for line in aws)
    assert "4 min 52 s -> checkpointless 47 s" in aws[0]
    assert "15-30 min -> checkpointless under 2 min" in aws[1]
