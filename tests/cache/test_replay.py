"""`infercloud cache-replay`: Mooncake traces through the real cache, under real pressure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from infercloud.cache.replay import TraceRequest, load_mooncake, replay, unique_blocks

MOONCAKE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_synthetic.jsonl"


def write_trace(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_hits_count_tokens_and_last_partial_block(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2, 3]},
        {"timestamp": 10_000, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2, 3]},
        {"timestamp": 20_000, "input_length": 700, "output_length": 1, "hash_ids": [1, 9]},
    ]
    requests = load_mooncake(write_trace(tmp_path / "t.jsonl", rows))
    report = replay(requests, capacity_blocks=10, policy="lru")
    # second request: all 1100 tokens; third: its first block, 512 tokens
    assert report.hit_rate_tokens == pytest.approx((1100 + 512) / (1100 + 1100 + 700))
    assert report.unique_blocks == 4 and report.requests_uncacheable == 0


def test_blocks_in_use_are_never_evicted(tmp_path: Path) -> None:
    """A request that runs long holds its blocks: a newcomer that does not fit runs uncached."""
    long = TraceRequest(0.0, 1024, 10_000, (1, 2))
    other = TraceRequest(1.0, 1024, 1, (5, 6))
    again = TraceRequest(2.0, 1024, 1, (1, 2))
    report = replay([long, other, again], capacity_blocks=3, policy="lru")
    assert report.requests_uncacheable == 1
    assert report.hit_rate_tokens == pytest.approx(1024 / 3072)


def test_cli_prints_the_documented_fields(tmp_path: Path) -> None:
    rows = [
        {"timestamp": t * 1000, "input_length": 2048, "output_length": 8, "hash_ids": [0, 1, t, 7]}
        for t in range(20)
    ]
    trace = write_trace(tmp_path / "t.jsonl", rows)
    for policy in ("lru", "value", "belady"):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "infercloud",
                "cache-replay",
                "--trace",
                str(trace),
                "--capacity-blocks",
                "6",
                "--policy",
                policy,
                "--json",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        report = json.loads(out.stdout)
        assert {"policy", "capacity_blocks", "requests", "hit_rate_tokens"} <= report.keys()
        assert report["policy"] == policy and report["requests"] == 20
        assert 0.0 < report["hit_rate_tokens"] < 1.0
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "infercloud",
            "cache-replay",
            "--trace",
            str(tmp_path / "no"),
            "--capacity-blocks",
            "6",
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "No such file" in bad.stderr


@pytest.mark.skipif(not MOONCAKE.exists(), reason="shared traces not present")
def test_belady_bounds_the_online_policies_on_mooncake() -> None:
    requests = load_mooncake(MOONCAKE)[:1500]
    capacity = unique_blocks(requests) // 10
    rates = {p: replay(requests, capacity, p).hit_rate_tokens for p in ("lru", "value", "belady")}
    assert rates["belady"] >= rates["lru"] and rates["belady"] >= rates["value"]
    assert rates["lru"] > 0.0
