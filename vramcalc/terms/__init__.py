"""One module per memory term; each exposes pure functions of a RankContext."""
