"""Alerts: the payloads and their signature, the outbox written with each incident, the delivery lanes."""
