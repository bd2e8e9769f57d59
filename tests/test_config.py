import pytest

from quickdraft.config import EngineConfig


def test_kv_cache_dtype_is_validated():
    assert EngineConfig().kv_cache_dtype == "auto"
    assert EngineConfig(kv_cache_dtype="float16").kv_cache_dtype == "float16"
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .*'bf8'"):
        EngineConfig(kv_cache_dtype="bf8")
    with pytest.raises(ValueError, match="kv_cache_dtype other than 'auto' needs tensor_parallel_size 1"):
        EngineConfig(kv_cache_dtype="float16", tensor_parallel_size=2)
