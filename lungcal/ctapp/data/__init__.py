"""From a datalist to bags: the cohort (splits, cached bags, streams), series checks, inputs to score, bag building."""
