"""The test files whose parity runs ``conftest.parity_results`` launches at once (each lists its runs in ``RUNS``
or ``prepare_runs``). The root conftest reads this list too: under pytest-xdist these files share one worker."""

PARITY_MODULES = (
    "test_hf_pipeline",
    "test_hf_expert_parallel",
    "test_hf_trainer",
    "test_hf_checkpoints",
    "test_hf_compile",
)
