"""Code every service shares: settings, logging, gRPC bootstrap, metrics, broker helpers, records."""
