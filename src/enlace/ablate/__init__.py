"""`enlace ablate`: variants of one run trained for the same wall time, scored and tabled."""
