"""The command lines (quantize, generate, kv_sensitivity, train_medusa, evaluate) and the Ray
workers they start. A worker that runs a class of one of these modules (a quantize LayerWorker,
say) imports this package before torch: the collector's threshold is raised first
(sala/gc_tuning.py says why and what it saves).
"""
from sala.gc_tuning import collect_less

collect_less()
