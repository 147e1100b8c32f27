"""The hardware catalog: accelerators as data (peak compute, memory, bandwidth, links, prices).

Entries come from `sim/data/hardware.yaml` (datasheet figures and provider prices, each with its
source and date) and from the calibration file that `infercloud calibrate` writes for the local
CPU (`$INFERCLOUD_CACHE_DIR/calibration.yaml`, default `~/.cache/infercloud`), which also holds
efficiency factors fitted to the builtin engine's measured step times. A calibration entry of
the same name replaces the catalog's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from infercloud.sim.perf_model import Efficiency


@dataclass(frozen=True, slots=True)
class Price:
    provider: str
    usd_per_hour: float
    date: str
    source: str


@dataclass(frozen=True, slots=True)
class Accelerator:
    name: str
    peak_tflops: float
    """Dense bf16 tensor TFLOP/s (the dtype's peak for a calibrated CPU)."""
    memory_gb: float
    bandwidth_gbps: float
    """Device memory bandwidth, GB/s."""
    interconnect_gbps: float
    """Per-device bandwidth to its peers, GB/s (tensor parallel all-reduce, KV transfer)."""
    host_link_gbps: float
    """Device <-> host memory, GB/s (the second KV tier)."""
    source: str
    vendor: str = ""
    prices: tuple[Price, ...] = ()
    efficiency: Efficiency | None = None
    """Fitted by calibration; None: the performance model's defaults."""

    def price(self, provider: str | None = None) -> Price | None:
        """The named provider's price, or the first listed; None if there is none."""
        if provider is None:
            return self.prices[0] if self.prices else None
        for p in self.prices:
            if p.provider == provider:
                return p
        known = ", ".join(p.provider for p in self.prices) or "none"
        raise KeyError(f"no price for {self.name} from {provider!r} (known: {known})")


def calibration_path() -> Path:
    root = os.environ.get("INFERCLOUD_CACHE_DIR") or str(Path.home() / ".cache" / "infercloud")
    return Path(root) / "calibration.yaml"


def accelerator_from_dict(name: str, raw: dict[str, Any]) -> Accelerator:
    eff = raw.get("efficiency")
    return Accelerator(
        name=name,
        peak_tflops=float(raw["peak_tflops"]),
        memory_gb=float(raw["memory_gb"]),
        bandwidth_gbps=float(raw["bandwidth_gbps"]),
        interconnect_gbps=float(raw.get("interconnect_gbps", raw["bandwidth_gbps"])),
        host_link_gbps=float(raw.get("host_link_gbps", raw["bandwidth_gbps"])),
        source=str(raw.get("source", "")),
        vendor=str(raw.get("vendor", "")),
        prices=tuple(
            Price(str(p["provider"]), float(p["usd_per_hour"]), str(p["date"]), str(p["source"]))
            for p in raw.get("prices", [])
        ),
        efficiency=Efficiency(**eff) if eff else None,
    )


@dataclass(slots=True)
class HardwareCatalog:
    accelerators: dict[str, Accelerator] = field(default_factory=dict)

    @classmethod
    def load(cls, calibration: Path | None = None) -> HardwareCatalog:
        text = resources.files("infercloud.sim").joinpath("data/hardware.yaml").read_text()
        entries = dict(yaml.safe_load(text)["accelerators"])
        path = calibration or calibration_path()
        if path.exists():
            entries.update((yaml.safe_load(path.read_text()) or {}).get("accelerators", {}))
        return cls({name: accelerator_from_dict(name, raw) for name, raw in entries.items()})

    def __getitem__(self, name: str) -> Accelerator:
        try:
            return self.accelerators[name]
        except KeyError:
            known = ", ".join(sorted(self.accelerators))
            hint = " (run `infercloud calibrate` first)" if name == "local-cpu" else ""
            raise KeyError(f"unknown accelerator {name!r}{hint}; known: {known}") from None
