"""`Compiler.compiling`: the slot programs compile on worker threads; an error in one reaches the
caller, and leaves nothing half-built behind."""

from __future__ import annotations

import threading

import pytest

from eagle_jax.serve import config as config_lib
from eagle_jax.serve import engine as engine_lib


def test_slot_programs_compile_on_worker_threads_and_a_failure_reaches_the_caller(speculation_target,
                                                                                 monkeypatch):
    engine = engine_lib.Engine(speculation_target, None, config=config_lib.EngineConfig(
        max_length=32, batch_size=2, scheduler="continuous", steps_per_call=2))
    cache = engine.compile_cache
    compile_one = cache.compile
    threads = set()

    def failing(module, key, lowered):
        threads.add(threading.current_thread().name)
        if module == "insert":
            raise RuntimeError("no insert today")
        return compile_one(module, key, lowered)

    monkeypatch.setattr(cache, "compile", failing)
    with pytest.raises(RuntimeError, match="no insert today"):
        engine.slot_programs()
    assert threads and all(name.startswith("eagle_jax-compile") for name in threads)
    monkeypatch.setattr(cache, "compile", compile_one)
    programs = engine.slot_programs()  # what failed compiles anew; nothing pending is left
    assert not any(type(p).__name__ == "Pending" for p in engine.compiler.compiled.values())
    results = engine.generate([[1, 2, 3], [4, 5]], max_new_tokens=4)
    assert [r.num_tokens for r in results] == [4, 4] and programs.row_counts == (1, 2)
