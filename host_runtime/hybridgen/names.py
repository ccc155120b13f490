"""Names the command line offers, kept apart from the modules that need torch,
so that ``chm`` starts without importing it."""

METHODS = ("full", "hybridgen", "flexgen", "moe-lightning", "h2o", "keyformer", "streamingllm", "infinigen")
TIMINGS = ("measured", "model")
MAPPINGS = ("semantic", "interleaved")
