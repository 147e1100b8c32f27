"""`infercloud calibrate` against a served tiny engine, and a simulation on what it wrote."""

from __future__ import annotations

from pathlib import Path

import pytest

from infercloud.engine.cpu_kernels import load_kernels
from infercloud.engine.model_config import ModelConfig
from infercloud.sim.calibrate import calibrate
from infercloud.sim.fleet import Fleet
from infercloud.sim.hardware import HardwareCatalog
from infercloud.sim.model_specs import ModelSpec
from infercloud.sim.simulator import Simulation
from infercloud.sim.workload import poisson


@pytest.mark.slow
def test_calibrate_writes_a_fitted_local_cpu_entry_the_simulator_uses(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "calibration.yaml"
    samples = tmp_path / "steps.json"
    result = calibrate(
        str(tiny_model_dir), "float32", 1, 8 << 20, usd_per_hour=0.05, out=out, samples_out=samples
    )
    assert result["path"] == str(out) and samples.exists()
    cal = result["calibration"]
    assert cal["num_steps"] > 50
    assert result["peak_tflops"] > 0 and result["bandwidth_gbps"] > 0
    acc = HardwareCatalog.load(out)["local-cpu"]
    assert acc.efficiency is not None and "fitted to" in acc.efficiency.source
    # the engine was served with the decode attention it has here, and the model prices that:
    # padded groups for torch attention, each context at its own length for our CPU kernel
    kernel = cal["decode_attention"] == "kernel"
    assert kernel == load_kernels()
    assert (acc.efficiency.decode_group_overhead_tokens is None) == kernel
    assert acc.price("local") is not None
    # the catalog's GPUs are still there beside it
    assert "h100-sxm" in HardwareCatalog.load(out).accelerators

    config = ModelConfig.from_folder(tiny_model_dir)
    spec = ModelSpec.from_config("tiny", config, config.max_position_embeddings)
    fleet = Fleet.model_validate(
        {
            "model": "tiny",
            "dtype": "float32",
            "pools": [{"hardware": "local-cpu", "kv_cache_bytes": 8 << 20}],
            "scheduler": {"max_num_batched_tokens": 512, "max_num_seqs": 64},
        }
    )
    reqs = poisson(4.0, 40, (16, 256), (8, 32), seed=2)
    report = Simulation(fleet, reqs, HardwareCatalog.load(out), spec=spec).run()
    assert report["completed"] == 40 and report["efficiency"]["local-cpu"] == acc.efficiency.source
