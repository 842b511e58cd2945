"""What a run reports: per-request metrics, the summary, the report and its figures, the files."""
