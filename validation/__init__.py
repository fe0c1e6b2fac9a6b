"""The pipelines that check tpusim against measurements and against XLA's compiler: the
MaxText fit behind the shipped efficiency factors, the XLA cross-checks of collectives, per-op
costs and peak HBM, the HLO fixtures and their replays, and the CLI fuzzer. Each module runs as
`python -m validation.NAME` from the repository root (validation/README.md); none is imported
by tpusim itself."""
