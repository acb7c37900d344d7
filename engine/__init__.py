"""cdna2_engine: the bundled DeepSeek-V4 engine (official FP8/MXFP4 checkpoint layout)."""
