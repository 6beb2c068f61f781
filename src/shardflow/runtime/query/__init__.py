"""A query's way from text to answer, whatever runs its fragments: planning with the plan
cache and the gathered-whole fallbacks, stage-by-stage execution over a ``Runner``, and the
profile of what ran."""
