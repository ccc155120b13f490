"""Trace replay: the emulator's controller driven by request traces in virtual time.

    from host_runtime.replay import HymcacheMicrobench, run_replay
    result = run_replay(HymcacheMicrobench(64 << 20, turns=4), "cmmh", "lru")

See docs/replay.md and ``chm replay --help``.
"""

from .driver import VARIANTS, Replay, master_key, replay_config, replay_label, run_replay, window_blocks
from .lcs_trace import TRACE_FORMATS, LibCacheSimTrace, parse_trace_params
from .models import MODELS, KvModel, get_model
from .prefill import GpuProfile, PrefillModel, load_gpu, prefill_for_block
from .traces import ConversationGenerator, HymcacheMicrobench, MooncakeTrace, RandomReadBench, Workload

__all__ = ["VARIANTS", "Replay", "master_key", "replay_config", "replay_label", "run_replay", "window_blocks",
           "TRACE_FORMATS", "LibCacheSimTrace", "parse_trace_params", "MODELS", "KvModel", "get_model",
           "GpuProfile", "PrefillModel", "load_gpu", "prefill_for_block",
           "ConversationGenerator", "HymcacheMicrobench", "MooncakeTrace", "RandomReadBench", "Workload"]
