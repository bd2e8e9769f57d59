import pytest

from quickdraft.config import EngineConfig


def test_kv_cache_dtype_is_validated():
    assert EngineConfig().kv_cache_dtype == "auto"
    assert EngineConfig(kv_cache_dtype="float16").kv_cache_dtype == "float16"
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .*'bf8'"):
        EngineConfig(kv_cache_dtype="bf8")
    with pytest.raises(ValueError, match="kv_cache_dtype other than 'auto' needs tensor_parallel_size 1"):
        EngineConfig(kv_cache_dtype="float16", tensor_parallel_size=2)


@pytest.mark.parametrize("value", [-1, 1.5, True, "4"])
def test_lazy_logits_rows_is_validated(value):
    assert EngineConfig().lazy_logits_rows is None and EngineConfig(lazy_logits_rows=4).lazy_logits_rows == 4
    with pytest.raises(ValueError, match="lazy_logits_rows must be None or an integer >= 0"):
        EngineConfig(lazy_logits_rows=value)
    with pytest.raises(ValueError, match="lazy_logits_rows > 0 needs tensor_parallel_size 1"):
        EngineConfig(lazy_logits_rows=2, tensor_parallel_size=2)
    assert EngineConfig(lazy_logits_rows=0, tensor_parallel_size=2).lazy_logits_rows == 0


@pytest.mark.parametrize("value", ["yes", 1, 0.0])
def test_weights_in_huge_pages_is_validated(value):
    assert EngineConfig().weights_in_huge_pages is None
    assert EngineConfig(weights_in_huge_pages=False).weights_in_huge_pages is False
    with pytest.raises(ValueError, match="weights_in_huge_pages must be true, false or None"):
        EngineConfig(weights_in_huge_pages=value)
