"""The performance model: how long one engine step takes on one accelerator (a roofline).

A step (`StepShape`) does three kinds of work:

    compute_s = linear_flops / (peak x e_compute) + attention_flops / (peak x e_attention)
    memory_s  = weight bytes / (bandwidth x e_bandwidth) + KV bytes / (bandwidth x e_kv)
    step_s    = overhead_s + per_seq_s x seqs + per_chunk_s x prefill chunks
                + max(compute_s, memory_s) + (1 - overlap) x min(compute_s, memory_s)
                + comm_s + host_load_s

  - linear_flops = 2 x (weights a token meets in all layers) x tokens + 2 x hidden x vocab x
    sampled rows (the LM head runs only where a token is sampled);
  - attention_flops = 4 x layers x heads x head_dim x (query, key) pairs;
  - weight bytes: every layer and the LM head are read once per step, whatever the batch
    (streamed: near the bandwidth); KV bytes: each chunk reads its whole context once and
    writes one entry per new token (paged: gathers of blocks, its own efficiency e_kv);
  - overlap: 1 where compute and memory traffic overlap (a GPU: the pure roofline, the
    default), 0 where they add up (what a CPU engine that gathers KV before attending does);
  - comm_s (tensor parallel over `tp` devices): two all-reduces of the activations per layer,
    2 (tp - 1) / tp x tokens x hidden x dtype bytes each, over the interconnect;
  - host_load_s: blocks copied back from the second tier over the host link;
  - padded decode groups (`decode_group_overhead_tokens` set: the builtin engine): decodes
    attend in groups of similar context length (`engine.decode_groups`), each request of a
    group reading the group's longest context, and each group costing as much as that many
    padded keys (the engine's own rule for forming them); the padding and the groups' cost
    count as attention pairs and KV bytes. None (the default): an engine whose attention
    kernel reads exactly each request's context (vLLM, SGLang on GPUs);
  - per_chunk_s: what each prefill chunk (a request computing more than one token in the
    step) costs beyond its FLOPs and bytes. An engine that attends chunk by chunk (the builtin
    engine gathers each chunk's context and builds its causal mask in every layer) pays it; a
    fused variable-length attention kernel (vLLM, SGLang on GPUs) nearly nothing, hence the
    default 0.

So prefill is compute-bound (flops grow with tokens, bytes barely), decode is bandwidth-bound
(weights and KV are read for a handful of tokens), and the crossover falls where the roofline
says. The efficiency factors (`Efficiency`) are what the hardware does not give for free: the
fraction of peak the kernels reach and the fixed host-side cost of a step. `fit_efficiency`
fits them to measured step times (`infercloud calibrate`); defaults stand in for uncalibrated
accelerators, and every report says which were used.

Pure: no clock, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from infercloud.engine.decode_groups import decode_groups
from infercloud.engine.step_shape import StepShape
from infercloud.sim.model_specs import ModelSpec


class Device(Protocol):
    @property
    def peak_tflops(self) -> float: ...
    @property
    def bandwidth_gbps(self) -> float: ...
    @property
    def interconnect_gbps(self) -> float: ...
    @property
    def host_link_gbps(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Efficiency:
    compute: float = 0.6
    """Fraction of peak FLOP/s that matrix multiplies reach."""
    attention: float = 0.4
    """Fraction of peak FLOP/s that attention reaches."""
    bandwidth: float = 0.8
    """Fraction of memory bandwidth reached reading weights."""
    kv_bandwidth: float = 0.5
    """Fraction of memory bandwidth reached reading and writing paged KV blocks."""
    overlap: float = 1.0
    """How far compute and memory time overlap: 1 the roofline's max(), 0 their sum."""
    overhead_s: float = 0.003
    """Fixed cost of a step (scheduling, kernel launches, sampling, host work)."""
    per_seq_s: float = 2e-5
    """Extra cost per request in the step (block tables, sampling, output handling)."""
    per_chunk_s: float = 0.0
    """Extra cost per prefill chunk in the step (attention run chunk by chunk)."""
    decode_group_overhead_tokens: float | None = None
    """The engine pads decodes within groups of similar length (the builtin engine: its
    `decode_group_overhead_tokens`); None: no padding. A property of the engine, not fitted."""
    source: str = "defaults (uncalibrated)"


