"""Command-line tools, each `python -m spectr_gbv.tools.<name> --help`: audit (exact, float64), bench (verifier
kernels), bench_engine (the engine against transformers and its cost-model limit), report (tables and plots)."""
