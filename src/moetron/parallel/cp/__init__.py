"""Context parallelism: every sequence split over the `cp` ranks (zigzag chunks), attention across the split."""
