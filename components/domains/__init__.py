"""Task domains: one module per domain with its generator, execution plan and verifier."""
