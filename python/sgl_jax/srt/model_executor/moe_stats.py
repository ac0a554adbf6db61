"""Routing statistics of a mixture-of-experts model: tokens per expert per layer, over the server's life and over a
window of recent steps, and how unevenly they load the experts and the expert-parallel devices.

Each step's program counts the tokens routed to each expert (`layers.moe.expert_token_counts`, real tokens only:
padding rows are not counted). The counts come back with the step's sampled tokens, and `MoeStats.add_step` sums
them on the host. They are reported in /get_server_info's ``moe`` entry and as the Prometheus metrics
``sglang:moe_expert_load_ratio`` (a histogram) and ``sglang:moe_ep_imbalance`` (a gauge); see `MoeStats.state`.

The imbalance is what expert parallelism pays for: a step takes as long as its busiest device. So the measure is
max / mean tokens per device, as in DeepSpeed-MoE's and SGLang's expert-load reports.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Deque, Optional, Sequence

import numpy as np

# bucket upper bounds of the load-ratio histogram: an expert's tokens in a window / its layer's mean per expert
LOAD_RATIO_BUCKETS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 8.0, float("inf"))
DEFAULT_WINDOW_STEPS = 64


@dataclasses.dataclass
class MoeStats:
    """Per-expert token counts of one server.

    Args:
        num_layers: L, every decoder layer (dense layers keep zero counts).
        num_experts: E.
        sparse_layers: indices of the layers with experts.
        ep_size: devices the experts are split over (`--ep-size`); expert e lives on device e // (E / ep).
        window_steps: steps in the window (default `DEFAULT_WINDOW_STEPS`).
    """

    num_layers: int
    num_experts: int
    sparse_layers: Sequence[int]
    ep_size: int = 1
    window_steps: int = DEFAULT_WINDOW_STEPS
    total: np.ndarray = dataclasses.field(init=False)  # [L, E] int64, since start-up
    recent: Deque[np.ndarray] = dataclasses.field(init=False)  # the window's per-step [L, E] counts
    steps: int = dataclasses.field(init=False, default=0)
    hist_counts: np.ndarray = dataclasses.field(init=False)  # per LOAD_RATIO_BUCKETS bucket (not cumulative)
    hist_sum: float = dataclasses.field(init=False, default=0.0)

    def __post_init__(self):
        self.sparse_layers = list(self.sparse_layers)
        self.total = np.zeros((self.num_layers, self.num_experts), np.int64)
        self.recent = collections.deque(maxlen=self.window_steps)
        self.hist_counts = np.zeros(len(LOAD_RATIO_BUCKETS), np.int64)

    def add_step(self, counts: np.ndarray) -> None:
        """Add one step's counts [L, E] (tokens routed to each expert). Every `window_steps` steps, each sparse
        layer's experts' load ratios over the window go into the histogram."""
        counts = np.asarray(counts, np.int64)
        self.total += counts
        self.recent.append(counts)
        self.steps += 1
        if self.steps % self.window_steps == 0:
            self._observe(self.window())

    def window(self) -> np.ndarray:
        """[L, E] tokens per expert over the last `window_steps` steps."""
        if not self.recent:
            return np.zeros_like(self.total)
        return np.sum(np.stack(self.recent), axis=0)

    def _observe(self, window: np.ndarray) -> None:
        rows = window[self.sparse_layers].astype(np.float64)
        mean = rows.mean(axis=1, keepdims=True)
        ratios = (rows / np.where(mean > 0, mean, 1.0))[mean[:, 0] > 0].ravel()
        self.hist_counts += np.bincount(np.searchsorted(LOAD_RATIO_BUCKETS, ratios, side="left"),
                                        minlength=len(LOAD_RATIO_BUCKETS))
        self.hist_sum += float(ratios.sum())

    def ep_imbalance(self, window: np.ndarray) -> Optional[float]:
        """max / mean tokens per expert-parallel device in `window` [L, E], over the sparse layers together;
        None when no token was routed (1.0 with one device)."""
        per_device = window[self.sparse_layers].reshape(len(self.sparse_layers), self.ep_size, -1).sum(
            axis=(0, 2))
        mean = per_device.mean()
        return None if mean == 0 else float(per_device.max() / mean)

    def expert_imbalance(self, window: np.ndarray) -> Optional[float]:
        """The largest, over the sparse layers, of max / mean tokens per expert in `window`; None without tokens."""
        rows = window[self.sparse_layers].astype(np.float64)
        mean = rows.mean(axis=1)
        ok = mean > 0
        return float(np.max(rows.max(axis=1)[ok] / mean[ok])) if ok.any() else None

    def state(self) -> dict:
        """The ``moe`` entry of /get_server_info:

        - ``expert_tokens``: [L][E] tokens routed to each expert since start-up, dense layers all 0 (each real
          token counts once per expert it went to: k per token and sparse layer);
        - ``window_steps``, ``window_expert_tokens``: the same over the last `window_steps` steps;
        - ``ep_size``, ``ep_imbalance``: max / mean tokens per expert-parallel device over the window;
          ``expert_imbalance``: the largest per-layer max / mean tokens per expert over the window (None: no
          token in the window);
        - ``load_ratio_histogram``: ``buckets`` (upper bounds, the last ``inf``), ``counts`` (per bucket, not
          cumulative), ``sum``, ``count``: every sparse layer's experts' tokens / their layer's mean, one
          observation per expert and layer each `window_steps` steps.
        """
        window = self.window()
        return {
            "num_experts": self.num_experts,
            "sparse_layers": self.sparse_layers,
            "steps": self.steps,
            "expert_tokens": self.total.tolist(),
            "window_steps": len(self.recent),
            "window_expert_tokens": window.tolist(),
            "ep_size": self.ep_size,
            "ep_imbalance": self.ep_imbalance(window),
            "expert_imbalance": self.expert_imbalance(window),
            "load_ratio_histogram": {"buckets": list(LOAD_RATIO_BUCKETS), "counts": self.hist_counts.tolist(),
                                     "sum": self.hist_sum, "count": int(self.hist_counts.sum())},
        }
