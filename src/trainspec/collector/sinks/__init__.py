"""One sink per destination: run store, OpenTelemetry (OTLP), Prometheus, and in-memory for tests."""
