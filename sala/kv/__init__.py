"""Mixed-precision cache: K/V formats per sparse layer, state dtypes per lightning layer, the plan."""
from sala.kv.formats import FP8, NVFP4, Dense, KVCodec, make_codec
from sala.kv.pages import KVPages, decode_attention
from sala.kv.plan import KV_FORMATS, PLAN_FILE, STATE_DTYPES, KVPlan, KVPlanError, apply_to_model, default_plan, load_plan

__all__ = ["FP8", "NVFP4", "Dense", "KVCodec", "make_codec", "KVPages", "decode_attention", "KV_FORMATS", "PLAN_FILE",
           "STATE_DTYPES", "KVPlan", "KVPlanError", "apply_to_model", "default_plan", "load_plan"]
