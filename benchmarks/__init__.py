"""Benchmarks of ckpttools against DeepSpeed's own tools (README.md); run from the repository root, e.g.
`python -m benchmarks.bench_consolidate --help`. Results stay under benchmarks/results/."""
