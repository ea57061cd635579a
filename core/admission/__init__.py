"""KV-budget admission: the policy arithmetic and the settings schema (no vLLM)."""
