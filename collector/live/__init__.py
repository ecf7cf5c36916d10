"""What runs beside ingest on each commit: detection (the analysis) and healing (the policy carried out)."""
