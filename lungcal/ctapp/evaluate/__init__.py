"""What a run reports: split reports and plots, summaries, stored calibrators, case records, pictures."""
