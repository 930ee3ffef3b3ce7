"""Stage `sandbox` and the executors it uses: run what the policy produced, contained."""
