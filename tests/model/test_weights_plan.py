"""The start-up log's weights plan: every tensor counted once, rotary tables apart from the
weights (they grow with the context length, as the KV cache does)."""
from __future__ import annotations

import logging

from octavo.model.layers.rotary import RotaryEmbedding
from octavo.model.loader.weights_plan import log_weights_plan, rotary_table_bytes, weight_bytes


def test_rotary_tables_are_counted_apart_from_the_weights(smollm_llm, caplog):
    model = smollm_llm.engine.client.core.executor.worker.runner.model
    rotaries = {id(m): m for m in model.modules() if isinstance(m, RotaryEmbedding)}
    assert rotaries  # one instance shared by the layers
    tables = sum(t.numel() * t.element_size() for m in rotaries.values() for t in (m.cos, m.sin))
    assert rotary_table_bytes(model) == tables
    table_storages = {t.untyped_storage().data_ptr() for m in rotaries.values()
                      for t in (m.cos, m.sin)}
    others = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
              for t in [*model.parameters(), *model.buffers()]}
    assert weight_bytes(model)["other"] == sum(
        n for ptr, n in others.items() if ptr not in table_storages) < tables
    with caplog.at_level(logging.INFO, logger="octavo.model.loader.weights_plan"):
        log_weights_plan(model, 10 << 20)
    assert f"rotary tables {tables / 2**20:.1f} MB" in caplog.text
