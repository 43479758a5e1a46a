"""adapters/metrics.py: the children of the metrics kept by their values, the figures unchanged."""

from __future__ import annotations

from prometheus_client import generate_latest

from contextrender.metrics import ProxyMetrics


def test_a_metrics_child_is_kept_by_its_values_and_counts_as_labels_would():
    metrics = ProxyMetrics({"/v1/chat/completions": "chat"})
    asked = []
    labels = metrics.requests.labels
    metrics.requests.labels = lambda *values: asked.append(values) or labels(*values)
    for status in ("200", "200", "400", "200"):
        metrics.of(metrics.requests, "/v1/chat/completions", "chat", status).inc()
    assert asked == [("/v1/chat/completions", "chat", "200"), ("/v1/chat/completions", "chat", "400")]  # once per values
    assert metrics.of(metrics.requests, "/v1/chat/completions", "chat", "200") is labels("/v1/chat/completions", "chat", "200")
    text = generate_latest(metrics.registry).decode()
    assert 'contextrender_requests_total{endpoint="/v1/chat/completions",protocol="chat",status="200"} 3.0' in text
    assert 'contextrender_requests_total{endpoint="/v1/chat/completions",protocol="chat",status="400"} 1.0' in text
    metrics.rendered("chat", 1200, 600, 0.004)
    metrics.prefix("chat", [{"role": "user"}], [{"role": "user"}, {"role": "assistant"}])
    text = generate_latest(metrics.registry).decode()
    assert 'contextrender_proxy_history_tokens_before_total{protocol="chat"} 1200.0' in text
    assert 'contextrender_proxy_render_seconds_count{protocol="chat"} 1.0' in text
    assert 'contextrender_proxy_cached_prefix_share_sum{protocol="chat"} 0.5' in text
