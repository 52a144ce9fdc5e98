"""The engine's configuration (sala/engine/config.py): every setting checked once, with an error
naming it; what resolving it for a model fills in, against the rules worked by hand; and the
settings the engine refuses for Medusa heads, before it allocates anything."""
import dataclasses

import pytest

from sala import lightning
from sala.engine import Engine, EngineConfig, SpeculationSettingError
from tests.engine.parts import random_heads
from tests.model.test_model import random_model


@pytest.mark.parametrize("settings, message", [
    ({"max_seqs": 0}, "max_seqs=0 must be a positive integer"),
    ({"memory_bytes": -1}, "memory_bytes=-1 must be a positive integer"),
    ({"max_batch_tokens": True}, "max_batch_tokens=True must be a positive integer"),
    ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization=1.5 must be in \(0, 1\]"),
    ({"max_waiting": 0}, "max_waiting=0 and page_size=64 must be positive"),
    ({"prefix_snapshot_interval": 100}, "prefix_snapshot_interval=100 must be a positive multiple of 64"),
])
def test_each_bad_setting_is_named(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)


def test_settings_are_one_frozen_record():
    EngineConfig(prefix_cache=False, prefix_snapshot_interval=100)  # no prefix cache: the interval is unused
    with pytest.raises(SpeculationSettingError, match="medusa_max_batch='many'"):
        EngineConfig(medusa_max_batch="many")
    assert EngineConfig(medusa_max_batch="3").medusa_max_batch == 3  # from a command line
    with pytest.raises(TypeError, match="max_seq"):
        EngineConfig(max_seq=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineConfig().max_seqs = 4
    assert EngineConfig().granule == 1 and EngineConfig(batch_invariant=True).granule == lightning.CHUNK_SIZE
    assert EngineConfig().compiled and not EngineConfig(batch_invariant=True).compiled


def test_resolve_fills_in_what_depends_on_the_model():
    model = random_model()
    config = EngineConfig(max_model_len=10_000, max_seqs=16, page_size=16, memory_bytes=4 << 20).resolve(model)
    assert config.max_model_len == model.config.max_position_embeddings == 256  # capped at the model's
    assert config.model is model.config and str(config.device) == "cpu" and config.kv_plan.describe()
    assert config.max_seqs == config.memory.max_seqs <= 16 and config.memory.page_size == 16
    assert config.prefix_snapshot_bytes == (4 << 20) // 8  # an eighth of the budget, on top of it on CPU
    assert config.max_batch_tokens == max(512, config.max_seqs + 1)  # the CPU default
    tree = config.max_seqs * 7 + 1  # a Medusa tree of 7 nodes: 16 verifying requests still fit a step
    assert EngineConfig(max_seqs=16, page_size=16).resolve(model, tree_rows=7).max_batch_tokens == max(512, tree)
    assert config.resolve(model) == config  # resolving is idempotent
    with pytest.raises(ValueError, match="max_batch_tokens=70 must be at least max_seqs=8 \\+ 63"):
        EngineConfig(batch_invariant=True, max_seqs=8, max_batch_tokens=70, page_size=16).resolve(model)


def test_medusa_settings_are_checked_before_anything_is_allocated():
    model = random_model()
    heads = random_heads(model)
    with pytest.raises(ValueError, match="no batch-invariant mode"):
        Engine(model, None, medusa=heads, batch_invariant=True)
    with pytest.raises(ValueError, match="medusa_max_batch=2 was given but Medusa is off"):
        Engine(model, None, medusa_max_batch=2)
    sparse = random_model(sparse_config={"dense_len": 128})
    with pytest.raises(ValueError, match=r"max_model_len \(256\) must stay at or below sparse_config.dense_len \(128\)"):
        Engine(sparse, None, medusa=random_heads(sparse))
