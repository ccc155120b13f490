"""Names and defaults the command line offers, kept apart from the modules that need torch,
so that ``chm`` starts without importing it."""

METHODS = ("full", "hybridgen", "flexgen", "moe-lightning", "h2o", "keyformer", "streamingllm", "infinigen")
# eval's rows: every method, hybridgen pinned to post-QKᵀ at a fixed K (accuracy), plus hybridgen with
# Algorithm 1 on (on modelled times, so the row does not depend on this machine's load)
EVAL_ROWS = METHODS + ("hybridgen-scheduled",)
TIMINGS = ("measured", "model")
MAPPINGS = ("semantic", "interleaved")
# how CXL-resident V rows are reached: explicit read requests (the baseline), or loads and stores through a
# mapping of a `chm serve` device (mapped_tier.MappedHostKV; needs the device's node)
V_TIERS = ("read", "mapped")
POST, PRE = "post", "pre"  # selection before or after the CPU's logits of every offloaded token
STRATEGY_MODES = ("auto", POST, PRE)  # auto: Algorithm 1 picks K and the strategy; post/pre: pinned, K = k_min
HOST_DRAM_BYTES = 32 << 20  # default host-DRAM budget for offloaded KV: SmolLM2's KV (46 KB a token) outgrows it
                            # at ~730 tokens, so a 1K context puts V in the CXL tier and a 2K one K as well
