"""The command lines (quantize, generate, kv_sensitivity, train_medusa, evaluate) and the Ray
workers they start. A worker that runs a class of one of these modules (a quantize LayerWorker,
say) imports this package before torch: the collector's threshold is raised first
(sala/gc_tuning.py), which takes about a fifth off its imports.
"""
from sala.gc_tuning import collect_less

collect_less()
