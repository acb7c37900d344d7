"""pytest-cdna2: tiered conformance suite for DeepSeek-V4 inference."""