@dataclass(frozen=True, slots=True)
class StepWork:
    linear_flops: float
    attention_flops: float
    weight_bytes: float
    kv_bytes: float
    comm_bytes: float
    host_bytes: float
    num_seqs: int
    num_prefill_chunks: int


class PerfModel:
    def __init__(
        self,
        model: ModelSpec,
        device: Device,
        efficiency: Efficiency | None = None,
        dtype_bytes: int = 2,
        tensor_parallel: int = 1,
        block_size: int = 16,
    ) -> None:
        if tensor_parallel < 1:
            raise ValueError("tensor_parallel must be >= 1")
        self.model = model
        self.device = device
        self.efficiency = efficiency or Efficiency()
        self.dtype_bytes = dtype_bytes
        self.tp = tensor_parallel
        self.block_size = block_size
        self.kv_bytes_per_token = model.kv_elements_per_token() * dtype_bytes
        self.weight_bytes = model.weights_read_per_step * dtype_bytes

    def work(self, shape: StepShape) -> StepWork:
        m = self.model
        tokens = shape.num_tokens
        linear = m.linear_flops_per_token() * tokens + m.lm_head_flops_per_row() * shape.num_sampled
        attention = m.attention_flops_per_pair() * shape.attention_pairs
        kv = self.kv_bytes_per_token * (shape.context_tokens + tokens)
        padding = self._decode_padding_tokens(shape)
        if padding:
            attention += m.attention_flops_per_pair() * padding
            kv += self.kv_bytes_per_token * padding
        comm = 0.0
        if self.tp > 1:
            per_reduce = 2 * (self.tp - 1) / self.tp * tokens * m.hidden_size * self.dtype_bytes
            comm = 2 * m.num_layers * per_reduce
        host = shape.host_blocks_loaded * self.block_size * self.kv_bytes_per_token
        prefill_chunks = sum(1 for _, n in shape.chunks if n > 1)
        return StepWork(
            linear, attention, self.weight_bytes, kv, comm, host, shape.num_seqs, prefill_chunks
        )

    def _decode_padding_tokens(self, shape: StepShape) -> int:
        """Keys the decodes of the step read beyond their contexts when the engine pads them in
        groups, plus each group's fixed cost in keys (0 without padding)."""
        overhead = self.efficiency.decode_group_overhead_tokens
        if overhead is None:
            return 0
        contexts = sorted(start + 1 for start, n in shape.chunks if n == 1)
        if not contexts:
            return 0
        bs = self.block_size
        blocks = [-(-c // bs) for c in contexts]
        groups = decode_groups(blocks, overhead / bs)
        padded = sum(len(g) * blocks[g.stop - 1] * bs for g in groups)
        return padded - sum(contexts) + round(overhead) * len(groups)

    def time_of(self, work: StepWork, eff: Efficiency | None = None) -> float:
        e = eff or self.efficiency
        d = self.device
        peak = d.peak_tflops * 1e12 * self.tp
        compute_s = work.linear_flops / (peak * e.compute) + work.attention_flops / (
            peak * e.attention
        )
        bandwidth = d.bandwidth_gbps * 1e9 * self.tp
        memory_s = work.weight_bytes / (bandwidth * e.bandwidth) + work.kv_bytes / (
            bandwidth * e.kv_bandwidth
        )
        comm_s = work.comm_bytes / (d.interconnect_gbps * 1e9) if work.comm_bytes else 0.0
        host_s = work.host_bytes / (d.host_link_gbps * 1e9) if work.host_bytes else 0.0
        fixed_s = (
            e.overhead_s + e.per_seq_s * work.num_seqs + e.per_chunk_s * work.num_prefill_chunks
        )
        if isinstance(compute_s, np.ndarray) or isinstance(memory_s, np.ndarray):
            hi, lo = np.maximum(compute_s, memory_s), np.minimum(compute_s, memory_s)
        else:
            hi, lo = max(compute_s, memory_s), min(compute_s, memory_s)
        roof_s = hi + (1.0 - e.overlap) * lo
        return fixed_s + roof_s + comm_s + host_s

    def step_s(self, shape: StepShape) -> float:
        return self.time_of(self.work(shape))

    def decode_run_s(self, starts: Sequence[int], steps: int) -> Any:
        """The times of `steps` decode steps in a row of requests whose next token to compute
        is at `starts` (step j computes token `start + j` of each), as a numpy array: each the
        same as `step_s` of that step's shape. A decode step's work is affine in j (attention
        pairs and KV read grow by one token per request per step), so it is taken from the
        first two steps' and priced all at once. With padded decode groups it is not
        (padding moves in whole blocks), so each step is priced on its own."""
        if self.efficiency.decode_group_overhead_tokens is not None:
            n = len(starts)
            shapes = (StepShape(tuple((s + j, 1) for s in starts), n) for j in range(steps))
            return np.array([self.step_s(shape) for shape in shapes])
        first = self.work(StepShape(tuple((s, 1) for s in starts), len(starts)))
        second = self.work(StepShape(tuple((s + 1, 1) for s in starts), len(starts)))
        j = np.arange(steps, dtype=float)
        run = StepWork(
            first.linear_flops,
            first.attention_flops + j * (second.attention_flops - first.attention_flops),  # type: ignore[arg-type]
            first.weight_bytes,
            first.kv_bytes + j * (second.kv_bytes - first.kv_bytes),  # type: ignore[arg-type]
            first.comm_bytes,
            first.host_bytes,
            first.num_seqs,
            0,
        )
        return self.time_of(run)

    def host_copy_s_per_block(self) -> float:
        return self.block_size * self.kv_bytes_per_token / (self.device.host_link_gbps * 1e9)

    def kv_transfer_s(self, num_tokens: int, link_gbps: float) -> float:
        """Seconds to move `num_tokens` tokens of KV over a link (prefill -> decode replica)."""
        return num_tokens * self.kv_bytes_per_token / (link_gbps * 1e9)


_FIELDS = (
    "compute",
    "attention",
    "bandwidth",
    "kv_bandwidth",
    "overlap",
    "overhead_s",
    "per_seq_s",
    "per_chunk_s",
)


def fit_efficiency(
    perf: PerfModel, samples: Sequence[tuple[StepShape, float]], source: str
) -> tuple[Efficiency, float]:
    """Least-squares fit of the efficiency factors to measured (shape, seconds) steps.

    Minimises the relative error of each step's predicted time. Returns the factors and the
    median absolute relative error of the fit over the samples.
    """
    import numpy as np
    from scipy.optimize import least_squares

    if len(samples) < len(_FIELDS):
        raise ValueError(f"need at least {len(_FIELDS)} measured steps to fit, got {len(samples)}")
    works = [perf.work(shape) for shape, _ in samples]
    measured = np.array([s for _, s in samples], dtype=float)
    start = perf.efficiency

    def effs(x: Any) -> Efficiency:
        values = {f: float(v) for f, v in zip(_FIELDS, x, strict=True)}
        return replace(start, **values, source=source)

    def residuals(x: Any) -> Any:
        e = effs(x)
        predicted = np.array([perf.time_of(w, e) for w in works])
        return predicted / measured - 1.0

    x0 = np.array([getattr(start, f) for f in _FIELDS], dtype=float)
    x0[5] = max(x0[5], float(np.min(measured)) / 2)
    x0[4] = 0.5
    lower = np.array([1e-4, 1e-4, 1e-4, 1e-4, 0.0, 0.0, 0.0, 0.0])
    upper = np.array([2.0, 2.0, 2.0, 2.0, 1.0, math.inf, math.inf, math.inf])
    x0 = np.clip(x0, lower + 1e-9, np.where(np.isinf(upper), x0 + 1.0, upper))
    fit = least_squares(residuals, x0, bounds=(lower, upper), x_scale="jac")
    eff = effs(fit.x)
    error = float(np.median(np.abs(residuals(fit.x))))
    return replace(eff, source=source), error
