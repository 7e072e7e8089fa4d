"""``GET /metrics``: the service's counters in Prometheus text (prometheus-client), read at each scrape.

Names follow llama-server's ``/metrics`` where they mean the same (requests, prompt and generated tokens,
tokens per second), plus what a KV budget adds (evictions, live cells per sequence, the budget). Off unless
the server runs with ``--metrics``.
"""

from __future__ import annotations


def metrics_text(service) -> tuple[bytes, str]:
    """(body, content type) of one scrape of ``service``."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class Collector:
        def collect(self):
            yield CounterMetricFamily("epikv_requests", "generations run (completed or cut off)",
                                      value=service.n_served)
            yield CounterMetricFamily("epikv_requests_cancelled", "generations cut off (client gone, limit, "
                                      "shutdown)", value=service.n_cancelled)
            yield CounterMetricFamily("epikv_prompt_tokens", "prompt tokens of the generations run",
                                      value=service.prompt_tokens)
            yield CounterMetricFamily("epikv_tokens_predicted", "tokens generated", value=service.tokens_generated)
            yield CounterMetricFamily("epikv_evictions", "KV cells evicted by the generations run",
                                      value=service.n_evicted)
            yield GaugeMetricFamily("epikv_predicted_tokens_seconds", "generated tokens per second of decode "
                                    "time, over the generations run", value=service.decode_tokens_per_s)
            yield GaugeMetricFamily("epikv_requests_processing", "requests inside the model now",
                                    value=min(service.n_parallel, service._admitted))
            yield GaugeMetricFamily("epikv_requests_deferred", "requests waiting for a sequence",
                                    value=service.queued)
            live = GaugeMetricFamily("epikv_kv_live_cells", "live KV cells per sequence", labels=["slot"])
            budget = GaugeMetricFamily("epikv_kv_budget_cells", "KV budget per sequence", labels=["slot"])
            for slot in service.llama.slots():
                live.add_metric([str(slot["id"])], slot["n_live"])
                budget.add_metric([str(slot["id"])], slot["kv_budget"])
            yield live
            yield budget

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())
    return generate_latest(registry), CONTENT_TYPE_LATEST
