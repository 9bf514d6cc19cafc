"""What a run shows and writes: console, progress, metrics and their backends, plots, image grids, reports, run directory."""
