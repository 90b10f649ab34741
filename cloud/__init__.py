"""Cloud workers (layer-wise collective sync) and the edge gateway hosted by rank 0."""
