"""Test support: real servers (PostgreSQL, Prometheus, Alertmanager) as local processes on 127.0.0.1."""
