"""Host runtime: software that uses the CXL-HM device (HybridGen, HyMCache, trace replay)."""
