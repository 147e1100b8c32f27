"""The serving report: one set of figures for a measured run and a simulated one alike.

Field names are those of vLLM's `bench serve` (completed, request_throughput,
output_throughput, request_goodput, mean_/median_/std_/p99_ ttft, tpot, itl, e2el in ms), so
a benchmark here, a simulation and a published vLLM run line up field by field. Percentiles are
linearly interpolated (numpy's default, as vLLM computes them). TPOT is per request: (e2el -
ttft) / (output tokens - 1), for requests with more than one output token. A request counts
towards goodput when it meets every SLO given (TTFT, TPOT, E2EL, in ms).
"""

from __future__ import annotations

import itertools
from collections.abc import MutableSequence, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy.typing as npt


@dataclass(slots=True)
class RequestTiming:
    ok: bool
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    itls_s: MutableSequence[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


def _stats(name: str, values_s: Sequence[float] | npt.NDArray[Any]) -> dict[str, float]:
    import numpy as np

    ms = np.asarray(values_s, dtype=float) * 1e3 if len(values_s) else np.zeros(1)
    return {
        f"mean_{name}_ms": float(np.mean(ms)),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(np.std(ms)),
        f"p99_{name}_ms": float(np.percentile(ms, 99)),
    }


def _all_itls_s(results: Sequence[RequestTiming]) -> npt.NDArray[Any]:
    import numpy as np

    flat = itertools.chain.from_iterable(r.itls_s for r in results)
    return np.fromiter(flat, dtype=float, count=sum(len(r.itls_s) for r in results))


def serving_report(
    results: Sequence[RequestTiming],
    duration_s: float,
    ttft_slo_ms: float | None = None,
    tpot_slo_ms: float | None = None,
    e2el_slo_ms: float | None = None,
) -> dict[str, float]:
    ok = [r for r in results if r.ok]
    duration_s = max(duration_s, 1e-9)
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    tpots = [t for t in (r.tpot_s for r in ok) if t is not None]

    def good(r: RequestTiming) -> bool:
        tpot = r.tpot_s
        return (
            (ttft_slo_ms is None or r.ttft_s * 1e3 <= ttft_slo_ms)
            and (tpot_slo_ms is None or tpot is None or tpot * 1e3 <= tpot_slo_ms)
            and (e2el_slo_ms is None or r.e2el_s * 1e3 <= e2el_slo_ms)
        )

    num_good = sum(1 for r in ok if good(r))
    return {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": num_good / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "prefix_cache_hit_rate": cached / input_tokens if input_tokens else 0.0,
        **_stats("ttft", [r.ttft_s for r in ok]),
        **_stats("tpot", tpots),
        **_stats("itl", _all_itls_s(ok)),
        **_stats("e2el", [r.e2el_s for r in ok]),
    }
