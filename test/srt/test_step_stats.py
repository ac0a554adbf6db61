"""The scheduler loop's step histograms (scheduler/step_stats.py) and their Prometheus rendering
(metrics/collector.py), on a fake clock: host time is an iteration's wall time less its waits, only iterations that
launched a step count, and the step rate is observed per window of at least a second (a pause restarts it)."""

from __future__ import annotations

from sgl_jax.srt.metrics.collector import MetricsCollector
from sgl_jax.srt.scheduler.step_stats import StepStats


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_host_and_wait_split_and_rate_windows():
    clock = Clock()
    stats = StepStats(clock)
    for _ in range(1000):  # 1,000 iterations of 4 ms: 3 ms host, 1 ms blocked on the device
        stats.iteration_started()
        clock.t += 0.002
        stats.launched()
        stats.waited(0.001)
        clock.t += 0.002
        stats.iteration_ended()
    stats.iteration_started()  # an idle iteration: nothing launched, nothing observed
    clock.t += 0.5
    stats.iteration_ended()
    s = stats.state()
    host, wait = s["host_seconds"], s["device_wait_seconds"]
    assert sum(host["counts"]) == sum(wait["counts"]) == 1000
    assert abs(host["sum"] - 3.0) < 1e-6 and abs(wait["sum"] - 1.0) < 1e-6
    assert host["counts"][host["buckets"].index(0.005)] == 1000  # 3 ms: the (0.0025, 0.005] bucket
    rate = s["steps_per_second"]
    assert sum(rate["counts"]) == 3 and rate["counts"][rate["buckets"].index(400.0)] == 3  # 3 s of 250 steps/s
    clock.t += 5.0  # a pause longer than a window: the next window starts afresh
    for _ in range(3):
        stats.iteration_started()
        stats.launched()
        clock.t += 0.5
        stats.iteration_ended()
    assert sum(stats.state()["steps_per_second"]["counts"]) == 4  # one window of 2 steps in 1 s
    assert stats.state()["steps_per_second"]["counts"][1] == 1


def test_histograms_rendered_for_prometheus():
    clock = Clock()
    stats = StepStats(clock)
    stats.iteration_started()
    stats.launched()
    clock.t += 0.0003
    stats.iteration_ended()
    metrics = MetricsCollector("m")
    metrics.update_gauges({"kv_tokens_total": 10, "kv_tokens_free": 10, "kv_tokens_evictable": 0,
                           "num_running_reqs": 0, "num_waiting_reqs": 0, "step_stats": stats.state()})
    text = metrics.render().decode()
    assert 'sglang:scheduler_step_host_seconds_bucket{le="0.0005",model_name="m"} 1.0' in text
    assert 'sglang:scheduler_step_host_seconds_bucket{le="0.00025",model_name="m"} 0.0' in text
    assert 'sglang:scheduler_step_device_wait_seconds_count{model_name="m"} 1.0' in text
    assert 'sglang:scheduler_steps_per_second_count{model_name="m"} 0.0' in text
