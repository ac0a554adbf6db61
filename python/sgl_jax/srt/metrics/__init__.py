"""Prometheus metrics (``--enable-metrics``, served at ``/metrics``): see `collector`."""
