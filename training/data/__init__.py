"""What it is trained on: records -> token ids + loss mask, length buckets, the default corpus."""
