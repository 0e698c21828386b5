"""Distillation from a teacher: the chunked distillation loss (losses), loading a frozen teacher (teacher), the
offline top-k cache format (cache) and the pipeline that fills it (caching)."""
