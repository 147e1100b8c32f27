"""Copy back or recompute: the per-block decision for a hit in the second tier, from measurements.

Recomputing a block means running its `block_size` tokens through the model with attention over
everything before them, so it costs more the deeper the block sits. The model fits the engine's
measured step times to

    step_s = overhead_s + s_per_token * tokens + s_per_pair * attention_pairs

(non-negative least squares over the latest `window` steps; `attention_pairs` is the sum, over
the step's tokens, of the context each attends to), so that recomputing the block starting at
token `p` costs `s_per_token * B + s_per_pair * (B * p + B * (B + 1) / 2)`. Copying a block back
costs the measured mean seconds per block of the loads done so far (the caller seeds it with one
timed copy at start-up). A block's load pays when it is cheaper than its recompute.

A request's computed tokens are a prefix, so of a run of host blocks only a leading part can be
loaded (the rest is recomputed after it). `blocks_worth_loading` picks the length whose total
saving (recompute minus copy, summed) is largest: shallow blocks that are cheap to recompute
are still loaded when the deeper ones behind them make up for it.

Pure: observations come in with their durations; no clock is read here.
"""

from __future__ import annotations

from collections import deque

import numpy as np

MIN_STEPS_TO_FIT = 8


def attention_pairs(start: int, num_tokens: int) -> int:
    """Sum over tokens `start .. start + num_tokens - 1` of the context each attends to."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


class TransferCostModel:
    __slots__ = (
        "_coef",
        "_copy_blocks",
        "_copy_s",
        "_steps",
        "block_size",
    )

    def __init__(self, block_size: int, window: int = 256) -> None:
        self.block_size = block_size
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._coef: np.ndarray | None = None
        self._copy_blocks = 0
        self._copy_s = 0.0

    # -- observations --------------------------------------------------------------------------

    def observe_step(self, num_tokens: int, pairs: int, seconds: float) -> None:
        self._steps.append((num_tokens, pairs, seconds))
        self._coef = None

    def observe_copy(self, num_blocks: int, seconds: float) -> None:
        self._copy_blocks += num_blocks
        self._copy_s += seconds

    # -- estimates -----------------------------------------------------------------------------

    @property
    def copy_s_per_block(self) -> float | None:
        return self._copy_s / self._copy_blocks if self._copy_blocks else None

    def coefficients(self) -> tuple[float, float, float] | None:
        """(overhead_s, s_per_token, s_per_pair), or None before `MIN_STEPS_TO_FIT` steps."""
        if self._coef is None and len(self._steps) >= MIN_STEPS_TO_FIT:
            from scipy.optimize import nnls  # a third of a second to import; few callers fit

            data = np.array(self._steps, dtype=np.float64)
            design = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
            # Columns scaled to unit norm so that nnls sees a well-conditioned problem.
            scale = np.linalg.norm(design, axis=0)
            scale[scale == 0] = 1.0
            coef, _ = nnls(design / scale, data[:, 2])
            self._coef = coef / scale
        if self._coef is None:
            return None
        return float(self._coef[0]), float(self._coef[1]), float(self._coef[2])

    def recompute_s(self, start_token: int) -> float | None:
        """Estimated seconds to recompute the block that starts at `start_token`."""
        coef = self.coefficients()
        if coef is None:
            return None
        _, per_token, per_pair = coef
        bs = self.block_size
        return per_token * bs + per_pair * attention_pairs(start_token, bs)

    def blocks_worth_loading(self, first_start_token: int, num_blocks: int) -> int:
        """How many of `num_blocks` consecutive host blocks, the first starting at
        `first_start_token`, to load: the prefix with the largest total saving (all of them
        while either speed is unknown)."""
        copy_s = self.copy_s_per_block
        if copy_s is None or self.coefficients() is None:
            return num_blocks
        best, best_saving, saving = 0, 0.0, 0.0
        for i in range(num_blocks):
            recompute_s = self.recompute_s(first_start_token + i * self.block_size)
            assert recompute_s is not None
            saving += recompute_s - copy_s  # this block's load pays when positive
            if saving > best_saving:
                best, best_saving = i + 1, saving
        return best
